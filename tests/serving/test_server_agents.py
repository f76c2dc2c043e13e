"""dflash-server as agents use it, through the real `openai` and `anthropic` clients:
tool calls in each template's format (streamed and not, parallel, forced), tool
results rendered back, reasoning split out, thinking switched off, the Anthropic
Messages API, API keys and CORS, and hostile requests answered with a 400 in the
API's own shape. The model's replies are scripted under the HTTP layer (the demo
engine's tokenizer and the published templates, a script in place of generation), so
each format's parser meets exactly the text its template teaches; the prompts the
server renders are checked against transformers' rendering of the same conversation.
"""
from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest
from openai import OpenAI

from helpers.chat_fixtures import CALLS, TOOLS, assistant_text, history, transformers_render, with_results
from helpers.scripted_app import (REASONING, render, script_calls_turn, scripted, server,  # noqa: F401 - fixtures
                                  use_template)
from helpers.servers import AppServer, anthropic_client, defaults, openai_messages, streamed_chat

from dflash_gguf.chat.templates import ChatTemplate

TEMPLATES = ["Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen3-Coder", "google-gemma-4-31B-it"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_parallel_tool_calls_in_each_format(server, scripted, use_template, name):
    source = use_template(name)
    _, text = assistant_text(ChatTemplate(source), history(), tools=TOOLS, enable_thinking=True)
    scripted.replies += [text, text]
    kwargs = dict(model="x", messages=openai_messages(history()[:-1]), tools=TOOLS,
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    resp = server.openai.chat.completions.create(**kwargs)
    assert scripted.prompts[-1] == render(source, history()[:-1], TOOLS, enable_thinking=True)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
    assert all(c.type == "function" and c.id for c in choice.message.tool_calls)
    content, reasoning, calls, finish = streamed_chat(server.openai, **kwargs)
    assert (content, finish) == ("", "tool_calls")
    assert [(name, args) for _, name, args in calls] == CALLS and all(i for i, _, _ in calls)


def test_a_tool_result_turn_renders_back(server, scripted, use_template):
    """The client sends back the assistant's calls (arguments as JSON strings, as it
    received them) and the tools' results: the template gets them as the model saw them."""
    source = use_template("Qwen3.5-4B")
    _, text = assistant_text(ChatTemplate(source), history(), tools=TOOLS, enable_thinking=True)
    # Qwen3.5's prompt opens a thinking block: the reply starts with thoughts
    scripted.replies += [text, "Both came back.\n</think>\n\nIt is 21 degrees; nothing found."]
    messages = openai_messages(history()[:-1])
    first = server.openai.chat.completions.create(model="x", messages=messages, tools=TOOLS)
    calls = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": calls[0].id, "content": "{\"temp\": 21}"},
                 {"role": "tool", "tool_call_id": calls[1].id, "content": "nothing found"}]
    second = server.openai.chat.completions.create(model="x", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "It is 21 degrees; nothing found."
    assert second.choices[0].message.model_extra["reasoning_content"] == "Both came back."
    assert second.choices[0].finish_reason == "stop"
    want = with_results(history())
    for call, sent in zip(want[2]["tool_calls"], calls):
        call["id"] = sent.id
    want[3]["tool_call_id"], want[4]["tool_call_id"] = calls[0].id, calls[1].id
    assert scripted.prompts[-1] == render(source, want, TOOLS)


@pytest.mark.parametrize("name,reply,reasoning,content", [
    ("Qwen3.5-4B", "The user asks.\nCheck.\n</think>\n\nIt is sunny.", "The user asks.\nCheck.", "It is sunny."),
    ("Qwen-Qwen3-0.6B", "<think>\nHm.\n</think>\n\nSunny.", "Hm.", "Sunny."),
    ("google-gemma-4-31B-it", "<|channel>thought\nHm.<channel|>Sunny.", "Hm.", "Sunny."),
])
def test_reasoning_is_split_streamed_and_not(server, scripted, use_template, name, reply, reasoning, content):
    use_template(name)
    scripted.replies += [reply, reply]
    kwargs = dict(model="x", messages=[{"role": "user", "content": "Weather?"}],
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = server.openai.chat.completions.create(**kwargs).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)
    got = streamed_chat(server.openai, **kwargs)
    assert got == (content, reasoning, [], "stop")


def test_reasoning_format_none_and_legacy_per_request(server, scripted, use_template):
    use_template("Qwen-Qwen3-0.6B")
    reply = "<think>\nHm.\n</think>\n\nSunny."
    scripted.replies += [reply, reply]
    ask = dict(model="x", messages=[{"role": "user", "content": "Weather?"}])
    message = server.openai.chat.completions.create(**ask, extra_body={"reasoning_format": "none"}).choices[0].message
    assert message.content == reply and "reasoning_content" not in (message.model_extra or {})
    message = server.openai.chat.completions.create(**ask, extra_body={"reasoning_format": "deepseek-legacy"}) \
        .choices[0].message
    assert message.content == reply and message.model_extra["reasoning_content"] == "Hm."


def test_thinking_off_by_default_on_per_request(scripted, use_template):
    """--reasoning-budget 0 (enable_thinking false for the template): the prompt closes
    the thinking block; a request's chat_template_kwargs turn it back on."""
    source = use_template("Qwen3.5-4B")
    s = AppServer(scripted, defaults(template_kwargs={"enable_thinking": False}))
    try:
        messages = [{"role": "user", "content": "Weather?"}]
        scripted.replies += ["Sunny.", "Hm.\n</think>\n\nSunny."]
        message = s.openai.chat.completions.create(model="x", messages=messages).choices[0].message
        assert scripted.prompts[-1] == render(source, messages, enable_thinking=False)
        assert scripted.prompts[-1].endswith("<think>\n\n</think>\n\n") and message.content == "Sunny."
        message = s.openai.chat.completions.create(
            model="x", messages=messages, extra_body={"chat_template_kwargs": {"enable_thinking": True}}) \
            .choices[0].message
        assert scripted.prompts[-1] == render(source, messages, enable_thinking=True)
        assert (message.model_extra["reasoning_content"], message.content) == ("Hm.", "Sunny.")
    finally:
        s.stop()


@pytest.mark.parametrize("name", TEMPLATES)
def test_tool_choice_forces_a_call_or_none(server, scripted, use_template, name):
    source = use_template(name)
    _, text = assistant_text(ChatTemplate(source), history(CALLS[1:]), tools=TOOLS, enable_thinking=True)
    opening = "<|tool_call>call:search{" if name.startswith("google") else \
        "<tool_call>\n<function=search>\n" if "3.5" in name or "Coder" in name else \
        '<tool_call>\n{"name": "search", "arguments": '
    rest = text[text.index(opening) + len(opening):]
    scripted.replies += [rest, "No tools needed."]
    resp = server.openai.chat.completions.create(
        model="x", messages=openai_messages(history()[:2]), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "search"}})
    assert scripted.prompts[-1].endswith(opening)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in resp.choices[0].message.tool_calls] \
        == CALLS[1:]
    resp = server.openai.chat.completions.create(model="x", messages=openai_messages(history()[:2]), tools=TOOLS,
                                                 tool_choice="none",
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "get_weather" not in scripted.prompts[-1]
    assert resp.choices[0].message.content == "No tools needed." and resp.choices[0].message.tool_calls is None


def test_parallel_tool_calls_false_keeps_the_first_call(server, scripted, use_template):
    source = use_template("Qwen3.5-4B")
    _, text = assistant_text(ChatTemplate(source), history(), tools=TOOLS, enable_thinking=True)
    scripted.replies.append(text)
    resp = server.openai.chat.completions.create(model="x", messages=openai_messages(history()[:-1]), tools=TOOLS,
                                                 parallel_tool_calls=False)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in resp.choices[0].message.tool_calls] \
        == CALLS[:1]
    assert resp.choices[0].finish_reason == "tool_calls"


