"""Structured output through dflash-server and the real OpenAI client: replies to
response_format json_schema / json_object and llama-server's `json_schema` and `grammar`
fields, greedy and sampled, validate with `jsonschema`; bad constraints get a 400 naming
the field."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from helpers.servers import HABITS, SERVER_FLAGS, ServerProcess

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("grammar-server"), *SERVER_FLAGS, *HABITS, "--queue", "16")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.text
    assert "Traceback" not in s.text, s.text


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3},
                                      {"temperature": 1.0, "top_p": 0.9, "seed": 7}])
def test_json_schema_replies_validate(server, sampling):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = server.client.chat.completions.create(model="x", messages=MESSAGES, response_format=fmt, max_tokens=200,
                                                 **sampling)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    # streamed, and llama-server's own field on the completions endpoint
    stream = server.client.chat.completions.create(model="x", messages=MESSAGES, response_format=fmt,
                                                   max_tokens=200, stream=True, **sampling)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    done = server.client.completions.create(model="x", prompt="    def to_json(self):\n        return ", max_tokens=200,
                                            extra_body={"json_schema": SCHEMA}, **sampling)
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_json_object_and_grammar_fields(server):
    chat = server.client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=300,
                                                 response_format={"type": "json_object"})
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    else:  # the demo model may write one long string: the prefix still follows the grammar
        assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content.startswith("{")
    done = server.client.completions.create(model="x", prompt="def fib(n):", max_tokens=40,
                                            extra_body={"grammar": 'root ::= "[" [0-9]+ ("," [0-9]+)* "]"'})
    assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", done.choices[0].text)
    assert done.choices[0].finish_reason == "stop"


def test_a_reply_cut_by_max_tokens_mid_structure_has_finish_reason_length(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    chat = server.client.chat.completions.create(model="x", messages=MESSAGES, response_format=fmt, max_tokens=4)
    assert chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs"),
    ({"response_format": {"type": "yaml"}}, "'response_format' must be"),
    ({"grammar": "root ::= missing"}, "invalid grammar"),
    ({"grammar": 5}, "'grammar' must be"),
    ({"json_schema": [1]}, "must be an object"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "not grammar and json_schema"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "not response_format and grammar"),
])
def test_bad_constraints_get_400_naming_the_problem(server, body, needle):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=8, extra_body=body)
    assert needle in str(e.value)


# ---- strict tools and required calls, in the model's own call format -------------------------

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "strict": True, "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "strict": True,
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string", "maxLength": 12}},
                                               "required": ["query"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module", params=["Qwen-Qwen3-0.6B", "Qwen3.5-4B"])  # hermes JSON calls, qwen-xml calls
def tool_server(request, tmp_path_factory, published_template):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "template.jinja").write_text(published_template(request.param), encoding="utf-8")
    s = ServerProcess(folder, *SERVER_FLAGS, *HABITS, "--chat-template-file", str(folder / "template.jinja"))
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.text
    assert "Traceback" not in s.text, s.text


def _schema_of(name):
    return {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]


# without `strict` too: a required call's arguments follow the schema, as llama-server's
# grammars make them (its suite's test_completion_with_required_tool_real_model)
LAX_TOOLS = [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in TOOLS]


@pytest.mark.parametrize("choice, sampling, tools", [("required", {"temperature": 0}, TOOLS),
                                                     ("required", {"temperature": 0.9, "seed": 5}, TOOLS),
                                                     ({"type": "function", "function": {"name": "get_weather"}},
                                                      {"temperature": 0}, TOOLS),
                                                     ("required", {"temperature": 0}, LAX_TOOLS),
                                                     ({"type": "function", "function": {"name": "search"}},
                                                      {"temperature": 0.9, "seed": 7}, LAX_TOOLS)])
def test_strict_tool_calls_through_openai_parse_and_validate(tool_server, choice, sampling, tools):
    resp = tool_server.client.chat.completions.create(model="x", messages=ASK, tools=tools, tool_choice=choice,
                                                      max_tokens=200, parallel_tool_calls=False, **sampling)
    calls = resp.choices[0].message.tool_calls
    assert calls and resp.choices[0].finish_reason == "tool_calls", resp
    for call in calls:
        if isinstance(choice, dict):
            assert call.function.name == choice["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))


def test_strict_tool_calls_through_anthropic_parse_and_validate(tool_server):
    import anthropic

    client = anthropic.Anthropic(base_url=tool_server.url, api_key="none", max_retries=0,
                                 http_client=anthropic.DefaultHttpxClient(trust_env=False, timeout=120))
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"], "strict": True,
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "search", "disable_parallel_tool_use": True}):
        msg = client.messages.create(model="x", max_tokens=200, messages=ASK, tools=tools, tool_choice=choice)
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and msg.stop_reason == "tool_use", msg
        for use in uses:
            jsonschema.validate(use.input, _schema_of(use.name))
        if choice["type"] == "tool":
            assert {u.name for u in uses} == {"search"}


@pytest.mark.parametrize("thinking", [False, True])
def test_json_schema_with_a_thinking_template_constrains_the_answer(tool_server, thinking):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = tool_server.client.chat.completions.create(
        model="x", messages=MESSAGES, response_format=fmt, max_tokens=300,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    choice = chat.choices[0]
    if not thinking:
        assert choice.finish_reason == "stop"
    if choice.finish_reason == "stop":  # with thinking, the demo model may think until max_tokens
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
