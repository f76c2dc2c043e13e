"""OpenAI's Responses API (/v1/responses, /responses) as llama-server serves it, through
the real `openai` client: a response whole and streamed (the event sequence llama-server
emits, which the client's own stream helper also reads), instructions and input items
rendered as the chat they translate to, function tools and calls with reasoning, a
function call's output sent back, and malformed requests answered with a 400 in the
OpenAI shape. The replies are scripted under the HTTP layer, as in test_server_agents;
test_server.py checks a response against the demo engine's own generation."""
from __future__ import annotations

import json

import openai
import pytest

from helpers.chat_fixtures import CALLS, TOOLS, history, with_results
from helpers.scripted_app import (REASONING, render, script_calls_turn, scripted, server,  # noqa: F401 - fixtures
                                  use_template)

from dflash_gguf.serving.api_errors import validated
from dflash_gguf.serving.responses_api import to_chat
from dflash_gguf.serving.responses_models import ResponsesRequest

# the tools of helpers.chat_fixtures in the Responses API's form (flat, no "function" wrapper)
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def events(client, **kwargs) -> list:
    return list(client.responses.create(stream=True, **kwargs))


def test_a_response_whole_and_streamed(server, scripted, use_template):
    source = use_template(None)
    scripted.replies += ["Hello there."] * 4
    ask = dict(model="x", instructions="Be brief.", input="Hi", max_output_tokens=64, temperature=0.8)
    res = server.openai.responses.create(**ask)
    assert scripted.prompts[-1] == render(source, [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}])
    assert res.id.startswith("resp_") and res.object == "response" and res.status == "completed"
    assert [item.type for item in res.output] == ["message"] and res.output[0].id.startswith("msg_")
    assert res.output[0].role == "assistant" and res.output_text == "Hello there."
    assert res.usage.output_tokens > 0 and res.usage.total_tokens == res.usage.input_tokens + res.usage.output_tokens

    got = events(server.openai, **ask)
    kinds = [e.type for e in got]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9  # streamed piece by piece
    assert [e.sequence_number for e in got] == list(range(len(got)))
    rid, msg_id = got[0].response.id, got[2].item.id
    assert rid.startswith("resp_") and msg_id.startswith("msg_") and got[1].response.id == rid
    assert all(e.item_id == msg_id for e in got[3:-2]) and got[-2].item.id == msg_id
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    final = got[-1].response
    assert text == got[-4].text == final.output_text == "Hello there."
    assert final.id == rid and final.output[0].id == msg_id and final.usage.output_tokens == res.usage.output_tokens
    assert "timings" in got[-1].model_extra

    # the client's stream helper builds its snapshot from the events' output and content indices
    with server.openai.responses.stream(**ask) as stream:
        done = stream.get_final_response()
    assert done.output_text == "Hello there."

    # unprefixed, as llama-server has it, and the prompt's tokens counted
    r = server.http.post("/responses", json={"input": "Hi", "instructions": "Be brief."})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "Hello there."
    count = server.http.post("/v1/responses/input_tokens", json={"input": "Hi", "instructions": "Be brief."}).json()
    assert count == {"input_tokens": res.usage.input_tokens, "object": "response.input_tokens"}


