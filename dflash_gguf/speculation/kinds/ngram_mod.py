"""ngram-mod (llama.cpp's `--spec-type ngram-mod`): a map from every `n_match` tokens seen to
the token that last followed them, chained token by token; a draft shorter than `n_min`
(capped at the draft's length) is dropped. Unlike llama.cpp's, whose hashed table is shared
by all sequences and reset when it fills or misses often, each sequence keeps an exact map
of its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..ngram import Index
from .kind import Kind, Options, option

# llama.cpp's default shortest draft (common_params_speculative_ngram_mod), cut to a shorter n-max
THEIR_N_MIN = 48


@dataclass(frozen=True)
class NgramModOptions(Options):
    n_match: int = option(24, "--spec-ngram-mod-n-match", "ngram-mod: tokens its map is keyed on",
                          what="the n-gram size")
    n_min: int = option(48, "--spec-ngram-mod-n-min", "ngram-mod: its shortest draft, capped at the longest",
                        what="the shortest draft")


class NgramMod(Index):
    """A sequence's ngram-mod state: the last n tokens' next token in the map, then that
    token's, and so on."""

    kind = "ngram-mod"

    def __init__(self, n_match: int, n_min: int):
        super().__init__(n_match)
        self.n_min = n_min
        self._next: Dict[Tuple[int, ...], int] = {}

    def _add(self, history, key, i):
        self._next[key] = history[i + self.n]

    def draft(self, history: Sequence[int], n_max: int) -> Tuple[List[int], int]:
        """(the chained tokens, the run: n, the map keeps no positions to measure it
        further); ([], 0) when shorter than n_min."""
        self.catch_up(history)
        n = self.n
        if len(history) < n or n_max < 1:
            return [], 0
        key, out = tuple(history[-n:]), []
        while len(out) < n_max:
            t = self._next.get(key)
            if t is None:
                break
            out.append(t)
            key = key[1:] + (t,)
        return (out, n) if len(out) >= min(self.n_min, n_max) else ([], 0)


def _their_flags(size, n_max) -> list:
    """llama-speculative-simple's: the key size, and the longest draft with the shortest cut
    to it (its shortest may not pass its longest)."""
    return (["--spec-ngram-mod-n-match", str(size)] if size is not None else []) + \
        (["--spec-ngram-mod-n-max", str(n_max), "--spec-ngram-mod-n-min", str(min(THEIR_N_MIN, n_max))]
         if n_max is not None else [])


KIND = Kind("ngram-mod", "chains each last tokens' latest successor from a map of the history, no weights",
            NgramModOptions, source=lambda o: NgramMod(o.n_match, o.n_min), lookup="n_match", sweep_sizes=(8, 16),
            their_flags=_their_flags)