def test_a_malformed_call_comes_back_as_content(server, scripted, use_template):
    use_template("Qwen-Qwen3-0.6B")
    text = '<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call>'
    scripted.replies += [text, text]
    ask = dict(model="x", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    resp = server.openai.chat.completions.create(**ask)
    assert resp.choices[0].message.content == text and resp.choices[0].finish_reason == "stop"
    assert streamed_chat(server.openai, **ask) == (text, "", [], "stop")


# -- the Anthropic Messages API -----------------------------------------------------------------

def test_anthropic_plain_and_streamed(server, scripted, use_template):
    source = use_template(None)
    scripted.replies += ["Hello there.", "Hello there."]
    ask = dict(model="x", max_tokens=64, system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
    msg = server.anthropic.messages.create(**ask)
    assert scripted.prompts[-1] == render(source, [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}])
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello there."
    assert msg.stop_reason == "end_turn" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.usage.output_tokens > 0 and msg.usage.input_tokens > 0
    with server.anthropic.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there." and final.content[0].text == text and final.stop_reason == "end_turn"
    count = server.anthropic.messages.count_tokens(model="x", system="Be brief.",
                                                   messages=[{"role": "user", "content": "Hi"}])
    assert count.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_anthropic_tools_thinking_and_a_tool_result_turn(server, scripted, use_template):
    source, messages = script_calls_turn(scripted, use_template)
    reasoning = REASONING
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    ask = dict(model="x", max_tokens=256, system="You are terse.", tools=tools,
               messages=[{"role": "user", "content": messages[1]["content"]}],
               thinking={"type": "enabled", "budget_tokens": 1024})
    msg = server.anthropic.messages.create(**ask)
    assert scripted.prompts[-1] == render(source, messages[:2], TOOLS, enable_thinking=True)
    assert [b.type for b in msg.content] == ["thinking", "tool_use", "tool_use"]
    assert msg.content[0].thinking == reasoning
    assert [(b.name, b.input) for b in msg.content[1:]] == CALLS and msg.stop_reason == "tool_use"
    assert all(b.id.startswith("toolu_") for b in msg.content[1:])
    with server.anthropic.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use", "tool_use"]
    assert final.content[0].thinking == reasoning and [(b.name, b.input) for b in final.content[1:]] == CALLS
    assert final.stop_reason == "tool_use"
    results = [{"type": "tool_result", "tool_use_id": msg.content[1].id, "content": "{\"temp\": 21}"},
               {"type": "tool_result", "tool_use_id": msg.content[2].id,
                "content": [{"type": "text", "text": "nothing found"}]}]
    done = server.anthropic.messages.create(**{**ask, "messages": ask["messages"] + [
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": results}]})
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in done.content] == \
        [("thinking", "Got both."), ("text", "Done: 21 degrees.")]
    assert done.stop_reason == "end_turn"
    want = with_results(history(reasoning=reasoning))
    for call, block in zip(want[2]["tool_calls"], msg.content[1:]):
        call["id"] = block.id
    want[3]["tool_call_id"], want[4]["tool_call_id"] = msg.content[1].id, msg.content[2].id
    assert scripted.prompts[-1] == render(source, want, TOOLS, enable_thinking=True)


def test_anthropic_stop_sequence_and_max_tokens(server, scripted, use_template):
    use_template(None)
    scripted.replies.append("abc STOP def")
    msg = server.anthropic.messages.create(model="x", max_tokens=64, stop_sequences=["STOP"],
                                           messages=[{"role": "user", "content": "Hi"}])
    assert msg.content[0].text == "abc " and msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"


# -- hostile requests ------------------------------------------------------------------------------

DEEP = "[" * 100000 + "]" * 100000
HUGE_SCHEMA = {"type": "function", "function": {"name": "big", "description": "x" * 200000,
                                                "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body,needle", [
    ({"messages": [{"role": "user", "content": "hi"}], "tools": "all"}, "'tools' must be a list"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOLS[0]] * 2}, "given twice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOLS[0]] * 200}, "at most 128"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [HUGE_SCHEMA]}, "exceeds the available context size"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "no tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "'wizard' is not one of"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "search", "arguments": "{not json"}}]}]},
     "arguments is not valid JSON"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "search", "arguments": "[1]"}}]}]}, "JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "tool_calls must be a list"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text only"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "'response_format' must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": True}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "reasoning_format": "loud"}, "reasoning_format"),
    (DEEP, "nested too deeply"),
])
def test_hostile_chat_requests_get_400(server, use_template, body, needle):
    use_template("Qwen3.5-4B")
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = server.http.post("/v1/chat/completions", headers={"Content-Type": "application/json"}, **kwargs)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] and r.json()["error"]["type"] in ("invalid_request_error",
                                                                                   "exceed_context_size_error")
    assert server.http.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize("body,needle", [
    ({"model": "x", "messages": [{"role": "user", "content": "hi"}]}, "'max_tokens' is required"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "'user' or 'assistant'"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": 3}]}, "content"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "text only"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]}, "input must be an object"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"model": "x", "max_tokens": "lots", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thinking": "on"},
     "'thinking'"),
])
def test_hostile_anthropic_requests_get_400_in_its_shape(server, use_template, body, needle):
    use_template("Qwen3.5-4B")
    r = server.http.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]
    if "max_tokens" in body:  # the client itself insists on one
        with pytest.raises(anthropic.BadRequestError):
            server.anthropic.messages.create(**body)
    assert server.http.get("/health").json()["status"] == "ok"