def test_function_calls_with_reasoning_and_their_outputs_sent_back(server, scripted, use_template):
    source, messages = script_calls_turn(scripted, use_template)
    reasoning = REASONING
    ask = dict(model="x", instructions="You are terse.", tools=RESPONSES_TOOLS,
               input=[{"role": "user", "content": messages[1]["content"]}],
               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    res = server.openai.responses.create(**ask)
    assert scripted.prompts[-1] == render(source, messages[:2], TOOLS, enable_thinking=True)
    assert [item.type for item in res.output] == ["reasoning", "function_call", "function_call"]
    assert res.output[0].content[0].text == reasoning and res.output[0].id.startswith("rs_")
    calls = res.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert all(c.call_id.startswith("call_") and c.id == "fc_" + c.call_id[5:] for c in calls)

    got = events(server.openai, **ask)
    added = [e.item for e in got if e.type == "response.output_item.added"]
    assert [(i.type, i.status) for i in added] == [("reasoning", "in_progress"), ("function_call", "in_progress"),
                                                   ("function_call", "in_progress")]
    assert "".join(e.delta for e in got if e.type == "response.reasoning_text.delta") == reasoning
    args = [e.delta for e in got if e.type == "response.function_call_arguments.delta"]
    assert [json.loads(a) for a in args] == [a for _, a in CALLS]
    final = got[-1].response
    assert got[-1].type == "response.completed"
    assert [i.type for i in final.output] == ["reasoning", "function_call", "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in final.output[1:]] == CALLS

    # the output items sent back as they came, with the calls' outputs
    outputs = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "{\"temp\": 21}"},
               {"type": "function_call_output", "call_id": calls[1].call_id, "output": "nothing found"}]
    done = server.openai.responses.create(**{**ask, "input": ask["input"] + [
        item.model_dump(exclude_none=True) for item in res.output] + outputs})
    assert [i.type for i in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == "Got both." and done.output_text == "Done: 21 degrees."
    want = with_results(history(reasoning=reasoning))
    for call, sent in zip(want[2]["tool_calls"], calls):
        call["id"] = sent.call_id
    want[3]["tool_call_id"], want[4]["tool_call_id"] = calls[0].call_id, calls[1].call_id
    assert scripted.prompts[-1] == render(source, want, TOOLS, enable_thinking=True)


def chat_of(body: dict):
    return to_chat(validated(ResponsesRequest, body), body)


def test_the_translation_to_a_chat_request():
    chat = chat_of({"input": [{"role": "developer", "content": [{"type": "input_text", "text": "Be "},
                                                                 {"type": "input_text", "text": "brief."}]},
                              {"type": "message", "role": "assistant", "content": [
                                  {"type": "output_text", "text": "Earlier."}]},
                              {"role": "user", "content": "Now?"}],
                    "max_output_tokens": 12, "top_p": 0.5, "seed": 7, "stop": ["END"], "top_k": 3,
                    "reasoning": {"effort": "low"}, "text": {"format": {"type": "json_object"}},
                    "tools": [{"type": "web_search"}, RESPONSES_TOOLS[1]], "tool_choice": {"type": "function",
                                                                                          "name": "search"}})
    assert [(m.role, m.text) for m in chat.messages] == [("developer", "Be brief."), ("assistant", "Earlier."),
                                                        ("user", "Now?")]
    assert chat.max_tokens == 12 and chat.sampling.top_p == 0.5 and chat.sampling.seed == 7
    assert chat.stops == ["END"] and chat.sampling.top_k == 3 and chat.reasoning_effort == "low"
    assert chat.constraint.compiled is not None  # the text format, as response_format
    assert [t.function.name for t in chat.tools] == ["search"]  # a hosted tool has no chat equivalent: passed over
    assert chat.tool_choice.function.name == "search"
    plain = chat_of({"input": "Hi", "stream": True})
    assert [(m.role, m.text) for m in plain.messages] == [("user", "Hi")] and plain.stream


HOSTILE = [
    ({}, "'input' is required"),
    ({"input": 5}, "'input' must be a string or a list"),
    ({"input": [{"foo": 1}]}, "input[0] is none of the input items"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0] is none of the input items"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "'wizard' is not one of"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]}, "text only"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "text only"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "needs 'text'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "search", "arguments": "{not json"}]},
     "input[0].arguments is not valid JSON"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "search", "arguments": "[1]"}]},
     "input[0].arguments must be a JSON object"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "content"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "'previous_response_id' is not supported"),
    ({"input": "hi", "max_output_tokens": -1}, "'max_output_tokens' must be >= 0"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "instructions": 3}, "'instructions' must be a string"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "name"),
    ({"input": "hi", "tools": [{"name": "f"}]}, "needs a 'type'"),
    ({"input": "hi", "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "not among the tools"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "needs a 'schema'"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "effort"),
    ({"input": "hi", "logit_bias": {"5": True}}, "logit_bias"),
]


@pytest.mark.parametrize("body,needle", HOSTILE)
def test_malformed_requests_get_400_in_the_openai_shape(server, use_template, body, needle):
    use_template(None)
    for path in ("/v1/responses", "/responses"):
        r = server.http.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400
    assert server.http.get("/health").json()["status"] == "ok"


def test_the_client_raises_on_a_refusal_and_bad_json_is_a_400(server, use_template):
    use_template(None)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        server.openai.responses.create(model="x", input="hi", previous_response_id="resp_1")
    r = server.http.post("/v1/responses", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
