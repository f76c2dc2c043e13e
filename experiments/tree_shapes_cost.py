#!/usr/bin/env python3
"""What a tree verify costs against a chain verify of the same rows, by depth (issue 86
item 3): the cost table prices a tree of n nodes as a chain-shaped tree of n nodes, and
what depth adds from chains. This times, on one target at each depth, four passes of n
rows and their choices: a chain verify, and tree verifies shaped as a chain, as a binary
tree and as a root with n - 1 children, each followed by its commit (a pass keeps one
cell, the next pass settles it, and the cells are dropped again so that each sample sees
the same depth). The least of --reps samples after two that build the graphs.

    .venv/bin/python experiments/tree_shapes_cost.py [-m MODEL.gguf] [--depths 64,2048,4096] \\
        [--sizes 4,8,16] [--reps 5] [-t 2] [--out results/tree-shapes-cost-DATE.json]
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from depth_map import fill_to  # noqa: E402

from dflash_gguf.bench import method, provenance  # noqa: E402
from dflash_gguf.decoding.sampling import GREEDY  # noqa: E402
from dflash_gguf.runtime.target import Target, TargetConfig  # noqa: E402
from dflash_gguf.tools import real_models  # noqa: E402

SHAPES = {
    "chain-shaped tree": lambda n: list(range(-1, n - 1)),
    "binary tree": lambda n: [-1] + [(i - 1) // 2 for i in range(1, n)],
    "root and siblings": lambda n: [-1] + [0] * (n - 1),
}


def least(step: Callable[[], None], settle: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        settle()
    return min(times[2:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="the GGUF (default: the published Qwen2.5-Coder 1.5B Q4_K_M)")
    ap.add_argument("--depths", default="64,2048,4096")
    ap.add_argument("--sizes", default="4,8,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    depths = sorted({int(d) for d in a.depths.split(",")})
    sizes = sorted({int(s) for s in a.sizes.split(",")})
    model = a.model or str(real_models.path("qwen2.5-coder-1.5b"))
    # room for the cells a settled commit can leave before the next truncation
    target = Target(model, TargetConfig(n_threads=a.threads, n_verify=max(sizes),
                                        n_ctx=max(depths) + max(sizes) + 1024))
    target.set_sampling(GREEDY.native())
    started = dt.datetime.now(dt.timezone.utc)
    rows: List[Dict] = []
    for depth in depths:
        fill_to(target, depth)
        here = target.n_past

        def back() -> None:  # settle the commit, then drop the cells again
            target.decode([3])
            if target.can_truncate():
                target.seq_truncate(0, here)

        for n in sizes:
            tokens = [2 + i for i in range(n)]
            row = {"depth": depth, "rows": n, "load_1m": method.load_1m(),
                   "chain_ms": 1e3 * least(lambda: (target.verify(tokens), target.choices(0, n)),
                                                  lambda: (target.commit(1), back()), a.reps)}
            for name, parents in SHAPES.items():
                p = parents(n)
                row[f"{name}_ms"] = 1e3 * least(lambda: (target.verify_tree(tokens, p), target.choices(0, n)),
                                                lambda: (target.commit_path([0]), back()), a.reps)
            row["threads_in_use"] = target.info()["n_threads_in_use"]  # the governor's, after the samples
            rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            print(" ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    out = a.out or Path("results") / f"tree-shapes-cost-{Path(model).stem}-{started:%Y-%m-%d}.json"
    provenance.write_results(out, provenance.results_doc(
        "experiments/tree_shapes_cost.py", sys.argv[1:] if argv is None else argv,
        started=started.isoformat(timespec="seconds"),
        finished=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine=provenance.machine(a.threads, target.info()["device"]), versions=provenance.versions(),
        settings={"model": model, "depths": depths, "sizes": sizes, "reps": a.reps, "threads": a.threads},
        table=rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
