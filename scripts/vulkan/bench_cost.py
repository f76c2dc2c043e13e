#!/usr/bin/env python3
"""What the batch-invariant Vulkan kernels (ggml-patches/0003) cost against ggml-vulkan's
stock kernel choices, timed by llama.cpp's own llama-bench on Vulkan0: the same build both
ways, the stock arm under GGML_VK_BATCH_VARIANT=1 (the patch keeps the stock choices behind
that switch), arms interleaved in a shuffled order each repetition.

    .venv-vulkan/bin/python scripts/vulkan/bench_cost.py [-m MODEL.gguf] [-r 5] [--tg 64]
        [--pp 2,4,8,16] [-t 2] [--out results/vulkan-cost-DATE.json]

llama-bench is compiled here, once, against the Vulkan ggml and libllama of .venv-vulkan
(scripts/setup-vulkan.sh): its two sources from the pinned llama.cpp tree, linked to the
wheel's libraries (build/vulkan-bench/llama-bench). Each figure is llama-bench's tokens per
second (one run of `-r 1` per arm and repetition); the ratio is patched over stock within
each repetition, quoted as the median with its range.

On lavapipe (Mesa's software Vulkan, no GPU) this measures the kernels' shapes on a CPU: a
GPU's cost depends on its cooperative-matrix and subgroup paths, which lavapipe lacks, so a
card needs the same run (docs/exactness.md says what)."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from dflash_gguf.tools import llama_cpp_tree, real_models

ROOT = Path(__file__).resolve().parents[2]


def build_bench(venv: Path) -> Path:
    """llama-bench linked to the virtualenv's Vulkan ggml (compiled once)."""
    out = ROOT / "build" / "vulkan-bench" / "llama-bench"
    lib = next((venv / "lib").glob("python3*/site-packages/lib"))
    if out.exists() and out.stat().st_mtime > (lib / "libggml-vulkan.so").stat().st_mtime:
        return out
    src = llama_cpp_tree.source_dir()
    if src is None:
        sys.exit("no llama.cpp sources: run scripts/setup.sh test")
    tool = src / "tools" / "llama-bench"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[vulkan-bench] compiling llama-bench against {lib}", file=sys.stderr)
    subprocess.run(["g++", "-O2", "-std=c++17", str(tool / "main.cpp"), str(tool / "llama-bench.cpp"),
                    f"-I{src / 'common'}", f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-I{src / 'vendor'}",
                    f"-L{lib}", "-lllama-common", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-lpthread",
                    "-o", str(out)], check=True)
    return out


def vulkan_env() -> dict:
    return {**os.environ, "GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}


def run_arm(bench: Path, model: str, stock: bool, pp: list, tg: int, threads: int) -> dict:
    """tokens per second by test ("pp2", ..., "tg64") for one run of llama-bench."""
    env = vulkan_env()
    env.pop("GGML_VK_BATCH_VARIANT", None)
    if stock:
        env["GGML_VK_BATCH_VARIANT"] = "1"
    cmd = [str(bench), "-m", model, "-dev", "Vulkan0", "-ngl", "99", "-t", str(threads), "-r", "1", "-o", "json",
           "-p", ",".join(map(str, pp)), "-n", str(tg)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode != 0:
        sys.exit(f"llama-bench failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    out = {}
    for row in json.loads(res.stdout):
        name = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        out[name] = row["avg_ts"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the published Qwen2.5-Coder 0.5B)")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--pp", default="2,4,8,16")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--venv", default=str(ROOT / ".venv-vulkan"))
    ap.add_argument("--out")
    args = ap.parse_args()
    model = args.model or str(real_models.path("qwen2.5-coder-0.5b"))
    pp = [int(x) for x in args.pp.split(",")]
    bench = build_bench(Path(args.venv))
    runs = {"patched": [], "stock": []}
    for rep in range(args.reps):
        arms = ["patched", "stock"]
        random.Random(rep).shuffle(arms)
        for arm in arms:
            runs[arm].append(run_arm(bench, model, arm == "stock", pp, args.tg, args.threads))
            print(f"[vulkan-bench] rep {rep} {arm}: {runs[arm][-1]}", file=sys.stderr)
    tests = list(runs["patched"][0])
    table = {}
    for test in tests:
        ratios = [p[test] / s[test] for p, s in zip(runs["patched"], runs["stock"])]
        table[test] = {"patched_tps_median": statistics.median(p[test] for p in runs["patched"]),
                       "stock_tps_median": statistics.median(s[test] for s in runs["stock"]),
                       "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    device = subprocess.run([str(bench), "--list-devices"], capture_output=True, text=True,
                            env=vulkan_env()).stdout.strip().splitlines()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    record = {"what": "llama-bench tokens/s on Vulkan0, batch-invariant kernels (0003) vs stock choices "
                      "(GGML_VK_BATCH_VARIANT=1), same build, arms interleaved; ratio = patched / stock per repetition",
              "date": dt.datetime.now().isoformat(timespec="seconds"), "commit": commit, "uncommitted_changes": dirty,
              "load_average_at_start": os.getloadavg(), "model": model, "threads": args.threads, "reps": args.reps,
              "device": device[-1] if device else "", "table": table, "runs": runs}
    out = Path(args.out or ROOT / "results" / f"vulkan-cost-{dt.date.today()}.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    for test, row in table.items():
        print(f"{test:6s} patched {row['patched_tps_median']:8.2f} t/s  stock {row['stock_tps_median']:8.2f} t/s  "
              f"ratio {row['ratio_median']:.3f} [{row['ratio_min']:.3f}-{row['ratio_max']:.3f}]")
    print(f"[vulkan-bench] {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
