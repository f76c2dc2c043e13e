"""Anthropic's Messages API (POST /v1/messages) over the chat machinery: a request,
checked as anthropic_models' MessagesRequest, is read into the OpenAI chat request the
rest of the server speaks (system, text, tool_use / tool_result and thinking blocks,
tools, tool_choice, thinking), and a reply is written back as a message, or as the
API's stream of events, in its shape. Errors have the API's shape too."""
from __future__ import annotations

import json
import uuid
from typing import Iterator, List, Optional, Union

from ..chat.assistant import Reply
from .anthropic_models import (AssistantMessage, MessagesRequest, TextBlock, ThinkingBlock, ThinkingEnabled, Tool,
                               ToolChoice, ToolResultBlock, ToolUseBlock, UserMessage)
from .api_errors import validated
from .openai_models import ChatRequest

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               503: "overloaded_error"}

# stop reasons by our finish reasons (a reply with tool calls that ended by itself: tool_use)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def error_json(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _text(content: Union[str, List[TextBlock]]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _user(message: UserMessage) -> List[dict]:
    """A user turn: its tool results (as tool messages, in order), then its text."""
    blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
    out, texts = [], []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            text = ("Error: " if block.is_error else "") + _text(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        else:
            texts.append(block)
    if texts or not out:
        out.append({"role": "user", "content": _text(texts)})
    return out


def _assistant(message: AssistantMessage) -> dict:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    blocks = message.content
    out: dict = {"role": "assistant", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        out["tool_calls"] = calls
    reasoning = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def _tool(tool: Tool) -> dict:
    fn = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    if "strict" in tool.model_fields_set:
        fn["strict"] = tool.strict
    return {"type": "function", "function": fn}


def _tool_choice(choice: Optional[ToolChoice]) -> tuple:
    """(OpenAI tool_choice, parallel tool calls)."""
    if choice is None:
        return "auto", True
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, not choice.disable_parallel_tool_use
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], not choice.disable_parallel_tool_use


def to_openai(request: MessagesRequest) -> ChatRequest:
    """The request as an OpenAI chat request (whose checks, of tool names and the tool
    choice among them, it passes through too)."""
    messages: List[dict] = []
    if request.system is not None:
        messages.append({"role": "system", "content": _text(request.system)})
    for m in request.messages:
        messages.extend(_user(m) if isinstance(m, UserMessage) else [_assistant(m)])
    choice, parallel = _tool_choice(request.tool_choice)
    out = {"messages": messages, "tools": [_tool(t) for t in request.tools or []], "tool_choice": choice,
           "parallel_tool_calls": parallel, "max_tokens": request.max_tokens, "stream": request.stream,
           "stop": request.stop_sequences, "temperature": request.temperature, "top_p": request.top_p,
           "top_k": request.top_k, "chat_template_kwargs": request.chat_template_kwargs}
    thinking = request.thinking
    if thinking is not None:
        implied = {"enable_thinking": thinking.type != "disabled"}
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens is not None:
            implied["reasoning_effort"] = effort_of_budget(thinking.budget_tokens)
        out["chat_template_kwargs"] = {**implied, **(request.chat_template_kwargs or {})}
    return validated(ChatRequest, out)


# a thinking budget read as a reasoning effort (gpt-oss's harmony template takes an effort,
# not a budget): Claude Code's "think" (4,000 tokens) is low, "think hard" (10,000) medium,
# "ultrathink" (31,999) high
EFFORT_BUDGETS = ((8192, "low"), (16384, "medium"))


def effort_of_budget(budget_tokens: int) -> str:
    """The reasoning effort of a thinking budget: below 8192 tokens low, below 16384
    medium, else high."""
    return next((effort for limit, effort in EFFORT_BUDGETS if budget_tokens < limit), "high")


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(reply: Reply, finish: str, stop_sequence: Optional[str]) -> str:
    if finish == "stop" and reply.tool_calls:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish, "end_turn")


def usage_json(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}


def message_json(rid: str, model: str, reply: Reply, stop: str, stop_sequence: Optional[str], usage: dict) -> dict:
    content: List[dict] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": stop_sequence, "usage": usage}


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream:
    """The Messages API's stream events for a reply's deltas (ReplyParser's): one
    content block per run of thinking or text, one per tool call."""

    def __init__(self, rid: str, model: str, prompt_tokens: int):
        self.rid, self.model, self.prompt_tokens = rid, model, prompt_tokens
        self._open: Optional[str] = None  # the kind of the block being written
        self._index = -1

    def start(self) -> Iterator[str]:
        message = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        yield sse("message_start", {"type": "message_start", "message": message})

    def _block(self, kind: str, block: dict) -> Iterator[str]:
        yield from self._close()
        self._index += 1
        self._open = kind
        yield sse("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})

    def _close(self) -> Iterator[str]:
        if self._open is not None:
            yield sse("content_block_stop", {"type": "content_block_stop", "index": self._index})
            self._open = None

    def _delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def deltas(self, delta: tuple) -> Iterator[str]:
        kind = delta[0]
        if kind == "reasoning":
            if self._open != "thinking":
                yield from self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": delta[1]})
        elif kind == "content":
            if self._open != "text":
                yield from self._block("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": delta[1]})
        else:
            call = delta[2]
            yield from self._block("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            yield self._delta({"type": "input_json_delta", "partial_json": call.arguments_json})
            yield from self._close()

    def stop(self, stop: str, stop_sequence: Optional[str], usage: dict) -> Iterator[str]:
        yield from self._close()
        yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop,
                                                                       "stop_sequence": stop_sequence},
                                    "usage": usage})
        yield sse("message_stop", {"type": "message_stop"})
