#!/usr/bin/env python3
"""JSON generation under a schema (issue #40's benchmark): tok/s and AL of plain, chain,
tree and auto decoding, each with and without grammar-aware drafting, greedy and at
T 0.6 / top-k 20 / top-p 0.95, arms interleaved within each repetition; and, with
--mask-cost, what the allowed-token mask adds to a target pass at Qwen3.5's 248,320-token
vocabulary (the shape model of scripts/sampling_cost.py: a chain pass of 16 rows, greedy,
without masks and with a mask on every row).

    .venv/bin/python scripts/bench_grammar.py [-m target.gguf -md draft.gguf] [--reps 3]
        [--max-tokens 128] [--threads 2] [--mask-cost] [--out results/]

Without -m it runs the bundled demo pair. Time only on an idle machine: the results file
records the load average before and after.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dflash_gguf.constraints import Constraint
from dflash_gguf.demo import demo_paths
from dflash_gguf.engine import Engine
from dflash_gguf.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_cost import ROOT, make_files, provenance  # noqa: E402  (the shape model and the provenance)

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "version": {"type": "string", "maxLength": 16},
                         "dependencies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                          "maxItems": 8},
                         "scripts": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 60}}},
          "required": ["name", "version", "dependencies", "scripts"], "additionalProperties": False}
PROMPTS = ["# package.json of a small web app\n", "def manifest():\n    return ", "config = "]
SETTINGS = {"greedy": {}, "T0.6": {"temperature": 0.6, "top_k": 20, "top_p": 0.95}}
MODES = ("plain", "chain", "tree", "auto")


def engines(model: str, draft: str, threads: int) -> dict:
    common = {"n_ctx": 1024, "n_threads": threads}
    return {"plain": Engine(model, None, **common), "chain": Engine(model, draft, **common),
            "tree": Engine(model, draft, tree_budget=16, **common),
            "auto": Engine(model, draft, tree_budget="auto", **common)}


def run(engines_: dict, reps: int, max_tokens: int) -> list:
    constraint = Constraint.json_schema(SCHEMA)
    rows = {}
    for rep in range(reps):
        for setting, extra in SETTINGS.items():
            for prompt in PROMPTS:
                for mode in MODES:
                    for aware in ((True,) if mode == "plain" else (True, False)):
                        engine = engines_[mode]
                        engine.grammar_drafting = aware
                        params = SamplingParams(seed=rep, constraint=constraint, **extra)
                        t0 = time.perf_counter()
                        r = engine.generate(prompt, max_tokens, sampling=params)
                        wall = time.perf_counter() - t0
                        row = rows.setdefault((setting, mode, aware), {"tps": [], "al": [], "valid": 0, "n": 0})
                        row["tps"].append(r.stats.decode_tps)
                        row["al"].append(r.stats.mean_accepted if mode != "plain" else 1.0)
                        row["n"] += 1
                        row["wall"] = row.get("wall", 0.0) + wall
                        try:
                            json.loads(r.text)
                            row["valid"] += 1
                        except ValueError:
                            pass  # cut by max_tokens mid-structure
    return [{"setting": s, "mode": m, "grammar_drafting": a, "tok_s_median": statistics.median(v["tps"]),
             "al_median": statistics.median(v["al"]), "complete_json": v["valid"], "runs": v["n"]}
            for (s, m, a), v in rows.items()]


def mask_cost(threads: int, reps: int) -> dict:
    """Median chain pass (16 rows, greedy) on the 248K-vocabulary shape model, without and
    with a mask on every row, alternating."""
    from dflash_gguf.target import Target, TargetConfig

    model, _ = make_files()
    target = Target(str(model), TargetConfig(n_ctx=512, n_threads=threads, n_verify=16))
    words = (target.n_vocab + 31) // 32
    mask = np.full((16, words), 0xFFFFFFFF, dtype=np.uint32)
    mask[:, 1::2] = 0x0F0F0F0F
    prompt = list(range(100, 164))
    times = {"none": [], "masked": []}
    for i in range(2 * reps + 2):
        masked = i % 2 == 1
        target.reset()
        target.decode(prompt)
        if masked:
            target.set_masks(mask)
        t0 = time.perf_counter()
        target.verify(list(range(200, 216)))
        target.choices(0, 16)
        if i >= 2:
            times["masked" if masked else "none"].append(time.perf_counter() - t0)
    target.close()
    none, masked = statistics.median(times["none"]), statistics.median(times["masked"])
    return {"n_vocab": int(target.n_vocab), "rows": 16, "pass_seconds": none, "masked_pass_seconds": masked,
            "mask_share": (masked - none) / none, "upload_bytes_per_pass": 16 * words * 4 * 4}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model")
    p.add_argument("-md", "--model-draft")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mask-cost", action="store_true", help="also time the mask at a 248K vocabulary")
    p.add_argument("--out", default=str(ROOT / "results"), help="folder for the results file")
    args = p.parse_args(argv)
    model, draft = (args.model, args.model_draft) if args.model else demo_paths()
    prov = provenance(args.threads)
    es = engines(model, draft, args.threads)
    try:
        res = {"arms": run(es, args.reps, args.max_tokens)}
    finally:
        for e in es.values():
            e.close()
    if args.mask_cost:
        res["mask_cost"] = mask_cost(args.threads, max(args.reps, 5))
    prov["loadavg_after"] = os.getloadavg()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"bench-grammar-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "bench_grammar", "model": str(model), "draft": str(draft),
                               "schema": SCHEMA, "prompts": PROMPTS, "max_tokens": args.max_tokens,
                               "reps": args.reps, **prov, "results": res}, indent=1))
    for row in res["arms"]:
        print(f"{row['setting']:7s} {row['mode']:6s} grammar drafting {'on ' if row['grammar_drafting'] else 'off'} "
              f"{row['tok_s_median']:8.1f} tok/s  AL {row['al_median']:.2f}  complete {row['complete_json']}/"
              f"{row['runs']}")
    if "mask_cost" in res:
        m = res["mask_cost"]
        print(f"mask at {m['n_vocab']} tokens, {m['rows']} rows: {m['mask_share'] * 100:.1f}% of a pass")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
