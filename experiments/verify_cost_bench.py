#!/usr/bin/env python3
"""What a verify of k rows costs against one decode step, ours and llama.cpp's, on one
GGUF with the same threads (issue 54's verify row: llama.cpp's 4/8/16 rows cost 1.26x,
2.3x, 2.8x a decode step on the real Qwen2.5-Coder 1.5B).

    .venv/bin/python experiments/verify_cost_bench.py [-m MODEL.gguf] [--sizes 1,2,4,8,16] [-r 5] [-t 2] [-o PATH]

Each repetition runs, in an order shuffled by random.Random(repetition):
- ours, decode: plain decoding's step (Target.decode_next, one row, greedy) after 64
  tokens of context, timed --steps times;
- ours, verify k: a chain verify of k rows and their choices, as decoding runs it (its
  graph built, the last step's commit riding along: verify_cost.measure_verify_cost,
  the measurement `--tree-budget auto` prices its arms with), --steps times each;
- llama.cpp: llama-bench -p k -n 0 -d 64 -r --steps at each k (its ppk: one pass of k rows
  after 64 tokens of context; it computes the output head for the last row only, ours
  for every row, since every verified row chooses a token), and -p 0 -n --steps -d 64 for
  its decode step.

With --head-split, also ours with the output head cut to 16 rows (TargetConfig.head_tokens,
as a cut drafter head): the body's cost by rows, and the head's as the difference.

Within a repetition each figure is the least of its --steps samples (other processes only
ever add to a time); across repetitions the median. The ratio that matters is each
engine's verify(k) over its own decode step. Writes results/verify-cost-MODEL-DATE.json
(with its records file), and prints the table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import List

from dflash_gguf.tools import real_models
from dflash_gguf.bench import llama_cpp, method, provenance
from dflash_gguf.decoding.sampling import GREEDY
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
from dflash_gguf.speculation.verify_cost import measure_verify_cost

DEPTH = 64  # tokens of context before each timed pass, on both sides


def our_decode_step(target: Target, steps: int) -> float:
    """Least seconds of plain decoding's one-row step after DEPTH tokens."""
    target.set_sampling(GREEDY.native())
    target.reset()
    target.prefill(list(range(1, DEPTH + 1)), LOGITS_LAST)
    times = []
    token = 7
    for _ in range(steps + 2):  # the first two build the graph
        t0 = time.perf_counter()
        (token,) = target.decode_next([0], [token], [-1.0])
        times.append(time.perf_counter() - t0)
    target.reset()
    return min(times[2:])


