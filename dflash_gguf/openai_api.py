"""The chat side of the OpenAI API: a request's messages, tools, tool choice and
template switches checked and put in the form the chat templates read; replies and
their streamed deltas in the API's shape. Every refusal is a BadRequest naming the
field."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, List, Optional

from .api_errors import BadRequest
from .assistant import Reply, ToolChoice
from .config import ConfigError, check_reasoning_effort
from .reasoning import REASONING_FORMATS

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128  # the OpenAI API's own limit
MAX_STOPS = 16
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}\Z")  # what the call formats can carry

# fields whose meaning this server does not implement: refused rather than ignored
UNSUPPORTED = {
    "logit_bias": lambda v: v not in (None, {}),
    "logprobs": lambda v: v not in (None, False, 0),
    "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: v not in (None, False),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v not in (None, ""),
    "functions": lambda v: v is not None,  # the API's deprecated form of tools
    "function_call": lambda v: v is not None,
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
}


def refuse_unsupported(body: dict) -> None:
    for name, asked in UNSUPPORTED.items():
        if asked(body.get(name)):
            raise BadRequest(f"'{name}' is not supported by this server", name)


def stop_strings(body: dict) -> List[str]:
    """The request's 'stop' strings (checked)."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' takes at most {MAX_STOPS} strings", "stop")
    return [s for s in stops if s]


def constraint_of(body: dict):
    """The constraint a request asks for (a constraints.Constraint, or None): OpenAI's
    response_format (json_object, or json_schema with its schema; `strict` or not, the
    schema is enforced), or llama-server's `grammar` (GBNF) or `json_schema`; one of them."""
    from .config import ConfigError, check_constraint

    asked = [name for name in ("response_format", "grammar", "json_schema")
             if body.get(name) not in (None, "") and not (name == "response_format" and body[name] == {"type": "text"})]
    if len(asked) > 1:
        raise BadRequest(f"give one of 'response_format', 'grammar' and 'json_schema', not {' and '.join(asked)}",
                         asked[1])
    if not asked:
        return None
    name = asked[0]
    grammar, schema = None, None
    if name == "grammar":
        grammar = body["grammar"]
        if not isinstance(grammar, str):
            raise BadRequest("'grammar' must be a GBNF grammar as a string", name)
    elif name == "json_schema":
        schema = body["json_schema"]
    else:
        schema = _response_schema(body["response_format"])
    if schema is not None and not isinstance(schema, (dict, str)):
        raise BadRequest(f"the JSON schema must be an object, got {type(schema).__name__}", name)
    try:
        return check_constraint(grammar, schema)
    except ConfigError as e:
        raise BadRequest(str(e), name) from None
    except RecursionError:
        raise BadRequest("the JSON schema is nested too deeply", name) from None


def _response_schema(fmt: Any) -> Any:
    """The schema of a response_format: any object for json_object (or llama-server's
    `schema` beside it), the json_schema's own schema."""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                         "response_format")
    if fmt["type"] == "json_object":
        return fmt.get("schema") or {"type": "object"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise BadRequest("'response_format' of type json_schema needs {'json_schema': {'name': ..., 'schema': "
                         "{...}}}", "response_format")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        raise BadRequest("'response_format.json_schema.strict' must be true or false", "response_format")
    return spec["schema"]


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content parts must be {{'type': 'text', 'text': ...}} (this model reads "
                                 "text only)", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where}.content must be a string or a list of text parts", "messages")


def _arguments(value: Any, where: str) -> dict:
    """A call's arguments as an object: templates write them out key by key."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):
            raise BadRequest(f"{where}.function.arguments is not valid JSON", "messages") from None
    if not isinstance(value, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON object", "messages")
    return value


def _tool_calls(calls: Any, where: str) -> List[dict]:
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"{at} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                             "messages")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise BadRequest(f"{at}.id must be a string", "messages")
        out.append({"id": call_id or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), at)}})
    return out


def chat_messages(messages: Any) -> List[dict]:
    """The messages checked and normalised for the templates: content as text, roles
    among ROLES (developer read as system), call arguments as objects."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"{where}.role must be a non-empty string", "messages")
        if role not in ROLES:
            raise BadRequest(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", "messages")
        msg = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"), where)}
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
            reasoning = m.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise BadRequest(f"{where}.reasoning_content must be a string", "messages")
                msg["reasoning_content"] = reasoning
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise BadRequest(f"{where}.{key} must be a string", "messages")
                msg[key] = m[key]
        out.append(msg)
    return out


def chat_tools(body: dict) -> tuple:
    """(tools, tool_choice, parallel_tool_calls) of a request, checked."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' takes at most {MAX_TOOLS} tools", "tools")
    checked, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise BadRequest(f"tools[{i}].function.name must be 1-128 letters, digits, '_', '-', '.' or ':'", "tools")
        if name in names:
            raise BadRequest(f"tools[{i}]: the name {name!r} is given twice", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise BadRequest(f"tools[{i}].function.description must be a string", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if not isinstance(fn.get("strict", False), (bool, type(None))):
            raise BadRequest(f"tools[{i}].function.strict must be true or false", "tools")
        names.add(name)
        # strict: its calls' arguments are held to its parameters (tool_grammar)
        checked.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters",
                                                                            "strict") if k in fn}})
    choice: ToolChoice = body.get("tool_choice") or "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise BadRequest("'tool_choice' must be auto, none, required or {'type': 'function', 'function': "
                             "{'name': ...}}", "tool_choice")
        if name not in names:
            raise BadRequest(f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    elif choice not in ("auto", "none", "required"):
        raise BadRequest("'tool_choice' must be auto, none, required or a named function", "tool_choice")
    elif choice == "required" and not checked:
        raise BadRequest("'tool_choice' is 'required' but no tools are given", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return checked, choice, parallel


def _effort(value: Any, field: str) -> str:
    try:
        return check_reasoning_effort(value)
    except ConfigError as e:
        where = "chat_template_kwargs.reasoning_effort" if field == "chat_template_kwargs" else field
        raise BadRequest(f"'{where}': {e}", field) from None


@dataclass
class ChatOptions:
    """What a chat request asks of the template and of the reply's reading."""

    messages: List[dict]
    tools: List[dict]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    template_kwargs: dict
    reasoning_format: str


def chat_options(body: dict, template_kwargs: dict, reasoning_format: str) -> ChatOptions:
    """A chat request's options on top of the server's defaults (template_kwargs,
    reasoning_format): its chat_template_kwargs override the server's one by one."""
    messages = chat_messages(body.get("messages"))
    tools, choice, parallel = chat_tools(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kwargs = {**kwargs}
    if "reasoning_effort" in kwargs:
        _effort(kwargs["reasoning_effort"], "chat_template_kwargs")
    if body.get("reasoning_effort") is not None:  # the OpenAI field wins, as in llama-server
        kwargs["reasoning_effort"] = _effort(body["reasoning_effort"], "reasoning_effort")
    fmt = body.get("reasoning_format") or reasoning_format
    if fmt not in REASONING_FORMATS:
        raise BadRequest(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
    return ChatOptions(messages, tools, choice, parallel, {**template_kwargs, **kwargs}, fmt)


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