def test_api_key_and_cors(scripted, use_template):
    use_template(None)
    s = AppServer(scripted, defaults(), api_keys=["sesame", "other"])
    try:
        scripted.replies += ["yes", "yes"]
        ask = dict(model="x", messages=[{"role": "user", "content": "hi"}])
        keyed = OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0,
                       http_client=httpx.Client(trust_env=False, timeout=60))
        assert keyed.chat.completions.create(**ask).choices[0].message.content == "yes"
        wrong = OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0,
                       http_client=httpx.Client(trust_env=False, timeout=60))
        with pytest.raises(Exception) as e:
            wrong.chat.completions.create(**ask)
        assert getattr(e.value, "status_code", None) == 401
        claude = anthropic_client(s.url, "other")
        assert claude.messages.create(max_tokens=5, **ask).content[0].text == "yes"
        with pytest.raises(anthropic.AuthenticationError):
            s.anthropic.messages.create(max_tokens=5, **ask)
        r = s.http.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert s.http.get("/health").status_code == 200
        # CORS: by default only pages served from localhost may read a reply
        for origin, allowed in (("http://localhost:5173", True), ("http://127.0.0.1", True),
                                ("http://[::1]:3000", True), ("http://ui.example", False),
                                ("http://localhost.evil.com", False)):
            pre = s.http.options("/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert pre.status_code == 200 and pre.headers.get("access-control-allow-origin") == \
                (origin if allowed else None), origin
            r = s.http.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer sesame"})
            assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == \
                (origin if allowed else None), origin
            # a refusal carries the header too (the page may read why), or not at all
            r = s.http.get("/models", headers={"Origin": origin})
            assert r.status_code == 401 and r.headers.get("access-control-allow-origin") == \
                (origin if allowed else None), origin
    finally:
        s.stop()


@pytest.mark.parametrize("origins,origin,allowed", [
    ("http://ui.example", "http://ui.example", True),
    ("http://ui.example,https://b.example", "https://b.example", True),
    ("http://ui.example", "http://evil.example", False),
    ("http://ui.example", "http://localhost:8080", False),  # a list replaces the localhost default
    ("*", "http://evil.example", True),
])
def test_cors_origins_list(scripted, use_template, origins, origin, allowed):
    """--cors-origins: a listed origin can read a reply, an unlisted one cannot."""
    use_template(None)
    s = AppServer(scripted, defaults(), cors={"origins": origins})
    try:
        scripted.replies += ["yes"]
        r = s.http.post("/v1/chat/completions", headers={"Origin": origin},
                        json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert r.headers.get("access-control-allow-origin") == (origin if allowed else None)
    finally:
        s.stop()


@pytest.mark.parametrize("path,body,status,kind,needle", [
    ("/completion", {}, 400, "invalid_request_error", "'prompt' is required"),
    ("/completion", {"prompt": 5}, 400, "invalid_request_error", "'prompt' must be"),
    ("/completion", {"prompt": {"text": "hi"}}, 400, "invalid_request_error", "prompt_string"),
    ("/completion", {"prompt": ["hi", 5.5]}, 400, "invalid_request_error", "prompt[1]"),
    ("/completion", {"prompt": [1, 2, 10 ** 9]}, 400, "invalid_request_error", "outside the vocabulary"),
    ("/completion", {"prompt": {"prompt_string": "hi", "multimodal_data": ["x"]}}, 400, "invalid_request_error",
     "text only"),
    ("/completion", {"prompt": "hi", "n_predict": -5}, 400, "invalid_request_error", "'n_predict' must be"),
    ("/completion", {"prompt": "hi", "n_predict": "8"}, 400, "invalid_request_error", "'n_predict' must be"),
    ("/completion", {"prompt": "hi", "n_probs": 101}, 400, "invalid_request_error", "'n_probs' must be <= 100"),
    ("/completion", {"prompt": "hi", "id_slot": "first"}, 400, "invalid_request_error", "'id_slot'"),
    ("/completion", {"prompt": ["a", "b"], "stream": True}, 400, "invalid_request_error", "cannot be streamed"),
    ("/completion", {"prompt": "hi", "response_fields": "content"}, 400, "invalid_request_error",
     "'response_fields' must be a list"),
    ("/completion", {"prompt": "word " * 5000}, 400, "exceed_context_size_error", "exceeds the available context"),
    ("/completions", {"prompt": "hi", "temperature": -1}, 400, "invalid_request_error", "'temperature'"),
    ("/infill", {"input_prefix": "a", "input_suffix": "b"}, 501, "not_supported_error",
     "Infill is not supported by this model"),
    ("/infill", {"input_extra": [{"filename": 123}]}, 501, "not_supported_error", "Infill is not supported"),
    ("/apply-template", {"messages": "hi"}, 400, "invalid_request_error", "'messages' must be a list"),
    ("/chat/completions/input_tokens", {"messages": {}}, 400, "invalid_request_error", "'messages'"),
    ("/embeddings", {"input": "hi"}, 501, "not_supported_error", "not supported"),
])
def test_hostile_native_requests(server, path, body, status, kind, needle):
    """llama-server's own routes answer malformed input with its error shape and status,
    never a 500."""
    r = server.http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["code"] == status and needle in err["message"], err
    if kind == "exceed_context_size_error":
        assert err["n_prompt_tokens"] > err["n_ctx"] > 0
    assert server.http.get("/health").json()["status"] == "ok"


def test_native_completion_and_slots(server, scripted):
    """/completion in llama-server's shape: content, tokens, stop_type, timings; a batch
    of prompts as a list; streamed pieces with their tokens; /slots and /apply-template."""
    scripted.replies += ["one two", "three", "four"]
    r = server.http.post("/completion", json={"prompt": "hi", "n_predict": 8, "return_tokens": True})
    body = r.json()
    assert r.status_code == 200 and body["content"] == "one two" and body["stop"] is True, body
    assert body["tokens"] and body["stop_type"] in ("eos", "limit") and body["timings"]["predicted_n"] > 0
    r = server.http.post("/completions", json={"prompt": ["hi", [5, 6, "x"]], "n_predict": 8,
                                               "response_fields": ["content", "timings/prompt_n"]})
    assert r.status_code == 200 and [b["content"] for b in r.json()] == ["three", "four"], r.text
    assert set(r.json()[0]) == {"content", "timings/prompt_n"}
    scripted.replies += ["five six"]
    with server.http.stream("POST", "/completion", json={"prompt": "hi", "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == "five six" and events[-1]["stop"] is True
    assert all(e["tokens"] for e in events[:-1])
    slots = server.http.get("/slots").json()
    assert slots and all(not s["is_processing"] for s in slots)
    r = server.http.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "hi" in r.json()["prompt"]
    bare = server.http.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "add_generation_prompt": False}).json()["prompt"]
    assert r.json()["prompt"].startswith(bare) and len(bare) < len(r.json()["prompt"])


PREFILL = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"},
           {"role": "assistant", "content": "Whill"}]


@pytest.mark.parametrize("name", [None, "meta-llama-Llama-3.1-8B-Instruct", "Qwen-Qwen3-0.6B", "Qwen3.5-4B"])
def test_an_assistant_prefill_is_continued(server, scripted, use_template, name):
    """A chat whose last message is the assistant's: the reply continues it (the template
    rendered without closing that turn, no new one opened: transformers'
    continue_final_message as the oracle), and the reply is the continuation alone."""
    source = use_template(name)
    scripted.replies += ["iam Tell", "iam Tell"]
    resp = server.openai.chat.completions.create(model="x", messages=PREFILL)
    want = transformers_render(source, PREFILL, None, bos_token="", eos_token="<|endoftext|>",
                               add_generation_prompt=False, continue_final_message=True,
                               date_string=time.strftime("%d %b %Y"))  # as llama.cpp's, today
    assert scripted.prompts[-1] == want and want.endswith("Whill")
    assert resp.choices[0].message.content == "iam Tell"
    if name == "meta-llama-Llama-3.1-8B-Instruct":  # llama.cpp's own test's expectation
        assert want.endswith("<|start_header_id|>user<|end_header_id|>\n\nWhat is the best book<|eot_id|>"
                             "<|start_header_id|>assistant<|end_header_id|>\n\nWhill")
    content, _, _, _ = streamed_chat(server.openai, model="x", messages=PREFILL)
    assert content == "iam Tell" and scripted.prompts[-1] == want


@pytest.mark.parametrize("messages,needle", [
    (PREFILL + [{"role": "assistant", "content": "again"}], "2 or more assistant messages at the end"),
    (PREFILL[:2] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}],
     "an assistant message that contains tool calls"),
])
def test_an_assistant_message_that_cannot_be_continued_gets_400(server, use_template, messages, needle):
    use_template(None)
    r = server.http.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
