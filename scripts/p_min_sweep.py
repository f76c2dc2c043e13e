#!/usr/bin/env python3
"""The greedy chain's confidence cut (--draft-p-min) swept, measured side by side.

    .venv/bin/python scripts/p_min_sweep.py --demo                 # the bundled pairs, f32 and q8_0
    .venv/bin/python scripts/p_min_sweep.py -m TARGET.gguf -md DRAFT.gguf --p-min 0,0.2,0.3,0.5

One process loads a chain engine per p-min value and the values take turns prompt by
prompt (as scripts/auto_compare.py does for auto's arms), so a slow spell weighs on all
of them alike. Prints each value's decode tok/s and its ratio to the uncut chain
(p-min 0), which is always among the values.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def p_min_list(text: str) -> list:
    try:
        values = sorted({0.0} | {float(v) for v in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad p-min list {text!r}: numbers in [0, 1)")
    if not all(0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"p-min values must be in [0, 1): {text!r}")
    return values


def main(argv=None) -> int:
    from auto_compare import add_pair_args, pairs_of, side_by_side

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_args(p)
    p.add_argument("--p-min", type=p_min_list, default=p_min_list("0.1,0.2,0.3,0.4,0.5"),
                   help="values to compare (0 is always added; default 0.1,0.2,0.3,0.4,0.5)")
    args = p.parse_args(argv)
    pairs = pairs_of(p, args)

    import bench

    prompts = [text for _, text in bench.PROMPTS]
    print(f"# load average {os.getloadavg()[0]:.2f}; {args.threads} threads; {len(prompts)} prompts x "
          f"{args.rounds} rounds, {args.max_tokens} tokens each\n", flush=True)
    print("| pair | " + " | ".join(f"p-min {v:g}" for v in args.p_min) + " |")
    print("|---|" + "---:|" * len(args.p_min))
    for name, target, draft in pairs:
        tps = side_by_side(target, draft, {v: {"draft_p_min": v} for v in args.p_min}, args.rounds,
                           args.max_tokens, args.threads, prompts)
        print(f"| {name} | " + " | ".join(f"{tps[v]:.0f} tok/s ({tps[v] / tps[0.0]:.3f})" for v in args.p_min)
              + " |", flush=True)
    print(f"\n# load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
