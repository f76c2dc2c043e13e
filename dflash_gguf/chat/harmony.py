"""OpenAI's harmony format (gpt-oss): the messages its chat template reads, and the
reading of a reply into reasoning, content and tool calls as the text streams.

A harmony reply is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>thoughts<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

The prompt ends with "<|start|>assistant", so the first header comes without it. What
llama.cpp's gpt-oss parser (common/parsers/gpt-oss.cpp) accepts is accepted here too:
the recipient in the role part of the header (" to=functions.NAME<|channel|>commentary
json") or after the channel; "<|constrain|>" before the content type, or a bare type, or
none; a stray "<|channel|>commentary" (with " to=assistant") before the real channel,
which then counts; a commentary message with no recipient (a preamble) as content.
A message to a recipient other than a function, or a call when no tools are offered,
is dropped as llama.cpp drops it (the model asking for a built-in tool nobody runs).
Text that is not harmony, or a call whose arguments are not a JSON object, is content:
a malformed reply is the model's answer, not a server error.

`<|return|>` and `<|call|>` end generation: llama.cpp's vocabulary marks them
end-of-generation tokens for an o200k_harmony tokenizer (and takes `<|end|>` off that
list), so a reply read here usually ends without its last terminator.

OpenAI's own parser (PyPI openai-harmony) is not used: it loads the o200k vocabulary by
downloading it on first use, which fails offline, and it reads o200k token ids, while
this server streams text from whatever tokenizer the GGUF has.
"""
from __future__ import annotations

import json
import re
from typing import Callable, List, Optional, Sequence

from ..decoding.streamtext import partial_marker
from .toolcalls import Reply, ToolCall

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
TERMINATORS = (END, CALL, RETURN)
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)

# an empty analysis message: written at the end of the prompt, the reply starts after the
# model's thinking (thinking off, as llama.cpp's --reasoning-budget 0 closes it at once)
EMPTY_ANALYSIS = f"{CHANNEL}analysis{MESSAGE}{END}{START}assistant"
MAX_HEADER = 256  # longer text before a <|message|> is not a header


