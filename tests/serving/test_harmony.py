"""gpt-oss's harmony format: prompts rendered with llama.cpp's published gpt-oss template
(models/templates/openai-gpt-oss-120b.jinja of the pinned sources) equal that template
rendered by transformers' Jinja renderer with the messages llama.cpp's chat code hands
it (common/parsers/gpt-oss.cpp); replies in harmony parse into reasoning, content and
tool calls, fed whole or a few characters at a time, malformed ones into content;
reasoning_effort reaches the template per request and server-wide, bad values are
refused; `<|return|>` and `<|call|>` end generation under llama.cpp's vocabulary; and
requests through the real `openai` and `anthropic` clients against dflash-server, whose
scripted engine replies in harmony, come back in the right fields, streamed and not."""
from __future__ import annotations

import json
import random

import anthropic
import openai
import pytest

from helpers.chat_fixtures import CALLS, TOOLS, history, transformers_render, with_results
from helpers.chat_fixtures import GPT_OSS, llama_cpp_messages
from helpers.servers import AppServer, ScriptedEngine, defaults, openai_messages, streamed_chat

from dflash_gguf.chat.assistant import prepare_turn
from dflash_gguf.chat.templates import ChatTemplate
from dflash_gguf.chat.harmony import EMPTY_ANALYSIS, HarmonyParser
from dflash_gguf.chat.toolcalls import format_of


@pytest.fixture(scope="module")
def source(published_template):
    return published_template(GPT_OSS)


@pytest.fixture(scope="module")
def template(source):
    return ChatTemplate(source, bos_token="<|startoftext|>", eos_token="<|return|>")


def oracle(source, messages, tools=None, **kwargs):
    return transformers_render(source, llama_cpp_messages(messages), tools, bos_token="<|startoftext|>",
                               eos_token="<|return|>", **kwargs)


def one_call(i=0, reasoning=None):
    """A conversation whose assistant makes CALLS[i] alone (what gpt-oss does: <|call|>
    ends its turn), and gets its result."""
    name, args = CALLS[i]
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}]}
    if reasoning:
        assistant["reasoning_content"] = reasoning
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in São Paulo?"},
            assistant, {"role": "tool", "tool_call_id": f"call_{i}", "content": "{\"temp\": 21}"}]


# -- rendering ---------------------------------------------------------------------------------

OTHER_TEMPLATES = ["Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen3-Coder", "google-gemma-4-31B-it"]


def test_the_harmony_format_is_read_from_the_template(template, published_template):
    assert template.harmony and format_of(template) == "harmony"
    assert not any(ChatTemplate(published_template(name)).harmony for name in OTHER_TEMPLATES)
    turn = prepare_turn(template, history()[:2], tools=TOOLS)
    assert turn.thinking is None and turn.tool_format == "harmony" and turn.prompt.endswith("<|start|>assistant")


@pytest.mark.parametrize("effort", [None, "low", "high"])
def test_rendering_equals_llama_cpp(template, source, effort):
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    final = {"role": "assistant", "content": "It is 21 degrees.", "reasoning_content": "The tool said 21."}
    conversations = [
        (history()[:2], None),
        (history()[1:2], None),  # no system message: no developer message either
        (history()[:2], TOOLS),
        (one_call(0, reasoning="I should look it up."), TOOLS),  # the call's reasoning is kept (no final yet)
        (one_call(1) + [final, {"role": "user", "content": "And tomorrow?"}], TOOLS),  # dropped after a final
        (one_call(0, reasoning="Look it up.") + [final, {"role": "user", "content": "Thanks"}], TOOLS),
    ]
    for messages, tools in conversations:
        assert template.render(messages, tools=tools, **kwargs) == oracle(source, messages, tools, **kwargs)
    prompt = template.render(history()[:2], tools=TOOLS, **kwargs)
    assert f"Reasoning: {effort or 'medium'}\n" in prompt
    assert "<b>live</b> data & more" in prompt  # tojson does not escape HTML


def test_several_calls_render_one_per_message_each_followed_by_its_result(template, source):
    """The template writes only an assistant message's first call; several calls are
    split so that each is written, followed by its own result (sent in any order)."""
    messages = with_results(history(reasoning="Both, then."))
    messages[-2:] = messages[-2:][::-1]  # the results come back in the other order
    calls = messages[2]["tool_calls"]
    interleaved = messages[:2] + [
        {**messages[2], "tool_calls": calls[:1]}, messages[4],
        {"role": "assistant", "content": "", "tool_calls": calls[1:]}, messages[3]]
    rendered = template.render(messages, tools=TOOLS)
    assert rendered == oracle(source, interleaved, TOOLS)
    assert "to=functions.get_weather" in rendered and "to=functions.search" in rendered
    assert rendered.index("<|start|>functions.search to=assistant") > rendered.index("to=functions.search<|channel|>")


