#!/usr/bin/env python3
"""The depth map (issue 86 item 1): what a verify of k rows costs as the context grows, in
three ways on one GGUF with the same threads:

- ours: a chain verify of k rows and their choices as decoding runs it (its graphs built,
  the output head on every row, since every verified row chooses a token), at D tokens of
  context (the target prefilled once to each depth in turn, the verify's rows dropped
  again after each pass so that every sample sees exactly D cells);
- ours, last row's head: a pass of the same k rows with the output head on the last row
  only, what llama-bench's pp k computes: the difference from ours is what every
  verified row's head costs, the rest is the step itself against llama.cpp's;
- llama.cpp, patched: llama-bench -p k -n 0 -d D -fa 1 over the same patched ggml our
  runtime runs on (llama_cpp_tree's build: the same batch-invariant kernels, one row of
  flash attention at a time for steps of up to 256 rows; its output head on the last row
  only);
- llama.cpp, stock: the same llama-bench built over stock ggml (--stock): ggml's own
  kernels, the tiled flash attention for 8 rows and more.

Per depth the arms take turns: half of ours' repetitions, the patched llama-bench, the
stock llama-bench, the other half of ours' (llama-bench fills its depth once a run and
restores it between repetitions). Within a repetition ours takes the least of --steps
samples; llama-bench's repetitions are one sample each. Each figure is the median over
repetitions with its spread (min-max); the ratios are of medians.

    .venv/bin/python experiments/depth_map.py --stock STOCK/bin/llama-bench \\
        [-m MODEL.gguf] [--depths 0,2048,8192,16384] [--sizes 1,2,4,8,16,32,64] [-r 4] [-t 2] \\
        [--no-patched] [--out results/depth-map-MODEL-DATE.json]
    .venv/bin/python experiments/depth_map.py --plot results/depth-map-....json docs/depth-map.png

(--plot needs matplotlib: .venv/bin/python -m pip install matplotlib.)

Run it on an idle machine: ggml's threads spin, and a busy core slows every arm unevenly.
The results file is written after each depth (its settings' depths_done say which), so
that a run stopped in a long fill (32K: about half an hour an arm on two cores) keeps the
depths it finished.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from dflash_gguf.bench import llama_cpp, method, provenance
from dflash_gguf.decoding.sampling import GREEDY
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
from dflash_gguf.tools import llama_cpp_tree, real_models

ARMS = ("ours", "ours, last row's head", "llama.cpp patched", "llama.cpp stock")


def fill_to(target: Target, depth: int) -> float:
    """Prefill the target up to `depth` cells (from where it is); seconds taken. The
    tokens are arbitrary ids, as llama-bench's are random: a pass's cost does not depend
    on them."""
    have = target.n_past
    tokens = [1 + (i * 7919) % (target.n_vocab - 1) for i in range(have, depth)]
    t0 = time.perf_counter()
    if tokens:
        target.prefill(tokens, LOGITS_LAST)
    return time.perf_counter() - t0


def our_verify(target: Target, k: int, steps: int, truncate: bool) -> float:
    """Least seconds of a chain verify of k rows with their choices at the target's depth,
    over `steps` samples after two that build the graphs; truncate: the depth is the same
    after (a model with recurrent layers cannot go back: each sample then adds a cell)."""
    depth = target.n_past
    tokens = [2 + i for i in range(k)]
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        target.verify(tokens)
        target.choices(0, k)
        times.append(time.perf_counter() - t0)
        target.commit(1)
        if truncate:  # a commit is settled by the next pass: then the cells can go
            target.decode([3])
            target.seq_truncate(0, depth)
    return min(times[2:])


def our_pass(target: Target, k: int, steps: int, truncate: bool) -> float:
    """Least seconds of a pass of k rows at the target's depth with the output head on
    the last row only (llama-bench's pp k), as our_verify samples it."""
    depth = target.n_past
    tokens = [2 + i for i in range(k)]
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        target.prefill(tokens, LOGITS_LAST)
        times.append(time.perf_counter() - t0)
        if truncate:
            target.seq_truncate(0, depth)
    return min(times[2:])


def llama_bench(exe: str, model: str, threads: int, reps: int, sizes: List[int], depth: int) -> Dict[int, List[float]]:
    """llama-bench's seconds for a pass of each size at `depth`, one per repetition."""
    cmd = [exe, "-m", model, "-p", ",".join(map(str, sizes)), "-n", "0", "-d", str(depth), "-r", str(reps),
           "-t", str(threads), "-fa", "1", "-o", "json"]
    stdout, _ = llama_cpp.run_tool(cmd, timeout=4 * 3600)
    return {int(t["n_prompt"]): [ns / 1e9 for ns in t["samples_ns"]] for t in json.loads(stdout)}


def spread(xs: List[float]) -> dict:
    return {"median_ms": round(statistics.median(xs) * 1e3, 3), "min_ms": round(min(xs) * 1e3, 3),
            "max_ms": round(max(xs) * 1e3, 3), "n": len(xs)}


def plot(results: Path, image: Path) -> None:
    """A results file's map as a picture: per depth, each arm's verify time by rows, the
    time of a one-row decode at no depth as the unit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = json.loads(results.read_text())["table"]
    depths = sorted({r["depth"] for r in table})
    unit = next(r["ours"]["median_ms"] for r in table if r["depth"] == depths[0] and r["rows"] == 1)
    fig, axes = plt.subplots(1, len(depths), figsize=(3.2 * len(depths), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, depth in zip(axes, depths):
        rows = [r for r in table if r["depth"] == depth]
        for arm, style in zip(ARMS, ("o-", "x-", "s--", "^:")):
            got = [(r["rows"], r[arm]["median_ms"] / unit) for r in rows if arm in r]
            if got:
                ax.plot(*zip(*got), style, label=arm, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_title(f"depth {depth}" if depth else "no depth")
        ax.set_xlabel("rows verified")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("time / one-row decode at no depth")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(image, dpi=110)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--plot"]:
        plot(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="the GGUF (default: the published Qwen2.5-Coder 1.5B Q4_K_M)")
    ap.add_argument("--stock", help="llama-bench built over stock ggml (without it: no stock arm)")
    ap.add_argument("--patched", help="llama-bench over the patched ggml (default: llama_cpp_build.py's)")
    ap.add_argument("--no-patched", action="store_true",
                    help="no patched llama-bench arm (a 32K run: each llama-bench fill takes about half an hour)")
    ap.add_argument("--depths", default="0,2048,8192,16384")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("-r", "--repetitions", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="samples of ours in a repetition (the least kept)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    depths = sorted({int(d) for d in a.depths.split(",")})
    sizes = sorted({int(s) for s in a.sizes.split(",")})
    model = a.model or str(real_models.path("qwen2.5-coder-1.5b"))
    patched = None if a.no_patched else a.patched or str(llama_cpp_tree.tool("llama-bench") or "")
    if patched == "":
        ap.error("no patched llama-bench: .venv/bin/python scripts/llama_cpp_build.py llama-bench builds it")
    benches = {**({"llama.cpp patched": patched} if patched else {}),
               **({"llama.cpp stock": a.stock} if a.stock else {})}
    # a target that cannot drop cells (recurrent layers) keeps each sample's: a verify's
    # one, a pass's k, so its context has room for all of them
    kept = a.repetitions * (a.steps + 2) * sum(sizes)
    target = Target(model, TargetConfig(n_threads=a.threads, n_verify=max(sizes),
                                        n_ctx=max(depths) + max(sizes) + 16 + kept))
    target.set_sampling(GREEDY.native())
    truncate = target.can_truncate()
    started = dt.datetime.now(dt.timezone.utc)
    records: List[dict] = []
    fills = {}

    def ours(rep: int, depth: int) -> None:
        for k in sizes:
            load = method.load_1m()
            s = our_verify(target, k, a.steps, truncate)
            records.append({"arm": "ours", "depth": depth, "rows": k, "rep": rep, "seconds": s, "load_1m": load,
                            "threads_in_use": target.info()["n_threads_in_use"]})
            s = our_pass(target, k, a.steps, truncate)
            records.append({"arm": "ours, last row's head", "depth": depth, "rows": k, "rep": rep, "seconds": s,
                            "load_1m": method.load_1m(), "threads_in_use": target.info()["n_threads_in_use"]})
        print(f"[depth-map] d{depth} ours rep {rep + 1}: "
              + " ".join(f"{r['rows']}:{r['seconds'] * 1e3:.0f}" for r in records[-2 * len(sizes)::2]), flush=True)

    def results(done: List[int]) -> dict:
        """The results document over the depths measured so far (written after each depth,
        so that a run stopped in a long fill keeps what it measured)."""
        table = []
        for depth in done:
            for k in sizes:
                row = {"depth": depth, "rows": k}
                for arm in ARMS:
                    xs = [r["seconds"] for r in records if r["arm"] == arm and r["depth"] == depth and r["rows"] == k]
                    if xs:
                        row[arm] = spread(xs)
                base = row.get("llama.cpp patched")
                if base:
                    row["ours_over_patched"] = round(row["ours"]["median_ms"] / base["median_ms"], 3)
                    if "ours, last row's head" in row:
                        row["ours_pass_over_patched"] = round(
                            row["ours, last row's head"]["median_ms"] / base["median_ms"], 3)
                if "llama.cpp stock" in row:
                    stock = row["llama.cpp stock"]["median_ms"]
                    row["ours_over_stock"] = round(row["ours"]["median_ms"] / stock, 3)
                    if base:
                        row["patched_over_stock"] = round(base["median_ms"] / stock, 3)
                table.append(row)
        loads = [r["load_1m"] for r in records]
        return provenance.results_doc(
            "experiments/depth_map.py", sys.argv[1:] if argv is None else argv,
            started=started.isoformat(timespec="seconds"),
            finished=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            machine=provenance.machine(a.threads, target.info()["device"]), versions=provenance.versions(),
            settings={"model": model, "depths": depths, "depths_done": done, "sizes": sizes,
                      "repetitions": a.repetitions, "steps": a.steps, "threads": a.threads, "benches": benches,
                      "ours": "chain verify of k rows + their choices (output head on every row), least of --steps",
                      "ours, last row's head": "a pass of k rows, output head on the last row, least of --steps",
                      "llama_bench": "-p k -n 0 -d D -fa 1 (output head on the last row only), "
                                     "one sample a repetition"},
            our_fill_seconds=fills, load_average={"min": min(loads), "max": max(loads)}, table=table, runs=records)

    out = a.out or Path("results") / f"depth-map-{Path(model).stem}-{started:%Y-%m-%d}.json"
    for i, depth in enumerate(depths):
        fills[depth] = round(fill_to(target, depth), 1)
        print(f"[depth-map] ours filled to {depth} in {fills[depth]} s", flush=True)
        half = a.repetitions // 2
        for rep in range(half):
            ours(rep, depth)
        for arm, exe in benches.items():
            load = method.load_1m()
            timed = llama_bench(exe, model, a.threads, a.repetitions, sizes, depth)
            for k, secs in timed.items():
                records += [{"arm": arm, "depth": depth, "rows": k, "rep": i, "seconds": s, "load_1m": load}
                            for i, s in enumerate(secs)]
            print(f"[depth-map] d{depth} {arm}, median of {a.repetitions}: " + " ".join(
                f"{k}:{statistics.median(secs) * 1e3:.0f}" for k, secs in sorted(timed.items())), flush=True)
        for rep in range(half, a.repetitions):
            ours(rep, depth)
        provenance.write_results(out, results(depths[:i + 1]))

    table = results(depths)["table"]
    print(f"{'depth':>6} {'rows':>4} " + " ".join(f"{arm:>22}" for arm in ARMS)
          + f" {'ours/patched':>12} {'pass/patched':>12} {'ours/stock':>10} {'patched/stock':>13}")
    for row in table:
        cells = [f"{row[arm]['median_ms']:9.1f} ({row[arm]['min_ms']:.0f}-{row[arm]['max_ms']:.0f})" if arm in row
                 else "" for arm in ARMS]
        print(f"{row['depth']:>6} {row['rows']:>4} " + " ".join(f"{c:>22}" for c in cells)
              + f" {row.get('ours_over_patched', ''):>12} {row.get('ours_pass_over_patched', ''):>12}"
              + f" {row.get('ours_over_stock', ''):>10}"
              + f" {row.get('patched_over_stock', ''):>13}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
