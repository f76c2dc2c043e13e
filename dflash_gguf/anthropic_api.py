"""Anthropic's Messages API (POST /v1/messages) over the chat machinery: a request is
read into the OpenAI chat form the rest of the server speaks (system, text,
tool_use / tool_result and thinking blocks, tools, tool_choice, thinking), and a reply
is written back as a message, or as the API's stream of events, in its shape. Errors
have the API's shape too."""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterator, List, Optional

from .api_errors import BadRequest
from .assistant import Reply

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               503: "overloaded_error"}

# stop reasons by our finish reasons (a reply with tool calls that ended by itself: tool_use)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def error_json(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _blocks(content: Any, where: str) -> List[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content blocks", "messages")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{where}.content[{j}] must be a content block with a 'type'", "messages")
    return content


def _text_of(blocks: List[dict], where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise BadRequest(f"{where}[{j}]: only text blocks can be read here (this model reads text only), "
                             f"got {block['type']!r}", "messages")
        texts.append(block["text"])
    return "".join(texts)


def _user(blocks: List[dict], where: str) -> List[dict]:
    """A user turn: its tool results (as tool messages, in order), then its text."""
    out, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block["type"] == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise BadRequest(f"{at}.tool_use_id must be a string", "messages")
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_of(_blocks(result, at), f"{at}.content")
            if block.get("is_error") is True:
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            texts.append(block)
    if texts or not out:
        out.append({"role": "user", "content": _text_of(texts, f"{where}.content")})
    return out


def _assistant(blocks: List[dict], where: str) -> dict:
    message: dict = {"role": "assistant", "content": ""}
    calls, reasoning = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text" and isinstance(block.get("text"), str):
            message["content"] += block["text"]
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted for another model: nothing this one can read
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise BadRequest(f"{at} needs a string 'id' and 'name'", "messages")
            if not isinstance(block.get("input", {}), dict):
                raise BadRequest(f"{at}.input must be an object", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        else:
            raise BadRequest(f"{at}: a {kind!r} block cannot be read here", "messages")
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def _tools(tools: Any) -> List[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}] must be an object with a 'name' and an 'input_schema'", "tools")
        if tool.get("type") not in (None, "custom"):
            raise BadRequest(f"tools[{i}]: server tools ({tool['type']!r}) are not supported", "tools")
        fn = {"name": tool["name"], "description": tool.get("description", ""),
              "parameters": tool.get("input_schema", {})}
        if "strict" in tool:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple:
    """(OpenAI tool_choice, parallel tool calls)."""
    if choice is None:
        return "auto", True
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise BadRequest("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise BadRequest("'tool_choice' of type 'tool' needs a 'name'", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def to_openai(body: dict) -> dict:
    """The request as an OpenAI chat request (fields the chat path checks further)."""
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if body.get("max_tokens") is None:
        raise BadRequest("'max_tokens' is required", "max_tokens")
    messages: List[dict] = []
    system = body.get("system")
    if system is not None:
        text = system if isinstance(system, str) else _text_of(_blocks(system, "system"), "system")
        messages.append({"role": "system", "content": text})
    for i, m in enumerate(body["messages"]):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'", "messages")
        blocks = _blocks(m.get("content"), where)
        messages.extend(_user(blocks, where) if m["role"] == "user" else [_assistant(blocks, where)])
    choice, parallel = _tool_choice(body.get("tool_choice"))
    out = {"messages": messages, "tools": _tools(body.get("tools")), "tool_choice": choice,
           "parallel_tool_calls": parallel, "max_tokens": body["max_tokens"]}
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            out[key] = body[key]
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise BadRequest("'thinking' must be {'type': 'enabled' | 'disabled', ...}", "thinking")
        kwargs = out.get("chat_template_kwargs") if isinstance(out.get("chat_template_kwargs"), dict) else {}
        implied = {"enable_thinking": thinking["type"] != "disabled"}
        budget = thinking.get("budget_tokens")
        if thinking["type"] == "enabled" and budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise BadRequest("'thinking.budget_tokens' must be a positive integer", "thinking")
            implied["reasoning_effort"] = effort_of_budget(budget)
        out["chat_template_kwargs"] = {**implied, **kwargs}
    return out


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

    def start(self) -> str:
        message = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return sse("message_start", {"type": "message_start", "message": message})

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