def test_bad_reasoning_effort_is_refused(template):
    with pytest.raises(ValueError, match="reasoning effort must be one of low, medium, high"):
        template.render(history()[:2], reasoning_effort="extreme")


# -- parsing -----------------------------------------------------------------------------------

def parse(text, step, tools=True, fmt="auto", primed=""):
    parser = HarmonyParser(tools, primed=primed, reasoning_format=fmt)
    deltas = []
    for i in range(0, len(text), step):
        deltas += parser.feed(text[i:i + step])
    deltas += parser.finish()
    reply = parser.reply
    assert reply.content == "".join(d[1] for d in deltas if d[0] == "content")
    assert reply.reasoning == "".join(d[1] for d in deltas if d[0] == "reasoning")
    assert [(d[1], d[2]) for d in deltas if d[0] == "call"] == list(enumerate(reply.tool_calls))
    return reply


def check(text, reasoning, content, calls=(), **kwargs):
    for step in (1, 2, 3, 7, len(text) or 1):
        reply = parse(text, step, **kwargs)
        assert (reply.reasoning, reply.content) == (reasoning, content), step
        assert [(c.name, c.arguments) for c in reply.tool_calls] == list(calls), step


def test_analysis_and_final():
    text = "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant<|channel|>final" \
           "<|message|>2 + 2 = **4**.\n"
    check(text, "User asks 2+2. Answer 4.", "2 + 2 = **4**.\n")
    check(text + "<|return|>", "User asks 2+2. Answer 4.", "2 + 2 = **4**.\n")
    # llama.cpp's --reasoning-format none: the analysis stays in the content as written
    check(text, "", "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>2 + 2 = **4**.\n", fmt="none")
    check(text, "User asks 2+2. Answer 4.",
          "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>2 + 2 = **4**.\n", fmt="deepseek-legacy")


def test_the_templates_own_calls_parse_back(template):
    """What the template writes for an assistant turn (reasoning, then a call with the
    recipient in the role header) is what a model trained on it generates."""
    for i, (name, args) in enumerate(CALLS):
        messages = one_call(i, reasoning="Need the tool.")[:3]
        prompt = template.render(messages[:2], tools=TOOLS)
        full = template.render(messages, tools=TOOLS, add_generation_prompt=False)
        assert full.startswith(prompt)
        check(full[len(prompt):], "Need the tool.", "", [(name, args)])


def test_calls_in_the_channel_header_several_and_mixed_with_content():
    get, search = (f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>"
                   for n, a in CALLS)
    check("<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant" + get + "<|start|>assistant" + search,
          "Two lookups.", "", CALLS)
    # a preamble (commentary, no recipient) is content; the call's constraint may be bare or absent
    text = ("<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant<|channel|>commentary "
            "to=functions.search json<|message|>{\"query\": \"q\"}<|call|><|start|>assistant<|channel|>final"
            "<|message|>Done.")
    check(text, "", "Checking. Done.", [("search", {"query": "q"})])
    check("<|channel|>commentary to=functions.search<|message|>{}<|call|>", "", "", [("search", {})])
    # the stray commentary gpt-oss-20b sometimes writes before its channel
    check("<|channel|>commentary to=assistant<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant"
          "<|channel|>commentary<|channel|>final<|message|>Yes.", "Hm.", "Yes.")


def test_calls_nobody_offered_are_dropped_as_llama_cpp_drops_them():
    builtin = "<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|call|>"
    check(builtin, "", "")
    get = f"<|channel|>commentary to=functions.get_weather json<|message|>{json.dumps(CALLS[0][1])}<|call|>"
    check(get, "", "", tools=False)
    check(get, "", "", CALLS[:1], tools=True)


@pytest.mark.parametrize("text, content", [
    ("Hello there, no markup at all.", "Hello there, no markup at all."),
    ("to be or not to be", "to be or not to be"),
    ("<|channel|>commentary to=functions.search <|constrain|>json<|message|>{\"query\": <|call|>",
     "<|channel|>commentary to=functions.search <|constrain|>json<|message|>{\"query\": <|call|>"),
    ("<|channel|>commentary to=functions.search json<|message|>[1, 2]",
     "<|channel|>commentary to=functions.search json<|message|>[1, 2]"),
    ("<|channel|>final<|message|>cut sho", "cut sho"),
    ("<|channel|>analysis<|message|>thinking", ""),
    ("<|channel|>fin", ""),
    ("<|channel|>analysis<|end|>oops", "<|channel|>analysisoops"),
])
def test_malformed_replies_are_content_not_a_crash(text, content):
    check(text, "thinking" if text.endswith("<|message|>thinking") else "", content)


