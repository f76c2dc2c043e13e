"""Weightless drafts priced against plain decoding (the n-gram kinds, suffix): each step's
proposal is cut to the size with the most expected tokens per second, from the target's
verify cost by row count (verify_cost.VerifyCost: measured before the first step, cached
per model, build, device and threads) and the drafts' own probabilities of being kept;
to none at all, a plain decode, when no size beats the last token alone.

Making these drafts costs nothing, so their price is the verify's extra rows. On a GPU
those are nearly free and a long guess pays; on a CPU each row costs a good part of a
decode step, and an unlikely draft makes a step slower than plain decoding. A verify of
m drafts emits 1 + (the drafts kept) tokens, so with p_i the probability that draft i is
kept (a chain's position, a tree's node in best-first order; each at most its parent's),
its rate is (1 + p_1 + ... + p_m) / cost(1 + m)."""
from __future__ import annotations

from typing import Callable, Dict, Sequence

import numpy as np

from .ddtree import DraftTree


def best_size(probs: Sequence[float], cost: Callable[[np.ndarray], np.ndarray]) -> int:
    """How many of the drafts to verify (0: the last token alone): the m whose expected
    tokens per second, (1 + probs[0] + ... + probs[m-1]) / cost(1 + m), is the highest,
    the smallest such m on a tie. cost: seconds by row count."""
    if len(probs) == 0:
        return 0
    gain = 1.0 + np.concatenate(([0.0], np.cumsum(np.asarray(probs, dtype=np.float64))))
    return int(np.argmax(gain / np.asarray(cost(np.arange(1, len(probs) + 2)), dtype=np.float64)))


class Calibration:
    """How far a kind's own estimates run ahead of what the target keeps: the drafts kept
    over the drafts expected, summed over the steps so far with one of each as a prior
    (a fresh sequence trusts its estimates), at most 1 (estimates are only lowered:
    suffix's counts over a handful of earlier occurrences are overconfident)."""

    def __init__(self):
        self.kept = 1.0
        self.expected = 1.0

    @property
    def factor(self) -> float:
        return min(1.0, self.kept / self.expected)

    def observe(self, expected: float, kept: int) -> None:
        self.expected += expected
        self.kept += kept


def tree_probs(tree: DraftTree, factor: float) -> np.ndarray:
    """A suffix tree's nodes' probabilities of being kept, in best-first order (its
    scores are the log-probabilities of their paths), scaled by a calibration factor."""
    return factor * np.exp(np.asarray([tree.scores[i] for i in tree.pick_order], dtype=np.float64))


def walk_depth(tree: DraftTree, emitted: Sequence[int]) -> int:
    """How many of the tree's nodes the target's tokens walk through from the root (the
    drafts a verify of the whole tree keeps): each emitted token is the target's choice
    after the node before it."""
    kids: Dict[int, Dict[int, int]] = {}
    for i in range(1, len(tree.tokens)):
        kids.setdefault(tree.parents[i], {}).setdefault(tree.tokens[i], i)
    node, depth = 0, 0
    for t in emitted:
        node = kids.get(node, {}).get(int(t))
        if node is None:
            break
        depth += 1
    return depth
