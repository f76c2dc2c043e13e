"""The comparisons of dflash-bench results files taken again from their runs by the
current method (dflash_gguf.bench.report): a file keeps every run with its repetition
and round, so a later, better statistic can be read off an earlier run without running
it again. The files themselves are left as written; the new comparisons go to --out, with auto
against the fastest fixed row of each file pooled over every repetition of every file.

    .venv/bin/python experiments/recompare.py results/auto-vs-fixed-*.json --out results/recompared.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from dflash_gguf.bench import method, report, slim
from dflash_gguf.bench.provenance import results_doc, write_results
from dflash_gguf.bench.runs import Run


def recompare(path: Path, pooled: dict) -> dict:
    """One file's comparisons; auto's per-repetition ratios against the fastest fixed
    row are added to pooled[(drafter, sampling)]."""
    doc = slim.read(path)  # the JSON and its records file
    if doc.get("tool") != "dflash-bench" or "runs" not in doc:
        raise ValueError(f"{path}: not a dflash-bench results file")
    table = report.rows([Run.from_json(r) for r in doc["runs"]])
    autos = report.each_sampling(table, report.auto_comparisons)
    for sampling in dict.fromkeys(c["sampling"] for c in autos):
        ours = [r for r in table if r.cell.engine == "ours" and r.cell.sampling == sampling]
        auto = next(r for r in ours if r.cell.mode == "auto")
        fastest = max((r for r in ours if r is not auto and r.tok_s), key=lambda r: r.tok_s.median)
        key = (Path(doc["models"]["draft"] or "-").name, sampling)
        pooled.setdefault(key, []).extend(method.matched_ratios(auto.rounds, fastest.rounds))
    return {"file": str(path), "checkout": doc.get("checkout"), "started": doc.get("started"),
            "comparisons": report.each_sampling(table, report.comparisons), "auto_comparisons": autos}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="dflash-bench JSON results files")
    p.add_argument("--out", type=Path, help="write the comparisons here (JSON)")
    args = p.parse_args(argv)
    pooled: dict = {}
    try:
        files = [recompare(f, pooled) for f in args.files]
    except (OSError, ValueError) as e:
        print(f"recompare: error: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f["file"])
        for c in f["auto_comparisons"]:
            print(f"  {c['sampling'][:8]:8s} auto / {c['fixed']}: per repetition {c['per_rep_ratio_median']:.3f} "
                  f"({c['per_rep_ratio_range'][0]:.2f}-{c['per_rep_ratio_range'][1]:.2f}), ratio of medians "
                  f"{c['ratio_of_medians']:.3f}")
        for c in f["comparisons"]:
            print(f"  {c['sampling'][:8]:8s} {c['pairing']}: {c['ours']} / {c['llama_cpp']}: per repetition "
                  f"{c['per_rep_ratio_median']:.3f}, ratio of medians {c['ratio_of_medians']:.3f}")
    # auto against the fastest fixed row of its file, every repetition of every file together
    pool = [{"drafter": d, "sampling": s, "repetitions": len(v), "per_rep_ratio_median": statistics.median(v),
             "per_rep_ratio_range": [min(v), max(v)]} for (d, s), v in pooled.items() if v]
    for c in pool:
        print(f"{c['drafter']}, {c['sampling'][:8]}: auto / the fastest fixed row over {c['repetitions']} repetitions "
              f"of {len(files)} files: median {c['per_rep_ratio_median']:.3f} "
              f"({c['per_rep_ratio_range'][0]:.2f}-{c['per_rep_ratio_range'][1]:.2f})")
    if args.out:
        write_results(args.out, results_doc("experiments/recompare.py", sys.argv[1:] if argv is None else argv,
                                            files=files, auto_pooled=pool))
    return 0


if __name__ == "__main__":
    sys.exit(main())