def test_random_harmony_soup_never_crashes():
    pieces = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.search",
              " to=x", "<|constrain|>", "json", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "{}",
              "{\"query\": \"a\"}", "text ", "<|", "|>", " "]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        whole = parse(text, len(text) or 1)
        for step in (1, 4):
            piecewise = parse(text, step)
            assert (piecewise.reasoning, piecewise.content, [(c.name, c.arguments) for c in piecewise.tool_calls]) \
                == (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.tool_calls]), text


def test_forced_calls_and_thinking_off_prime_the_reply(template):
    named = prepare_turn(template, history()[:2], tools=TOOLS,
                         tool_choice={"type": "function", "function": {"name": "search"}})
    assert named.prompt.endswith("<|start|>assistant to=functions.search<|channel|>commentary json<|message|>")
    reply = named.parser()
    reply.feed('{"query": "q"}')
    reply.finish()
    assert [(c.name, c.arguments) for c in reply.reply.tool_calls] == [("search", {"query": "q"})]
    required = prepare_turn(template, history()[:2], tools=TOOLS, tool_choice="required",
                            template_kwargs={"enable_thinking": False})
    assert required.prompt.endswith("<|start|>assistant" + EMPTY_ANALYSIS + " to=functions.")
    reply = required.parser()
    reply.feed('get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}')
    reply.finish()
    assert [(c.name, c.arguments) for c in reply.reply.tool_calls] == [("get_weather", {"city": "Oslo"})]
    assert prepare_turn(template, history()[:2], tools=TOOLS, tool_choice="none").tool_format is None


# -- stop tokens -------------------------------------------------------------------------------

def test_return_and_call_end_generation_under_llama_cpps_vocabulary(tmp_path):
    """A vocabulary with o200k_harmony's special tokens, loaded by llama.cpp: <|return|>
    and <|call|> end generation, <|end|> does not (the model goes on to its next message)."""
    import gguf

    from dflash_gguf.runtime.tokenizer import Tokenizer

    specials = ["<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                "<|message|>", "<|call|>", "<|endoftext|>"]
    byte_chars = [chr(c) for c in (*range(33, 127), *range(161, 173), *range(174, 256))]
    byte_chars += [chr(256 + i) for i in range(256 - len(byte_chars))]  # GPT-2's byte-to-unicode table's rest
    tokens = byte_chars + ["hi"] + specials  # llama.cpp wants at least one merge
    types = [gguf.TokenType.NORMAL] * (len(byte_chars) + 1) + [gguf.TokenType.CONTROL] * len(specials)
    path = tmp_path / "harmony-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 8), ("attention.head_count", 1)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["h i"])
    w.add_bos_token_id(tokens.index("<|startoftext|>"))
    w.add_eos_token_id(tokens.index("<|return|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer(str(path))
    eog = {tok.decode([t]) for t in tok.eog_ids}
    assert {"<|return|>", "<|call|>"} <= eog and "<|end|>" not in eog
    assert tok.decode(tok.encode("<|channel|>final<|message|>hi", add_bos=False)) == "<|channel|>final<|message|>hi"


# -- dflash-server through the real clients ----------------------------------------------------

@pytest.fixture(scope="module")
def scripted():
    from dflash_gguf.runtime.demo import demo_paths
    from dflash_gguf.engine.engine import Engine

    target, draft = demo_paths()
    with Engine(target, draft, n_ctx=4096, n_threads=1) as engine:
        yield ScriptedEngine(engine)


@pytest.fixture(scope="module")
def server(scripted, source):
    scripted._engine.set_chat_template(source, GPT_OSS)
    s = AppServer(scripted, defaults(template_kwargs={"reasoning_effort": "low"}))
    yield s
    s.stop()


THINK_AND_ANSWER = ("<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final<|message|>"
                    "Hello! How can I help?")
CALL_REPLY = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
              f"to=functions.get_weather <|constrain|>json<|message|>{json.dumps(CALLS[0][1])}<|call|>")


def test_openai_reasoning_and_content_streamed_and_not(server, scripted, source):
    scripted.replies[:] = [THINK_AND_ANSWER] * 2
    messages = [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    resp = server.openai.chat.completions.create(model="x", messages=messages)
    msg = resp.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == ("Hello! How can I help?", "Greet back.")
    assert resp.choices[0].finish_reason == "stop"
    # the server-wide effort (low) reached the template; developer is the system message
    assert scripted.prompts[-1] == oracle(source, [{"role": "system", "content": "Be kind."}, messages[1]],
                                          reasoning_effort="low")
    chunks = list(server.openai.chat.completions.create(model="x", messages=messages, stream=True,
                                                         reasoning_effort="high"))
    assert "Reasoning: high\n" in scripted.prompts[-1]
    content = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    reasoning = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks
                 if (c.choices[0].delta.model_extra or {}).get("reasoning_content")]
    assert "".join(content) == "Hello! How can I help?" and "".join(reasoning) == "Greet back."
    assert len(content) > 1 and len(reasoning) > 1  # streamed as the channels arrive
    assert not any("<|" in piece or "|>" in piece for piece in content + reasoning)


def test_openai_tool_calls_and_the_result_turn(server, scripted, source):
    scripted.replies[:] = [CALL_REPLY, CALL_REPLY, "<|channel|>final<|message|>21 degrees."]
    kwargs = dict(model="x", messages=openai_messages(history()[:2]), tools=TOOLS,
                  extra_body={"chat_template_kwargs": {"reasoning_effort": "medium"}})
    resp = server.openai.chat.completions.create(**kwargs)
    assert scripted.prompts[-1] == oracle(source, history()[:2], TOOLS, reasoning_effort="medium")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS[:1]
    content, reasoning, calls, finish = streamed_chat(server.openai, **kwargs)
    assert (content, reasoning, finish) == ("", "Need weather.", "tool_calls")
    assert [(name, args) for _, name, args in calls] == CALLS[:1]
    # the client sends the call (with its reasoning) and the result back
    call = choice.message.tool_calls[0]
    messages = kwargs["messages"] + [choice.message.model_dump(exclude_none=True),
                                     {"role": "tool", "tool_call_id": call.id, "content": "{\"temp\": 21}"}]
    second = server.openai.chat.completions.create(model="x", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "21 degrees."
    want = one_call(0, reasoning="Need weather.")
    want[2]["tool_calls"][0]["id"] = call.id
    want[3]["tool_call_id"] = call.id
    want[1] = history()[1]
    assert scripted.prompts[-1] == oracle(source, want, TOOLS, reasoning_effort="low")


@pytest.mark.parametrize("extra, field", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"reasoning_effort": 3}}, "chat_template_kwargs"),
])
def test_bad_reasoning_effort_gets_400_naming_the_field(server, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        server.openai.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                              extra_body=extra)
    assert e.value.body["param"] == field and "reasoning" in e.value.body["message"]


