"""Weightless chains from a sequence's own prompt and output (the n-gram family of kinds:
kinds/ngram_simple.py, ngram_mod.py, ngram_map_k.py, ...): when the answer repeats its input
(code edits, documents, tool results), the tokens that followed the last few tokens' earlier
occurrence are a good guess of what follows now. Here what they share: the source's
interface (ChainSource), the incremental index of a history's n-grams (Index: it reads the
sequence's one list of tokens, decoding.Tokens.text, and never copies it, each position
once, so a step costs a lookup, not a scan), how far a match runs back (agreeing_before),
and the competition of the sources' drafts, each priced by its kind's run hazard
(NgramDrafts)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from .pricing import RequestHazard


class ChainSource:
    """A sequence's source of one kind's chains (kinds/kind.Kind.source): `kind` its name,
    draft(history, n_max) -> (drafts, run) its proposal, heard its last draft's outcome."""

    kind = ""

    def heard(self, drafts: Sequence[int], kept: int) -> None:
        """The target kept the first `kept` of the source's last drafts as far as its
        tokens reached them (`drafts`; most kinds learn nothing from it: their state is
        the history)."""


class Index(ChainSource):
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


MAX_RUN = 512  # runs are measured this far back: RunHazard's last bucket starts there


def agreeing_before(a: Sequence[int], i: int, b: Sequence[int], j: int, limit: int) -> int:
    """How many tokens before a[i] equal those before b[j], walking back from them, at
    most `limit` (a match's length: an n-gram's run here, a suffix match's in speculation/suffix.py)."""
    limit = min(limit, i, j)
    k = 0
    while k < limit and a[i - 1 - k] == b[j - 1 - k]:
        k += 1
    return k


class NgramDrafts:
    """A sequence's n-gram sources, each with its kind's hazard (the request's view of
    the corpus key's, pricing.RunHazards.request: carried from request to request):
    each step the draft with the most expected accepted drafts (ties: the first kind
    listed, llama.cpp's order), from the sequence's history (Tokens.text: its prompt,
    its output, the bonus last)."""

    def __init__(self, sources: Sequence[ChainSource], hazards: Sequence[RequestHazard]):
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
        for source, (drafts, run), hazard in zip(self.sources, found or (), self.hazards):
            if drafts:
                judged = drafts[:len(emitted)]
                kept = _agreeing(judged, emitted)
                hazard.observe(run, kept, len(judged))
                source.heard(judged, kept)


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