def llama_bench(exe: Path, model: str, threads: int, steps: int, n_prompt: int) -> float:
    """Least seconds of llama-bench's pass of n_prompt rows (0: one decode step) after DEPTH tokens."""
    n_gen = 0 if n_prompt else steps
    cmd = [str(exe), "-m", model, "-p", str(n_prompt), "-n", str(n_gen), "-d", str(DEPTH), "-r",
           str(steps if n_prompt else 1), "-t", str(threads), "-fa", "1", "-o", "json"]
    stdout, _ = llama_cpp.run_tool(cmd)
    (test,) = json.loads(stdout)
    per = [ns / 1e9 / (1 if n_prompt else n_gen) for ns in test["samples_ns"]]
    return min(per)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="the GGUF (default: the published Qwen2.5-Coder 1.5B Q4_K_M)")
    ap.add_argument("--sizes", default="1,2,4,8,16", help="verify rows to time (default 1,2,4,8,16)")
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="samples of each figure in a repetition (default 5)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--head-split", action="store_true",
                    help="also time ours with the output head cut to 16 rows: the body's cost, the head's the rest")
    ap.add_argument("-o", "--out", type=Path)
    a = ap.parse_args()
    sizes = sorted({int(s) for s in a.sizes.split(",")})
    model = a.model or str(real_models.path("qwen2.5-coder-1.5b"))
    tools = llama_cpp.Tools.find(None)
    if "llama-bench" not in tools.found:
        ap.error("llama-bench is missing: bash scripts/setup.sh test builds it")
    config = TargetConfig(n_threads=a.threads, n_verify=max(sizes), n_ctx=512)
    targets = {"ours": Target(model, config)}
    if a.head_split:
        targets["ours, head cut"] = Target(model, replace(config, head_tokens=tuple(range(16))))
    started = dt.datetime.now(dt.timezone.utc)
    records: List[dict] = []
    engines = [*targets, "llama.cpp"]
    arms = [(engine, k) for engine in engines for k in [0, *sizes]]
    for rep in range(a.repetitions):
        order = random.Random(rep).sample(arms, len(arms))
        for engine, k in order:
            load = method.load_1m()
            if engine in targets:
                target = targets[engine]
                s = our_decode_step(target, a.steps) if k == 0 else \
                    measure_verify_cost(target, [k], tree=False, repeats=a.steps, rounds=1)[0][k]
            else:
                s = llama_bench(tools.found["llama-bench"], model, a.threads, a.steps, k)
            records.append({"engine": engine, "rows": k, "rep": rep, "seconds": s, "load_1m": load})
            print(f"[verify-cost] rep {rep + 1}, {engine} {'decode' if k == 0 else f'verify {k}'}: "
                  f"{s * 1e3:.1f} ms (load {load:.2f})", flush=True)

    def med(engine: str, k: int) -> float:
        return statistics.median(r["seconds"] for r in records if r["engine"] == engine and r["rows"] == k)

    def ratio_med(engine: str, k: int) -> float:
        # each repetition's verify(k) over its own decode step, the median over repetitions
        by_rep = {(r["rep"], r["rows"]): r["seconds"] for r in records if r["engine"] == engine}
        return statistics.median(by_rep[(rep, k)] / by_rep[(rep, 0)] for rep in range(a.repetitions))

    rows = []
    for k in [0] + sizes:
        row = {"rows": k, "what": "decode step" if k == 0 else f"verify of {k}",
               "ours_ms": round(med("ours", k) * 1e3, 2), "llama_cpp_ms": round(med("llama.cpp", k) * 1e3, 2)}
        if a.head_split:
            row["ours_head_cut_ms"] = round(med("ours, head cut", k) * 1e3, 2)
            row["head_ms"] = round(row["ours_ms"] - row["ours_head_cut_ms"], 2)
        if k:
            row["ours_vs_own_decode"] = round(ratio_med("ours", k), 3)
            row["llama_cpp_vs_own_decode"] = round(ratio_med("llama.cpp", k), 3)
        rows.append(row)
    doc = provenance.results_doc(
        "experiments/verify_cost_bench.py", sys.argv[1:], started=started.isoformat(timespec="seconds"),
        finished=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine=provenance.machine(a.threads, targets["ours"].info()["device"]), versions=provenance.versions(),
        settings={"model": model, "sizes": sizes, "repetitions": a.repetitions, "steps": a.steps,
                  "head_split": a.head_split, "threads": a.threads, "depth": DEPTH,
                  "figure": "least of --steps samples within a repetition, median over repetitions",
                  "llama_bench": "-p k -n 0 -d 64 -fa 1 (its ppk; output head for the last row only); "
                                 "decode: -p 0 -n steps -d 64"},
        load_average={"start": records[0]["load_1m"], "max": max(r["load_1m"] for r in records)},
        rows=rows, runs=records)
    print(f"{'':14} {'ours ms':>9} {'x decode':>9} {'llama.cpp ms':>13} {'x decode':>9}"
          + (f" {'head ms':>8}" if a.head_split else ""))
    for r in rows:
        print(f"{r['what']:14} {r['ours_ms']:9.1f} {r.get('ours_vs_own_decode', 1):9.2f} "
              f"{r['llama_cpp_ms']:13.1f} {r.get('llama_cpp_vs_own_decode', 1):9.2f}"
              + (f" {r['head_ms']:8.1f}" if a.head_split else ""))
    out = a.out or Path("results") / f"verify-cost-{Path(model).stem}-{started:%Y-%m-%d}.json"
    provenance.write_results(out, doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
