"""`--tree-budget auto`: choose, at every step, the tree size that maximises expected
tokens per second.

Two ingredients: how long a verify of n nodes takes on this machine and model (measured
once, cached per model file, runtime build, device and thread count), and how many
tokens a tree of b nodes is expected to yield (from the drafter's own probabilities
along the best-first order, DraftTree.expected_accepted). The step's choice is
    argmax_b  expected_accepted[b] / (draft_time + verify_time(b + 1)),
and the plain chain of the drafter's top choices competes with it at the chain verify's
own (lower) cost, so `auto` is never expected to be slower than the chain.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from ._native import _HERE
from .demo import cache_dir
from .target import LOGITS_LAST, Target


# bumped when measure_verify_cost changes what it measures
MEASURE_VERSION = 2


def _key(target: Target, n_threads: int) -> str:
    # the model file, the runtime build that measured it, the device and threads
    st = os.stat(target.path)
    lib = os.stat(_HERE / "libdflash.so")
    raw = (f"{os.path.abspath(target.path)}|{st.st_size}|{int(st.st_mtime)}|{lib.st_size}|{int(lib.st_mtime)}|"
           f"{target.info()['device']}|{n_threads}|{MEASURE_VERSION}")
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def measure_verify_cost(target: Target, sizes: List[int], tree: bool, repeats: int = 3) -> Dict[int, float]:
    """Median seconds of a verify of each size as decoding sees it, as a tree
    (chain-shaped) or as a chain: its graph already built and the previous step's commit
    riding along. The target is reset afterwards."""
    cost = {}
    for n in sizes:
        target.reset()
        target.prefill(list(range(1, 65)), LOGITS_LAST)
        tokens = list(range(2, 2 + n))
        times = []
        for _ in range(repeats + 2):  # the first two build the graphs, without and with a commit to carry
            t0 = time.perf_counter()
            if tree:
                target.verify_tree(tokens, list(range(-1, n - 1)))
            else:
                target.verify(tokens)
            target.argmax(0, n)
            times.append(time.perf_counter() - t0)
            if tree:
                target.commit_path([0])
            else:
                target.commit(1)
        cost[n] = float(np.median(times[2:]))
    target.reset()
    return cost


class VerifyCost:
    """Verify time as a function of node count, interpolated from a cached measurement:
    cost(n) for a tree, cost.chain(n) for a chain."""

    def __init__(self, target: Target, n_threads: int = 0, cache: Path | None = None):
        max_n = target.n_verify
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_n} & set(range(1, max_n + 1)))
        path = cache or (cache_dir() / "verify-cost.json")
        key = _key(target, n_threads)
        table = json.loads(path.read_text()) if path.exists() else {}
        entry = table.get(key)
        if not (isinstance(entry, dict) and all(sorted(int(k) for k in entry.get(kind, {})) == sizes
                                                for kind in ("tree", "chain"))):
            entry = {kind: {str(k): v for k, v in measure_verify_cost(target, sizes, kind == "tree").items()}
                     for kind in ("tree", "chain")}
            table[key] = entry
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1))
        self.sizes = np.array(sizes, dtype=float)
        self.tree_seconds = np.array([entry["tree"][str(k)] for k in sizes])
        self.chain_seconds = np.array([entry["chain"][str(k)] for k in sizes])

    def __call__(self, n_nodes) -> np.ndarray:
        return np.interp(n_nodes, self.sizes, self.tree_seconds)

    def chain(self, n_tokens) -> np.ndarray:
        return np.interp(n_tokens, self.sizes, self.chain_seconds)


class AcceptanceCalibration:
    """The drafter's probabilities are not the target's: the running ratio of accepted
    drafted tokens to the drafter's expectation for the trees actually verified scales
    the expectation of every candidate size."""

    def __init__(self, smoothing: float = 0.1):
        self.ratio = 1.0
        self.smoothing = smoothing

    def update(self, expected_drafts: float, accepted_drafts: int) -> None:
        if expected_drafts > 1e-6:
            observed = accepted_drafts / expected_drafts
            self.ratio += self.smoothing * (min(observed, 4.0) - self.ratio)


def _rate(expected, seconds, calibration: AcceptanceCalibration | None):
    ratio = calibration.ratio if calibration is not None else 1.0
    return (1.0 + ratio * (np.asarray(expected) - 1.0)) / seconds


def budget_sizes(largest: int) -> List[int]:
    """The tree sizes `auto` chooses among, up to `largest`: a few sizes, so that the
    verify graphs of consecutive steps mostly share their shape."""
    return sorted({b for b in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48) if b < largest} | {largest})


def choose_budget(expected: np.ndarray, cost: VerifyCost, draft_seconds: float,
                  calibration: AcceptanceCalibration | None = None, sizes: List[int] | None = None) -> int:
    """The budget b (nodes besides the root; any of `sizes`, default 0..len(expected)-1)
    with the best expected tokens per second. expected[b] counts the target's own token
    (1) plus drafts; a budget past the tree's own size is the whole tree, padded."""
    b = np.arange(len(expected)) if sizes is None else np.asarray(sizes)
    gain = np.asarray(expected)[np.minimum(b, len(expected) - 1)]
    return int(b[np.argmax(_rate(gain, draft_seconds + cost(b + 1), calibration))])


def chain_expected(top1_logprobs) -> float:
    """Expected tokens of a pass verifying the chain of the drafter's top choices: the
    target's own token plus each prefix's probability of being all right."""
    return 1.0 + float(np.exp(np.cumsum(top1_logprobs)).sum())


def chain_beats_tree(chain_exp: float, n_chain: int, tree_exp: float, n_tree: int, cost: VerifyCost,
                     draft_seconds: float, calibration: AcceptanceCalibration | None = None) -> bool:
    """Whether verifying the chain (n_chain tokens) promises more tokens per second than
    the chosen tree (n_tree nodes)."""
    chain = _rate(chain_exp, draft_seconds + cost.chain(n_chain), calibration)
    tree = _rate(tree_exp, draft_seconds + cost(n_tree), calibration)
    return bool(chain > tree)
