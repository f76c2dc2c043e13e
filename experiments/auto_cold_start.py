#!/usr/bin/env python3
"""`dflash-run --tree-budget auto` as a new user runs it, a new process a request, beside
`--no-spec`: auto cold (no memory of earlier processes: DFLASH_AUTO_MEMORY naming a file
that does not exist yet), auto warm (the memory an earlier process of the same files and
settings left, auto_store), and plain decoding. Arms take turns, a run each a round, in a
shuffled order; each run is a process of its own, and its decode tok/s is what dflash-run
reports (--json). Medians of the per-round ratios to --no-spec.

    .venv/bin/python experiments/auto_cold_start.py [-m TARGET] [-md DRAFT] [-n 128] [-r 5] [-t 2]
        [-- extra dflash-run flags] [-o results/auto-cold-start-DATE.json]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_gguf.bench import provenance

DATA = Path(__file__).resolve().parents[1] / "dflash_gguf" / "data"
RUN = str(Path(sys.executable).with_name("dflash-run"))


def run(args, memory: str) -> dict:
    env = {**os.environ, "DFLASH_AUTO_MEMORY": memory}
    out = subprocess.run([RUN, *args, "--json"], env=env, capture_output=True, text=True, check=True)
    return json.loads(next(line for line in reversed(out.stderr.splitlines()) if line.startswith("{")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=str(DATA / "demo-target.gguf"))
    p.add_argument("-md", "--model-draft", default=str(DATA / "demo-draft.gguf"))
    p.add_argument("-p", "--prompt", default="def quicksort(xs):\n")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("-r", "--repetitions", type=int, default=5)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-o", "--out", type=Path, default=Path("results") / f"auto-cold-start-{dt.date.today()}.json")
    p.add_argument("extra", nargs="*", help="more dflash-run flags (after --)")
    a = p.parse_args(argv)
    common = ["-p", a.prompt, "-n", str(a.n_predict), "-t", str(a.threads), "--ignore-eos", *a.extra]
    spec = ["-m", a.model, "-md", a.model_draft, "--tree-budget", "auto", *common]
    workdir = Path(tempfile.mkdtemp(prefix="auto-cold-start-"))
    warm = str(workdir / "warm.json")
    doc = provenance.results_doc("experiments/auto_cold_start.py", sys.argv[1:] if argv is None else argv,
                                 model=a.model, draft=a.model_draft, n_predict=a.n_predict, threads=a.threads,
                                 repetitions=a.repetitions, load_average={"before": provenance.load_average()},
                                 runs=[])
    try:
        run(spec, warm)  # the earlier process whose memory the warm arm starts from (not timed)
        arms = {"no-spec": (["-m", a.model, "--no-spec", *common], "off"), "auto, warm": (spec, warm)}
        for rep in range(a.repetitions):
            arms["auto, cold"] = (spec, str(workdir / f"cold-{rep}.json"))  # a memory file not there yet
            order = list(arms)
            random.Random(rep).shuffle(order)
            for name in order:
                args, memory = arms[name]
                r = run(args, memory)
                doc["runs"].append({"arm": name, "rep": rep, "tok_s": r["decode_tokens_per_second"],
                                    "generated_tokens": r["generated_tokens"], "auto": r.get("auto"),
                                    "load_1m": provenance.load_average()[0]})
                print(f"rep {rep + 1} {name}: {r['decode_tokens_per_second']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc["load_average"]["after"] = provenance.load_average()

    def tps(arm, rep):
        return next(r["tok_s"] for r in doc["runs"] if r["arm"] == arm and r["rep"] == rep)

    reps = range(a.repetitions)
    doc["rows"] = {arm: {"tok_s_median": statistics.median(tps(arm, rep) for rep in reps),
                         "vs_no_spec": statistics.median(tps(arm, rep) / tps("no-spec", rep) for rep in reps),
                         "vs_no_spec_range": [min(tps(arm, rep) / tps("no-spec", rep) for rep in reps),
                                              max(tps(arm, rep) / tps("no-spec", rep) for rep in reps)]}
                   for arm in ("no-spec", "auto, cold", "auto, warm")}
    provenance.write_results(a.out, doc)
    for arm, row in doc["rows"].items():
        print(f"{arm:>12}: {row['tok_s_median']:9.1f} tok/s, {row['vs_no_spec']:.2f}x --no-spec "
              f"({row['vs_no_spec_range'][0]:.2f}-{row['vs_no_spec_range'][1]:.2f})")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
