#!/usr/bin/env python3
"""Instructions a grammar's mask adds to a target pass at Qwen3.5's 248,320-token vocabulary,
counted by valgrind's callgrind (repeatable on a machine that is not idle, where
sampling_cost.py's timings are not; issue #40's bar: masked <= 1.10 x greedy).

The passes are sampling_cost.py's (its shape model, chain of 16 and 16-node tree, greedy
and greedy under the dense worst-case mask alternating, then greedy alternating with a
JSON schema's masks from llguidance; with --sampled instead, its sampled passes: sampled
(T 0.6 / top-k 20 / top-p 0.95) and sampled under the dense worst-case mask alternating),
run on one thread under callgrind, with a
callgrind dump around every pass (a client request, CALLGRIND_DUMP_STATS, from a marker
library the script compiles: valgrind does not name libdflash's functions, so a dump at a
function's entry cannot be asked for), so that each pass's instructions are its own and
graph builds show where they happen.

    experiments/mask_count.py --ggml-lib /path/to/avx2/ggml/lib [--reps 4] [--cache-sim] [--sampled] \
        [--package-dir OLD] [--out results/mask-count-<date>.json] [--label before]

valgrind does not run AVX-512 code, so ggml's CPU backend is preloaded from --ggml-lib (a
ggml build with GGML_NATIVE=OFF GGML_AVX2=ON). The JSON schema's masks are computed outside
valgrind (llguidance walking the document is slow there) and handed to the child.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

def grammar_file(n_vocab: int, folder: Path) -> Path:
    from sampling_cost import grammar_masks
    path = folder / "grammar.npy"
    np.save(path, grammar_masks(n_vocab))
    return path


def dump_events(path: Path) -> dict:
    """The totals of one callgrind dump, by event name."""
    text = path.read_text()
    events = re.search(r"^events:\s+(.+)$", text, re.M).group(1).split()
    totals = re.search(r"^(?:summary|totals):\s+(.+)$", text, re.M).group(1).split()
    return dict(zip(events, (int(x) for x in totals)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ggml-lib", required=True, help="folder of an AVX2 build of ggml's libraries")
    p.add_argument("--python", default=sys.executable, help="the install's interpreter (default: this one)")
    p.add_argument("--package-dir", help="a folder holding another build of dflash_gguf, which the counted run "
                                         "imports in place of the install's (an earlier commit's, for a before/after)")
    p.add_argument("--reps", type=int, default=4, help="passes counted per kind (default 4)")
    p.add_argument("--cache-sim", action="store_true", help="also count last-level cache misses (slower)")
    p.add_argument("--sampled", action="store_true", help="count sampled passes, plain and under the dense "
                                                          "worst-case mask, instead of the greedy ones")
    p.add_argument("--label", default="", help="a name for this install's counts in the results file")
    p.add_argument("--out", type=Path, help="results JSON (appended to when it exists)")
    args = p.parse_args(argv)
    from sampling_cost import make_files
    target, draft = make_files()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        grammar = grammar_file(248320, tmp)
        out = tmp / "cg.out"
        env = {**os.environ, "LD_LIBRARY_PATH": args.ggml_lib, "PYTHONHASHSEED": "0"}
        if args.package_dir:
            env["PYTHONPATH"] = args.package_dir
        marker = tmp / "cgmark.so"
        (tmp / "cgmark.c").write_text("#include <valgrind/callgrind.h>\nvoid cg_mark(void) { CALLGRIND_DUMP_STATS; }\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(marker), str(tmp / "cgmark.c")], check=True)
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        if args.cache_sim:
            cmd.append("--cache-sim=yes")
        # run outside the checkout: the working directory first on sys.path would shadow the install
        res = subprocess.run(cmd + [args.python, str(ROOT / "experiments" / "mask_count_child.py"), str(target), str(draft),
                                    str(grammar), str(args.reps), str(marker),
                                    "sampled" if args.sampled else "greedy"], capture_output=True, text=True,
                                   env=env, cwd=tmp)
        if res.returncode != 0:
            raise SystemExit(f"the counted run failed:\n{res.stderr[-3000:]}")
        log = json.loads(res.stdout.strip().splitlines()[-1])
        dumps = sorted(tmp.glob("cg.out.*"), key=lambda f: int(f.name.rsplit(".", 1)[1]))
        events = [dump_events(f) for f in dumps]
    # the dumps at the marks: one before each loop, then one per pass (the last file, at exit, unnumbered)
    passes, k = [], 0
    loop_starts = {0}
    for j in range(1, len(log)):
        if log[j][0] != log[j - 1][0] or (log[j][1].startswith("json") != log[j - 1][1].startswith("json")):
            loop_starts.add(j)
    for j, entry in enumerate(log):
        if j in loop_starts:
            k += 1  # the loop's set-up dump
        passes.append({"case": entry[0], "kind": entry[1], "counted": entry[2], "graph_builds": entry[3],
                       **events[k]})
        k += 1
    summary = {}
    kinds = ("sampled", "sampled-masked") if args.sampled else ("greedy", "masked", "json-greedy", "json")
    for case in ("chain16", "tree16"):
        med = {}
        for kind in kinds:
            rows = [x for x in passes if x["case"] == case and x["kind"] == kind and x["counted"]]
            med[kind] = {ev: statistics.median(r[ev] for r in rows) for ev in rows[0] if ev not in
                         ("case", "kind", "counted", "graph_builds")}
            med[kind]["graph_builds"] = sum(r["graph_builds"] for r in rows)
        if args.sampled:
            summary[case] = {"median": med,
                             "dense_masked_over_sampled": med["sampled-masked"]["Ir"] / med["sampled"]["Ir"]}
        else:
            summary[case] = {"median": med,
                             "dense_masked_over_greedy": med["masked"]["Ir"] / med["greedy"]["Ir"],
                             "json_masked_over_greedy": med["json"]["Ir"] / med["json-greedy"]["Ir"]}
        if "DLmr" in med[kinds[0]]:
            ll = {k: v.get("DLmr", 0) + v.get("DLmw", 0) for k, v in med.items()}
            summary[case]["ll_misses"] = ll
        print(case, json.dumps({k: v for k, v in summary[case].items() if k != "median"}), flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    run = {"label": args.label, "commit": commit, "date": _dt.datetime.now().isoformat(timespec="minutes"),
           "command": " ".join(["experiments/mask_count.py"] + (sys.argv[1:] if argv is None else argv)),
           "threads": 1, "summary": summary, "passes": passes}
    if args.out:
        from dflash_gguf.bench import provenance, slim

        doc = slim.read(args.out) if args.out.exists() else {
            "what": "instructions of a target pass %s vs %s under a grammar's mask at a 248,320-token "
                    "vocabulary (issue #40's bar: <= 1.10), callgrind, one thread" % (kinds[0], kinds[0]),
            "runs": []}
        doc["runs"].append(run)
        provenance.write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
