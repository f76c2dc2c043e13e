#!/usr/bin/env python3
"""What `auto`'s plain steps cost beyond plain decoding's, timed in one process: plain
decoding without a drafter, plain decoding with the drafter loaded (the target then
writes the features a drafter takes), and `--tree-budget auto` held on its plain arm (no
decision, probe or cost measurement), on the demo pair, taking turns request by request.
Prints each one's median and least decode time a token (128 tokens a request).

    .venv/bin/python scripts/auto_plain_time.py [--rounds 15] [--threads 2] [--out FILE]

Time only on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

from dflash_gguf import budget, verify_cost
from dflash_gguf.demo import DEMO_PROMPT, demo_paths
from dflash_gguf.engine import Engine


def hold_auto_on_plain() -> None:
    """AutoBudget on its plain arm for good, and a flat verify cost table (not measured)."""
    init = budget.AutoBudget.__init__

    def held(self, *a, **k):
        init(self, *a, **k)
        self.current = self.arm = budget.PLAIN
        self.next_decision = self.next_survey = self.to_probe = 10**9

    def flat(self, target, n_threads=0, cache=None):
        self.sizes, self.tree_seconds, self.chain_seconds = np.array([1.0, 64.0]), np.ones(2), np.ones(2)

    budget.AutoBudget.__init__, verify_cost.VerifyCost.__init__ = held, flat


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="requests per arm, taking turns (default 15)")
    p.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    p.add_argument("--out", help="results JSON")
    args = p.parse_args(argv)
    hold_auto_on_plain()
    target, draft = demo_paths()
    arms = {"plain, no drafter": (Engine(target, None, n_ctx=512, n_threads=args.threads), False),
            "plain, drafter loaded": (Engine(target, draft, n_ctx=512, n_threads=args.threads), False),
            "auto held on plain": (Engine(target, draft, n_ctx=512, n_threads=args.threads, tree_budget="auto"), True)}
    load = os.getloadavg()
    us = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (engine, speculative) in arms.items():
            r = engine.generate(DEMO_PROMPT, 129, stop_tokens=(), speculative=speculative)
            us[name].append(r.stats.decode_seconds / r.stats.generated_tokens * 1e6)
    out = {"tool": "scripts/auto_plain_time.py", "argv": sys.argv[1:] if argv is None else argv,
           "load_average_before": load, "load_average_after": os.getloadavg(),
           "us_per_token": {name: {"median": statistics.median(v), "min": min(v), "all": v} for name, v in us.items()}}
    for name, v in out["us_per_token"].items():
        print(f"{name}: median {v['median']:.1f} us a token, least {v['min']:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
