#!/usr/bin/env python3
"""`--tree-budget auto` against the fixed arms it chooses among, measured side by side.

    .venv/bin/python scripts/auto_compare.py -m TARGET.gguf -md DRAFT.gguf
    .venv/bin/python scripts/auto_compare.py --demo            # the bundled pairs, f32 and q8_0

bench.py runs every decoder in a process of its own, one after the other; on this machine
two runs of one decoder minutes apart differ by up to 2x per prompt, which drowns a 3%
figure. Here one process loads an engine per arm (auto, the chain and fixed budgets) and
the arms take turns prompt by prompt, so a slow spell weighs on all of them alike. Each
arm's tok/s is its decode tokens (the prefill's token left out) over its decode seconds,
summed over every prompt and round; auto's is also given as a fraction of the best
fixed arm, with the arms auto ran (its choices, step by step).
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

ARM_LETTERS = {0: "c", 4: "4", 8: "8", 16: "G", 32: "X"}


def parse_arms(text: str) -> list:
    arms = []
    for a in text.split(","):
        a = a.strip()
        if a in ("auto", "chain"):
            arms.append(a)
        elif a.isdigit() and 1 <= int(a) <= 63:
            arms.append(int(a))
        else:
            raise argparse.ArgumentTypeError(f"bad arm {a!r}: auto, chain or a tree budget 1..63")
    if "auto" not in arms or len(arms) < 2:
        raise argparse.ArgumentTypeError("the arms need auto and at least one fixed arm")
    return arms


def side_by_side(target: str, draft: str, options: dict, rounds: int, max_tokens: int, threads: int,
                 prompts, warmed=lambda: None) -> dict:
    """{arm: decode tok/s} of one engine per arm (options: arm -> Engine options), the
    arms taking turns prompt by prompt over `rounds` rounds after one warm-up each
    (then `warmed` is called). Their order is shuffled (seeded) on each prompt, so that
    none always runs first, or right after the same other one, whose memory traffic
    the caches remember."""
    from bench import WARMUP_TEXT
    from dflash_gguf.engine import Engine

    engines = {a: Engine(target, draft, n_ctx=2048, n_threads=threads, **o) for a, o in options.items()}
    try:
        for e in engines.values():
            e.generate(WARMUP_TEXT, max_tokens=16, stop_tokens=())
        warmed()
        totals = {a: [0, 0.0] for a in options}
        order, shuffle = list(engines), random.Random(0).shuffle
        for text in list(prompts) * rounds:
            shuffle(order)
            for a in order:
                s = engines[a].generate(text, max_tokens=max_tokens, stop_tokens=()).stats
                totals[a][0] += max(s.generated_tokens - 1, 0)
                totals[a][1] += s.decode_seconds
    finally:
        for e in engines.values():
            e.close()
    return {a: n / s if s > 0 else 0.0 for a, (n, s) in totals.items()}


def compare(target: str, draft: str, arms: list, rounds: int, max_tokens: int, threads: int, prompts) -> dict:
    """{arm: tok/s}, plus "ratio" (auto / the best fixed arm) and "choices" (auto's arms
    after its warm-up)."""
    from dflash_gguf import budget

    choices = []
    choose = budget.AutoBudget.choose

    def recording_choose(self):
        arm = choose(self)
        choices.append(arm)
        return arm

    budget.AutoBudget.choose = recording_choose
    try:
        out = side_by_side(target, draft, {a: {"tree_budget": None if a == "chain" else a} for a in arms},
                           rounds, max_tokens, threads, prompts, choices.clear)
    finally:
        budget.AutoBudget.choose = choose
    best = max(v for a, v in out.items() if a != "auto")
    return {"tps": out, "ratio": out["auto"] / best if best > 0 else 0.0, "choices": list(choices)}


def report(name: str, res: dict) -> str:
    best = max(v for a, v in res["tps"].items() if a != "auto")
    lines = [f"## {name}", "", "| arm | tok/s | of the best fixed arm |", "|---|---:|---:|"]
    for a, v in res["tps"].items():
        lines.append(f"| {a} | {v:.1f} | {v / best:.3f} |")
    counts = collections.Counter(res["choices"])
    lines += ["", f"auto / best fixed arm: **{res['ratio']:.3f}**; auto's steps per arm: "
              + ", ".join(f"{'chain' if a == 0 else a}: {n}" for a, n in sorted(counts.items())),
              "", "auto's arms step by step (c chain, 4, 8, G = 16, X = 32): "
              + "".join(ARM_LETTERS.get(a, "?") for a in res["choices"]), ""]
    return "\n".join(lines)


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """The pairs and the run's size, as this script and scripts/p_min_sweep.py take them."""
    p.add_argument("-m", "--model", help="target GGUF")
    p.add_argument("-md", "--model-draft", help="drafter GGUF")
    p.add_argument("--demo", action="store_true", help="the bundled demo and weak pairs, f32 and q8_0 targets")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the prompts (default 2)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")


def pairs_of(p: argparse.ArgumentParser, args) -> list:
    """[(name, target, drafter)] of add_pair_args' flags (p.error when they do not add up)."""
    if args.demo == bool(args.model or args.model_draft) or (args.model is None) != (args.model_draft is None):
        p.error("give either --demo or both -m and -md")
    if args.rounds < 1 or args.max_tokens < 2:
        p.error("--rounds must be >= 1 and --max-tokens >= 2")
    import bench

    if not args.demo:
        return [(f"{Path(args.model).name} + {Path(args.model_draft).name}", args.model, args.model_draft)]
    return [(f"{pair} pair, {t} target", str(path), str(bench.DATA / f"{draft}.gguf"))
            for t, path in bench.demo_targets(("f32", "q8_0")).items()
            for pair, draft in (("demo", "demo-draft"), ("weak", "demo-draft-weak"))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_args(p)
    p.add_argument("--arms", type=parse_arms, default=parse_arms("auto,chain,4,8"),
                   help="auto and the fixed arms beside it (default auto,chain,4,8)")
    p.add_argument("--prompts", type=int, default=0, help="use only the first N bench prompts (default all)")
    args = p.parse_args(argv)
    pairs = pairs_of(p, args)

    import bench

    prompts = [text for _, text in bench.PROMPTS]
    prompts = prompts[:args.prompts] if args.prompts > 0 else prompts
    print(f"# load average {os.getloadavg()[0]:.2f}; {args.threads} threads; {len(prompts)} prompts x "
          f"{args.rounds} rounds, {args.max_tokens} tokens each; arms take turns prompt by prompt\n", flush=True)
    for name, target, draft in pairs:
        res = compare(target, draft, args.arms, args.rounds, args.max_tokens, args.threads, prompts)
        print(report(name, res), flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
