#!/usr/bin/env python3
"""The cost of the project's ggml patches (batch-invariant CPU kernels), kernel by kernel:
llama-bench of llama.cpp built over stock ggml against the same tool built over the patched
ggml (scripts/llama_cpp_build.py builds that one), on one GGUF, same threads, taking turns
within each round (stock, patched, patched, stock), one llama-bench repetition a run.

Tests: tg (one-row decoding), pp K for K = 2, 4, 8, 16 (the rows of a verify) and pp 512 and
2048 (prompt processing); ppK@D runs pp K at a depth of D cells already in the cache
(llama-bench -d D: a verify at depth, where flash attention dominates). Per test the table
gives each build's median tok/s over every run with its spread (min-max), and the median of
the per-round ratios (patched / stock).
Run it on an idle machine: ggml's threads spin.

    .venv/bin/python experiments/ggml_patch_ab.py --stock STOCK/bin/llama-bench -m MODEL.gguf \\
        --out results/ggml-patch-ab-<model>-<date>.json

One patch against the others (0007, flash attention): --stock is then llama-bench over the
patch set without it (scripts/llama_cpp_build.py run from a checkout without it), e.g.
    --tests pp16,pp64,pp16@2048,pp64@2048,pp16@8192,pp64@8192
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from dflash_gguf.tools import llama_cpp_tree
from dflash_gguf.bench.provenance import load_average, machine, results_doc, versions, write_results

TESTS = ("tg128", "pp2", "pp4", "pp8", "pp16", "pp512", "pp2048")


def run(bench: str, model: str, test: str, threads: int) -> float:
    """One llama-bench run of one test: tok/s."""
    kind, n = test[:2], test[2:]
    n, _, depth = n.partition("@")
    args = ["-p", n, "-n", "0"] if kind == "pp" else ["-p", "0", "-n", n]
    if depth:
        args += ["-d", depth]
    out = subprocess.run([bench, "-m", model, "-t", str(threads), "-r", "1", "-o", "json", *args],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stock", required=True, help="llama-bench built over stock ggml")
    p.add_argument("--patched", help="llama-bench built over the patched ggml (default: llama_cpp_build.py's)")
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--tests", default=",".join(TESTS), help=f"comma-separated (default {','.join(TESTS)})")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    patched = args.patched or str(llama_cpp_tree.tool("llama-bench") or "")
    if not patched:
        p.error("no patched llama-bench: run scripts/llama_cpp_build.py llama-bench, or pass --patched")
    tests = args.tests.split(",")
    runs = []
    for r in range(args.rounds):
        for test in tests:
            for side, bench in (("stock", args.stock), ("patched", patched), ("patched", patched),
                                ("stock", args.stock)):
                load = load_average()
                tps = run(bench, args.model, test, args.threads)
                runs.append({"round": r, "test": test, "side": side, "tok_s": tps, "load_1m_at_start": load[0]})
                print(f"[ab] round {r} {test} {side}: {tps:.2f} tok/s (load {load[0]})", file=sys.stderr, flush=True)
    table = []
    for test in tests:
        row = {"test": test}
        for side in ("stock", "patched"):
            v = [x["tok_s"] for x in runs if x["test"] == test and x["side"] == side]
            row[side] = {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2)}
        ratios = []
        for r in range(args.rounds):
            got = {s: sum(x["tok_s"] for x in runs if x["round"] == r and x["test"] == test and x["side"] == s)
                   for s in ("stock", "patched")}
            ratios.append(got["patched"] / got["stock"])
        row["ratio_median"] = round(statistics.median(ratios), 4)
        row["ratio_min_max"] = [round(min(ratios), 4), round(max(ratios), 4)]
        table.append(row)
        print(f"{test:>7}: stock {row['stock']['median']:8.2f} ({row['stock']['min']}-{row['stock']['max']})  "
              f"patched {row['patched']['median']:8.2f} ({row['patched']['min']}-{row['patched']['max']})  "
              f"ratio {row['ratio_median']:.3f} [{row['ratio_min_max'][0]:.3f}, {row['ratio_min_max'][1]:.3f}]")
    doc = results_doc("ggml_patch_ab", sys.argv, machine=machine(args.threads, "CPU"), versions=versions(),
                      model=args.model, builds={"stock": args.stock, "patched": patched},
                      patches=[q.name for q in llama_cpp_tree.ggml_patches()], patch_key=llama_cpp_tree.patch_key(),
                      table=table, runs=runs)
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
