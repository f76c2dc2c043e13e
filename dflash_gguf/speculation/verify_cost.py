"""The verify cost table that `--tree-budget auto`, the weightless kinds and the suffix
tree price their steps with: the time of a verify by its row count, as a chain and as a
tree, and what depth adds to it, measured once per model file, runtime build, device and
thread count, and cached (~/.cache/dflash-gguf/verify-cost.json).

Depth: every verified row reads every cell of the context in attention, so a verify's
time grows with the depth it runs at, and faster for more rows (on a CPU, where flash
attention takes a step's rows one at a time, in proportion to them). The table holds the
verifies at SHALLOW cells of context, and what a cell of context adds to a chain of each
of a few sizes, taken as constant with depth (a row's attention reads each cell once). A
verify of n rows at depth d is priced at shallow(n) + per_cell(n) * (d - SHALLOW).

A measurement on a busy machine is not kept: each size is timed in rounds, and unless two
of them agree within NOISY (a size's floor seen twice) the table serves this process only
and the next one measures again. A slow spell that lasts a whole measurement (another guest on
the host) makes every round agree, so what depth adds is measured from points timed one
after the other, from SHALLOW up to the deep point and down again (measure_per_cell):
such a spell slows them all alike, and a robust fit of the slope lets a busy moment at one
point pass. A slope below nothing is not kept either."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from ..decoding.sampling import GREEDY
from ..runtime.demo import cache_dir
from ..runtime.native import _HERE
from ..runtime.target import LOGITS_LAST, Target

# bumped when measure_verify_cost changes what it measures
MEASURE_VERSION = 6
SHALLOW = 64  # cells of context before the table's verifies
DEEP = 2048  # ... before the depth measurement's deepest point (less where the context is shorter)
STAIRS = 4  # the depth measurement's steps from SHALLOW to its deepest point
NOISY = 1.25  # rounds' least times further apart than this: the machine was busy


def _key(target: Target, n_threads: int) -> str:
    # the model file, the runtime build that measured it, the device and threads
    st = os.stat(target.path)
    lib = os.stat(_HERE / "libdflash.so")
    raw = (f"{os.path.abspath(target.path)}|{st.st_size}|{int(st.st_mtime)}|{lib.st_size}|{int(lib.st_mtime)}|"
           f"{target.info()['device']}|{n_threads}|{MEASURE_VERSION}")
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def _filler(start: int, stop: int) -> List[int]:
    # the tokens of context positions start..stop-1 (any tokens do: a verify's cost does not read them)
    return [1 + i % 997 for i in range(start, stop)]


def _time_sizes(target: Target, sizes: List[int], tree: bool, repeats: int) -> Dict[int, float]:
    """Each size's least seconds over `repeats` verifies as decoding sees them, after two
    that build its graphs (without and with a commit to carry); each verify keeps one cell."""
    least = {}
    for n in sizes:
        tokens = list(range(2, 2 + n))
        times = []
        for _ in range(repeats + 2):
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
        least[n] = min(times[2:])
    return least


def _agreed(by_round: Dict[int, List[float]]) -> bool:
    """Whether every size's floor was seen twice: two of its rounds' least times within
    NOISY of each other. One slow round among three is a busy moment, not a busy machine
    (on a noisy two-core VM, idle otherwise, one round of three of a one-row
    verify ran 1.65x the others, and the table was measured again, two minutes, every run)."""
    def floor_twice(times):
        t = sorted(times)
        return any(b <= NOISY * a for a, b in zip(t, t[1:]))
    return all(floor_twice(t) for t in by_round.values())


def measure_verify_cost(target: Target, sizes: List[int], tree: bool, repeats: int = 3,
                        depth: int = SHALLOW, rounds: int = 2) -> Tuple[Dict[int, float], bool]:
    """Least seconds of a verify of each size as decoding sees it (the least: other
    processes on the machine only ever add to a time) after `depth` cells of context, as
    a tree (chain-shaped) or as a chain: its graph already built and the previous step's
    commit riding along, its rows greedy (a request's own sampling is timed as it runs).
    The sizes are timed in `rounds` rounds, every other one in reverse order, and one more
    where a size's rounds disagree, each size's figure its least; the second value says
    whether each size's floor was seen twice (_agreed; a busy machine's is not). One prefill serves them all (each verify keeps one
    cell, a few dozen in all); the target is reset afterwards."""
    target.set_sampling(GREEDY.native())
    target.reset()
    target.prefill(_filler(0, depth), LOGITS_LAST)
    by_round: Dict[int, List[float]] = {n: [] for n in sizes}
    for r in range(rounds + 1):
        if r == rounds and _agreed(by_round):
            break  # the extra round only where a size's rounds disagree
        for n, s in _time_sizes(target, sizes if r % 2 == 0 else sizes[::-1], tree, repeats).items():
            by_round[n].append(s)
    target.reset()
    return {n: float(min(t)) for n, t in by_round.items()}, _agreed(by_round)


def measure_per_cell(target: Target, sizes: List[int], depth: int, repeats: int = 3) -> Tuple[Dict[int, float], bool]:
    """Seconds one cell of context adds to a chain verify of each size, from one fill: the
    sizes timed at STAIRS + 1 depths evenly spaced from SHALLOW to `depth`, on the way up
    (prefilling from each to the next) and, where the target can take positions back, on
    the way down again (truncating costs nothing). A depth's two times are averaged: the
    machine's speed drifting steadily while they are timed then adds the same to every
    depth, the deepest timed once in the middle. A size's figure is the median of the
    slopes between every two depths (Theil-Sen), which one depth timed in a busy moment
    moves little. Two points 1K cells apart, where depth adds a fifth of a one-row
    verify's time, gave a slope below nothing on a noisy two-core VM in one measurement of
    three; cached, it priced every depth as shallow, and auto drafted at 8K where drafts
    lose. The second value says whether every size's slope came out above nothing (else
    the table is not kept)."""
    target.set_sampling(GREEDY.native())
    target.reset()
    down = target.can_truncate()
    stairs = [SHALLOW + round(i * (depth - SHALLOW) / STAIRS) for i in range(STAIRS + 1)]
    times: Dict[int, Dict[int, List[float]]] = {n: {c: [] for c in stairs} for n in sizes}  # by size, by depth

    def time_at(cells: int) -> None:
        for n, s in _time_sizes(target, sizes, False, repeats).items():
            times[n][cells].append(s)

    for cells in stairs:
        target.prefill(_filler(target.info()["n_past"], cells), LOGITS_LAST)
        time_at(cells)
    if down:
        for cells in stairs[-2::-1]:
            target.seq_truncate(0, cells)
            time_at(cells)
    target.reset()
    per = {n: _theil_sen([(c, float(np.mean(t))) for c, t in by_depth.items()]) for n, by_depth in times.items()}
    return per, all(v > 0 for v in per.values())


def _theil_sen(points: List[Tuple[int, float]]) -> float:
    """The median of the slopes between every two points."""
    return float(np.median([(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(points, 2)]))


def deep_point(target: Target, max_n: int) -> int:
    """The depth of the depth measurement: DEEP, or as deep as the context holds with room
    for the largest verify and the cells the timed verifies keep (0: too short a context
    to tell depth from noise)."""
    d = min(DEEP, target.n_ctx - max_n - SHALLOW)
    return d if d >= 4 * SHALLOW else 0


class CostTable:
    """Verify time as a function of node count and depth, interpolated from a table:
    cost(n, depth) for a tree, cost.chain(n, depth) for a chain. sizes: the row counts
    timed at SHALLOW cells of context; depth_rows and per_cell: what one more cell of
    context adds to a verify of those rows."""

    def __init__(self, key: str, sizes, tree_seconds, chain_seconds, depth_rows=(1,), per_cell=(0.0,)):
        self.key = key
        self.sizes = np.asarray(sizes, dtype=float)
        self.tree_seconds = np.asarray(tree_seconds, dtype=float)
        self.chain_seconds = np.asarray(chain_seconds, dtype=float)
        self.depth_rows = np.asarray(depth_rows, dtype=float)
        self.per_cell = np.asarray(per_cell, dtype=float)

    def record(self) -> dict:
        """The table as a results file keeps it (from_record reads it back)."""
        return {"key": self.key, "rows": self.sizes.tolist(), "chain": self.chain_seconds.tolist(),
                "tree": self.tree_seconds.tolist(), "depth_rows": self.depth_rows.tolist(),
                "per_cell": self.per_cell.tolist(), "shallow": SHALLOW}

    @classmethod
    def from_record(cls, rec: dict) -> "CostTable":
        """A table as an earlier results file recorded it (one from before depth was
        priced prices every depth as shallow)."""
        return cls(rec["key"], rec["rows"], rec["tree"], rec["chain"], rec.get("depth_rows", (1,)),
                   rec.get("per_cell", (0.0,)))

    def extra(self, rows, depth) -> np.ndarray:
        """What `depth` cells of context add to a verify of `rows` rows over the table's."""
        cells = np.maximum(np.asarray(depth, dtype=float) - SHALLOW, 0.0)
        return np.interp(rows, self.depth_rows, self.per_cell) * cells

    def __call__(self, n_nodes, depth: int = 0) -> np.ndarray:
        return np.interp(n_nodes, self.sizes, self.tree_seconds) + self.extra(n_nodes, depth)

    def chain(self, n_tokens, depth: int = 0) -> np.ndarray:
        return np.interp(n_tokens, self.sizes, self.chain_seconds) + self.extra(n_tokens, depth)


