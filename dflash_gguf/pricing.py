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


class ContinuationRate:
    """How likely the target goes on along a weightless draft one token further than it
    has: c in a node's probability count/occurrences x c^depth (tree_probs). Counts alone
    say how an earlier text went on, not how long this one will follow it; one earlier
    occurrence makes every node of a long chain "certain". Each verified step counts the
    drafts the target walked through (continues) and whether it stopped short of the
    deepest (a stop), with a prior of PRIOR (a fresh corpus key trusts a few drafts, not
    a whole earlier reply); the counts fade to at most WEIGHT so that a changed text is
    followed. One per corpus key (SuffixCorpora.rate), carried from request to request: a
    tool loop's third turn drafts as long as its first two have earned."""

    PRIOR = (3.0, 1.0)
    WEIGHT = 128.0

    def __init__(self):
        self.continues, self.stops = self.PRIOR

    @property
    def rate(self) -> float:
        return self.continues / (self.continues + self.stops)

    def observe(self, walked: int, deepest: int) -> None:
        """A step walked `walked` drafts of a proposal `deepest` deep (walked <= deepest)."""
        self.continues += walked
        self.stops += walked < deepest
        total = self.continues + self.stops
        if total > self.WEIGHT:
            self.continues *= self.WEIGHT / total
            self.stops *= self.WEIGHT / total


def tree_probs(tree: DraftTree, rate: float) -> np.ndarray:
    """A suffix tree's nodes' probabilities of being kept, in best-first order: their
    paths' count over the occurrences (the scores are those log-probabilities) times the
    continuation rate to the power of their depth."""
    order = tree.pick_order
    scores = np.asarray([tree.scores[i] for i in order], dtype=np.float64)
    depths = np.asarray([tree.depths[i] for i in order], dtype=np.float64)
    return np.exp(scores) * rate ** depths


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
