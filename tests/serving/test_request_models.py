"""The request models (openai_models, anthropic_models) and their errors in words
(api_errors): content blocks keyed on their type, ranges that name the field, unknown
fields ignored, the sampling ranges those every caller is held to, and each API's error
shape from the HTTP application. No engine: a refused body never reaches one."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from dflash_gguf.serving import anthropic_api
from dflash_gguf.serving.anthropic_models import MessagesRequest
from dflash_gguf.serving.api_errors import BadRequest, validated
from dflash_gguf.runtime.errors import ConfigError
from dflash_gguf.serving.openai_models import ChatRequest, CompletionRequest
from dflash_gguf.serving.routes import create_app
from dflash_gguf.decoding.sampling import SamplingParams

HI = [{"role": "user", "content": "hi"}]


def refusal(model, body) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        validated(model, body)
    return e.value


def test_an_unknown_anthropic_block_type_is_refused_naming_the_block_and_the_types_known():
    e = refusal(MessagesRequest, {"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "hologram", "data": "x"}]}]})
    assert str(e) == ("messages[0].content[1] must be of type 'text', 'tool_result', 'image' or 'document' "
                      "(got 'hologram')")
    assert e.param == "messages"


def test_a_block_of_the_other_role_is_refused_as_not_one_of_its_types():
    e = refusal(MessagesRequest, {"max_tokens": 5, "messages": [
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]})
    assert str(e) == ("messages[0].content[0] must be of type 'text', 'thinking', 'redacted_thinking' or "
                      "'tool_use' (got 'tool_result')")


def test_a_block_without_a_type_and_a_field_of_the_wrong_type_are_named():
    assert str(refusal(MessagesRequest, {"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"text": "x"}]}]})) \
        == "messages[0].content[0] needs 'type'"
    # the block's tag, "text", is also its field's name: the path names the field once
    assert str(refusal(MessagesRequest, {"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]})) == \
        "messages[0].content[0].text must be a string, got 5"


def test_images_are_known_and_refused_as_text_only():
    e = refusal(ChatRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]})
    assert str(e) == "messages[0].content[0] is 'image_url' content: this model reads text only"
    e = refusal(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "sticker"}]}]})
    assert "messages[0].content[0] must be of type 'text', 'image_url'" in str(e) and "(got 'sticker')" in str(e)


@pytest.mark.parametrize("model,field,value,message", [
    (CompletionRequest, "temperature", -0.5, "'temperature' must be >= 0, got -0.5"),
    (CompletionRequest, "top_p", 1.5, "'top_p' must be <= 1, got 1.5"),
    (CompletionRequest, "min_p", 1, "'min_p' must be < 1, got 1"),
    (CompletionRequest, "presence_penalty", -3, "'presence_penalty' must be >= -2, got -3"),
    (CompletionRequest, "repeat_last_n", -2, "'repeat_last_n' must be >= -1, got -2"),
    (CompletionRequest, "max_tokens", -1, "'max_tokens' must be >= 0, got -1"),
    (CompletionRequest, "temperature", float("inf"), "'temperature' must be finite"),
    (CompletionRequest, "seed", "7", "'seed' must be an integer, got \"7\""),
    (MessagesRequest, "max_tokens", -1, "'max_tokens' must be >= 0, got -1"),
    (MessagesRequest, "top_p", 0, "'top_p' must be > 0, got 0"),
])
def test_range_and_type_errors_name_the_field(model, field, value, message):
    body = {"prompt": "x"} if model is CompletionRequest else {"max_tokens": 5, "messages": HI}
    e = refusal(model, {**body, field: value})
    assert str(e) == message and e.param == field


def test_a_nested_range_error_names_its_path():
    e = refusal(MessagesRequest, {"max_tokens": 5, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 0}})
    assert str(e) == "thinking.budget_tokens must be >= 1, got 0" and e.param == "thinking"


@pytest.mark.parametrize("field,values", [
    ("temperature", (-0.01, 0, 7)), ("top_p", (0, 1e-9, 1, 1.01)), ("min_p", (-0.1, 0, 0.99, 1)),
    ("presence_penalty", (-2.01, -2, 2, 2.01)), ("frequency_penalty", (-2.01, -2, 2, 2.01)),
    ("repeat_penalty", (0, 1e-9, 5)), ("repeat_last_n", (-2, -1, 0, 64)),
])
def test_the_sampling_ranges_are_those_every_caller_is_held_to(field, values):
    for value in values:
        try:
            SamplingParams(**{field: value})
            allowed = True
        except ConfigError:
            allowed = False
        try:
            validated(CompletionRequest, {"prompt": "x", field: value})
            assert allowed, f"{field}={value} is taken by the request model and refused by check_sampling"
        except BadRequest:
            assert not allowed, f"{field}={value} is refused by the request model and taken by check_sampling"


def test_unknown_fields_are_ignored_and_valid_requests_read_as_before():
    chat = validated(ChatRequest, {"model": "m", "messages": HI, "user": "u", "metadata": {"a": 1},
                                   "stop": "END", "temperature": 0.5, "stream": None})
    assert chat.stops == ["END"] and chat.sampling.temperature == 0.5 and chat.stream is False
    request = validated(MessagesRequest, {
        "model": "m", "max_tokens": 64, "metadata": {"user_id": "u"}, "system": [
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look.", "signature": "s"},
                                                       {"type": "tool_use", "id": "t1", "name": "get", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                   "content": [{"type": "text", "text": "down"}]},
                                                  {"type": "text", "text": "Try again"}]}],
        "tools": [{"name": "get", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    chat = anthropic_api.to_openai(request)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[2].reasoning_content == "Look." and chat.messages[2].tool_calls[0].function.name == "get"
    assert chat.messages[3].text == "Error: down" and chat.messages[4].text == "Try again"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and chat.max_tokens == 64


def _never(*_):
    raise AssertionError("a refused request reached the server")


def _app():
    """The application over a server it never reaches: every request here is refused first."""
    server = SimpleNamespace(api_keys=[], completion_prompt=_never, chat_prompt=_never, native_prompts=_never,
                             tokenize=_never, detokenize=_never, webui=False)
    return TestClient(create_app(server))


def test_openai_errors_have_the_openai_shape():
    r = _app().post("/v1/chat/completions", json={"messages": HI, "top_p": 2})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "'top_p' must be <= 1, got 2", "type": "invalid_request_error",
                                  "param": "top_p", "code": 400}}
    r = _app().post("/v1/completions", json={"prompt": "x", "echo": True})
    assert r.json()["error"]["param"] == "echo" and r.json()["error"]["message"] == \
        "'echo' is not supported by this server"


def test_anthropic_errors_have_the_anthropic_shape():
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = _app().post(path, json=body)
        assert r.status_code == 400
        assert r.json() == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "messages[0].content[0] must be of type 'text', 'tool_result', 'image' or 'document' "
                       "(got 'video')"}}


def test_tokenizer_endpoints_check_their_fields():
    r = _app().post("/tokenize", json={"content": "x", "with_pieces": "yes"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "'with_pieces' must be true or false, got \"yes\""


@pytest.mark.parametrize("bias, pairs", [
    ({"5": 10}, [(5, 10.0)]), ({"5": False}, [(5, float("-inf"))]), ([[5, -100]], [(5, -100.0)]),
    ([["hello", 2.5]], [("hello", 2.5)]), ([[5, False]], [(5, float("-inf"))]), ({"hi": 1}, [("hi", 1.0)]),
    ({"5": 250.5}, [(5, 250.5)]), (None, None), ({}, []), ([], [])])
def test_logit_bias_forms_are_read(bias, pairs):
    """OpenAI's map (llama-server's: any number, false = never, a text as a key) and llama-server's list forms."""
    for model, body in ((ChatRequest, {"messages": HI}), (CompletionRequest, {"prompt": "x"})):
        assert validated(model, {**body, "logit_bias": bias}).logit_bias == pairs


@pytest.mark.parametrize("bias", [{"5": True}, {"5": "x"}, {"-1": 2}, [[5]], [5, 2], [[5, None]], "x", 5,
                                  [[1.5, 2]], [[True, 2]]])
def test_bad_logit_biases_get_400(bias):
    for path, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "x"}),
                       ("/completion", {"prompt": "x"})):
        r = _app().post(path, json={**body, "logit_bias": bias})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
