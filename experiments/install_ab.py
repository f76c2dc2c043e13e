#!/usr/bin/env python3
"""dflash-bench of two installs of the project, before and after a change, taking turns:
each round runs, mode by mode, four dflash-benches of that mode alone (our engine only,
the bundled demo pair unless -m/-md) in the order before, after, after, before, so that
a machine whose speed drifts over minutes (this one's does: a first run of a round was
up to 1.5x the second, results/install-ab-2026-11-26-step.json) weighs on both installs
alike. Per row (mode and sampling), the table gives each install's median tok/s over
every repetition and the median of the per-round ratios, a round's ratio being the
after runs' summed medians over the before runs'. Time it on an idle machine: nothing
else running (ggml's threads spin).

    .venv/bin/python experiments/install_ab.py --before OLD/.venv/bin/python --after .venv/bin/python \
        --rounds 3 --out results/install-ab-<date>.json

Extra arguments after -- go to every dflash-bench (e.g. -- --tree-budgets 8 -n 64).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_gguf.bench.provenance import load_average, results_doc, write_results

RUN = "import sys; from dflash_gguf.bench.cli import main; sys.exit(main(sys.argv[1:]))"


def bench(python: str, args: list) -> list:
    """One dflash-bench run of an install: its rows (ours only)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        # run outside the checkout, so that the install's package is the one imported
        subprocess.run([python, "-c", RUN, "--no-llama-cpp", "-o", str(out), *args], check=True, cwd=tmp,
                       stdout=subprocess.DEVNULL)
        return [r for r in json.loads(out.read_text())["rows"] if r["engine"] == "ours"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the install before the change (its interpreter)")
    p.add_argument("--after", required=True, help="the install after it")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each one run of both (default 3)")
    p.add_argument("--modes", default="plain,chain,tree,auto", help="dflash-bench --modes (default: all four)")
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("rest", nargs="*", help="after --: more dflash-bench arguments")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    runs = []
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            for side, python in (("before", args.before), ("after", args.after), ("after", args.after),
                                 ("before", args.before)):
                load = load_average()
                rows = bench(python, ["--modes", mode, *args.rest])
                runs.append({"round": r, "side": side, "load_1m_at_start": load, "rows": rows})
                print(f"round {r} {side}: " + ", ".join(f"{x['mode']} ({x['sampling']}) "
                                                        f"{x['decode_tok_s']['median']:.0f}" for x in rows), flush=True)
    table = []
    keys = list(dict.fromkeys((x["mode"], x["sampling"]) for run in runs for x in run["rows"]))
    for mode, sampling in keys:
        def medians(side, r=None):
            return [x["decode_tok_s"]["median"] for run in runs if run["side"] == side and r in (None, run["round"])
                    for x in run["rows"] if (x["mode"], x["sampling"]) == (mode, sampling)]

        def reps(side):
            return [v for run in runs if run["side"] == side for x in run["rows"]
                    if (x["mode"], x["sampling"]) == (mode, sampling) for v in x["decode_tok_s_per_rep"]]

        ratios = [sum(medians("after", r)) / sum(medians("before", r)) for r in range(args.rounds)
                  if medians("after", r) and medians("before", r)]
        table.append({"mode": mode, "sampling": sampling, "before_tok_s": statistics.median(reps("before")),
                      "after_tok_s": statistics.median(reps("after")), "ratio_per_round": ratios,
                      "ratio_median": statistics.median(ratios)})
        print(f"{mode:>40} {sampling:>50}: {table[-1]['before_tok_s']:8.0f} -> {table[-1]['after_tok_s']:8.0f} "
              f"tok/s, after/before {table[-1]['ratio_median']:.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    if args.out:
        write_results(args.out, results_doc("experiments/install_ab.py", sys.argv[1:] if argv is None else argv,
                                            table=table, runs=runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
