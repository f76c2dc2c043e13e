"""One request run alone on an engine to its end (Engine.generate and Engine.stream): its
tokens as they are committed, and their text as it comes (TextStream: never splitting a
UTF-8 character, ended by a stop token or a stop string)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence

from .requests import GenerationStats, Request, collect
from .step import sequence_steps
from .streamtext import partial_marker


@dataclass
class Result:
    text: str
    tokens: List[int]
    stats: GenerationStats


def reply_tokens(tokens: List[int], stops: set) -> List[int]:
    """The tokens whose text is the reply: a stop token ends it without being part of it."""
    return tokens[:-1] if tokens and tokens[-1] in stops else tokens


def run_tokens(engine, request: Request, speculative: bool, stats: GenerationStats,
               on_tokens: Optional[Callable[[List[int]], None]]) -> List[int]:
    """The request's tokens, each step's passed to on_tokens as it is committed."""
    seq = engine.sequence(request, speculative=speculative, stats=stats, on_stage=engine.stage_hook)
    steps = sequence_steps(seq)
    out: List[int] = []
    failed = True
    try:
        out = collect(steps, on_tokens)
        failed = False
    finally:
        steps.close()
        engine.end_sequence(seq, out, failed)
    return out


def stream_text(engine, request: Request, stop: Sequence[str], speculative: bool, stats: GenerationStats,
                out: List[int]) -> Iterator[str]:
    """The request's text in pieces as its tokens (appended to `out`) are committed, ended
    at a stop string (excluded, recorded in stats) as well as where the tokens end."""
    seq = engine.sequence(request, speculative=speculative, stats=stats, on_stage=engine.stage_hook)
    steps = sequence_steps(seq)
    text = engine.text_stream(stop, request.stop_tokens)
    failed = False
    try:
        for new in steps:
            out.extend(new)
            piece = text.push(new)
            if piece:
                yield piece
            if text.stopped:
                break
        piece = text.end()
        if piece:
            yield piece
        if text.stop_string is not None:
            stats.stop_reason, stats.stop_string = "stop string", text.stop_string
    except GeneratorExit:  # the consumer stopped at a yield, between steps
        raise
    except BaseException:
        failed = True
        raise
    finally:
        steps.close()
        engine.end_sequence(seq, out, failed)


class TextStream:
    """The text of a request's tokens as they come, never splitting a UTF-8 character: a
    stop token ends the tokens (its text is not part of the reply), a stop string ends
    the text (excluded), and text that could begin a stop string is held back until it
    is decided."""

    def __init__(self, decoder, stop: Sequence[str], stop_tokens: set):
        self.decoder, self.stop, self.stop_tokens = decoder, stop, stop_tokens
        self.pending = ""
        self.stop_string: Optional[str] = None  # the stop string that ended it

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, tokens: List[int]) -> str:
        """The text the tokens complete that is sure to be part of the reply."""
        if self.stopped:
            return ""
        if tokens and tokens[-1] in self.stop_tokens:
            tokens = tokens[:-1]
        self.pending += self.decoder.push(tokens)
        cut = _find_stop(self.pending, self.stop)
        if cut is not None:
            self.stop_string = _stop_at(self.pending, cut, self.stop)
            out, self.pending = self.pending[:cut], ""
            return out
        keep = partial_marker(self.pending, self.stop)
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def end(self) -> str:
        """The rest, once the tokens have ended."""
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        cut = _find_stop(self.pending, self.stop)
        if cut is not None:
            self.stop_string = _stop_at(self.pending, cut, self.stop)
            self.pending = self.pending[:cut]
        out, self.pending = self.pending, ""
        return out


def _find_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _stop_at(text: str, cut: int, stops: Sequence[str]) -> str:
    """The stop string found at text[cut:] (the longest, when several start there)."""
    return max((s for s in stops if s and text.startswith(s, cut)), key=len)
