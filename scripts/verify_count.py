#!/usr/bin/env python3
"""The target's verify step, counted: graph nodes, wall time and (under callgrind)
instructions of a chain verify of n tokens against tree verifies of n nodes, each verify
carrying the previous step's commit as decoding does.

    .venv/bin/python scripts/verify_count.py TARGET.gguf --n 4,8,16,32
    valgrind --tool=callgrind --callgrind-out-file=/tmp/vc.%p \\
        .venv/bin/python scripts/verify_count.py TARGET.gguf --n 16 --reps 3 --threads 1 --dumps > /tmp/vc.log
    .venv/bin/python scripts/verify_count.py --callgrind /tmp/vc.<pid> --log /tmp/vc.log

Wall times on a shared machine are noise (the load average is printed); with one thread
the graph runs on the calling thread, whose CPU time (cpu_ms) a loaded machine disturbs
less; instruction counts with one thread are repeatable (but count a large memcpy's
`rep movsb` once per byte, so they overweight big copies). With --dumps the run asks callgrind (through
callgrind_control) for a dump before and after each verify call (the verify and the
argmax read of its rows: the commit carried from the previous step runs inside it);
--callgrind reads the dumps back in the order of the run's @dump lines and reports the
median instructions per (shape, n) over the timed reps (the warm-up verifies, which
build graphs, are left out).

Shapes (every tree has exactly n nodes):
  chain    dfl_target_verify of n tokens (the chain verify)
  line     the same n tokens as a chain-shaped tree
  ddtree   the best-first tree of a confident drafter (top-4 candidates per depth with
           probabilities 0.6, 0.2, 0.1, 0.05; depth at most 15): a spine with branches
  bushy    the best-first tree of an unsure drafter (0.3, 0.25, 0.2, 0.15)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ar import typical  # noqa: E402  (scripts/bench_ar.py: the lower quartile of rep times)

SHAPES = ("chain", "line", "ddtree", "bushy")
PROFILES = {"ddtree": (0.6, 0.2, 0.1, 0.05), "bushy": (0.3, 0.25, 0.2, 0.15)}


def tree_parents(shape: str, n: int) -> list[int]:
    import numpy as np

    from dflash_gguf.ddtree import build_tree

    if shape == "line":
        return list(range(-1, n - 1))
    depth = 15
    lp = np.log(np.tile(np.array(PROFILES[shape]), (depth, 1)))
    cand = np.arange(depth * 4).reshape(depth, 4) + 10
    tree = build_tree(1, cand, lp, n - 1, max_depth=depth)
    assert len(tree) == n, (shape, n, len(tree))
    return list(tree.parents)


def paths_and_depth(parents: list[int]) -> tuple[int, int]:
    inner = set(p for p in parents if p >= 0)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return sum(1 for i in range(len(parents)) if i not in inner), max(depth) + 1


def dump(args, label: str) -> None:
    """A callgrind dump of everything since the previous one, labelled in the log."""
    if args.dumps:
        subprocess.run(["callgrind_control", "-d", str(os.getpid())], check=True, capture_output=True)
        print(f"@dump {label}", flush=True)


def run(args) -> None:
    from dflash_gguf.target import LOGITS_LAST, Target, TargetConfig

    ns = [int(x) for x in args.n.split(",")]
    shapes = args.shapes.split(",")
    # every (shape, n) starts from the same context and stays in one 256-row attention span
    steps = args.warmup + args.reps
    config = TargetConfig(n_ctx=args.prompt + 2 * steps + max(ns) + 256, n_ubatch=64, n_verify=max(ns),
                          n_threads=args.threads, kv_type="f16")
    # one target per shape, the shapes taking turns rep by rep: a machine that slows down
    # for a while slows every shape alike (and no shape's graphs are evicted by another's)
    targets = {shape: Target(args.gguf, config) for shape in shapes}
    rng_tokens = [10 + (7 * i) % 900 for i in range(64)]
    prompt = [(13 * i) % 900 + 5 for i in range(args.prompt)]
    first = next(iter(targets.values()))
    print(f"# load average {os.getloadavg()[0]:.2f}; threads {first.info()['n_threads']}", flush=True)
    for n in ns:
        parents = {shape: None if shape == "chain" else tree_parents(shape, n) for shape in shapes}
        tokens = rng_tokens[:n]
        walls = {shape: [] for shape in shapes}
        cpus = {shape: [] for shape in shapes}
        nodes, b0 = {}, {}
        for shape, t in targets.items():
            t.reset()
            t.prefill(prompt, LOGITS_LAST)
        for rep in range(steps):
            timed = rep >= args.warmup
            for shape, t in targets.items():
                if rep == args.warmup:
                    b0[shape] = t.info()["n_graph_builds"]
                dump(args, "pre")
                t0, c0 = time.perf_counter(), time.thread_time()
                if parents[shape] is None:
                    t.verify(tokens)
                else:
                    t.verify_tree(tokens, parents[shape])
                t.choices(0, n)
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                dump(args, f"verify {shape} {n} {'timed' if timed else 'warmup'}")
                if timed:
                    walls[shape].append(wall)
                    cpus[shape].append(cpu)
                nodes[shape] = t.info()["n_last_nodes"]
                # keep the root and one child: every verify carries a commit of the same size
                if parents[shape] is None:
                    t.commit(2 if n > 1 else 1)
                else:
                    child = parents[shape].index(0) if 0 in parents[shape] else None
                    t.commit_path([0] if child is None else [0, child])
        for shape, t in targets.items():
            pd = paths_and_depth(parents[shape]) if parents[shape] else (1, n)
            row = {"shape": shape, "n": n, "nodes": nodes[shape], "paths": pd[0], "depth": pd[1],
                   "wall_ms": 1000 * typical(walls[shape]), "cpu_ms": 1000 * typical(cpus[shape]),
                   "timed_builds": t.info()["n_graph_builds"] - b0.get(shape, t.info()["n_graph_builds"])}
            print("@row " + json.dumps(row), flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f}", flush=True)


def read_dumps(prefix: str, log: str) -> None:
    """Per-verify instruction counts from callgrind's numbered dumps, labelled by the
    @dump lines of the run's output (the same order)."""
    files = sorted(Path(prefix).parent.glob(Path(prefix).name + ".*"),
                   key=lambda p: int(p.name.rsplit(".", 1)[1]) if p.name.rsplit(".", 1)[1].isdigit() else -1)
    counts = []
    for f in files:
        if not f.name.rsplit(".", 1)[1].isdigit():
            continue
        m = re.search(r"^(?:summary|totals): (\d+)", f.read_text(errors="replace"), re.M)
        counts.append(int(m.group(1)) if m else 0)
    labels = [ln.split()[1:] for ln in Path(log).read_text().splitlines() if ln.startswith("@dump")]
    if len(labels) > len(counts):
        print(f"warning: {len(labels)} dump labels but {len(counts)} dumps", file=sys.stderr)
    by = {}
    for label, c in zip(labels, counts):
        if label[0] == "verify" and label[3] == "timed":
            by.setdefault((label[1], label[2]), []).append(c)
    print("| shape | n | instructions per verify (median) | reps |")
    print("|---|---:|---:|---:|")
    for (shape, n), cs in by.items():
        print(f"| {shape} | {n} | {statistics.median(cs) / 1e6:.2f} M | {len(cs)} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", nargs="?", help="target GGUF")
    p.add_argument("--n", default="4,8,16,32", help="node / token counts (default 4,8,16,32)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)} (default all)")
    p.add_argument("--reps", type=int, default=5, help="timed verifies per (shape, n) (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed verifies first (graph builds; default 2)")
    p.add_argument("--prompt", type=int, default=64, help="context before the verifies (default 64)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: all the process may use)")
    p.add_argument("--dumps", action="store_true", help="ask callgrind for a dump around every verify")
    p.add_argument("--callgrind", help="read callgrind dumps with this prefix instead of running")
    p.add_argument("--log", help="with --callgrind: the run's stdout (its @dump lines label the dumps)")
    args = p.parse_args(argv)
    if args.callgrind:
        if not args.log:
            p.error("--callgrind needs --log")
        read_dumps(args.callgrind, args.log)
        return 0
    if not args.gguf:
        p.error("a target GGUF is needed")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
