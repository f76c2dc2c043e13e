"""llama-server's chat habits that its own test suite checks, against llama.cpp's words
(its sources' expected prompts and templates, the pinned sdist): built-in template names,
`__verbose`, the continuation fields, a continued message's parts, and `enable_thinking`
defined for every template."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.fixtures import llama_cpp_source, missing_oracle
from helpers.servers import SERVER_FLAGS, ServerProcess

BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


def start(tmp_path, *flags: str) -> ServerProcess:
    return ServerProcess(tmp_path, *SERVER_FLAGS, "--jinja", *flags)


def llama_template(name: str) -> str:
    src = llama_cpp_source()
    if src is None:
        missing_oracle("llama.cpp's sources (scripts/setup.sh test)")
    return str(src / "models" / "templates" / f"{name}.jinja")


def test_a_builtin_template_name_renders_as_llama_cpp_writes_it(tmp_path):
    """`--chat-template command-r` / `llama3`: llama.cpp's built-in templates, the prompts
    its server tests expect (tools/server/tests/unit/test_chat_completion.py)."""
    s = start(tmp_path, "--chat-template", "command-r")
    try:
        messages = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
        prompt = s.http.post("/apply-template", json={"messages": messages}).json()["prompt"]
        assert prompt == ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
                          "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
                          "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
        # a chat is answered from that prompt
        reply = s.http.post("/v1/chat/completions", json={"messages": BOOK, "max_tokens": 4, "verbose": True}).json()
        assert reply["__verbose"]["prompt"].endswith("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    finally:
        s.stop()
    s = start(tmp_path, "--chat-template", "llama3")
    try:
        prompt = s.http.post("/apply-template", json={"messages": BOOK}).json()["prompt"]
        assert prompt == ("<|start_header_id|>system<|end_header_id|>\n\nBook<|eot_id|><|start_header_id|>user"
                          "<|end_header_id|>\n\nWhat is the best book<|eot_id|><|start_header_id|>assistant"
                          "<|end_header_id|>\n\n")
    finally:
        s.stop()


def test_a_chat_template_that_is_no_name_nor_template_is_refused_at_start(tmp_path):
    res = subprocess.run([sys.executable, "-m", "dflash_gguf.serving.server", *SERVER_FLAGS, "--chat-template",
                          "llama-nine"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 2
    assert "llama-nine" in res.stderr and "llama3" in res.stderr and "chatml" in res.stderr


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    template = llama_template("meta-llama-Llama-3.1-8B-Instruct")
    s = start(tmp_path_factory.mktemp("llama31"), "--chat-template-file", template)
    yield s
    s.stop()


def test_verbose_carries_the_native_result_whole_and_streamed(llama31):
    """A request's "verbose": true adds `__verbose`, the native result (its prompt the
    rendered one); false leaves it out; streamed, the last chunk carries it."""
    prompt = llama31.http.post("/apply-template", json={"messages": BOOK}).json()["prompt"]
    whole = llama31.http.post("/v1/chat/completions", json={"messages": BOOK, "max_tokens": 3, "verbose": True}).json()
    assert whole["__verbose"]["prompt"] == prompt
    assert whole["__verbose"]["content"] == whole["choices"][0]["message"]["content"]
    assert whole["__verbose"]["tokens_predicted"] == whole["usage"]["completion_tokens"] == 3
    plain = llama31.http.post("/v1/chat/completions", json={"messages": BOOK, "max_tokens": 3}).json()
    assert "__verbose" not in plain
    with llama31.http.stream("POST", "/v1/chat/completions",
                             json={"messages": BOOK, "max_tokens": 3, "verbose": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c for c in chunks if "__verbose" in c] == chunks[-1:]
    assert chunks[-1]["__verbose"]["prompt"] == prompt


def test_a_continued_message_is_its_parts_a_blank_line_apart(llama31):
    """A final assistant message is continued; its text parts are joined as llama.cpp joins
    the message it continues."""
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    for content, written in (("Whill", "Whill"), (parts, "Wh\n\nill")):
        reply = llama31.http.post("/v1/chat/completions", json={
            "messages": BOOK + [{"role": "assistant", "content": content}], "max_tokens": 2, "verbose": True}).json()
        assert reply["__verbose"]["prompt"].endswith(
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is the best book<|eot_id|><|start_header_id|>assistant"
            f"<|end_header_id|>\n\n{written}")


@pytest.mark.parametrize("body, needle", [
    ({"add_generation_prompt": True, "continue_final_message": True,
      "messages": BOOK + [{"role": "assistant", "content": "Whill"}]},
     "Cannot set both add_generation_prompt and continue_final_message to true."),
    ({"continue_final_message": True, "messages": BOOK}, "the last message to be the assistant's"),
    ({"add_generation_prompt": False, "messages": BOOK}, "add_generation_prompt false"),
])
def test_continuation_fields_that_contradict_get_400(llama31, body, needle):
    res = llama31.http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert res.status_code == 400 and needle in res.json()["error"]["message"], res.text


@pytest.mark.parametrize("template, on, off", [
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "<think>\n", "<think>\n</think>"),
    ("Qwen-QwQ-32B", "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n</think>"),
])
def test_thinking_on_defines_enable_thinking_true_as_llama_cpp_does(tmp_path, template, on, off):
    """Templates that close the thinking block unless enable_thinking is true: thinking on
    (the default) leaves it open, --reasoning-budget 0 closes it (llama.cpp's test_template.py)."""
    for flags, end in (((), on), (("--reasoning-budget", "0"), off)):
        s = start(tmp_path, "--chat-template-file", llama_template(template), *flags)
        try:
            prompt = s.http.post("/apply-template", json={"messages": [{"role": "user", "content": "What is today?"}]})
            assert prompt.json()["prompt"].endswith(end), (flags, prompt.text)
        finally:
            s.stop()


def test_ignore_eos_forbids_the_end_tokens_and_lists_their_biases(llama31):
    """ignore_eos as llama-server's: every end-of-generation token biased to -inf (listed as
    null in generation_settings.logit_bias, with a request's own biases), so the reply runs
    to its limit; without it, no bias is listed."""
    from dflash_gguf.runtime.demo import demo_paths
    from dflash_gguf.runtime.tokenizer import Tokenizer

    eog = Tokenizer(demo_paths()[0]).eog_ids
    body = {"prompt": "Once upon a time", "n_predict": 24, "temperature": 0.0, "return_tokens": True}
    res = llama31.http.post("/completion", json={**body, "ignore_eos": True, "logit_bias": [[5, 1.5]]}).json()
    assert res["generation_settings"]["logit_bias"] == sorted(
        [{"bias": None, "token": t} for t in eog] + [{"bias": 1.5, "token": 5}], key=lambda e: e["token"])
    assert res["tokens_predicted"] == 24 and not set(res["tokens"]) & eog
    res = llama31.http.post("/completion", json=body).json()
    assert res["generation_settings"]["logit_bias"] == []


def test_kv_unified_lets_a_slot_use_the_whole_context_and_n_is_a_default(tmp_path):
    """-np 4 -c 256: each slot has 64 positions, and a request for 80 tokens is cut at the
    slot's end; with --kv-unified a slot may hold all 256 (llama-server's unified cache), so
    the 80 are generated. -n 16 is the limit of a request that names none, not a cap."""
    body = {"prompt": "A", "n_predict": 80, "ignore_eos": True}
    for unified, got in ((False, 63), (True, 80)):
        s = ServerProcess(tmp_path, "-c", "256", "-np", "4", "-n", "16", *(["--kv-unified"] if unified else []))
        try:
            assert s.http.post("/completion", json=body).json()["tokens_predicted"] == got
            assert s.http.post("/completion", json={"prompt": "A", "ignore_eos": True}).json()["tokens_predicted"] == 16
        finally:
            s.stop()


def test_return_progress_tells_the_prompt_going_in_with_timings_so_far(tmp_path):
    """A stream that asks for return_progress gets llama-server's prompt_progress: first
    before any prompt token is computed (processed == cache, timings at 0), then after each
    chunk, ending at the whole prompt; with timings_per_token each chunk carries the
    timings so far, never going back. A second request resumes from the cache."""
    s = ServerProcess(tmp_path, "-c", "512", "-b", "16", "-ub", "16", "--checkpoint-every", "16")
    prompt = "the quick brown fox jumps over the lazy dog " * 6
    try:
        for attempt in range(2):
            with s.http.stream("POST", "/completion", json={"prompt": prompt, "n_predict": 4, "stream": True,
                                                            "return_progress": True, "timings_per_token": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
            progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
            total, cache = progress[0]["total"], progress[0]["cache"]
            assert progress[0]["processed"] == cache and (cache > 0) == (attempt == 1)
            assert all(p["total"] == total and p["cache"] == cache for p in progress)
            assert [p["processed"] for p in progress] == sorted({p["processed"] for p in progress})
            assert progress[-1]["processed"] == total and (len(progress) > 3 or attempt == 1)
            first = next(c for c in chunks if "prompt_progress" in c)["timings"]
            assert first["prompt_n"] == 0 and first["prompt_ms"] == 0 and first["predicted_n"] == 0
            ms = [c["timings"]["prompt_ms"] for c in chunks if "timings" in c]
            assert ms == sorted(ms) and ms[-1] > 0
        plain = s.http.post("/completion", json={"prompt": prompt, "n_predict": 2, "stream": True}).text
        assert "prompt_progress" not in plain and '"timings"' in plain  # only the last event's
    finally:
        s.stop()


def test_n_choices_are_each_the_reply_of_its_own_request(llama31):
    """n > 1: each choice is a job of its own; a seeded sampled request's choice i draws
    from seed + i, so it equals the single request with that seed, and greedy choices
    equal the greedy reply; usage counts the prompt once and every choice's tokens."""
    ask = {"messages": BOOK, "max_tokens": 6, "temperature": 0.9, "top_k": 40}

    def one(**extra):
        return llama31.http.post("/v1/chat/completions", json={**ask, **extra}).json()

    many = one(n=3, seed=11)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in many["choices"]] == \
        [one(seed=11 + i)["choices"][0]["message"]["content"] for i in range(3)]
    assert many["usage"]["completion_tokens"] == \
        sum(one(seed=11 + i)["usage"]["completion_tokens"] for i in range(3))
    greedy = {c["message"]["content"] for c in one(n=2, temperature=0)["choices"]}
    assert greedy == {one(temperature=0)["choices"][0]["message"]["content"]}


def test_a_responses_stream_tells_its_prompt_progress_and_timings(llama31):
    """/v1/responses streamed with return_progress and timings_per_token, as llama-server:
    response.in_progress events carry prompt_progress, each text delta the timings so far."""
    with llama31.http.stream("POST", "/v1/responses", json={"input": "This is a test" * 10, "max_output_tokens": 6,
                                                             "stream": True, "return_progress": True,
                                                             "timings_per_token": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [e for e in events if "prompt_progress" in e]
    assert progress and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e["timings"] for e in deltas)
    assert events[-1]["type"] == "response.completed" and "timings" in events[-1]


def test_a_string_joined_to_an_undefined_variable_renders_as_llama_cpp_renders_it():
    """firefunction v2's template adds `functions`, which no caller defines: llama.cpp's
    template engine joins an undefined value to a string as "", so the prompt renders
    (with today's date, which llama.cpp hands every template); any other use of an
    undefined value still fails."""
    from dflash_gguf.chat.templates import ChatTemplate

    t = ChatTemplate(open(llama_template("fireworks-ai-llama-3-firefunction-v2")).read())
    prompt = t.render([{"role": "user", "content": "What is today?"}])
    assert "Available functions as JSON spec:\n\nToday is " in prompt
    with pytest.raises(ValueError, match="failed"):
        ChatTemplate("{{ missing * 2 }}").render([])
