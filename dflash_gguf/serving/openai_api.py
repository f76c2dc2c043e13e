"""The chat side of the OpenAI API: a chat request's messages, tools, tool choice and
template switches (checked as openai_models' ChatRequest) put in the form the chat
templates read; replies and their streamed deltas in the API's shape."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..chat.assistant import Reply, ToolChoice
from .openai_models import ChatMessage, ChatRequest, NamedToolChoice, Tool


def template_messages(messages: List[ChatMessage]) -> List[dict]:
    """The messages as the templates read them: content as text, developer read as
    system, call arguments as objects."""
    out = []
    for i, m in enumerate(messages):
        # a final assistant message is continued: its parts a blank line apart, as llama.cpp
        # writes the message it continues (common_chat_msg::render_content)
        prefill = i == len(messages) - 1 and m.role == "assistant"
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.joined("\n\n" if prefill else "\n")}
        if m.role == "assistant":
            if m.tool_calls:
                msg["tool_calls"] = [{"id": call.id or f"call_{j}", "type": "function",
                                      "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                     for j, call in enumerate(m.tool_calls)]
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


def template_tools(tools: Optional[List[Tool]]) -> List[dict]:
    """The tools as the templates read them: the fields given, of those they know."""
    return [{"type": "function", "function": {key: getattr(t.function, key) for key in ("name", "description",
                                                                                       "parameters", "strict")
                                              if key in t.function.model_fields_set}} for t in tools or []]


@dataclass
class ChatOptions:
    """What a chat request asks of the template and of the reply's reading."""

    messages: List[dict]
    tools: List[dict]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    template_kwargs: dict
    reasoning_format: str


def chat_options(request: ChatRequest, template_kwargs: dict, reasoning_format: str) -> ChatOptions:
    """A chat request's options on top of the server's defaults (template_kwargs,
    reasoning_format): its chat_template_kwargs override the server's one by one."""
    kwargs = {**template_kwargs, **(request.chat_template_kwargs or {})}
    if request.reasoning_effort is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
    choice = request.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        choice = {"type": "function", "function": {"name": choice.function.name}}
    return ChatOptions(template_messages(request.messages), template_tools(request.tools), choice,
                       request.parallel_tool_calls, kwargs, request.reasoning_format or reasoning_format)


# -- replies ------------------------------------------------------------------------------------

def tool_call_json(index: Optional[int], call) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}


def message_json(reply: Reply) -> dict:
    """The assistant message of a non-streamed reply."""
    message = {"role": "assistant", "content": reply.content if reply.content or not reply.tool_calls else None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [tool_call_json(None, c) for c in reply.tool_calls]
    return message


def deltas_json(delta: tuple) -> List[dict]:
    """The chunk deltas of one ReplyParser delta: a call comes as its name (with id and
    empty arguments), then its arguments, as the API streams them."""
    kind = delta[0]
    if kind == "reasoning":
        return [{"reasoning_content": delta[1]}]
    if kind == "content":
        return [{"content": delta[1]}]
    index, call = delta[1], delta[2]
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments_json}}]}]


def finish_reason(reply: Reply, finish: str) -> str:
    """A reply that ended by itself with calls in it ends for "tool_calls"."""
    return "tool_calls" if reply.tool_calls and finish == "stop" else finish
