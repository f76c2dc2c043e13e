"""Reasoning ("thinking") in generated text: split out of the reply as it streams.

Two syntaxes: <think>...</think> (Qwen3, Qwen3.5 / 3.6, DeepSeek-R1 and their kin) and
Gemma 4's thought channel, <|channel>thought ... <channel|>. A template may open the
thinking block itself at the end of the prompt (Qwen3.5 writes "<think>\\n"): the reply
then starts inside it.

Reasoning formats, as llama.cpp names them (--reasoning-format):
  auto, deepseek    reasoning goes to reasoning_content, the rest to content
  deepseek-legacy   reasoning_content as well, content keeps the whole text, tags included
  none              no split: everything is content
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from ..decoding.streamtext import partial_marker
from ..runtime.errors import ConfigError

REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")


@dataclass(frozen=True)
class ThinkingSyntax:
    open: str
    close: str
    closed_empty: str  # what closes a block the prompt opened, leaving it empty


THINK_TAGS = ThinkingSyntax("<think>", "</think>", "\n</think>\n\n")
GEMMA4_CHANNEL = ThinkingSyntax("<|channel>thought", "<channel|>", "\n<channel|>")


def syntax_of(template_source: str) -> ThinkingSyntax:
    """The thinking syntax of a chat template (<think> tags unless it is Gemma 4's)."""
    return GEMMA4_CHANNEL if GEMMA4_CHANNEL.open in template_source else THINK_TAGS


def opens_thinking(prompt: str, syntax: ThinkingSyntax) -> bool:
    """Whether the prompt ends inside a thinking block (the reply starts with thoughts)."""
    return prompt.rstrip().endswith(syntax.open)


class ReasoningSplitter:
    """Splits reply text into reasoning and content as it arrives: feed() and finish()
    return events ("reasoning", text) / ("content", text). `thinking`: the reply starts
    inside a thinking block. `ends`: other markers that end a block (they stay in the
    content), e.g. a tool call the model starts without closing its thoughts.
    Whitespace around a block's text is dropped, as is whitespace opening the content
    that follows a block."""

    def __init__(self, syntax: ThinkingSyntax, fmt: str = "auto", thinking: bool = False, ends: Sequence[str] = ()):
        if fmt not in REASONING_FORMATS:
            raise ValueError(f"reasoning format must be one of {', '.join(REASONING_FORMATS)}, got {fmt!r}")
        self.syntax, self.fmt = syntax, fmt
        self._ends = (syntax.close, *ends)
        self._thinking = thinking
        self._buf = ""
        self._lead = thinking  # a block (or the content after one) has no text yet: drop whitespace
        self._held = ""  # whitespace at the end of the reasoning so far (dropped if the block ends)
        self._legacy_open = syntax.open if thinking and fmt == "deepseek-legacy" else ""

    def feed(self, text: str) -> List[tuple]:
        if self.fmt == "none":
            return [("content", text)] if text else []
        events: List[tuple] = []
        self._buf += text
        while True:
            if self._thinking:
                hits = [(i, m) for m in self._ends if (i := self._buf.find(m)) >= 0]
                if hits:
                    i, marker = min(hits)
                    self._reason(self._buf[:i], events, last=True)
                    self._buf = self._buf[i + len(marker):] if marker == self.syntax.close else self._buf[i:]
                    self._thinking, self._lead = False, True
                    continue
                keep = partial_marker(self._buf, self._ends)
            else:
                i = self._buf.find(self.syntax.open)
                if i >= 0:
                    self._content(self._buf[:i], events)
                    self._buf = self._buf[i + len(self.syntax.open):]
                    self._thinking, self._lead, self._held = True, True, ""
                    continue
                keep = partial_marker(self._buf, [self.syntax.open])
            cut = len(self._buf) - keep
            (self._reason if self._thinking else self._content)(self._buf[:cut], events)
            self._buf = self._buf[cut:]
            return self._legacy(events, text)

    def finish(self) -> List[tuple]:
        if self.fmt == "none":
            return []
        events: List[tuple] = []
        rest, self._buf = self._buf, ""
        if self._thinking:
            self._reason(rest, events, last=True)
        else:
            self._content(rest, events)
        return self._legacy(events, "")

    def _legacy(self, events: List[tuple], raw: str) -> List[tuple]:
        """deepseek-legacy: the reasoning events, and the raw text as content."""
        if self.fmt != "deepseek-legacy":
            return events
        raw, self._legacy_open = self._legacy_open + raw, ""
        return [e for e in events if e[0] == "reasoning"] + ([("content", raw)] if raw else [])

    def _reason(self, text: str, events: List[tuple], last: bool = False) -> None:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        text, self._held = self._held + text, ""
        body = text.rstrip()
        if not last:
            self._held = text[len(body):]
        if body:
            events.append(("reasoning", body))

    def _content(self, text: str, events: List[tuple]) -> None:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        if text:
            events.append(("content", text))


# the reasoning efforts a chat template is given (gpt-oss's "Reasoning: ..." line)
REASONING_EFFORTS = ("low", "medium", "high")


def check_reasoning_effort(effort) -> str:
    """A reasoning effort (--reasoning-effort, a request's reasoning_effort), checked."""
    if effort not in REASONING_EFFORTS:
        raise ConfigError("reasoning_effort", f"reasoning effort must be one of {', '.join(REASONING_EFFORTS)}, "
                                              f"got {effort!r}")
    return effort
