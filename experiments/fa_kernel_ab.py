#!/usr/bin/env python3
"""A CPU flash-attention patch against the kernels it replaces, op by op: the harness
experiments/fa_row_invariance.c (FA_BENCH) run over two builds of ggml-cpu, the patch set
with the patch (--new: the directory of its libggml-cpu.so.0) and without it (--old), same
harness, same libggml-base. Each run times one ggml_flash_attn_ext of n query rows at the
end of an n_kv-cell cache (causal mask, 12 query heads over 2 KV heads of 128: the
Qwen2.5 1.5B's shape) against the stock one-row kernel in the same library (use_ref), as
thread CPU time (one thread: on a loaded machine wall time measures the neighbours),
the best of --reps. Without patch 0007, up to 256 rows take the one-row kernel and more
the tiled one (patch 0001); with it, up to 256 rows, one included, take its exact tiled
kernel, its tiles spanning the heads of a KV head, and more keep ggml's tiled kernel.

    gcc -O2 -o /tmp/fa experiments/fa_row_invariance.c -I$GGML/include -L$NEW -lggml -lggml-base -lggml-cpu -lm
    python3 experiments/fa_kernel_ab.py --harness /tmp/fa --new NEW_LIB_DIR --old OLD_LIB_DIR \\
        --out results/fa-kernel-ab-<date>.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

CASES = [  # (kv type 1 f16 / 0 f32, rows, depth)
    (1, 1, 0), (1, 16, 0), (1, 1, 2048), (1, 1, 8192), (1, 1, 16384), (1, 4, 8192), (1, 16, 2048),
    (1, 64, 2048), (1, 16, 8192), (1, 64, 8192), (1, 16, 16384), (1, 64, 16384), (1, 512, 0), (1, 512, 2048),
    (0, 1, 8192), (0, 64, 8192), (0, 512, 2048),
]
LINE = re.compile(r"new ([0-9.]+) ms, one-row kernel \(use_ref\) ([0-9.]+) ms")


def bench(harness: str, lib: str, kv: int, rows: int, depth: int, reps: int) -> tuple:
    env = dict(os.environ, FA_BENCH=str(reps), LD_LIBRARY_PATH=lib)
    out = subprocess.run([harness, str(kv), "128", "12", "2", str(depth + rows), str(rows), "0", "0", "0", "0", "0",
                          "1"], env=env, capture_output=True, text=True, check=True).stdout
    m = LINE.search(out)
    return float(m.group(1)), float(m.group(2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--harness", required=True)
    p.add_argument("--new", required=True, help="directory of libggml-cpu.so.0 with the patch")
    p.add_argument("--old", required=True, help="directory of libggml-cpu.so.0 without it")
    p.add_argument("--patch", required=True, help="the patch's file name, for the record")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    table = []
    for kv, rows, depth in CASES:
        load = os.getloadavg()[0]
        new, ref = bench(args.harness, args.new, kv, rows, depth, args.reps)
        old, _ = bench(args.harness, args.old, kv, rows, depth, args.reps)
        row = {"kv": "f16" if kv == 1 else "f32", "rows": rows, "depth": depth, "with_patch_ms": new,
               "without_patch_ms": old, "one_row_kernel_ms": ref, "old_over_new": round(old / new, 3),
               "load_1m_at_start": round(load, 2)}
        table.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), "")
    doc = {"tool": "fa_kernel_ab", "patch": args.patch, "argv": sys.argv, "date": datetime.datetime.utcnow().isoformat() + "Z",
           "commit": commit, "cpu": cpu, "threads": 1, "clock": "thread CPU time, best of reps",
           "shape": "12 query heads over 2 KV heads, head dim 128, causal mask", "table": table}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
