"""Tool calls in generated text, in the format the chat template teaches the model.

Formats (the template's source says which; see `format_of`):

- "hermes": <tool_call>{"name": NAME, "arguments": {...}}</tool_call> (Qwen3, Qwen2.5,
  Hermes);
- "qwen-xml": <tool_call><function=NAME><parameter=P>value</parameter>...</function>
  </tool_call> (Qwen3-Coder, Qwen3.5 / 3.6); a value is raw text, read as JSON where the
  tool's schema does not say it is a string;
- "gemma4": <|tool_call>call:NAME{key:value,...}<tool_call|>, strings quoted <|"|>...<|"|>;
- "harmony": gpt-oss's <|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>,
  read with the rest of a harmony reply by harmony.HarmonyParser;
- "generic", for templates that never show tools to the model: the tools and the
  hermes format are described in the system message (`describe_tools`), earlier calls
  and results written into the messages as text (`as_plain_messages`), and replies read
  as hermes.

A call that does not parse stays in the reply's text: a malformed call is the model's
answer, not a server error. In the JSON formats a reply that is nothing but one call
of an offered tool, untagged (bare, in a code fence, or in doubled braces), is read as
that call (`bare_call`); such a reply, opening with "{" or a fence, is held until it
ends.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..decoding.streamtext import partial_marker

FORMATS = ("hermes", "qwen-xml", "gemma4", "harmony", "generic")


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Reply:
    """An assistant reply read into its parts (assistant.ReplyParser, harmony.HarmonyParser)."""
    reasoning: str = ""
    content: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)


def format_of(template) -> str:
    """The tool-call format of a chat template (chat.ChatTemplate)."""
    src = template.source
    if template.harmony:
        return "harmony"
    if "<|tool_call>call:" in src:
        return "gemma4"
    if "<tool_call>" in src and "<function=" in src and "<parameter=" in src:
        return "qwen-xml"
    if template.reads_tools:
        # templates that show tools in their own words; hermes is what most such models emit
        return "hermes"
    return "generic"


# -- parsing one call ------------------------------------------------------------------------

Schemas = Dict[str, dict]  # tool name -> its JSON schema of parameters


def _hermes(body: str, schemas: Schemas) -> Optional[Tuple[str, dict]]:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (call["name"], args) if isinstance(args, dict) else None


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _is_string_typed(schema: dict) -> bool:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind is None or kind == "string" or isinstance(kind, list) and "string" in kind


def _qwen_xml(body: str, schemas: Schemas) -> Optional[Tuple[str, dict]]:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    properties = (schemas.get(name) or {}).get("properties") or {}
    args = {}
    for p in _PARAMETER.finditer(m.group(2)):
        key, value = p.group(1).strip(), p.group(2)
        # the template writes "<parameter=P>\n" + value + "\n</parameter>"
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if not _is_string_typed(properties.get(key, {})):
            try:
                value = json.loads(value)
            except ValueError:
                pass  # the model wrote text where the schema wants another type: keep its text
        args[key] = value
    return name, args


_GEMMA_QUOTE = '<|"|>'
_GEMMA_CALL = re.compile(r"\s*call:([^{\s]+)\s*(\{.*\})\s*\Z", re.S)
_GEMMA_BARE_KEY = re.compile(r"([{,]\s*)([^\s:{}\[\],]+)\s*:")


def _gemma4(body: str, schemas: Schemas) -> Optional[Tuple[str, dict]]:
    m = _GEMMA_CALL.match(body)
    if m is None:
        return None
    parts = m.group(2).split(_GEMMA_QUOTE)
    if len(parts) % 2 == 0:  # an unterminated string
        return None
    # even parts are structure (bare keys, numbers, true/false/null, brackets), odd parts
    # the contents of quoted strings: quote the keys in the structure and each string as
    # JSON, and the whole is JSON
    text = "".join(json.dumps(part, ensure_ascii=False) if i % 2 else _GEMMA_BARE_KEY.sub(r'\1"\2":', part)
                   for i, part in enumerate(parts))
    try:
        args = json.loads(text)
    except ValueError:
        return None
    return (m.group(1), args) if isinstance(args, dict) else None


_DECODER = json.JSONDecoder()
_FENCE = re.compile(r"\A```[a-zA-Z]*\s*\n(.*?)\n?```\Z", re.S)


def bare_call(text: str, schemas: Schemas) -> Optional[Tuple[str, dict]]:
    """A reply that is one call of an offered tool as a JSON object without the format's
    tags, as small models write them: alone, in a code fence, or opened with a second
    brace (Qwen2.5's template shows its example call as `{{"name": ...}}`), stray closing
    braces after it."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    for candidate in (body, body[1:] if body.startswith("{{") else None):
        if not candidate:
            continue
        try:
            _, end = _DECODER.raw_decode(candidate)
        except ValueError:
            continue
        if candidate[end:].strip().strip("}"):
            continue  # more than stray braces after the object: not a call alone
        parsed = _hermes(candidate[:end], schemas)
        if parsed is not None and parsed[0] in schemas:
            return parsed
    return None


@dataclass(frozen=True)
class Syntax:
    open: str
    close: str
    parse: Callable[[str, Schemas], Optional[Tuple[str, dict]]]


SYNTAX = {
    "hermes": Syntax("<tool_call>", "</tool_call>", _hermes),
    "generic": Syntax("<tool_call>", "</tool_call>", _hermes),
    "qwen-xml": Syntax("<tool_call>", "</tool_call>", _qwen_xml),
    "gemma4": Syntax("<|tool_call>", "<tool_call|>", _gemma4),
}


def forced_start(fmt: str, name: Optional[str]) -> str:
    """The text that opens a call (of function `name`, or of any when None): appended
    to the prompt, it makes the reply a tool call (tool_choice "required" or named)."""
    if fmt == "qwen-xml":
        return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")
    if fmt == "gemma4":
        return "<|tool_call>call:" + (f"{name}{{" if name else "")
    return "<tool_call>\n" + ('{"name": ' + json.dumps(name) + ', "arguments": ' if name else "")


def schemas_of(tools: Sequence[dict]) -> Schemas:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


# -- parsing a reply as it streams ---------------------------------------------------------------

class ToolCallParser:
    """Splits reply text into content and tool calls as it arrives. feed() and
    finish() return events: ("content", text) or ("call", ToolCall). Text that may
    begin a call is held back until it is decided."""

    def __init__(self, fmt: str, tools: Sequence[dict], make_id: Optional[Callable[[], str]] = None):
        self.syntax = SYNTAX[fmt]
        self.schemas = schemas_of(tools)
        self.make_id = make_id
        self._buf = ""
        self._in_call = False
        # a JSON format's reply may be its call alone, untagged (bare_call): one that opens
        # with "{" or a code fence is held to its end to be read so
        self._opening = fmt in ("hermes", "generic") and bool(self.schemas)  # nothing but spaces seen yet
        self._holding = False

    def _tool_call(self, parsed: Optional[Tuple[str, dict]]) -> Optional[ToolCall]:
        if parsed is None:
            return None
        return ToolCall(*parsed, **({"id": self.make_id()} if self.make_id else {}))

    def _call(self, body: str) -> Optional[ToolCall]:
        return self._tool_call(self.syntax.parse(body, self.schemas))

    def feed(self, text: str) -> List[tuple]:
        self._buf += text
        if self._opening:
            head = self._buf.lstrip()
            if "```".startswith(head):  # nothing yet, or what may open a fence
                return []
            self._opening = False
            self._holding = head.startswith(("{", "```"))
        if self._holding:
            return []
        events = []
        s = self.syntax
        while True:
            if self._in_call:
                end = self._buf.find(s.close)
                if end < 0:
                    return events
                body, self._buf = self._buf[:end], self._buf[end + len(s.close):]
                self._in_call = False
                call = self._call(body)
                events.append(("call", call) if call else ("content", s.open + body + s.close))
            else:
                start = self._buf.find(s.open)
                if start < 0:
                    keep = partial_marker(self._buf, [s.open])
                    if len(self._buf) > keep:
                        events.append(("content", self._buf[:len(self._buf) - keep]))
                        self._buf = self._buf[len(self._buf) - keep:]
                    return events
                if start:
                    events.append(("content", self._buf[:start]))
                self._buf = self._buf[start + len(s.open):]
                self._in_call = True

    def finish(self) -> List[tuple]:
        """The end of the reply: an unclosed call (generation ended at its last
        token, or a stop string cut the close) is read as it stands; a held reply is a
        bare call, or read as any other."""
        events: List[tuple] = []
        if self._holding:
            self._holding = False
            held, self._buf = self._buf, ""
            call = self._tool_call(bare_call(held, self.schemas))
            if call is not None:
                return [("call", call)]
            events = self.feed(held)
        text, self._buf = self._buf, ""
        if not self._in_call:
            return events + ([("content", text)] if text else [])
        self._in_call = False
        call = self._call(text)
        return events + [("call", call) if call else ("content", self.syntax.open + text)]


# -- templates that do not show tools ----------------------------------------------------------------

def describe_tools(tools: Sequence[dict]) -> str:
    """System-message text that offers `tools` to a model whose template cannot."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to help answer. They are listed here as JSON schemas:\n<tools>\n"
            f"{lines}\n</tools>\n\nTo call one, reply with a JSON object holding its name and arguments between "
            "<tool_call> and </tool_call>, one block per call:\n<tool_call>\n"
            '{"name": "function_name", "arguments": {"parameter": "value"}}\n</tool_call>')


def as_plain_messages(messages: Sequence[dict], tools: Sequence[dict]) -> List[dict]:
    """Messages for a template that knows only roles and text: the tools described in
    the system message, an assistant's calls written in its content as hermes blocks,
    tool results given as a user message of <tool_response> blocks."""
    out: List[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False) for c in m["tool_calls"]]
            text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            content = (m["content"] + "\n" if m["content"] else "") + text
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("tool_results", None)
    if tools:
        offer = describe_tools(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + offer}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out
