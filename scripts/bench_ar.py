#!/usr/bin/env python3
"""Autoregressive decode speed of the dflash-gguf target runtime against llama.cpp
(llama-cpp-python), on the same GGUF with the same thread count, plus the cost of a
verify of k tokens relative to one decode step.

    .venv/bin/python scripts/bench_ar.py            # Qwen3.5-0.8B shape, q4_k_m, 2 threads
    .venv/bin/python scripts/bench_ar.py --quick    # tiny model, a sanity run in seconds
    .venv/bin/python scripts/bench_ar.py --arch all # one table per target family (qwen35, qwen3, qwen35moe)
    .venv/bin/python scripts/bench_ar.py -t 4 --runs 5 --tokens 128

The model is random-weight with the text shape of Qwen3.5-0.8B (taken from its
config.json: hidden 1024, 24 layers as 3x linear-attention + 1x full-attention, FFN 3584,
8 query / 2 KV heads of 256, gated delta net with 16 key and 16 value heads of 128, conv
kernel 4, tied embeddings, vocab 248320, rope theta 1e7, partial rotary 0.25). It is built
with transformers, converted to GGUF with our converter (`--outtype`, default q4_k_m) and
cached under .cache/bench/. Random weights decode as fast as trained ones: the work per
token depends only on the shapes.

Method: every decode run is a fresh child process (no shared thread pools; a crash is
reported instead of ending the bench), the two engines alternating run by run with the
order flipped each time, so that load changes on a shared machine hit both alike. A run
prefills a fresh prompt of --prompt random tokens (not timed), warms up, then times
--tokens greedy steps, each = one decode of the previous argmax (ours: argmax on the
device; llama.cpp: numpy argmax of its last logits row). Reported: tokens/second as 1 /
the median step time over all runs (robust to bursts of foreign load), and the median
per-run throughput. Both engines use an f16 KV cache; llama.cpp runs with flash attention
(ours always does) and its default weight repacking. Verify: at a context of --prompt
tokens, `verify(k)` + argmax + `commit(0)` for k in 1, 4, 8, 16, 32, --reps times each
(interleaved), median, divided by the median decode step; for reference llama.cpp's time
to decode a batch of k tokens with logits for every row, as a verify needs them, at the
same context (its prefill redone before each, not timed). On a loaded machine the numbers are noise: check the load average printed with
the table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench"

# Qwen3.5-0.8B text model (config.json "text_config"); see the module docstring.
QWEN35_08B = dict(hidden=1024, layers=24, ffn=3584, heads=8, kv_heads=2, head_dim=256, lin_k_heads=16,
                  lin_v_heads=16, lin_k_dim=128, lin_v_dim=128, tie=True, vocab_size=248320)
ROPE_THETA_08B = 10_000_000.0
# --quick: every matrix row a multiple of 256 so K-quants apply, small enough to build in seconds
QUICK = dict(hidden=256, layers=4, ffn=512, heads=4, kv_heads=2, head_dim=64, lin_k_heads=2,
             lin_v_heads=4, lin_k_dim=64, lin_v_dim=64, tie=True, vocab_size=2048)
# Qwen3-0.6B (config.json): attention only
QWEN3_06B = dict(hidden=1024, layers=28, ffn=3072, heads=16, kv_heads=8, head_dim=128, tie=True, vocab_size=151936)
QWEN3_QUICK = dict(hidden=256, layers=4, ffn=512, heads=4, kv_heads=2, head_dim=64, tie=True, vocab_size=2048)
# Qwen3.5-35B-A3B's layer structure (hybrid, 256-wide expert FFNs, 8 routed + a shared
# expert, vocabulary) at a width and depth that builds in minutes: hidden 1024, 24 layers,
# 32 experts
QWEN35MOE_SMALL = dict(hidden=1024, layers=24, heads=8, kv_heads=2, head_dim=256, lin_k_heads=16, lin_v_heads=16,
                       lin_k_dim=128, lin_v_dim=128, experts=32, experts_used=8, expert_ffn=512, shared_ffn=512,
                       vocab_size=248320)
QWEN35MOE_QUICK = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, lin_k_heads=2, lin_v_heads=4,
                       lin_k_dim=64, lin_v_dim=64, experts=8, experts_used=2, expert_ffn=256, shared_ffn=256,
                       vocab_size=2048)
# arch -> (fixture builder name, full shape, name, quick shape)
ARCHS = {
    "qwen35": ("make_qwen35", QWEN35_08B, "Qwen3.5-0.8B shape", QUICK),
    "qwen3": ("make_qwen3", QWEN3_06B, "Qwen3-0.6B shape", QWEN3_QUICK),
    "qwen35moe": ("make_qwen35moe", QWEN35MOE_SMALL, "Qwen3.5-35B-A3B structure, 1024 wide, 24 layers, 32 experts",
                  QWEN35MOE_QUICK),
}

VERIFY_KS = (1, 4, 8, 16, 32)


# ---- model ---------------------------------------------------------------------------------

def build_gguf(name: str, shape: dict, outtype: str, rope_theta: float | None, keep_hf: bool,
               builder: str = "make_qwen35") -> Path:
    """The cached GGUF for a shape, building the checkpoint and converting it when missing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    gguf = CACHE / f"{name}-{outtype}.gguf"
    if gguf.exists():
        return gguf
    hf_dir = CACHE / f"{name}-hf"
    if not (hf_dir / "config.json").exists():
        sys.path.insert(0, str(ROOT / "tests"))
        import torch

        import fixtures  # tests/fixtures.py: seeded random checkpoints + tokenizer

        print(f"[bench] building a random {name} checkpoint in {hf_dir} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        getattr(fixtures, builder)(hf_dir, dtype=torch.bfloat16, seed=0, **shape)
        if rope_theta is not None:
            cfg_path = hf_dir / "config.json"
            cfg = json.loads(cfg_path.read_text())
            rp = cfg.get("rope_parameters") or {}
            rp["rope_theta"] = rope_theta
            cfg["rope_parameters"] = rp
            cfg_path.write_text(json.dumps(cfg, indent=2))
        print(f"[bench] built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    from dflash_gguf.convert.cli import main as convert

    print(f"[bench] converting to {outtype} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    tmp = gguf.with_suffix(".tmp.gguf")
    rc = convert([str(hf_dir), "--outtype", outtype, "--outfile", str(tmp), "--force"])
    if rc != 0:
        raise SystemExit(f"conversion failed with exit code {rc}")
    tmp.rename(gguf)
    print(f"[bench] converted in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if not keep_hf:
        shutil.rmtree(hf_dir)
    return gguf


# ---- workers (child processes) -----------------------------------------------------------------

def _prompts(n_vocab: int, n_prompts: int, length: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(1234)
    # stay clear of the padded tail of the vocabulary: real prompts use real tokens
    hi = min(n_vocab, 1000)
    return [rng.integers(0, hi, size=length).tolist() for _ in range(n_prompts)]


def worker_ours(a: dict) -> dict:
    from dflash_gguf.target import LOGITS_LAST, LOGITS_NONE, Target, TargetConfig

    n_ctx = a["prompt"] + a["tokens"] + max(VERIFY_KS) + 8
    cfg = TargetConfig(n_ctx=n_ctx, n_ubatch=512, n_verify=max(VERIFY_KS), n_threads=a["threads"], kv_type="f16")
    t0 = time.perf_counter()
    t = Target(a["gguf"], cfg)
    load_s = time.perf_counter() - t0
    prompts = _prompts(t.n_vocab, a["n_prompts"], a["prompt"])

    def decode_run(prompt, n):
        t.reset()
        t.prefill(prompt, LOGITS_LAST)
        tok = int(t.argmax(0, 1)[0])
        steps = []
        t_start = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            t.decode([tok], LOGITS_LAST)
            tok = int(t.argmax(0, 1)[0])
            steps.append(time.perf_counter() - t0)
        return n / (time.perf_counter() - t_start), steps

    decode_run(prompts[0][:16], 4)                     # warm-up: graph allocation, page faults
    if a["mode"] == "decode":
        tps, steps = decode_run(prompts[a["run"]], a["tokens"])
        return {"tps": tps, "steps": steps, "load_s": load_s}

    # verify: single decode steps and verifies of each k at the same context length,
    # interleaved rep by rep so that a burst of load on a shared machine hits all alike
    t.reset()
    t.prefill(prompts[0], LOGITS_NONE)
    for k in VERIFY_KS:                                # warm-up: one graph per shape
        t.verify(list(range(10, 10 + k)))
        t.commit(0)
    step, verify = [], {k: [] for k in VERIFY_KS}
    for _ in range(a["reps"]):
        t0 = time.perf_counter()
        t.decode([7], LOGITS_LAST)
        t.argmax(0, 1)
        step.append(time.perf_counter() - t0)
        t.reset()
        t.prefill(prompts[0], LOGITS_NONE)
        for k in VERIFY_KS:
            cands = list(range(10, 10 + k))
            t0 = time.perf_counter()
            t.verify(cands)
            t.argmax(0, k)
            t.commit(0)
            verify[k].append(time.perf_counter() - t0)
    return {"step": statistics.median(step), "verify": {k: statistics.median(v) for k, v in verify.items()}}


def open_llama(path: str, n_ctx: int, threads: int, logits_all: bool):
    """llama-cpp-python on `path` as both benchmarks run it (flash attention, f16 KV
    cache, the same threads for decode and batches): (llm, last_argmax(), load seconds)."""
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                flash_attn=True, logits_all=logits_all, verbose=False)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx

    def last_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    return llm, last_argmax, load_s


def worker_llama(a: dict) -> dict:
    n_ctx = a["prompt"] + a["tokens"] + max(VERIFY_KS) + 8
    # a verify needs logits for every row (llama.cpp's own speculative decoding asks for
    # them too); plain decoding only for the last
    llm, last_argmax, load_s = open_llama(a["gguf"], n_ctx, a["threads"], logits_all=a["mode"] != "decode")
    n_vocab = llm.n_vocab()
    prompts = _prompts(n_vocab, a["n_prompts"], a["prompt"])

    def decode_run(prompt, n):
        llm.reset()
        llm.eval(prompt)
        tok = last_argmax()
        steps = []
        t_start = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            llm.eval([tok])
            tok = last_argmax()
            steps.append(time.perf_counter() - t0)
        return n / (time.perf_counter() - t_start), steps

    decode_run(prompts[0][:16], 4)
    if a["mode"] == "decode":
        tps, steps = decode_run(prompts[a["run"]], a["tokens"])
        return {"tps": tps, "steps": steps, "load_s": load_s}

    batch = {k: [] for k in VERIFY_KS}
    for _ in range(a["reps"]):
        for k in VERIFY_KS:
            llm.reset()
            llm.eval(prompts[0])
            t0 = time.perf_counter()
            llm.eval(list(range(10, 10 + k)))
            last_argmax()
            batch[k].append(time.perf_counter() - t0)
    batch = {k: statistics.median(v) for k, v in batch.items()}
    return {"step": batch[1], "batch": batch}


def run_worker(engine: str, args: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, json.dumps(args)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=str(CACHE))
    if res.returncode != 0:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit code {res.returncode}"
        tail = res.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"{engine} failed ({how}) {tail[0]}"}
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("@@")), None)
    if line is None:
        return {"error": f"{engine} printed no result: {res.stderr[-500:]}"}
    return json.loads(line[2:])


def measure(engine_args: dict, runs: int) -> dict:
    """Decode runs of both engines in alternation (each run in a fresh child, the order
    flipped every run) so that load changes on a shared machine hit both alike; then the
    verify/batch timings of each."""
    out = {e: {"tps": [], "steps": [], "load_s": []} for e in ("ours", "llama")}
    for i in range(runs):
        order = ("ours", "llama") if i % 2 == 0 else ("llama", "ours")
        for e in order:
            if "error" in out[e]:
                continue
            r = run_worker(e, {**engine_args, "mode": "decode", "run": i})
            if "error" in r:
                out[e] = r
                continue
            out[e]["tps"].append(r["tps"])
            out[e]["steps"] += r["steps"]
            out[e]["load_s"].append(r["load_s"])
        print(f"[bench] run {i + 1}/{runs} done", file=sys.stderr, flush=True)
    for e in ("ours", "llama"):
        if "error" not in out[e]:
            r = run_worker(e, {**engine_args, "mode": "verify", "run": 0})
            out[e].update(r) if "error" not in r else out[e].update({"verify_error": r["error"]})
    return out


# ---- report ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--outtype", default="q4_k_m", help="GGUF tensor types for our converter (default q4_k_m)")
    p.add_argument("--gguf", type=Path, help="benchmark this GGUF instead of building one")
    p.add_argument("--runs", type=int, default=6, help="decode runs per engine (median reported)")
    p.add_argument("--tokens", type=int, default=64, help="timed decode steps per run")
    p.add_argument("--prompt", type=int, default=64, help="prompt length (prefilled, not timed)")
    p.add_argument("--reps", type=int, default=9, help="repetitions of each verify timing")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: a sanity run")
    p.add_argument("--arch", choices=[*ARCHS, "all"], default="qwen35",
                   help="target family of the random shape model (default qwen35; all: one table each)")
    p.add_argument("--keep-hf", action="store_true", help="keep the generated HF checkpoint in .cache/bench")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("worker_args", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        fn = {"ours": worker_ours, "llama": worker_llama}[args.worker]
        print("@@" + json.dumps(fn(json.loads(args.worker_args))), flush=True)
        return 0

    if args.quick:
        args.runs, args.tokens, args.prompt, args.reps = min(args.runs, 3), min(args.tokens, 24), \
            min(args.prompt, 32), min(args.reps, 5)
    if args.gguf:
        return bench_one(args, args.gguf.resolve(), args.gguf.name)
    for arch in (ARCHS if args.arch == "all" else [args.arch]):
        builder, shape, label, quick = ARCHS[arch]
        if args.quick:
            gguf = build_gguf(f"quick-{arch}", quick, args.outtype, None, args.keep_hf, builder)
            label = f"{arch}, tiny (hidden 256, 4 layers)"
        else:
            gguf = build_gguf(f"{arch}-bench-shape", shape, args.outtype, ROPE_THETA_08B if arch == "qwen35" else None,
                              args.keep_hf, builder)
            label += ", random weights"
        bench_one(args, gguf, label)
    return 0


def bench_one(args, gguf: Path, shape_name: str) -> int:
    CACHE.mkdir(parents=True, exist_ok=True)
    wargs = {"gguf": str(gguf), "threads": args.threads, "tokens": args.tokens, "prompt": args.prompt,
             "reps": args.reps, "n_prompts": args.runs}
    print(f"[bench] {gguf.name}: {args.runs} decode runs per engine ...", file=sys.stderr, flush=True)
    res = measure(wargs, args.runs)
    ours, theirs = res["ours"], res["llama"]

    import llama_cpp

    size_mb = gguf.stat().st_size / 2**20
    print(f"\n### AR decode: {shape_name}, `{gguf.name}` ({size_mb:.0f} MiB)\n")
    print(f"{args.threads} threads, f16 KV cache, prompt {args.prompt} tokens (not timed), "
          f"{args.tokens} greedy steps per run, {args.runs} runs per engine in alternation; "
          f"llama-cpp-python {llama_cpp.__version__} with flash attention and its default weight repacking; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end.\n")
    print("| engine | decode tok/s (1 / median step) | median ms/step | tok/s per run: median (min..max) | load s |")
    print("|---|---:|---:|---:|---:|")
    step = {}
    for key, name, r in (("ours", "dflash-gguf", ours), ("llama", "llama.cpp", theirs)):
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | |")
            continue
        step[key] = statistics.median(r["steps"])
        print(f"| {name} | {1 / step[key]:.1f} | {1000 * step[key]:.2f} | {statistics.median(r['tps']):.1f} "
              f"({min(r['tps']):.1f}..{max(r['tps']):.1f}) | {statistics.median(r['load_s']):.2f} |")
    if len(step) == 2:
        print(f"\ndflash-gguf / llama.cpp decode speed: **{step['llama'] / step['ours']:.2f}x** "
              f"(median step; by median run throughput "
              f"{statistics.median(ours['tps']) / statistics.median(theirs['tps']):.2f}x)")

    if "verify" in ours:
        print(f"\n### Verify cost relative to one decode step (context {args.prompt} tokens, "
              f"median of {args.reps}; one decode step = the median step of the decode runs)\n")
        print("| k tokens | ours: verify+commit(0) ms | x one decode | llama.cpp: batch of k, all logits, ms | x its decode |")
        print("|---:|---:|---:|---:|---:|")
        for k in VERIFY_KS:
            v = ours["verify"][str(k)]
            cells = [f"{k}", f"{1000 * v:.2f}", f"{v / step['ours']:.2f}"]
            if "batch" in theirs and "llama" in step:
                b = theirs["batch"][str(k)]
                cells += [f"{1000 * b:.2f}", f"{b / step['llama']:.2f}"]
            else:
                cells += ["", ""]
            print("| " + " | ".join(cells) + " |")
    for e in ("ours", "llama"):
        if "verify_error" in res[e]:
            print(f"\n{e}: verify timing failed: {res[e]['verify_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
