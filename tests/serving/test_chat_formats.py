"""Chat templates, tool calls and reasoning against the templates the models publish
(models/templates/ of the pinned llama.cpp sources): our rendering equals
transformers' apply_chat_template rendering; the calls and thoughts a template writes
into an assistant turn parse back to the same calls and thoughts, fed whole or a few
characters at a time; thinking switches off; malformed calls stay text."""
from __future__ import annotations

import json

import pytest

from helpers.chat_fixtures import CALLS, TOOLS, assistant_text, history, transformers_render, with_results
from helpers.fixtures import CHAT_TEMPLATE

from dflash_gguf.chat.assistant import prepare_turn
from dflash_gguf.chat.templates import ChatTemplate
from dflash_gguf.chat.reasoning import ReasoningSplitter, THINK_TAGS
from dflash_gguf.chat.toolcalls import ToolCallParser, format_of

TEMPLATES = {  # published template -> tool-call format it teaches
    "Qwen-Qwen3-0.6B": "hermes",
    "Qwen3.5-4B": "qwen-xml",
    "Qwen3-Coder": "qwen-xml",
    "google-gemma-4-31B-it": "gemma4",
}

@pytest.fixture(scope="module")
def template(published_template):
    return lambda name: ChatTemplate(published_template(name), bos_token="<bos>", eos_token="<eos>")


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("thinking", [None, True, False])
def test_rendering_equals_transformers(template, name, thinking):
    t = template(name)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    for messages, tools in [(history()[:2], None), (history()[:2], TOOLS), (with_results(history()), TOOLS)]:
        assert t.render(messages, tools=tools, **kwargs) == transformers_render(t.source, messages, tools, **kwargs)
    assert "<b>live</b> data & more" in t.render(history()[:2], tools=TOOLS)  # tojson does not escape HTML


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_tool_call_format_is_read_from_the_template(template, name):
    assert format_of(template(name)) == TEMPLATES[name]
    assert format_of(ChatTemplate(CHAT_TEMPLATE)) == "generic"


def parse(turn, text, step):
    parser = turn.parser()
    deltas = []
    for i in range(0, len(text), step):
        deltas += parser.feed(text[i:i + step])
    deltas += parser.finish()
    return parser.reply, deltas


def check_streamed(turn, text, want_reply):
    for step in (1, 2, 3, 5, 11, len(text)):
        reply, deltas = parse(turn, text, step)
        assert reply.content == want_reply.content == "".join(d[1] for d in deltas if d[0] == "content")
        assert reply.reasoning == want_reply.reasoning == "".join(d[1] for d in deltas if d[0] == "reasoning")
        calls = [(d[1], d[2].name, d[2].arguments) for d in deltas if d[0] == "call"]
        assert calls == [(i, c.name, c.arguments) for i, c in enumerate(want_reply.tool_calls)]


@pytest.mark.parametrize("name", TEMPLATES)
def test_parallel_tool_calls_parse_back(template, name):
    t = template(name)
    kwargs = {"enable_thinking": True}
    prompt, text = assistant_text(t, history(), tools=TOOLS, **kwargs)
    turn = prepare_turn(t, history()[:-1], tools=TOOLS, template_kwargs=kwargs)
    assert turn.prompt == prompt and turn.tool_format == TEMPLATES[name]
    reply, _ = parse(turn, text, len(text))
    assert [(c.name, c.arguments) for c in reply.tool_calls] == CALLS
    assert reply.content == ""
    assert len({c.id for c in reply.tool_calls}) == 2
    check_streamed(turn, text, reply)


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "Qwen3.5-4B", "google-gemma-4-31B-it"])
def test_reasoning_parses_back(template, name):
    """The thoughts a template writes for the current turn (Gemma 4 writes them only
    next to tool calls) come back as reasoning, the rest as content and calls."""
    t = template(name)
    kwargs = {"enable_thinking": True}
    reasoning = "The user wants weather.\nThen a search."
    messages = history(CALLS[:1], reasoning=reasoning)
    if name != "google-gemma-4-31B-it":
        messages[-1]["content"] = "Let me look."
    prompt, text = assistant_text(t, messages, tools=TOOLS, **kwargs)
    turn = prepare_turn(t, messages[:-1], tools=TOOLS, template_kwargs=kwargs)
    assert turn.starts_thinking == (name == "Qwen3.5-4B")  # Qwen3.5's prompt opens the block
    reply, _ = parse(turn, text, len(text))
    assert reply.reasoning == reasoning
    assert reply.content == messages[-1]["content"]
    assert [(c.name, c.arguments) for c in reply.tool_calls] == CALLS[:1]
    check_streamed(turn, text, reply)


