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

    def draft(self, history: List[int], n_max: int) -> List[int]:
        self.catch_up(history)
        n = self.n
        if len(history) < n or n_max < 1:
            return []
        j = self._last.get(tuple(history[-n:]))
        return [] if j is None else history[j + n:j + n + n_max]


class NgramMod(_Index):
    """ngram-mod: the last n tokens' next token in the map, then that token's, and so on."""

    kind = "ngram-mod"

    def __init__(self, n_match: int, n_min: int):
        super().__init__(n_match)
        self.n_min = n_min
        self._next: Dict[Tuple[int, ...], int] = {}

    def _add(self, history, key, i):
        self._next[key] = history[i + self.n]

    def draft(self, history: Sequence[int], n_max: int) -> List[int]:
        self.catch_up(history)
        n = self.n
        if len(history) < n or n_max < 1:
            return []
        key, out = tuple(history[-n:]), []
        while len(out) < n_max:
            t = self._next.get(key)
            if t is None:
                break
            out.append(t)
            key = key[1:] + (t,)
        return out if len(out) >= min(self.n_min, n_max) else []


class Acceptance:
    """How often a source's drafts are right, per drafted token, from every step's
    outcome (whether or not its draft was the one verified: the target's tokens say what
    it would have kept). The estimate is the rate with one success and one failure
    added (so a source nobody has seen yet counts as a coin flip)."""

    def __init__(self):
        self.hits = 0
        self.trials = 0

    @property
    def rate(self) -> float:
        return (self.hits + 1) / (self.trials + 2)

    def expected(self, n: int) -> float:
        """Expected accepted drafts of a chain of n: each kept while the ones before it
        are, sum over i of rate^i."""
        a = self.rate
        return a * (1 - a ** n) / (1 - a)

    def observe(self, draft: Sequence[int], emitted: Sequence[int]) -> None:
        """The draft against the tokens the target emitted after the same bonus: every
        position up to the first miss is a trial."""
        for d, t in zip(draft, emitted):
            self.trials += 1
            if d != t:
                return
            self.hits += 1


def ngram_sources(kinds: Sequence[str], config) -> list:
    """Fresh per-sequence sources for the n-gram kinds (config: config.NgramConfig)."""
    make = {"ngram-simple": lambda: NgramSimple(config.size_n),
            "ngram-mod": lambda: NgramMod(config.n_match, config.n_min)}
    return [make[k]() for k in kinds]


class NgramDrafts:
    """A sequence's n-gram sources with their acceptance: each step the draft with the
    best expected accepted length (ties: the first kind listed, llama.cpp's order), from
    the sequence's history (Tokens.text: its prompt, its output, the bonus last)."""

    def __init__(self, sources: Sequence[_Index]):
        self.sources = list(sources)
        self.acceptance = [Acceptance() for _ in self.sources]

    def best(self, history: Sequence[int], n_max: int) -> Tuple[List[int], float, Optional[str], List[List[int]]]:
        """(draft, its expected accepted length, the kind that found it, every source's
        draft): the best of the sources' drafts for the next positions ([], 0 and None
        when none has one); observe judges every source's draft."""
        drafts = [s.draft(history, n_max) for s in self.sources]
        best, value, kind = [], 0.0, None
        for source, found, acc in zip(self.sources, drafts, self.acceptance):
            if found:
                e = acc.expected(len(found))
                if e > value:
                    best, value, kind = found, e, source.kind
        return best, value, kind, drafts

    def probs(self, kind: str, n: int) -> np.ndarray:
        """The chance that each of a draft's first n tokens is kept by the kind's measured
        acceptance: token i when it and the ones before it are right, rate^i."""
        rate = next(a for s, a in zip(self.sources, self.acceptance) if s.kind == kind).rate
        return rate ** np.arange(1, n + 1, dtype=np.float64)

    def observe(self, emitted: Sequence[int], drafts: Optional[List[List[int]]] = None) -> None:
        """After the step: the tokens it emitted after the bonus (the last is the next
        bonus), and each source's draft of the step (best's; None: the step asked none)."""
        for found, acc in zip(drafts or (), self.acceptance):
            if found:
                acc.observe(found, emitted)


def expected_chain(top1_logprobs) -> float:
    """A drafter chain's expected accepted drafts from its own confidence: draft i is
    kept when it and every draft before it are right, probability prod_{j<=i} p_j."""
    return float(np.cumprod(np.exp(np.asarray(top1_logprobs, dtype=np.float64))).sum())

