#!/usr/bin/env python3
"""Our plain greedy decoding of the bundled demo target on a device against the same
engine's chain and against the CPU, and, where two texts part, the top-2 logits there
(teacher-forced on the CPU, f32): a near tie, or a fault of one path.

    python scripts/cuda/plain_check.py [--device CUDA0] [-n 128]

Why: on the H100 (results/cuda-h100-2026-11-25-1828-part1.json) our plain decoding of
the demo pair's code prompt parted from our own chain, tree and llama-completion (which
agreed with each other) at the third token, and auto (plainly decoding) parted from both.
Run it with GGML_CUDA_DISABLE_GRAPHS=1 as well: ggml's CUDA graphs replay a captured
single-row graph, the one path that only plain decoding takes every step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "dflash_gguf" / "data"
PROMPT = "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file.\"\"\"\n"


def tokens(device: str, draft: bool, n: int, kv: str = "f16") -> list:
    from dflash_gguf import Engine

    eng = Engine(str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf") if draft else None, n_ctx=1024,
                 kv_type=kv, device=device)
    try:
        return [int(t) for t in eng.generate(PROMPT, max_tokens=n, stop_tokens=()).tokens]
    finally:
        eng.close()


def top2(prefix: list) -> list:
    """The CPU's two best tokens and logits after `prefix`, in f32 from one prefill."""
    from dflash_gguf import Target, TargetConfig
    from dflash_gguf.target import LOGITS_LAST

    t = Target(str(DATA / "demo-target.gguf"), TargetConfig(n_ctx=1024, kv_type="f32", device="CPU"))
    t.prefill(prefix, logits=LOGITS_LAST)
    row = np.asarray(t.logits(0, 1))[0]
    best = np.argsort(row)[::-1][:2]
    return [[int(i), float(row[i])] for i in best]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="CUDA0")
    p.add_argument("-n", type=int, default=128)
    p.add_argument("--kv", default="f16,f32", help="cache types of the device's plain runs (default f16,f32: "
                   "the device tests' f32 caches never parted, the Engine's f16 did)")
    a = p.parse_args(argv)
    from dflash_gguf import Engine

    prompt = Engine(str(DATA / "demo-target.gguf"), None, n_ctx=1024).encode(PROMPT)
    runs = {"cpu plain": tokens("CPU", False, a.n),
            **{f"{a.device} plain {kv}": tokens(a.device, False, a.n, kv) for kv in a.kv.split(",")},
            f"{a.device} chain": tokens(a.device, True, a.n)}
    ref = runs["cpu plain"]
    out = {"prompt_tokens": len(prompt), "runs": {}}
    for name, toks in runs.items():
        k = next((i for i, (x, y) in enumerate(zip(ref, toks)) if x != y), None)
        row = {"tokens": len(toks), "parts_from_cpu_plain_at": k}
        if k is not None:
            row["cpu_top2_there"] = top2(list(prompt) + ref[:k])
            row["ours_there"] = toks[k]
        out["runs"][name] = row
        print(f"{name:>14}: " + ("equal to cpu plain" if k is None else
                                 f"parts at token {k}: {toks[k]} vs {ref[k]}; CPU top-2 {row['cpu_top2_there']}"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