def is_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony (llama.cpp tells it by the same marker)."""
    return CHANNEL in template_source


def forced_call(name: Optional[str]) -> str:
    """The header that opens a call (of `name`, or of any function when None), in the
    form the template writes calls in: appended to the prompt, the reply is a call."""
    return f" to=functions.{name}{CHANNEL}commentary json{MESSAGE}" if name else " to=functions."


def template_messages(messages: Sequence[dict]) -> List[dict]:
    """Messages as the gpt-oss template reads them, as llama.cpp's chat code hands them
    over: an assistant's reasoning_content in `thinking` (and, when it made calls, its
    content left out). The template writes one call per assistant message and labels
    each tool result with the last call's name; an assistant message with several
    calls is split into one message per call, each followed by its result, so that no
    call is lost and every result follows its own call."""
    out: List[dict] = []
    i = 0
    while i < len(messages):
        m = dict(messages[i])
        i += 1
        if m.get("role") != "assistant":
            out.append(m)
            continue
        calls = m.get("tool_calls") or []
        if isinstance(m.get("reasoning_content"), str):
            m["thinking"] = m["reasoning_content"]
            if calls:
                m.pop("content", None)
        if len(calls) < 2:
            out.append(m)
            continue
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        ids = [c.get("id") for c in calls]
        if {r.get("tool_call_id") for r in results} <= set(ids) and len(results) == len(calls):
            results.sort(key=lambda r: ids.index(r.get("tool_call_id")))
        for k, call in enumerate(calls):
            out.append({**m, "tool_calls": [call]} if k == 0 else {"role": "assistant", "content": "",
                                                                   "tool_calls": [call]})
            if k < len(results):
                out.append(results[k])
        out.extend(results[len(calls):])
    return out


_ROLE = re.compile(r"\s*(?:<\|start\|>\s*\w*)?")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")


def _header_body(header: str) -> str:
    """The header without the "<|start|>assistant" that begins every message but the first."""
    return header[_ROLE.match(header).end():]


def _may_be_header(text: str) -> bool:
    """Whether `text`, with no <|message|> yet, can still grow into a message header:
    headers begin with a channel or a recipient, after the role."""
    stripped = text.lstrip()
    if START.startswith(stripped):
        return True
    if stripped.startswith(START):
        rest = stripped[len(START):].lstrip()
        role = re.match(r"\w*", rest).end()
        if role == len(rest):
            return True  # still the role
        stripped = rest[role:].lstrip()
    return any(stripped.startswith(c) or c.startswith(stripped) for c in (CHANNEL, "to="))


class HarmonyParser:
    """Reads a harmony reply as it arrives: feed() the text, then finish(); both return
    deltas ("reasoning", text), ("content", text), ("call", index, ToolCall), as
    assistant.ReplyParser does, and `reply` holds what has been read. Calls are read
    when `tools` is true (tools were offered); `primed` is the text the prompt wrote
    at the start of the reply (an empty analysis, a forced call's header)."""

    def __init__(self, tools: bool, make_id: Optional[Callable[[], str]] = None, primed: str = "",
                 reasoning_format: str = "auto"):
        self.reply = Reply()
        self._tools, self._make_id, self._fmt = tools, make_id, reasoning_format
        self._buf = ""
        self._header: Optional[str] = ""  # the header read so far; None: in a message's body
        self._route = ""  # the body's destination: reasoning, content, call or drop
        self._raw = ""  # the header as written, role left out (a malformed call goes back to content with it)
        self._name = ""  # the function a call's body is for
        self._body = ""  # a call's body so far
        self._not_header = False  # the body is text that failed to be a header
        self.feed(primed)

    def feed(self, text: str) -> List[tuple]:
        self._buf += text
        out: List[tuple] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> List[tuple]:
        out: List[tuple] = []
        while self._step(out, final=True):
            pass
        if self._header is None:
            self._end_body(out)
        elif self._header and "<|" not in self._header:
            # the reply ended in what might have been a header but holds no marker: its text
            # is content (a header cut short, markers and all, is dropped)
            self._emit("content", self._header, out)
        self._header = ""
        return out

    # -- the state machine -----------------------------------------------------------------
    def _step(self, out: List[tuple], final: bool) -> bool:
        """Reads what it can of the buffer; True when it should be called again."""
        if not self._buf:
            return False
        if self._header is not None:
            return self._read_header(out)
        return self._read_body(out, final)

    def _read_header(self, out: List[tuple]) -> bool:
        header = self._header + self._buf
        cut = header.find(MESSAGE)
        ended = [i for m in TERMINATORS if (i := header.find(m)) >= 0 and (cut < 0 or i < cut)]
        if cut >= 0 and not ended and cut <= MAX_HEADER and _may_be_header(header[:cut]):
            self._buf = header[cut + len(MESSAGE):]
            self._open(header[:cut], out)
            return True
        whole = header[:len(header) - partial_marker(header, [MESSAGE])]  # less a <|message|> begun
        if ended or len(whole) > MAX_HEADER or not _may_be_header(whole):
            # not a header: the text is content, and reading goes on in a body
            self._header, self._buf = None, header
            self._route, self._raw, self._not_header = "content", "", True
            return True
        self._header, self._buf = header, ""
        return False

    def _open(self, header: str, out: List[tuple]) -> None:
        """A message's header is complete: choose where its body goes."""
        body = _header_body(header)
        channels = _CHANNEL_NAME.findall(body)
        channel = channels[-1] if channels else ""
        recipients = [r for r in _RECIPIENT.findall(body) if r != "assistant"]
        self._header, self._raw, self._body = None, body + MESSAGE, ""
        if recipients:
            function = recipients[0][len("functions."):] if recipients[0].startswith("functions.") else ""
            self._route = "call" if function and self._tools else "drop"
            self._name = function
        elif channel == "analysis":
            self._route = "reasoning"
            if self._fmt in ("none", "deepseek-legacy"):
                self._emit("content", self._raw, out)
        else:
            self._route = "content"

    def _read_body(self, out: List[tuple], final: bool) -> bool:
        # a body that began as text which is no header: a <|start|> it begins with is text
        # too (else it would be read as the same failed header again)
        skip, self._not_header = self._not_header, False
        hits = [(i, m) for m in (*TERMINATORS, START) if (i := self._buf.find(m, int(skip and m == START))) >= 0]
        if hits:
            i, marker = min(hits)
            self._body_text(self._buf[:i], out)
            self._end_body(out, marker if marker != START else "")
            # a <|start|> with no terminator before it still begins the next message
            self._buf = self._buf[i + (len(marker) if marker != START else 0):]
            self._header = ""
            return True
        keep = 0 if final else partial_marker(self._buf, (*TERMINATORS, START))
        self._body_text(self._buf[:len(self._buf) - keep], out)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _body_text(self, text: str, out: List[tuple]) -> None:
        if not text:
            return
        if self._route == "call":
            self._body += text
        elif self._route == "reasoning":
            self._emit("reasoning", text, out)
        elif self._route == "content":
            self._emit("content", text, out)

    def _end_body(self, out: List[tuple], terminator: str = "") -> None:
        if self._route == "call":
            call = self._call()
            if call is None:
                self._emit("content", self._raw + self._body + terminator, out)
            else:
                self.reply.tool_calls.append(call)
                out.append(("call", len(self.reply.tool_calls) - 1, call))
        elif self._route == "reasoning" and self._fmt in ("none", "deepseek-legacy"):
            self._emit("content", terminator, out)
        self._route, self._body = "", ""

    def _call(self) -> Optional[ToolCall]:
        text = self._body.strip()
        try:
            args = json.loads(text) if text else {}
        except (ValueError, RecursionError):
            return None
        if not isinstance(args, dict):
            return None
        return ToolCall(self._name, args, **({"id": self._make_id()} if self._make_id else {}))

    def _emit(self, kind: str, text: str, out: List[tuple]) -> None:
        """A delta; reasoning with --reasoning-format none or deepseek-legacy goes to the
        content too (and so do its header and terminator, see _open and _end_body)."""
        if not text:
            return
        if kind == "reasoning":
            if self._fmt != "none":
                self.reply.reasoning += text
                out.append(("reasoning", text))
            if self._fmt in ("none", "deepseek-legacy"):
                self._emit("content", text, out)
            return
        self.reply.content += text
        out.append(("content", text))
