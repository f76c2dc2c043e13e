"""`--tree-budget auto`: choose, at every step, the tree size that maximises expected
tokens per second.

Two ingredients: how long a verify of n nodes takes on this machine and model (measured
once, cached per model file, device and thread count), and how many tokens a tree of
b nodes is expected to yield (from the drafter's own probabilities along the best-first
order, DraftTree.expected_accepted). The step's choice is
    argmax_b  expected_accepted[b] / (draft_time + verify_time(b + 1)).
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


def _key(target: Target, n_threads: int) -> str:
    # the model file, the runtime build that measured it, the device and threads
    st = os.stat(target.path)
    lib = os.stat(_HERE / "libdflash.so")
    raw = (f"{os.path.abspath(target.path)}|{st.st_size}|{int(st.st_mtime)}|{lib.st_size}|{int(lib.st_mtime)}|"
           f"{target.info()['device']}|{n_threads}")
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def measure_verify_cost(target: Target, sizes: List[int], repeats: int = 3) -> Dict[int, float]:
    """Median seconds of a chain-shaped tree verify of each size after a short context
    (the target is reset afterwards)."""
    cost = {}
    prompt = list(range(1, 65))
    for n in sizes:
        times = []
        for _ in range(repeats + 1):
            target.reset()
            target.prefill(prompt, LOGITS_LAST)
            t0 = time.perf_counter()
            target.verify_tree(list(range(2, 2 + n)), list(range(-1, n - 1)))
            target.argmax(0, n)
            times.append(time.perf_counter() - t0)
            target.commit_path([0])
        cost[n] = float(np.median(times[1:]))  # the first run warms caches
    target.reset()
    return cost


class VerifyCost:
    """Verify time as a function of node count, interpolated from a cached measurement."""

    def __init__(self, target: Target, n_threads: int = 0, cache: Path | None = None):
        max_n = target.n_verify
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_n} & set(range(1, max_n + 1)))
        path = cache or (cache_dir() / "verify-cost.json")
        key = _key(target, n_threads)
        table = json.loads(path.read_text()) if path.exists() else {}
        entry = table.get(key)
        if entry is None or sorted(int(k) for k in entry) != sizes:
            entry = {str(k): v for k, v in measure_verify_cost(target, sizes).items()}
            table[key] = entry
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1))
        self.sizes = np.array(sorted(int(k) for k in entry), dtype=float)
        self.seconds = np.array([entry[str(int(k))] for k in self.sizes])

    def __call__(self, n_nodes) -> np.ndarray:
        return np.interp(n_nodes, self.sizes, self.seconds)


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


def choose_budget(expected: np.ndarray, cost: VerifyCost, draft_seconds: float,
                  calibration: AcceptanceCalibration | None = None) -> int:
    """The budget b (0..len(expected)-1 nodes besides the root) with the best expected
    tokens per second; expected[b] counts the target's own token (1) plus drafts."""
    ratio = calibration.ratio if calibration is not None else 1.0
    b = np.arange(len(expected))
    rate = (1.0 + ratio * (expected - 1.0)) / (draft_seconds + cost(b + 1))
    return int(np.argmax(rate))
