"""OpenAI's Responses API (POST /v1/responses, /responses) over the chat machinery, as
llama-server serves it: a request, checked as responses_models' ResponsesRequest, is read
into the chat request the rest of the server speaks (instructions as the system message,
the input's items as messages, function tools, max_output_tokens as max_tokens), and a
reply is written back as a response object (reasoning, message and function-call output
items) or as the API's stream of events: response.created and response.in_progress, each
item's output_item.added and its deltas, then each item's done events and
response.completed. Errors have the OpenAI shape, as llama-server's do."""
from __future__ import annotations

import time
import uuid
from typing import Callable, Iterator, List, Optional

from ..chat.toolcalls import Reply, ToolCall
from .anthropic_api import sse
from .api_errors import validated
from .openai_models import ChatRequest
from .responses_models import (FunctionCall, FunctionCallOutput, FunctionChoice, FunctionTool, InputMessage,
                               OutputMessage, ReasoningItem, ResponsesRequest)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", None) or getattr(part, "refusal", "") for part in content)


def _messages(request: ResponsesRequest) -> List[dict]:
    """The chat messages of the instructions and the input: an assistant's items (its
    reasoning, message and calls) make one assistant message, as llama-server merges them."""
    out: List[dict] = []
    if request.instructions is not None:
        out.append({"role": "system", "content": request.instructions})
    items = [InputMessage(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    for item in items:
        prev = out[-1] if out and out[-1]["role"] == "assistant" else None
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            if prev is None:
                prev = {"role": "assistant", "content": ""}
                out.append(prev)
            if isinstance(item, OutputMessage):
                prev["content"] = (prev["content"] or "") + _text(item.content)
            elif isinstance(item, FunctionCall):
                prev.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function",
                     "function": {"name": item.name, "arguments": item.arguments}})
            elif isinstance(item, ReasoningItem):
                prev["reasoning_content"] = "".join(part.text for part in item.content)
    return out


def _tool(tool: FunctionTool) -> dict:
    fn = {"name": tool.name, "description": tool.description}
    fn.update({key: getattr(tool, key) for key in ("parameters", "strict") if getattr(tool, key) is not None})
    return {"type": "function", "function": fn}


def _response_format(request: ResponsesRequest) -> Optional[dict]:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}


def to_chat(request: ResponsesRequest, body: dict) -> ChatRequest:
    """The request as a chat request: the Responses fields translated, every other field
    of the body (stop, seed, top_k, chat_template_kwargs, ...) as it is."""
    out = {k: v for k, v in body.items() if k not in ResponsesRequest.model_fields}
    out.update(messages=_messages(request), stream=request.stream)
    tools = [_tool(t) for t in request.tools or [] if isinstance(t, FunctionTool)]
    if tools:
        out["tools"] = tools
    choice = request.tool_choice
    if choice is not None:
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
            if isinstance(choice, FunctionChoice) else choice
    if request.max_output_tokens is not None:
        out["max_tokens"] = request.max_output_tokens
    fmt = _response_format(request)
    if fmt is not None:
        out["response_format"] = fmt
    if request.reasoning is not None and request.reasoning.effort is not None:
        out["reasoning_effort"] = request.reasoning.effort
    return validated(ChatRequest, out)


# -- replies ------------------------------------------------------------------------------------

def _hex() -> str:
    return uuid.uuid4().hex[:24]


def new_id() -> str:
    return "resp_" + _hex()


def call_id() -> str:
    return "call_" + _hex()


def usage_json(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens, "input_tokens_details": {"cached_tokens": cached_tokens}}


def reasoning_item(item_id: str, text: Optional[str], status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "encrypted_content": "",
            "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: Optional[str], status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "status": status,
            "arguments": call.arguments_json if status == "completed" else "", "call_id": call.id, "name": call.name}


def response_json(rid: str, model: str, created: int, output: List[dict], usage: Optional[dict],
                  status: str = "completed") -> dict:
    out = {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
           "output": output}
    if usage is not None:
        out.update(completed_at=int(time.time()), usage=usage)
    return out