def per_cell(deep: dict) -> tuple:
    """The depth measurement's row counts and the seconds one cell of context adds to a
    verify of each (never below nothing, nor below a smaller verify's: noise, where depth
    adds little)."""
    if not deep or "per_cell" not in deep:
        return (1.0,), (0.0,)
    rows = sorted(int(n) for n in deep["per_cell"])
    per = np.maximum.accumulate(np.maximum([deep["per_cell"][str(n)] for n in rows], 0.0))
    return rows, per.tolist()


class VerifyCost(CostTable):
    """The target's CostTable, measured once per model file, runtime build, device and
    threads and cached; what a cached entry lacks (a longer verify, the depth) is
    measured and added."""

    def __init__(self, target: Target, n_threads: int = 0, cache: Path | None = None):
        max_n = target.n_verify
        # 12 and 24: on a CPU a step's rows share weight tiles in groups (16 rows for ggml's
        # x86 Q4_K gemm), so time is not linear between the powers of two
        sizes = sorted({1, 2, 4, 8, 12, 16, 24, 32, 64, max_n} & set(range(1, max_n + 1)))
        path = cache or (cache_dir() / "verify-cost.json")
        key = _key(target, n_threads)  # the model file, runtime build, device and threads
        table = json.loads(path.read_text()) if path.exists() else {}
        entry = table.get(key)
        entry = entry if isinstance(entry, dict) else {}
        # engines of one model verify up to different row counts (a chain drafter's block,
        # an n-gram kind's longest draft): each measures only the sizes the entry lacks and
        # adds them, instead of measuring all again and dropping the others' sizes
        missing, agreed = False, True
        for kind in ("tree", "chain"):
            have = entry[kind] = dict(entry.get(kind) or {})
            new = [n for n in sizes if str(n) not in have]
            if new:
                missing = True
                got, ok = measure_verify_cost(target, new, kind == "tree")
                have.update({str(k): v for k, v in got.items()})
                agreed &= ok
        # the depth measurement: chains of one row, a middle size and the largest
        deep_sizes = sorted({1, min(8, max_n), max_n})
        deep = entry.get("deep") if isinstance(entry.get("deep"), dict) else {}
        depth = deep_point(target, max_n)
        if depth and (deep.get("depth") != depth or any(str(n) not in deep.get("per_cell", {}) for n in deep_sizes)):
            missing = True
            print(f"[verify-cost] timing verifies from {SHALLOW} to {depth} cells of context (once per model, "
                  "build, device and threads)", file=sys.stderr, flush=True)
            got, ok = measure_per_cell(target, deep_sizes, depth)
            deep = entry["deep"] = {"depth": depth, "per_cell": {str(n): v for n, v in got.items()}}
            agreed &= ok
        if missing and agreed:
            table[key] = entry
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)  # another process reads a whole table or the one before
        elif missing:
            print("[verify-cost] the machine was busy while timing (its rounds disagreed, or depth came out adding "
                  "nothing): the table serves this run only", file=sys.stderr, flush=True)
        chain = np.array([entry["chain"][str(k)] for k in sizes])
        super().__init__(key, sizes, [entry["tree"][str(k)] for k in sizes], chain, *per_cell(deep))
