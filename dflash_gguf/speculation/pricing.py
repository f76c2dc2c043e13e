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

from collections import OrderedDict
from typing import Callable, Dict, Hashable, Sequence

import numpy as np

from ..decoding.tree import DraftTree


def best_size(probs: Sequence[float], cost: Callable[[np.ndarray], np.ndarray]) -> int:
    """How many of the drafts to verify (0: the last token alone): the m whose expected
    tokens per second, (1 + probs[0] + ... + probs[m-1]) / cost(1 + m), is the highest,
    the smallest such m on a tie. cost: seconds by row count."""
    if len(probs) == 0:
        return 0
    gain = 1.0 + np.concatenate(([0.0], np.cumsum(np.asarray(probs, dtype=np.float64))))
    return int(np.argmax(gain / np.asarray(cost(np.arange(1, len(probs) + 2)), dtype=np.float64)))


class RunHazard:
    """How likely the target breaks off a weightless draft at its next token, by the run
    before it: how many tokens the context has gone along the text the draft copies (the
    match's length, then each draft walked through). A long run tends to go on (a file
    returned whole, a tool call repeated); a short match is often chance, and one rate for
    every draft prices a copy's 40th token as unsure as its first. Runs are bucketed by
    doubling length (1, 2-3, 4-7, ...); each bucket counts its trials (a draft token judged,
    up to a draft's first miss) and breaks, from a prior of one break in r + 2 trials at
    half weight, r the bucket's middle run (the rule of succession for a run of r: the
    chance it goes one further is (r + 1) / (r + 2)), at most PRIOR_TRIALS of them (no
    run is taken as sure), fading to WEIGHT trials a bucket so that a text that stopped
    repeating is followed."""

    BUCKETS = 10  # the last holds every run of 512 and more
    WEIGHT = 256.0
    PRIOR = 0.5
    PRIOR_TRIALS = 64.0

    def __init__(self):
        middle = np.maximum(1.0, 1.5 * 2.0 ** np.arange(self.BUCKETS) - 0.5)
        self.trials = np.minimum(self.PRIOR * (middle + 2.0), self.PRIOR_TRIALS)
        self.breaks = np.full(self.BUCKETS, self.PRIOR)

    @classmethod
    def _buckets(cls, runs: np.ndarray) -> np.ndarray:
        return np.minimum(np.log2(np.maximum(runs, 1)).astype(np.int64), cls.BUCKETS - 1)

    @classmethod
    def going_on(cls, trials: np.ndarray, breaks: np.ndarray, run: int, depths) -> np.ndarray:
        """survival's arithmetic over counts by bucket (this hazard's, or a request's view)."""
        depths = np.asarray(depths, dtype=np.int64)
        if depths.size == 0:
            return np.zeros(0)
        b = cls._buckets(run + np.arange(int(depths.max())))
        return np.cumprod(1.0 - breaks[b] / trials[b])[depths - 1]

    @classmethod
    def count(cls, trials: np.ndarray, breaks: np.ndarray, run: int, walked: int, deepest: int) -> None:
        """observe's counting into counts by bucket: every depth up to the first miss is a
        trial, the miss a break."""
        b = cls._buckets(run + np.arange(min(walked + 1, deepest)))
        np.add.at(trials, b, 1.0)
        if walked < deepest:
            breaks[b[-1]] += 1.0

    def survival(self, run: int, depths) -> np.ndarray:
        """The chance that the target walks a draft down to each of `depths` (1: the first
        draft token) from a run of `run`: the product of going on at every run before."""
        return self.going_on(self.trials, self.breaks, run, depths)

    def observe(self, run: int, walked: int, deepest: int) -> None:
        """A step walked `walked` drafts of a draft `deepest` deep from a run of `run`
        (count), old trials fading to WEIGHT a bucket."""
        self.count(self.trials, self.breaks, run, walked, deepest)
        over = self.trials > self.WEIGHT
        if over.any():
            scale = self.WEIGHT / self.trials[over]
            self.trials[over] *= scale
            self.breaks[over] *= scale


class RequestHazard:
    """A request's own view of its key's RunHazard: the key's counts, shrunk to at most
    KEY_TRIALS trials a bucket, are the prior of what the request itself has seen, and
    every outcome goes into both. The key's hazard is learnt over its requests, and a
    request unlike the ones before it (new code after a run of copies, prose after a
    rename) would be priced by them for a long while: on the 1.5B's stdlib sessions in
    one server, drafts from 3-7-token matches priced at 0.8-0.9 by the copying turns
    before were kept about half the time in the turns that wrote new text."""

    KEY_TRIALS = 32.0  # the most trials a bucket the key's counts weigh in a request's

    def __init__(self, key: RunHazard):
        self.key = key
        self.trials = np.zeros(key.BUCKETS)
        self.breaks = np.zeros(key.BUCKETS)

    def survival(self, run: int, depths) -> np.ndarray:
        """As RunHazard.survival, from the key's prior and the request's own counts."""
        key = self.key
        shrink = np.minimum(1.0, self.KEY_TRIALS / key.trials)
        return RunHazard.going_on(key.trials * shrink + self.trials, key.breaks * shrink + self.breaks, run, depths)

    def observe(self, run: int, walked: int, deepest: int) -> None:
        """As RunHazard.observe, told to the key's hazard too."""
        self.key.observe(run, walked, deepest)
        RunHazard.count(self.trials, self.breaks, run, walked, deepest)


class RunHazards:
    """Each corpus key's RunHazard per weightless kind, carried from request to request
    (a tool loop's third turn drafts as long as its first two have earned; an Engine's
    requests without a key share one key's, None), another key's never touched: how long
    a key's drafts run is learnt from its own requests only; each request prices its
    drafts by its own view of them (request: RequestHazard). At most MAX_KEYS keys are
    kept, the least recently used dropped first."""

    MAX_KEYS = 4096

    def __init__(self):
        self._keys: "OrderedDict[Hashable, Dict[str, RunHazard]]" = OrderedDict()

    def get(self, key: Hashable, kind: str) -> RunHazard:
        kinds = self._keys.get(key)
        if kinds is None:
            kinds = self._keys[key] = {}
            if len(self._keys) > self.MAX_KEYS:
                self._keys.popitem(last=False)
        self._keys.move_to_end(key)
        return kinds.setdefault(kind, RunHazard())

    def request(self, key: Hashable, kind: str) -> RequestHazard:
        """A new request's view of the key's hazard for `kind`."""
        return RequestHazard(self.get(key, kind))


def tree_probs(tree: DraftTree, hazard: RunHazard, run: int) -> np.ndarray:
    """A suffix tree's nodes' probabilities of being kept, in best-first order: their
    paths' count over the occurrences (the scores are those log-probabilities) times the
    chance that the target goes on along the match that far (RunHazard.survival)."""
    order = tree.pick_order
    scores = np.asarray([tree.scores[i] for i in order], dtype=np.float64)
    depths = np.asarray([tree.depths[i] for i in order], dtype=np.int64)
    return np.exp(scores) * hazard.survival(run, depths)


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
