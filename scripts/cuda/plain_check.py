#!/usr/bin/env python3
"""Our plain greedy decoding of the bundled demo target on a device against the CPU's with
the same cache type, over a matrix of ggml-cuda's settings and cache types, and the
chain's on the device; where two texts part, the CPU's top-2 logits there (teacher-forced,
f32 cache): a near tie, or a fault.

    python scripts/cuda/plain_check.py [--device CUDA0] [-n 96] [--kv f16,bf16,f32,q8_0] \
        [--graphs on,off] [--pdl default,0] [--fusion on,off] [--out FILE]

Why: on the H100 (results/cuda-h100-2026-11-25-plain-check.json) plain decoding with
ggml's CUDA graphs on parted from the CPU's at its third token, and equalled it with them
off. Each cell runs in a process of its own (ggml-cuda reads its settings once): graphs
on (DFLASH_CUDA_GRAPHS=1) or off (the runtime's default), programmatic dependent launch
as built (on for sm_90) or off (GGML_CUDA_PDL=0), fusion on or off
(GGML_CUDA_DISABLE_FUSION=1), for each cache type. A kept graph that changed between
steps is ruled out on the CPU (DFLASH_CHECK_REUSE, docs/devices.md); which cell parts
says where the fault is. --out is written after every cell, so a call cut short keeps
what it finished. --rpc ENDPOINT registers a ggml RPC server first (--device RPC0: the
CPU's stand-in for a device, as the tests' dry run uses it; the settings then change
nothing).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "dflash_gguf" / "data"
PROMPT = "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
# each setting's values and the environment each value sets (None: left as built)
SETTINGS = {"graphs": {"on": {"DFLASH_CUDA_GRAPHS": "1"}, "off": {}},
            "pdl": {"default": {}, "0": {"GGML_CUDA_PDL": "0"}},
            "fusion": {"on": {}, "off": {"GGML_CUDA_DISABLE_FUSION": "1"}}}


def tokens(device: str, draft: bool, n: int, kv: str = "f16", rpc: Optional[str] = None) -> list:
    from dflash_gguf import Engine

    if rpc:
        from dflash_gguf.runtime.devices import add_rpc_server

        add_rpc_server(rpc)
    eng = Engine(str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf") if draft else None, n_ctx=1024,
                 kv_type=kv, device=device)
    try:
        return [int(t) for t in eng.generate(PROMPT, max_tokens=n, stop_tokens=()).tokens]
    finally:
        eng.close()


def in_child(env: dict, device: str, draft: bool, n: int, kv: str, rpc: Optional[str]) -> list:
    """tokens() in a fresh interpreter with `env` added: ggml-cuda reads its settings once."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import plain_check; "
            f"print(json.dumps(plain_check.tokens({device!r}, {draft!r}, {n}, {kv!r}, {rpc!r})))")
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         cwd="/")
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-1500:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def top2(prefix: list) -> list:
    """The CPU's two best tokens and logits after `prefix`, in f32 from one prefill."""
    from dflash_gguf import Target, TargetConfig
    from dflash_gguf.runtime.target import LOGITS_LAST

    t = Target(str(DATA / "demo-target.gguf"), TargetConfig(n_ctx=1024, kv_type="f32", device="CPU"))
    try:
        t.prefill(prefix, logits=LOGITS_LAST)
        row = np.asarray(t.logits(0, 1))[0]
    finally:
        t.close()
    best = np.argsort(row)[::-1][:2]
    return [[int(i), float(row[i])] for i in best]


def values(text: str, setting: str, p: argparse.ArgumentParser) -> list:
    got = [v for v in text.split(",") if v]
    bad = [v for v in got if v not in SETTINGS[setting]]
    if bad or not got:
        p.error(f"--{setting}: {', '.join(bad) or 'nothing'} is not one of {', '.join(SETTINGS[setting])}")
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="CUDA0")
    p.add_argument("-n", type=int, default=96, help="tokens each run decodes (default 96)")
    p.add_argument("--kv", default="f16,bf16,f32,q8_0", help="cache types (default f16,bf16,f32,q8_0)")
    p.add_argument("--graphs", default="on,off", help="CUDA graphs: on, off (default both)")
    p.add_argument("--pdl", default="default,0", help="programmatic dependent launch: default (as built), 0 (off)")
    p.add_argument("--fusion", default="on,off", help="ggml-cuda's op fusion: on, off (default both)")
    p.add_argument("--rpc", help="a ggml RPC server to register first (--device RPC0)")
    p.add_argument("--out", type=Path, help="results JSON, written after every cell")
    a = p.parse_args(argv)
    grid = [values(a.graphs, "graphs", p), values(a.pdl, "pdl", p), values(a.fusion, "fusion", p)]
    kvs = [k for k in a.kv.split(",") if k]
    from dflash_gguf import Engine

    with Engine(str(DATA / "demo-target.gguf"), None, n_ctx=1024) as eng:
        prompt = eng.encode(PROMPT)
    refs = {kv: tokens("CPU", False, a.n, kv) for kv in dict.fromkeys(kvs + ["f16"])}  # the CPU's, cache by cache
    out = {"device": a.device, "n": a.n, "prompt_tokens": len(prompt), "cells": []}
    t0 = time.perf_counter()

    def record(cell: dict, toks: list) -> None:
        ref = refs[cell["kv"]]
        k = next((i for i, (x, y) in enumerate(zip(ref, toks)) if x != y), None)
        if k is None and len(toks) != len(ref):
            k = min(len(toks), len(ref))
        cell.update(tokens=len(toks), parts_from_cpu_at=k)
        if k is not None and k < min(len(toks), len(ref)):
            cell.update(cpu_top2_there=top2(list(prompt) + ref[:k]), ours_there=toks[k], cpu_there=ref[k])
        out["cells"].append(cell)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        if a.out:
            a.out.write_text(json.dumps(out, indent=1))
        what = ", ".join(f"{k}={v}" for k, v in cell.items() if k in ("mode", "kv", *SETTINGS))
        print(f"{what}: " + ("equal to the CPU's plain decoding" if k is None else
                             f"parts at token {k}" + (f": {toks[k]} vs {ref[k]}, CPU top-2 {cell['cpu_top2_there']}"
                                                      if k < min(len(toks), len(ref)) else " (shorter)")), flush=True)

    for graphs, pdl, fusion in itertools.product(*grid):
        env = {**SETTINGS["graphs"][graphs], **SETTINGS["pdl"][pdl], **SETTINGS["fusion"][fusion]}
        for kv in kvs:
            cell = {"mode": "plain", "kv": kv, "graphs": graphs, "pdl": pdl, "fusion": fusion}
            try:
                record(cell, in_child(env, a.device, False, a.n, kv, a.rpc))
            except RuntimeError as e:
                out["cells"].append({**cell, "error": str(e)})
                print(f"{cell}: failed: {str(e)[-300:]}", flush=True)
    record({"mode": "chain", "kv": "f16", "graphs": "off", "pdl": "default", "fusion": "on"},
           in_child({}, a.device, True, a.n, "f16", a.rpc))
    parted = [c for c in out["cells"] if c.get("parts_from_cpu_at") is not None or "error" in c]
    print(f"{len(out['cells']) - len(parted)} of {len(out['cells'])} cells equal to the CPU's plain decoding")
    return 1 if parted else 0


if __name__ == "__main__":
    sys.exit(main())
