"""Weightless drafts from a sequence's own prompt and output (llama.cpp's `--spec-type
ngram-simple` and `ngram-mod`): when the answer repeats its input (code edits, documents,
tool results), the tokens that followed the last few tokens' earlier occurrence are a
good guess of what follows now.

  ngram-simple  the latest earlier occurrence of the last `size_n` tokens: the tokens
                after it, up to the draft's length
  ngram-mod     a map from every `n_match` tokens seen to the token that last followed
                them, chained token by token; a draft shorter than `n_min` is dropped

Both index the sequence's history (its one list of tokens, decoding.Tokens.text, which
they read and never copy) incrementally, each position once, so a step costs a lookup,
not a scan. Unlike llama.cpp's ngram-mod, whose hashed table is shared by all sequences and
reset when it fills or misses often, each sequence keeps an exact map of its own."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .pricing import RunHazard


class _Index:
    """The n-grams of a history's positions, indexed as it grows (a subclass's _add
    indexes one, its draft proposes from the index). The history is the caller's list:
    each call passes it, grown at its end since the last."""

    def __init__(self, n: int):
        self.n = n
        self._done = 0  # positions indexed so far

    def catch_up(self, history: Sequence[int]) -> None:
        """Index the positions the history gained: an n-gram at i is indexed once the
        token after it is known (i + n < len)."""
        n = self.n
        for i in range(self._done, len(history) - n):
            self._add(history, tuple(history[i:i + n]), i)
        self._done = max(self._done, len(history) - n)


class NgramSimple(_Index):
    """ngram-simple: the tokens that followed the latest earlier occurrence of the last n."""

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


MAX_RUN = 512  # runs are measured this far back: RunHazard's last bucket starts there


def agreeing_before(a: Sequence[int], i: int, b: Sequence[int], j: int, limit: int) -> int:
    """How many tokens before a[i] equal those before b[j], walking back from them, at
    most `limit` (a match's length: an n-gram's run here, a suffix match's in speculation/suffix.py)."""
    limit = min(limit, i, j)
    k = 0
    while k < limit and a[i - 1 - k] == b[j - 1 - k]:
        k += 1
    return k


class NgramMod(_Index):
    """ngram-mod: the last n tokens' next token in the map, then that token's, and so on."""

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


def ngram_sources(kinds: Sequence[str], config) -> list:
    """Fresh per-sequence sources for the n-gram kinds (config: config.NgramConfig)."""
    make = {"ngram-simple": lambda: NgramSimple(config.size_n),
            "ngram-mod": lambda: NgramMod(config.n_match, config.n_min)}
    return [make[k]() for k in kinds]


class NgramDrafts:
    """A sequence's n-gram sources, each with its kind's RunHazard (the corpus key's,
    pricing.RunHazards: carried from request to request): each step the draft with the
    most expected accepted drafts (ties: the first kind listed, llama.cpp's order), from
    the sequence's history (Tokens.text: its prompt, its output, the bonus last)."""

    def __init__(self, sources: Sequence[_Index], hazards: Sequence[RunHazard]):
        self.sources, self.hazards = list(sources), list(hazards)

    def best(self, history: Sequence[int], n_max: int) -> Tuple[List[int], np.ndarray, Optional[str], list]:
        """(draft, the chance each of its tokens is kept, the kind that found it, every
        source's (draft, run)): the best of the sources' drafts for the next positions
        ([], no chances and None when none has one); observe judges every source's draft."""
        found = [s.draft(history, n_max) for s in self.sources]
        best, probs, kind = [], np.zeros(0), None
        for source, (drafts, run), hazard in zip(self.sources, found, self.hazards):
            if drafts:
                p = hazard.survival(run, np.arange(1, len(drafts) + 1))
                if p.sum() > probs.sum():
                    best, probs, kind = drafts, p, source.kind
        return best, probs, kind, found

    def observe(self, emitted: Sequence[int], found: Optional[list] = None) -> None:
        """After the step: the tokens it emitted after the bonus (the last is the next
        bonus), and each source's (draft, run) of the step (best's; None: the step asked
        none). A draft is judged as far as the emitted tokens reach."""
        for (drafts, run), hazard in zip(found or (), self.hazards):
            if drafts:
                judged = drafts[:len(emitted)]
                hazard.observe(run, _agreeing(judged, emitted), len(judged))


def _agreeing(drafts: Sequence[int], emitted: Sequence[int]) -> int:
    """How many of the drafts the emitted tokens agree with, from the first."""
    k = 0
    for d, t in zip(drafts, emitted):
        if d != t:
            break
        k += 1
    return k


def expected_chain(top1_logprobs) -> float:
    """A drafter chain's expected accepted drafts from its own confidence: draft i is
    kept when it and every draft before it are right, probability prod_{j<=i} p_j."""
    return float(np.cumprod(np.exp(np.asarray(top1_logprobs, dtype=np.float64))).sum())

