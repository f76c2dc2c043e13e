#!/usr/bin/env python3
"""Plain decoding on a second thread, after the process's first thread computed graphs:
what a server does (it loads its models and measures its verify cost table on the main
thread, then decodes on its engine thread), with and without the first thread handing its
OpenMP team back (runtime/openmp.py). Three arms, each a fresh process, interleaved:

- one thread: every graph on the main thread (as dflash-run decodes);
- two teams: a request decoded on the main thread, then the timed one on a new thread,
  the main thread's team kept;
- released: the same, the main thread's team handed back (openmp.release_team) before
  the new thread decodes, as dflash-server's Scheduler does.

    .venv/bin/python experiments/openmp_teams.py [-m qwen2.5-coder-1.5b] [-n 128] [-t 2] [-r 3] \\
        [--out results/openmp-teams-DATE.json]

The rate is GenerationStats.decode_tps (greedy, after the first token)."""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_gguf.bench import provenance
from dflash_gguf.tools import real_models

ARMS = ("one thread", "two teams", "released")
CHILD = """
import sys, threading
from dflash_gguf import Engine
from dflash_gguf.runtime import openmp
arm, model, threads, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompt = "Write a long essay about the history of the Python programming language.\\n"
with Engine(model, n_threads=threads, exact="off") as e:
    e.generate("def f(x):\\n", 8, speculative=False)  # the main thread computes graphs, as loading does
    if arm == "released":
        openmp.release_team()
    out = []
    decode = lambda: out.append(e.generate(prompt, tokens, stop_tokens=(), speculative=False).stats.decode_tps)
    if arm == "one thread":
        decode()
    else:
        t = threading.Thread(target=decode)
        t.start()
        t.join()
    print("RATE", out[0])
"""


def run(arm: str, model: str, threads: int, tokens: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, arm, model, str(threads), str(tokens)], capture_output=True,
                         text=True, timeout=1800, cwd=tempfile.gettempdir())  # not the source tree
    rate = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("RATE ")]
    if not rate:
        raise RuntimeError(f"{arm} failed: {out.stderr[-2000:]}")
    return float(rate[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results") / f"openmp-teams-{dt.date.today()}.json")
    a = p.parse_args(argv)
    model = str(real_models.path(a.model)) if a.model in real_models.MODELS else a.model
    doc = provenance.results_doc("experiments/openmp_teams.py", sys.argv[1:] if argv is None else argv,
                                 model=model, threads=a.threads, n_predict=a.n_predict,
                                 cpus=os.cpu_count(), load_average={"before": provenance.load_average()}, runs=[])
    for rep in range(a.repetitions):
        order = ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]  # each arm first in turn
        for arm in order:
            rate = run(arm, model, a.threads, a.n_predict)
            doc["runs"].append({"rep": rep, "arm": arm, "decode_tps": rate})
            print(f"[openmp-teams] rep {rep + 1} {arm}: {rate:.1f} tok/s", flush=True)
    doc["load_average"]["after"] = provenance.load_average()
    by_arm = {arm: [r["decode_tps"] for r in doc["runs"] if r["arm"] == arm] for arm in ARMS}
    base = by_arm["one thread"]
    doc["summary"] = {arm: {"median_tps": statistics.median(v), "min_tps": min(v), "max_tps": max(v),
                            "over_one_thread_per_rep": [x / b for x, b in zip(v, base)]} for arm, v in by_arm.items()}
    provenance.write_results(a.out, doc)
    for arm, s in doc["summary"].items():
        ratios = s["over_one_thread_per_rep"]
        print(f"{arm:12s} {s['median_tps']:.1f} tok/s [{s['min_tps']:.1f}-{s['max_tps']:.1f}]  "
              f"x one thread {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
