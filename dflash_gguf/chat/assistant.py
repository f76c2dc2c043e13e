"""The assistant's turn of a chat: the prompt that asks for it (the template with the
tools, the tool choice and thinking on or off) and the reading of its reply into
reasoning, content and tool calls, as the text streams."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

from .harmony import CALL, EMPTY_ANALYSIS, HarmonyParser, forced_call
from .reasoning import ReasoningSplitter, ThinkingSyntax, opens_thinking, syntax_of
from .templates import ChatTemplate
from .toolcalls import SYNTAX, Reply, ToolCallParser, as_plain_messages, forced_start, format_of

ToolChoice = Union[str, dict]  # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}


class ReplyParser:
    """feed() the reply's text as it comes, then finish(); both return deltas:
    ("reasoning", text), ("content", text), ("call", index, ToolCall). `reply` holds
    what has been read so far."""

    def __init__(self, splitter: ReasoningSplitter, calls: Optional[ToolCallParser], primed: str = ""):
        self.reply = Reply()
        self._splitter, self._calls = splitter, calls
        self._space = ""  # whitespace ending the content so far: dropped if a tool call follows
        if calls is not None and primed:
            calls.feed(primed)  # the call opening the prompt wrote for the model (tool_choice)

    def feed(self, text: str) -> List[tuple]:
        return self._route(self._splitter.feed(text), final=False)

    def finish(self) -> List[tuple]:
        return self._route(self._splitter.finish(), final=True)

    def _route(self, events: List[tuple], final: bool) -> List[tuple]:
        out: List[tuple] = []
        for kind, text in events:
            if kind == "reasoning":
                self.reply.reasoning += text
                out.append(("reasoning", text))
            elif self._calls is None:
                self._content(text, out)
            else:
                for event in self._calls.feed(text):
                    self._event(event, out)
        if final and self._calls is not None:
            for event in self._calls.finish():
                self._event(event, out)
        if final and self._space and not self.reply.tool_calls:
            self._content("", out, hold=False)  # the whitespace ending a reply without calls is its own
        return out

    def _event(self, event: tuple, out: List[tuple]) -> None:
        if event[0] == "call":
            self._space = ""
            self.reply.tool_calls.append(event[1])
            out.append(("call", len(self.reply.tool_calls) - 1, event[1]))
        else:
            self._content(event[1], out)

    def _content(self, text: str, out: List[tuple], hold: bool = True) -> None:
        text, self._space = self._space + text, ""
        if hold:
            body = text.rstrip()
            self._space, text = text[len(body):], body
        if text:
            self.reply.content += text
            out.append(("content", text))


@dataclass
class Turn:
    """A prompt for the assistant's turn, and how to read the reply to it."""

    prompt: str
    thinking: Optional[ThinkingSyntax]  # None: a harmony reply (its analysis channel holds the thoughts)
    starts_thinking: bool  # the prompt ends inside a thinking block
    tool_format: Optional[str] = None  # None: no tool calls are read
    tools: Sequence[dict] = ()
    primed: str = ""  # the reply's opening, written at the end of the prompt (tool_choice, thinking off)
    reasoning_format: str = "auto"

    def parser(self, make_id: Optional[Callable[[], str]] = None):
        """A ReplyParser, or for a harmony reply a harmony.HarmonyParser (the same deltas)."""
        if self.thinking is None:
            return HarmonyParser(bool(self.tool_format), make_id, self.primed, self.reasoning_format)
        call_open = SYNTAX[self.tool_format].open if self.tool_format else None
        splitter = ReasoningSplitter(self.thinking, self.reasoning_format, self.starts_thinking,
                                     ends=[call_open] if call_open else [])
        calls = ToolCallParser(self.tool_format, self.tools, make_id) if self.tool_format else None
        return ReplyParser(splitter, calls, self.primed)

    def call_close(self) -> str:
        """The text that ends a tool call: generation stops there for one call only."""
        return CALL if self.thinking is None else SYNTAX[self.tool_format].close


