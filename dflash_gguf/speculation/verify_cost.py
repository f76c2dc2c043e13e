"""The verify cost table `--tree-budget auto` prices its arms with: the time of a verify
by its row count, as a chain and as a tree, measured once per model file, runtime build,
device and thread count, and cached (~/.cache/dflash-gguf/verify-cost.json)."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from ..decoding.sampling import GREEDY
from ..runtime.demo import cache_dir
from ..runtime.native import _HERE
from ..runtime.target import LOGITS_LAST, Target

# bumped when measure_verify_cost changes what it measures
MEASURE_VERSION = 3


def _key(target: Target, n_threads: int) -> str:
    # the model file, the runtime build that measured it, the device and threads
    st = os.stat(target.path)
    lib = os.stat(_HERE / "libdflash.so")
    raw = (f"{os.path.abspath(target.path)}|{st.st_size}|{int(st.st_mtime)}|{lib.st_size}|{int(lib.st_mtime)}|"
           f"{target.info()['device']}|{n_threads}|{MEASURE_VERSION}")
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def measure_verify_cost(target: Target, sizes: List[int], tree: bool, repeats: int = 5) -> Dict[int, float]:
    """Least seconds of a verify of each size as decoding sees it (the least: other
    processes on the machine only ever add to a time), as a tree
    (chain-shaped) or as a chain: its graph already built and the previous step's commit
    riding along, its rows greedy (a request's own sampling is timed as it runs). The
    target is reset afterwards."""
    target.set_sampling(GREEDY.native())
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
            target.choices(0, n)
            times.append(time.perf_counter() - t0)
            if tree:
                target.commit_path([0])
            else:
                target.commit(1)
        cost[n] = float(min(times[2:]))
    target.reset()
    return cost


class VerifyCost:
    """Verify time as a function of node count, interpolated from a cached measurement:
    cost(n) for a tree, cost.chain(n) for a chain."""

    def __init__(self, target: Target, n_threads: int = 0, cache: Path | None = None):
        max_n = target.n_verify
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_n} & set(range(1, max_n + 1)))
        path = cache or (cache_dir() / "verify-cost.json")
        self.key = key = _key(target, n_threads)  # the model file, runtime build, device and threads
        table = json.loads(path.read_text()) if path.exists() else {}
        entry = table.get(key)
        entry = entry if isinstance(entry, dict) else {}
        # engines of one model verify up to different row counts (a chain drafter's block,
        # an n-gram kind's longest draft): each measures only the sizes the entry lacks and
        # adds them, instead of measuring all again and dropping the others' sizes
        missing = False
        for kind in ("tree", "chain"):
            have = entry[kind] = dict(entry.get(kind) or {})
            new = [n for n in sizes if str(n) not in have]
            if new:
                missing = True
                have.update({str(k): v for k, v in measure_verify_cost(target, new, kind == "tree").items()})
        if missing:
            table[key] = entry
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)  # another process reads a whole table or the one before
        self.sizes = np.array(sizes, dtype=float)
        self.tree_seconds = np.array([entry["tree"][str(k)] for k in sizes])
        self.chain_seconds = np.array([entry["chain"][str(k)] for k in sizes])

    def __call__(self, n_nodes) -> np.ndarray:
        return np.interp(n_nodes, self.sizes, self.tree_seconds)

    def chain(self, n_tokens) -> np.ndarray:
        return np.interp(n_tokens, self.sizes, self.chain_seconds)
