#!/usr/bin/env python3
"""Fuzz the GGUF loading path: seeded mutants of the bundled demo target and drafter,
each loaded as a user loads it (Engine: drafter metadata, target, tokenizer, drafter)
in a forked child, and asked for a few tokens. Every case must end in a clear error or
a correct load: never a crash, an abort, a hang, a traceback or an absurd allocation.

    .venv/bin/python scripts/fuzz_gguf.py --count 5000 --seed 1
    .venv/bin/python scripts/fuzz_gguf.py --seed 1 --only 417      # replay one case

The test suite runs the same fuzzer on a few hundred cases (tests/test_fuzz_gguf.py).
Exit status: 0 when no case failed, 1 otherwise (the failures are listed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import gguf_fuzz  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=2000, help="mutants to run (default 2000)")
    p.add_argument("--seed", type=int, default=1, help="run seed: mutant i depends only on (seed, i) (default 1)")
    p.add_argument("--start", type=int, default=0, help="first mutant index (default 0)")
    p.add_argument("--only", type=int, action="append", help="run only this mutant index (repeatable)")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="worker processes")
    p.add_argument("--timeout", type=float, default=gguf_fuzz.TIMEOUT_S, help="seconds per case")
    p.add_argument("--target", help="target GGUF to mutate (default: the bundled demo target)")
    p.add_argument("--draft", help="drafter GGUF to mutate (default: the bundled demo drafter)")
    p.add_argument("--json", metavar="FILE", help="write every case's result to FILE (JSON lines)")
    args = p.parse_args()

    from tqdm import tqdm

    from dflash_gguf.demo import demo_paths

    target, draft = demo_paths()
    target, draft = args.target or target, args.draft or draft
    indices = args.only or [-1] + list(range(args.start, args.start + args.count))
    bar = tqdm(total=len(indices), unit="case", dynamic_ncols=True)
    failed = []

    def on_result(r):
        bar.update(1)
        if r["outcome"] in gguf_fuzz.FAILURES or (r["index"] < 0 and r["outcome"] != "ok"):
            failed.append(r)
            tqdm.write(f"#{r['index']} {r['which']} [{r['outcome']}] {r['desc']}: {r['message'][:300]}")
        bar.set_postfix_str(f"{len(failed)} failed")

    results = gguf_fuzz.run(target, draft, args.seed, indices, jobs=max(1, args.jobs), timeout=args.timeout,
                            on_result=on_result)
    bar.close()
    if args.json:
        with open(args.json, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    print(f"seed {args.seed}, {len(indices)} cases: {gguf_fuzz.summary(results)}")
    if failed:
        print(gguf_fuzz.describe_failures(results))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