def forced_tool(tool_choice: ToolChoice) -> Optional[str]:
    """The function a tool_choice names, else None."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


def prefilled(messages: Sequence[dict]) -> bool:
    """Whether the chat ends with an assistant's message, which the reply continues (an
    assistant prefill, as llama-server takes it), or a ValueError where it cannot."""
    if not messages or messages[-1]["role"] != "assistant":
        return False
    if len(messages) >= 2 and messages[-2]["role"] == "assistant":
        raise ValueError("Cannot have 2 or more assistant messages at the end of the list.")
    if messages[-1].get("tool_calls"):
        raise ValueError("Cannot continue an assistant message that contains tool calls.")
    return True


def continued(template: ChatTemplate, messages: Sequence[dict], **kwargs) -> str:
    """The prompt that continues the final (assistant) message: the template rendered
    with it and no generation prompt, cut where its content ends (its turn left open; as
    transformers' continue_final_message cuts it, past the spaces the template kept);
    where the rendering does not show the content, the conversation before it with the
    generation prompt, then the content."""
    content = messages[-1].get("content") or ""
    whole = template.render(messages, add_generation_prompt=False, **kwargs)
    body = content.strip()
    at = whole.rfind(body) if body else -1
    if at < 0:
        return template.render(messages[:-1], **kwargs) + content
    kept = content.lstrip()  # a template that keeps the trailing spaces: they are the prompt's too
    return whole[:at + (len(kept) if whole.startswith(kept, at) else len(body))]


def prepare_turn(template: ChatTemplate, messages: Sequence[dict], *, tools: Sequence[dict] = (),
                 tool_choice: ToolChoice = "auto", template_kwargs: Optional[dict] = None,
                 reasoning_format: str = "auto") -> Turn:
    """The prompt for the assistant's reply to `messages` (OpenAI chat messages whose
    tool-call arguments are objects), offering `tools` (OpenAI function tools) unless
    tool_choice is "none"; "required" or a named function starts the reply with a
    call's opening. template_kwargs reach the template (enable_thinking true unless they
    say false, as llama.cpp renders); enable_thinking=False turns thinking off also with
    templates that open a thinking block regardless. A chat that
    ends with an assistant's message has the reply continue it (prefilled)."""
    # thinking is on unless asked off, and the template is told so: llama.cpp defines
    # enable_thinking for every template (true with reasoning on), and templates such as
    # DeepSeek-R1's and QwQ's close the thinking block when it is undefined
    kwargs = {"enable_thinking": True, **(template_kwargs or {})}
    offered = list(tools) if tool_choice != "none" else []
    fmt = format_of(template)
    prefill = prefilled(messages)
    if fmt == "harmony":
        if prefill:
            raise ValueError("continuing an assistant message is not supported with a harmony template (gpt-oss): "
                             "the last message must not be the assistant's")
        return _harmony_turn(template, messages, offered, tool_choice, kwargs, reasoning_format)
    render = continued if prefill else type(template).render
    if fmt == "generic":
        # the template cannot show tools, calls or results: they become text it can show
        prompt = render(template, as_plain_messages(messages, offered), **kwargs)
    else:
        prompt = render(template, messages, tools=offered or None, **kwargs)
    syntax = syntax_of(template.source)
    thinking = opens_thinking(prompt, syntax)
    primed = ""
    if offered and tool_choice != "auto" and not prefill:  # a prefilled reply has begun already
        primed = forced_start(fmt, forced_tool(tool_choice))
    if thinking and not prefill and (kwargs.get("enable_thinking") is False or primed):
        prompt += syntax.closed_empty  # a forced call is answered without thinking first
        thinking = False
    return Turn(prompt + primed, syntax, thinking, fmt if offered else None, offered, primed, reasoning_format)


def _harmony_turn(template: ChatTemplate, messages: Sequence[dict], offered: List[dict], tool_choice: ToolChoice,
                  kwargs: dict, reasoning_format: str) -> Turn:
    """prepare_turn for a harmony template (gpt-oss): thinking off starts the reply after
    an empty analysis message; a forced call starts it with the call's header."""
    prompt = template.render(messages, tools=offered or None, **kwargs)
    primed = EMPTY_ANALYSIS if kwargs.get("enable_thinking") is False else ""
    if offered and tool_choice != "auto":
        primed += forced_call(forced_tool(tool_choice))
    return Turn(prompt + primed, None, False, "harmony" if offered else None, offered, primed, reasoning_format)
