"""Tools, tool calls and conversations shared by the chat tests."""
from __future__ import annotations

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city (uses <b>live</b> data & more)",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "city name"},
            "days": {"type": "integer"},
            "options": {"type": "object", "properties": {"units": {"type": "string"}}},
            "hours": {"type": "array", "items": {"type": "integer"}}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Web search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]

CALLS = [
    ("get_weather", {"city": "São Paulo, \"BR\"", "days": 3, "options": {"units": "metric"}, "hours": [6, 12]}),
    ("search", {"query": "multi-line\nquery with {braces}: and, commas"}),
]


def history(calls=CALLS, reasoning=None):
    call_msgs = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                 for i, (n, a) in enumerate(calls)]
    assistant = {"role": "assistant", "content": "", "tool_calls": call_msgs}
    if reasoning:
        assistant["reasoning_content"] = reasoning
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in São Paulo, then search."}, assistant]


def with_results(messages):
    return messages + [{"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 21}"},
                       {"role": "tool", "tool_call_id": "call_1", "content": "nothing found"}]


def assistant_text(t, messages, **kwargs):
    """What the template writes for the last (assistant) message: the text a model
    trained on it generates after the prompt for its turn."""
    prompt = t.render(messages[:-1], **kwargs)
    full = t.render(messages, add_generation_prompt=False, **kwargs)
    assert full.startswith(prompt)
    text = full[len(prompt):]
    for end in ("<|im_end|>\n", "<|tool_response>", "<turn|>\n"):
        text = text.removesuffix(end)
    return prompt, text


def transformers_render(source, messages, tools, bos_token="<bos>", eos_token="<eos>", **kwargs):
    """The oracle: the prompt transformers' apply_chat_template renders."""
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs.setdefault("add_generation_prompt", True)
    return render_jinja_template(conversations=[messages], tools=tools, chat_template=source, bos_token=bos_token,
                                 eos_token=eos_token, **kwargs)[0][0]


GPT_OSS = "openai-gpt-oss-120b"


def llama_cpp_messages(messages):
    """What llama.cpp's common_chat_params_init_gpt_oss hands the template: reasoning_content
    copied to `thinking`, and content erased from a message that has both it and calls."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("reasoning_content"), str):
            m["thinking"] = m["reasoning_content"]
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out
