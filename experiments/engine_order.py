"""Two identical engines (plain decoding of one GGUF) in one process, taking turns prompt
by prompt: how much faster the one loaded first runs, from which dflash-bench's rule to
load its engines in an order drawn anew each run. Each trial is a fresh process: the
engines load in the order given, then decode the benchmark's prompts for --rounds rounds,
the two alternating which goes first on each prompt.

    .venv/bin/python experiments/engine_order.py --trials 3 --out results/engine-order.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from dflash_gguf.bench.provenance import load_average, results_doc, write_results

TRIAL = r"""
import json, sys
from dflash_gguf.bench import ours
from dflash_gguf.bench.prompts import PROMPTS
from dflash_gguf.bench.runs import Sampling
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.runtime.tokenizer import Tokenizer

target, rounds, temp, first = sys.argv[1] or demo_paths()[0], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
ids = {name: Tokenizer(target).encode(text) for name, text in PROMPTS}
options = {"n_ctx": 512, "n_threads": 2, "kv_type": "f16", "device": None}
names = ["A", "B"] if first == "A" else ["B", "A"]
engines = {n: ours.open_engine(ours.Mode("plain", speculative=False), target, None, options) for n in names}
sampling = Sampling(temp, 20, 0.95, 0.0, 1) if temp > 0 else Sampling()
per_round = []
for r in range(rounds):
    made = {"A": [0, 0.0], "B": [0, 0.0]}
    for i, (name, x) in enumerate(ids.items()):
        for n in (["A", "B"] if (r + i) % 2 == 0 else ["B", "A"]):
            run = ours.generate(engines[n], ours.Mode("plain", speculative=False), name, x, 128, sampling, r)
            made[n][0] += run.tokens
            made[n][1] += run.decode_s
    per_round.append({n: t / s for n, (t, s) in made.items()})
print(json.dumps(per_round))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="", help="target GGUF (default: the demo target)")
    p.add_argument("--trials", type=int, default=3, help="processes per load order (default 3)")
    p.add_argument("--rounds", type=int, default=10, help="rounds of the prompts per process (default 10)")
    p.add_argument("--temp", type=float, default=0.6, help="temperature (default 0.6; 0: greedy)")
    p.add_argument("--out", type=Path, help="results JSON")
    args = p.parse_args(argv)
    trials = []
    for k in range(args.trials):
        for first in ("A", "B"):
            load = load_average()[0]
            out = subprocess.run([sys.executable, "-c", TRIAL, args.model, str(args.rounds), str(args.temp), first],
                                 capture_output=True, text=True, cwd=Path(__file__).resolve().parent)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 1
            rounds = json.loads(out.stdout.strip().splitlines()[-1])
            # the engine loaded second over the one loaded first, per round
            second = "B" if first == "A" else "A"
            ratios = [r[second] / r[first] for r in rounds]
            trials.append({"loaded_first": first, "load_1m": load, "rounds": rounds,
                           "second_over_first_median": statistics.median(ratios)})
            print(f"trial {k + 1}, {first} loaded first: second / first per round, median "
                  f"{statistics.median(ratios):.4f} ({min(ratios):.3f}-{max(ratios):.3f})")
    medians = [t["second_over_first_median"] for t in trials]
    print(f"over {len(trials)} processes: median {statistics.median(medians):.4f}, {min(medians):.4f}-{max(medians):.4f}")
    if args.out:
        write_results(args.out, results_doc("experiments/engine_order.py", sys.argv[1:] if argv is None else argv,
                                            trials=trials, median=statistics.median(medians)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
