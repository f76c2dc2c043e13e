"""ngram-simple (llama.cpp's `--spec-type ngram-simple`): the tokens that followed the
latest earlier occurrence of the sequence's last `size_n` tokens, up to the draft's length."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from ..ngram import MAX_RUN, Index, agreeing_before
from .kind import Kind, Options, option


@dataclass(frozen=True)
class NgramSimpleOptions(Options):
    size_n: int = option(12, "--spec-ngram-simple-size-n", "ngram-simple: tokens looked up in the history",
                         what="the n-gram size")


class NgramSimple(Index):
    """A sequence's ngram-simple state: every n-gram's latest start with a token after it."""

    kind = "ngram-simple"

    def __init__(self, size_n: int):
        super().__init__(size_n)
        self._last: Dict[Tuple[int, ...], int] = {}  # n-gram -> its latest start (with a token after it)

    def _add(self, history, key, i):
        self._last[key] = i

    def draft(self, history: List[int], n_max: int) -> Tuple[List[int], int]:
        """(the tokens after the last n's latest earlier occurrence, the run: how far back
        the context goes on agreeing with the text before it, at most MAX_RUN); ([], 0)
        when there is none."""
        self.catch_up(history)
        n = self.n
        if len(history) < n or n_max < 1:
            return [], 0
        j = self._last.get(tuple(history[-n:]))
        if j is None:
            return [], 0
        return history[j + n:j + n + n_max], n + agreeing_before(history, j, history, len(history) - n, MAX_RUN - n)


def _their_flags(size, n_max) -> list:
    """llama-speculative-simple's: the lookup size, and the m-gram it copies (its longest draft)."""
    return (["--spec-ngram-simple-size-n", str(size)] if size is not None else []) + \
        (["--spec-ngram-simple-size-m", str(n_max)] if n_max is not None else [])


KIND = Kind("ngram-simple", "copies what followed the last tokens' latest earlier occurrence, no weights",
            NgramSimpleOptions, source=lambda o: NgramSimple(o.size_n), lookup="size_n", sweep_sizes=(4, 8),
            their_flags=_their_flags)