def test_anthropic_thinking_tool_use_and_text(server, scripted):
    scripted.replies[:] = [CALL_REPLY, CALL_REPLY, THINK_AND_ANSWER]
    kwargs = dict(model="x", max_tokens=200, messages=[{"role": "user", "content": "Weather in São Paulo?"}],
                  tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                          "input_schema": t["function"]["parameters"]} for t in TOOLS],
                  thinking={"type": "enabled", "budget_tokens": 10000})
    msg = server.anthropic.messages.create(**kwargs)
    assert "Reasoning: medium\n" in scripted.prompts[-1]  # a 10,000-token budget is a medium effort
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].thinking == "Need weather."
    assert (msg.content[1].name, msg.content[1].input) == CALLS[0]
    with server.anthropic.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert (final.content[0].thinking, final.content[1].name, final.content[1].input) == ("Need weather.",
                                                                                          *CALLS[0])
    assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta" for e in events)
    text = server.anthropic.messages.create(model="x", max_tokens=200, messages=[{"role": "user", "content": "Hi"}],
                                            thinking={"type": "enabled", "budget_tokens": 2000})
    assert "Reasoning: low\n" in scripted.prompts[-1]
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in text.content] == [
        ("thinking", "Greet back."), ("text", "Hello! How can I help?")]


def test_anthropic_bad_budget_gets_400(server):
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        server.anthropic.messages.create(model="x", max_tokens=10, messages=[{"role": "user", "content": "Hi"}],
                                         thinking={"type": "enabled", "budget_tokens": "lots"})


@pytest.mark.parametrize("argv", [["--reasoning-effort", "extreme"],
                                  ["--chat-template-kwargs", '{"reasoning_effort": "max"}']])
def test_bad_reasoning_effort_flag_exits_2(argv, capsys):
    from dflash_gguf.chat.flags import validate_chat_args
    from dflash_gguf.serving.server import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        validate_chat_args(parser.parse_args(argv), parser)
    assert e.value.code == 2 and "reasoning effort must be one of low, medium, high" in capsys.readouterr().err
    args = parser.parse_args(["--reasoning-effort", "high"])
    validate_chat_args(args, parser)
    assert args.template_kwargs == {"reasoning_effort": "high"}