def output_items(reply: Reply) -> List[dict]:
    """A whole reply's output items: its reasoning, its text, its calls."""
    out = [reasoning_item("rs_" + _hex(), reply.reasoning)] if reply.reasoning else []
    if reply.content:
        out.append(message_item("msg_" + _hex(), reply.content))
    return out + [call_item(call) for call in reply.tool_calls]


class EventStream:
    """The Responses API's stream events for a reply's deltas (ReplyParser's): an output
    item for the reasoning, one for the text (each opened at its first delta), one per
    tool call; the items are closed, in the order they were opened, at the end."""

    def __init__(self, rid: str, model: str, created: int):
        self.rid, self.model, self.created = rid, model, created
        self._seq = 0
        self._items: List[list] = []  # [kind, item id, text or call], in the order opened
        self._open = {}  # kind ("reasoning", "message") -> its entry in _items
        self.timings: Optional[Callable[[], dict]] = None  # timings_per_token: each text delta's

    def _event(self, kind: str, **data) -> str:
        out = sse(kind, {"type": kind, "sequence_number": self._seq, **data})
        self._seq += 1
        return out

    def start(self) -> Iterator[str]:
        response = response_json(self.rid, self.model, self.created, [], None, "in_progress")
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)

    def progress(self, prompt_progress: dict, timings: Optional[dict]) -> Iterator[str]:
        """The prompt's progress (return_progress), as llama-server tells it: a
        response.in_progress event carrying prompt_progress (and the timings so far)."""
        response = response_json(self.rid, self.model, self.created, [], None, "in_progress")
        yield self._event("response.in_progress", response=response, prompt_progress=prompt_progress,
                          **({"timings": timings} if timings is not None else {}))

    def _added(self, kind: str, item_id: str, value, item: dict) -> Iterator[str]:
        self._items.append([kind, item_id, value])
        yield self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)

    def deltas(self, delta: tuple) -> Iterator[str]:
        kind = delta[0]
        if kind == "call":
            call = delta[2]
            yield from self._added("call", call_item(call)["id"], call, call_item(call, "in_progress"))
            yield self._event("response.function_call_arguments.delta", item_id=self._items[-1][1],
                              output_index=len(self._items) - 1, delta=call.arguments_json)
            return
        entry = self._open.get(kind)
        if entry is None:
            item_id = ("rs_" if kind == "reasoning" else "msg_") + _hex()
            opened = reasoning_item(item_id, None, "in_progress") if kind == "reasoning" else \
                message_item(item_id, None, "in_progress")
            yield from self._added(kind, item_id, "", opened)
            entry = self._open[kind] = self._items[-1]
            if kind == "content":
                yield self._event("response.content_part.added", item_id=item_id, output_index=self._index(entry),
                                  content_index=0, part=text_part(""))
        entry[2] += delta[1]
        where = dict(item_id=entry[1], output_index=self._index(entry), content_index=0, delta=delta[1])
        if kind == "reasoning":
            yield self._event("response.reasoning_text.delta", **where)
        else:
            yield self._event("response.output_text.delta", **where, logprobs=[],
                              **({"timings": self.timings()} if self.timings else {}))

    def _index(self, entry: list) -> int:
        return next(i for i, e in enumerate(self._items) if e is entry)

    def stop(self, usage: dict, extra: dict) -> Iterator[str]:
        """Each item's done events, then response.completed (with `extra` beside the
        response: llama-server's timings)."""
        output = []
        for i, (kind, item_id, value) in enumerate(self._items):
            if kind == "call":
                item = call_item(value)
            elif kind == "reasoning":
                item = reasoning_item(item_id, value)
            else:
                where = dict(item_id=item_id, output_index=i, content_index=0)
                yield self._event("response.output_text.done", **where, text=value, logprobs=[])
                yield self._event("response.content_part.done", **where, part=text_part(value))
                item = message_item(item_id, value)
            yield self._event("response.output_item.done", output_index=i, item=item)
            output.append(item)
        yield self._event("response.completed", response=response_json(self.rid, self.model, self.created, output,
                                                                        usage), **extra)