@pytest.mark.parametrize("name,off_ending", [
    ("Qwen-Qwen3-0.6B", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("Qwen3.5-4B", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("google-gemma-4-31B-it", "<|turn>model\n<|channel>thought\n<channel|>"),
])
def test_thinking_on_and_off(template, name, off_ending):
    t = template(name)
    messages = history()[:2]
    off = prepare_turn(t, messages, template_kwargs={"enable_thinking": False})
    assert off.prompt.endswith(off_ending) and not off.starts_thinking
    assert off.prompt == transformers_render(t.source, messages, None, enable_thinking=False)
    on = prepare_turn(t, messages, template_kwargs={"enable_thinking": True})
    assert not on.prompt.endswith(off_ending)
    assert on.starts_thinking == on.prompt.endswith("<think>\n")
    # a reply with thinking off is all content
    reply, _ = parse(off, "Sunny.", 1)
    assert (reply.reasoning, reply.content) == ("", "Sunny.")


def test_a_template_that_always_opens_thinking_is_closed_when_thinking_is_off():
    t = ChatTemplate(CHAT_TEMPLATE.replace("assistant\\n'", "assistant\\n<think>\\n'"))
    on = prepare_turn(t, [{"role": "user", "content": "hi"}])
    assert on.starts_thinking
    off = prepare_turn(t, [{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False})
    assert off.prompt.endswith("<think>\n\n</think>\n\n") and not off.starts_thinking


@pytest.mark.parametrize("name", TEMPLATES)
def test_tool_choice_required_and_named_start_the_call(template, name):
    t = template(name)
    messages = history()[:2]
    _, text = assistant_text(t, history(CALLS[:1]), tools=TOOLS, enable_thinking=True)
    body = text[text.index("<|tool_call>" if name.startswith("google") else "<tool_call>"):]
    named = prepare_turn(t, messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                         template_kwargs={"enable_thinking": True})
    assert not named.starts_thinking  # a forced call comes without thoughts
    prefix = named.prompt[len(named.prompt) - len(named.primed):]
    assert body.startswith(prefix) and "get_weather" in prefix
    reply, _ = parse(named, body[len(prefix):], 4)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == CALLS[:1]
    required = prepare_turn(t, messages, tools=TOOLS, tool_choice="required")
    assert required.primed and body.startswith(required.primed) and "get_weather" not in required.primed
    reply, _ = parse(required, body[len(required.primed):], 3)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == CALLS[:1]
    none = prepare_turn(t, messages, tools=TOOLS, tool_choice="none")
    assert none.tool_format is None and "get_weather" not in none.prompt


@pytest.mark.parametrize("name,text", [
    ("Qwen-Qwen3-0.6B", '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>'),
    ("Qwen-Qwen3-0.6B", '<tool_call>\n["search"]\n</tool_call>'),
    ("Qwen3.5-4B", "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>"),
    ("google-gemma-4-31B-it", '<|tool_call>call:search{query:<|"|>unterminated}<tool_call|>'),
    ("google-gemma-4-31B-it", "<|tool_call>call:search{query:[1,}<tool_call|>"),
])
def test_malformed_calls_stay_content(template, name, text):
    turn = prepare_turn(template(name), history()[:2], tools=TOOLS, template_kwargs={"enable_thinking": False})
    for step in (1, 4, len(text)):
        reply, _ = parse(turn, "Before. " + text, step)
        assert reply.tool_calls == [] and reply.content == "Before. " + text


def test_an_unclosed_call_at_the_end_is_read():
    """Generation may end right after the call (an end-of-generation token or a stop
    string in place of the close)."""
    turn = prepare_turn(ChatTemplate(CHAT_TEMPLATE), [{"role": "user", "content": "x"}], tools=TOOLS)
    reply, _ = parse(turn, '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n', 2)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("search", {"query": "a"})]


@pytest.mark.parametrize("text", [
    '{"name": "search", "arguments": {"query": "a"}}',
    '\n  {\n  "name": "search",\n  "arguments": {\n    "query": "a"\n  }\n}\n',
    '```json\n{"name": "search", "arguments": {"query": "a"}}\n```',
    '{{"name": "search", "arguments": {"query": "a"}}}',  # Qwen2.5-Coder, after its template's example
    '{{"name": "search", "arguments": {"query": "a"}}}}',  # ... and a brace too many
])
def test_a_reply_that_is_an_untagged_call_is_read_as_that_call(template, text):
    """Small models (Qwen2.5-Coder-1.5B in llama.cpp's tool-call tests) often write a
    call as the bare JSON object, in a code fence or in doubled braces: a reply that is
    nothing else is that call, whichever way it streams."""
    for t in (template("Qwen-Qwen3-0.6B"), ChatTemplate(CHAT_TEMPLATE)):  # hermes, the generic fallback
        for step in (1, 3, len(text)):
            turn = prepare_turn(t, [{"role": "user", "content": "x"}], tools=TOOLS,
                                template_kwargs={"enable_thinking": False})
            reply, deltas = parse(turn, text, step)
            assert [(c.name, c.arguments) for c in reply.tool_calls] == [("search", {"query": "a"})], step
            assert reply.content == "" and not [d for d in deltas if d[0] == "content"]


@pytest.mark.parametrize("text", [
    '{"name": "unknown_tool", "arguments": {}}',  # not an offered tool
    '{"answer": 42}',
    '{"name": "search", "arguments": {"query": "a"}} and then some words',
    '{"name": "search", "arguments": {"query": "a"}} {"name": "search", "arguments": {}}',
    '```python\nprint(1)\n```',
])
def test_json_that_is_no_call_stays_content(text):
    turn = prepare_turn(ChatTemplate(CHAT_TEMPLATE), [{"role": "user", "content": "x"}], tools=TOOLS)
    for step in (1, 4, len(text)):
        reply, deltas = parse(turn, text, step)
        assert reply.tool_calls == [] and reply.content == text.strip()
        assert "".join(d[1] for d in deltas if d[0] == "content") == text.strip()


def test_xml_values_are_typed_by_the_schema():
    parser = ToolCallParser("qwen-xml", TOOLS)
    events = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
                         "<parameter=days>\n4\n</parameter>\n<parameter=hours>\nnot json\n</parameter>\n"
                         "</function>\n</tool_call>")
    assert events[0][1].arguments == {"city": "42", "days": 4, "hours": "not json"}


def test_generic_fallback_writes_tools_calls_and_results_as_text():
    """A template that never reads `tools` (the demo pair's): the tools are offered in
    the system message, earlier calls and results become text, and replies are read
    as hermes calls."""
    t = ChatTemplate(CHAT_TEMPLATE)
    turn = prepare_turn(t, with_results(history()), tools=TOOLS)
    assert turn.tool_format == "generic"
    assert turn.prompt.startswith("<|im_start|>system\nYou are terse.\n\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in turn.prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "São Paulo' \
        in turn.prompt
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nnothing found\n" \
           "</tool_response><|im_end|>" in turn.prompt
    assert "<|im_start|>tool" not in turn.prompt
    reply, _ = parse(turn, 'Checking.\n<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>', 3)
    assert reply.content == "Checking." and reply.tool_calls[0].arguments == {"query": "q"}


@pytest.mark.parametrize("fmt,content,reasoning", [
    ("auto", "Answer.", "thought"),
    ("deepseek", "Answer.", "thought"),
    ("deepseek-legacy", "<think>\nthought\n</think>\n\nAnswer.", "thought"),
    ("none", "<think>\nthought\n</think>\n\nAnswer.", ""),
])
def test_reasoning_formats(fmt, content, reasoning):
    for step in (1, 3, 100):
        splitter = ReasoningSplitter(THINK_TAGS, fmt)
        text = "<think>\nthought\n</think>\n\nAnswer."
        events = []
        for i in range(0, len(text), step):
            events += splitter.feed(text[i:i + step])
        events += splitter.finish()
        assert "".join(t for k, t in events if k == "content") == content
        assert "".join(t for k, t in events if k == "reasoning") == reasoning


def test_reasoning_split_when_the_prompt_opened_the_block():
    splitter = ReasoningSplitter(THINK_TAGS, "auto", thinking=True)
    first = splitter.feed("\nstep one\n\n")
    events = first + splitter.feed("step two\n</thi") + splitter.feed("nk>\n\nDone.") + splitter.finish()
    assert first == [("reasoning", "step one")]  # the blank lines wait: they may end the block
    assert events == [("reasoning", "step one"), ("reasoning", "\n\nstep two"), ("content", "Done.")]
