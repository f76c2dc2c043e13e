#!/usr/bin/env python3
"""Plain decoding and the verify cost of dflash-gguf's target runtime against llama.cpp's
own benchmark tool, `llama-bench`, per target architecture, on the same GGUF with the same
thread count at the same context length.

    .venv/bin/python scripts/bench_ar.py                  # qwen35, qwen3 and qwen35moe shapes, q4_k_m, 2 threads
    .venv/bin/python scripts/bench_ar.py --quick          # tiny shapes: a sanity run, well under a minute per arch
    .venv/bin/python scripts/bench_ar.py --arch qwen3 -t 4 --runs 7
    .venv/bin/python scripts/bench_ar.py --gguf model.gguf

(Run it by its path from anywhere; it runs its workers from .cache/bench so that the
source tree never shadows the installed package.)

The peer is llama.cpp measured at its best: `llama-bench`, built from the pinned
llama-cpp-python sdist (the same ggml) into .cache/llama-cpp-build/ by
scripts/llama_cpp_build.py (once; nice 10, -j2, ~10+ minutes on 2 cores), never a Python
loop around its library. Both engines: f16 KV cache, CPU weight repacking on (llama.cpp's
default), --threads threads, the same GGUF. Ours always uses flash attention; llama-bench
runs with flash attention off and on (--fa 0,1) and the faster setting counts, per test.

Models: random weights with published shapes (work per token depends only on shapes),
built with tests/fixtures.py and converted with our converter (--outtype, default
q4_k_m), cached under .cache/bench/ by a hash of the shape:
  qwen35     Qwen3.5-0.8B text shape: hidden 1024, 24 layers (3 Gated DeltaNet + 1 gated
             attention, repeated), FFN 3584, 8 query / 2 KV heads of 256, GDN 16 key and
             16 value heads of 128, tied embeddings, vocab 248320, rope theta 1e7.
  qwen3      Qwen3-0.6B: hidden 1024, 28 layers, 16 query / 8 KV heads of 128, FFN 3072,
             tied embeddings, vocab 151936.
  qwen35moe  Qwen3.5-35B-A3B's layer structure reduced to build in minutes: its hybrid
             pattern, 8 routed experts of expert FFN 512 + a shared expert of 512, vocab
             248320, but hidden 1024, 24 layers and 32 experts (the real model: hidden
             2048, 40 layers, 256 experts), attention and GDN heads as qwen35 above.
--quick uses a tiny shape of each (hidden 256, 4 layers, vocab 2048).

Method. Rounds (--runs) alternate the engines, the order flipped every round, each
measurement a fresh process (ours: a child Python process on the C runtime; theirs: one
llama-bench invocation), so that load changes on a shared machine hit both alike:
  decode  ours: prefill --prompt tokens (not timed), then time --tokens steps of decode +
          argmax on the device, --reps times per process (reset and prefill again before
          each, the last prompt token through the one-token graph: not timed); theirs: `llama-bench -d PROMPT -n TOKENS -p 0 -r REPS`
          (restores the prefilled state before each rep, not timed, then times TOKENS
          single-token decodes). tok/s = TOKENS / the typical rep time (the lower quartile
          of all reps' times: other processes only ever add to a rep's time, and on this
          machine they moved medians by 30% between runs).
  verify  at a context of --prompt tokens, for k in --ks (default 1, 2, 3, 4, 6, 8, 12, 16,
          24, 32: the sizes --tree-budget auto picks among), grouped by k (one
          graph per shape, reused as in decoding): ours `verify(k)` + argmax of all k rows
          + `commit(0)` (the LM head over all k rows, as speculative decoding needs), and
          for a like-for-like reading a plain batch of k tokens with last-row logits and
          with all-row logits (successive batches from that context while the attention
          span stays in its 256-row KV padding, the span both engines compute over; a
          fresh context and an untimed batch otherwise); theirs
          `llama-bench -d PROMPT -p K1,K2,... -n 0 -r REPS` (one batch of k tokens per
          rep; llama-bench asks for logits of the LAST row only). Median over all reps.
Ours never builds a graph inside a timed section (checked and reported). Ratios are
speed ratios, ours over theirs (>1: ours faster). Rep times are sums, so on a loaded
machine a few preemptions dominate them and the numbers are noise: the load average is
printed with every table.

Report: markdown on stdout, saved with the raw samples (JSON) as
results/bench-ar-<date>[-quick].md/.json (--no-save: stdout only).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_build import LLAMA_CPP_PYTHON_VERSION, build_llama, llama_binary  # noqa: E402  (scripts/llama_cpp_build.py)

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench"
RESULTS = ROOT / "results"
LLAMA_BENCH = "llama-bench"
# the verify sizes: every tree size `--tree-budget auto` picks among, plus one more node for
# the root (a chain of block 8 verifies 8 tokens)
VERIFY_KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# csrc/dfl_target.c: attention spans the used context rounded up to this (at most n_ctx);
# llama.cpp pads both its n_ctx and its attention span to 256 as well
KV_PAD = 256

# ---- shapes ------------------------------------------------------------------------------
# Qwen3.5-0.8B text model (config.json "text_config")
QWEN35_08B = dict(hidden=1024, layers=24, ffn=3584, heads=8, kv_heads=2, head_dim=256, lin_k_heads=16,
                  lin_v_heads=16, lin_k_dim=128, lin_v_dim=128, tie=True, vocab_size=248320)
# Qwen3-0.6B (config.json): attention only
QWEN3_06B = dict(hidden=1024, layers=28, ffn=3072, heads=16, kv_heads=8, head_dim=128, tie=True, vocab_size=151936)
# Qwen3.5-35B-A3B's layer structure (hybrid 3:1, 8 routed experts of 512 + a shared expert
# of 512, vocabulary 248320) at hidden 1024, 24 layers, 32 experts (the real one: 2048, 40,
# 256), with Qwen3.5-0.8B's heads at that width
QWEN35MOE_SMALL = dict(hidden=1024, layers=24, heads=8, kv_heads=2, head_dim=256, lin_k_heads=16, lin_v_heads=16,
                       lin_k_dim=128, lin_v_dim=128, experts=32, experts_used=8, expert_ffn=512, shared_ffn=512,
                       tie=False, vocab_size=248320)
# --quick: every matrix row a multiple of 256 so that K-quants apply; builds in seconds
QWEN35_QUICK = dict(hidden=256, layers=4, ffn=512, heads=4, kv_heads=2, head_dim=64, lin_k_heads=2,
                    lin_v_heads=4, lin_k_dim=64, lin_v_dim=64, tie=True, vocab_size=2048)
QWEN3_QUICK = dict(hidden=256, layers=4, ffn=512, heads=4, kv_heads=2, head_dim=64, tie=True, vocab_size=2048)
QWEN35MOE_QUICK = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, lin_k_heads=2, lin_v_heads=4,
                       lin_k_dim=64, lin_v_dim=64, experts=8, experts_used=2, expert_ffn=256, shared_ffn=256,
                       vocab_size=2048)
ROPE_THETA_QWEN35 = 10_000_000.0

# arch -> fixture builder, full shape, its label, quick shape, rope theta to write (None: the builder's)
ARCHS = {
    "qwen35": ("make_qwen35", QWEN35_08B, "Qwen3.5-0.8B shape", QWEN35_QUICK, ROPE_THETA_QWEN35),
    "qwen3": ("make_qwen3", QWEN3_06B, "Qwen3-0.6B shape", QWEN3_QUICK, None),
    "qwen35moe": ("make_qwen35moe", QWEN35MOE_SMALL,
                  "Qwen3.5-35B-A3B structure reduced: hidden 1024, 24 layers, 32 experts (8 used + shared, "
                  "expert FFN 512)", QWEN35MOE_QUICK, None),
}


def log(msg: str) -> None:
    print(f"[bench_ar] {msg}", file=sys.stderr, flush=True)


# ---- model ---------------------------------------------------------------------------------

def build_gguf(arch: str, quick: bool, outtype: str, keep_hf: bool) -> Path:
    """The cached GGUF of an arch's shape (keyed by a hash of builder, shape and rope
    theta), building the checkpoint and converting it when missing."""
    builder, full, _, quick_shape, rope_theta = ARCHS[arch]
    shape = quick_shape if quick else full
    rope_theta = None if quick else rope_theta
    key = hashlib.sha256(json.dumps([builder, shape, rope_theta], sort_keys=True).encode()).hexdigest()[:8]
    name = f"{arch}-{'quick' if quick else 'full'}-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    gguf = CACHE / f"{name}-{outtype}.gguf"
    if gguf.exists():
        return gguf
    hf_dir = CACHE / f"{name}-hf"
    if not (hf_dir / "config.json").exists():
        sys.path.insert(0, str(ROOT / "tests"))
        import torch

        import fixtures  # tests/fixtures.py: seeded random checkpoints + tokenizer

        log(f"building a random {arch} checkpoint in {hf_dir} ...")
        t0 = time.perf_counter()
        tmp_dir = hf_dir.with_name(hf_dir.name + ".tmp")
        shutil.rmtree(tmp_dir, ignore_errors=True)
        getattr(fixtures, builder)(tmp_dir, dtype=torch.bfloat16, seed=0, **shape)
        if rope_theta is not None:
            cfg_path = tmp_dir / "config.json"
            cfg = json.loads(cfg_path.read_text())
            rp = cfg.get("rope_parameters") or {}
            rp["rope_theta"] = rope_theta
            cfg["rope_parameters"] = rp
            cfg_path.write_text(json.dumps(cfg, indent=2))
        tmp_dir.rename(hf_dir)
        log(f"built in {time.perf_counter() - t0:.0f} s")
    from dflash_gguf.convert.cli import main as convert

    log(f"converting to {outtype} ...")
    t0 = time.perf_counter()
    tmp = gguf.with_suffix(".tmp.gguf")
    rc = convert([str(hf_dir), "--outtype", outtype, "--outfile", str(tmp), "--force"])
    if rc != 0:
        raise SystemExit(f"conversion failed with exit code {rc}")
    tmp.rename(gguf)
    log(f"converted in {time.perf_counter() - t0:.0f} s")
    if not keep_hf:
        shutil.rmtree(hf_dir)
    return gguf


def matmul_work(gguf: Path) -> dict:
    """Multiply-accumulates per token row from the GGUF's tensor shapes: the LM head
    (output.weight, or token_embd.weight when tied) and the rest of the weight matrices
    (routed-expert tensors counted at expert_used_count / expert_count). Attention over
    the context is not counted (small at these lengths)."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(name, default=None):
        f = r.fields.get(f"{arch}.{name}")
        return int(f.parts[-1][0]) if f is not None else default

    n_expert, n_used = field("expert_count", 0), field("expert_used_count", 0)
    names = {t.name for t in r.tensors}
    lm_name = "output.weight" if "output.weight" in names else "token_embd.weight"
    lm = body = 0
    lm_bytes = body_bytes = 0
    for t in r.tensors:
        dims = [int(d) for d in t.shape if int(d) > 1]
        if len(dims) < 2:
            continue
        n = int(t.n_elements)
        if t.name == lm_name:
            lm, lm_bytes = n, int(t.n_bytes)
        elif t.name == "token_embd.weight":
            continue  # a lookup, not a matmul
        elif "_exps." in t.name and n_expert:
            body += n * n_used // n_expert
            body_bytes += int(t.n_bytes) * n_used // n_expert
        else:
            body += n
            body_bytes += int(t.n_bytes)
    return {"arch": arch, "lm_macs": lm, "body_macs": body, "lm_bytes": lm_bytes, "body_bytes": body_bytes,
            "lm_tensor": lm_name, "n_expert": n_expert, "n_expert_used": n_used}


# ---- ours (child processes) -----------------------------------------------------------------

def _prompt(n_vocab: int, length: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(1234 + seed)
    return rng.integers(0, min(n_vocab, 1000), size=length).tolist()  # clear of the padded vocab tail


def pad(n: int) -> int:
    return -(-n // KV_PAD) * KV_PAD


def worker_ours(a: dict) -> dict:
    from dflash_gguf.target import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, Target, TargetConfig

    # as llama.cpp sizes its context (n_ctx padded to 256): the attention spans match
    ks = a["ks"]
    n_ctx = pad(a["prompt"] + max(a["tokens"], max(ks)))
    cfg = TargetConfig(n_ctx=n_ctx, n_ubatch=512, n_verify=max(ks), n_threads=a["threads"], kv_type="f16",
                       repack=True)
    t = Target(a["gguf"], cfg)
    info = t.info()
    prompt = _prompt(t.n_vocab, a["prompt"], a["run"])
    builds = lambda: t.info()["n_graph_builds"]  # noqa: E731

    def at_depth():
        """A fresh context of `prompt` tokens whose last token went through the 1-row
        decode graph. dfl_target_reset drops every cached graph: without this the first
        timed step after it would pay a graph build."""
        t.reset()
        t.prefill(prompt[:-1], LOGITS_NONE)
        t.decode(prompt[-1:], LOGITS_LAST)

    # warm-up: graph allocation, page faults, weight repacking
    t.reset()
    t.prefill(prompt[:16], LOGITS_LAST)
    for _ in range(4):
        t.decode([int(t.choices(0, 1)[0])], LOGITS_LAST)

    out = {"n_threads": info["n_threads"], "arch": info["arch"]}
    if a["mode"] == "decode":
        reps, rebuilt = [], 0
        for _ in range(a["reps"]):
            at_depth()
            tok = int(t.choices(0, 1)[0])
            b0 = builds()
            t0 = time.perf_counter()
            for _ in range(a["tokens"]):
                t.decode([tok], LOGITS_LAST)
                tok = int(t.choices(0, 1)[0])
            reps.append(time.perf_counter() - t0)
            rebuilt += builds() - b0
        return {**out, "reps": reps, "graph_builds": rebuilt}

    # at a context of `prompt` tokens, grouped by k so that each shape's graph is built
    # once (untimed) and reused, as in decoding
    res = {}
    for k in ks:
        cands = list(range(10, 10 + k))
        r = {"verify": [], "batch_last": [], "batch_all": [], "graph_builds": 0}
        # verify(k) + argmax of the k rows + commit(0), which keeps nothing: every rep
        # starts from the same context
        at_depth()
        t.verify(cands)
        t.commit(0)
        b0 = builds()
        for _ in range(a["reps"]):
            t0 = time.perf_counter()
            t.verify(cands)
            t.choices(0, k)
            t.commit(0)
            r["verify"].append(time.perf_counter() - t0)
        r["graph_builds"] += builds() - b0
        # plain batches of k (they extend the context): successive batches from the same
        # context while the attention span stays in the same KV padding (which both
        # engines compute over), a fresh context with an untimed batch otherwise
        for key, mode in (("batch_last", LOGITS_LAST), ("batch_all", LOGITS_ALL)):
            fresh = True
            for _ in range(a["reps"]):
                if fresh or pad(t.n_past + k) != pad(len(prompt) + k):
                    at_depth()
                    t.decode(cands, mode)
                    fresh = False
                b0 = builds()
                t0 = time.perf_counter()
                t.decode(cands, mode)
                r[key].append(time.perf_counter() - t0)
                r["graph_builds"] += builds() - b0
        res[str(k)] = r
    return {**out, "k": res}


def run_worker(args: dict, timeout: float = 3600) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(args)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=str(CACHE), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "ours timed out"}
    if res.returncode != 0:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit code {res.returncode}"
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or [""]
        return {"error": f"ours failed ({how}): {tail[0][:300]}"}
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("@@")), None)
    if line is None:
        return {"error": f"ours printed no result: {res.stderr[-300:]}"}
    return json.loads(line[2:])


# ---- theirs: llama-bench ----------------------------------------------------------------------

def llama_bench_cmd(exe: Path, gguf: Path, a: dict, mode: str) -> list[str]:
    common = ["-d", str(a["prompt"]), "-t", str(a["threads"]), "-fa", a["fa"], "-ctk", "f16", "-ctv", "f16",
              "-r", str(a["reps"]), "-o", "json"]
    if mode == "decode":
        return [str(exe), "-m", str(gguf), "-p", "0", "-n", str(a["tokens"]), *common]
    return [str(exe), "-m", str(gguf), "-p", ",".join(map(str, a["ks"])), "-n", "0", *common]


def run_llama_bench(cmd: list[str], timeout: float = 3600) -> dict:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "llama-bench timed out"}
    if res.returncode != 0:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit code {res.returncode}"
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-2:]
        return {"error": f"llama-bench failed ({how}): " + " | ".join(tail)}
    try:
        tests = json.loads(res.stdout)
    except json.JSONDecodeError as e:
        return {"error": f"llama-bench printed no JSON ({e}): {res.stdout[-300:]}"}
    return {"tests": tests}


# ---- the benchmark -------------------------------------------------------------------------------

def typical(xs):
    """A rep time as the engine gives it: the lower quartile (both engines alike; the
    time of a rep other processes did not slow, without trusting the single fastest)."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return xs[0] if xs else None
    return statistics.quantiles(xs, n=4, method="inclusive")[0]


def bench_arch(exe: Path | None, gguf: Path, a: dict) -> dict:
    """Rounds of [ours decode, llama-bench decode, ours verify, llama-bench verify], the
    engines' order flipped every round. Returns the samples and the commands."""
    ks = a["ks"]
    ours = {"decode": [], "k": {str(k): {"verify": [], "batch_last": [], "batch_all": []} for k in ks},
            "graph_builds": 0, "error": None}
    # theirs: samples per flash-attention setting ("0"/"1"); the report takes the faster one
    theirs = {"decode_fa": {}, "k_fa": {str(k): {} for k in ks}, "error": None, "info": {}}
    cmds = {m: llama_bench_cmd(exe, gguf, a, m) for m in ("decode", "verify")} if exe else {}
    if exe is None:
        theirs["error"] = a["llama_bench_note"]
    load = [os.getloadavg()[0]]
    for i in range(a["runs"]):
        for mode in ("decode", "verify"):
            order = ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")
            for who in order:
                if who == "ours" and not ours["error"]:
                    r = run_worker({**a, "mode": mode, "run": i})
                    if "error" in r:
                        ours["error"] = r["error"]
                        continue
                    ours["n_threads"] = r["n_threads"]
                    if mode == "decode":
                        ours["decode"] += r["reps"]
                        ours["graph_builds"] += r["graph_builds"]
                    else:
                        for k, v in r["k"].items():
                            for key in ("verify", "batch_last", "batch_all"):
                                ours["k"][k][key] += v[key]
                            ours["graph_builds"] += v["graph_builds"]
                elif who == "theirs" and not theirs["error"]:
                    r = run_llama_bench(cmds[mode])
                    if "error" in r:
                        theirs["error"] = r["error"]
                        continue
                    for test in r["tests"]:
                        samples = [ns / 1e9 for ns in test["samples_ns"]]
                        fa = "1" if test.get("flash_attn") in (True, 1, "1", "on", "enabled") else "0"
                        where = theirs["decode_fa"] if test["n_gen"] > 0 else theirs["k_fa"][str(test["n_prompt"])]
                        where.setdefault(fa, []).extend(samples)
                        theirs["info"] = {key: test.get(key) for key in
                                          ("build_commit", "build_number", "cpu_info", "backends", "n_threads",
                                           "model_type", "type_k", "type_v", "flash_attn", "n_ubatch", "n_batch",
                                           "repack")}
        load.append(os.getloadavg()[0])
        log(f"{Path(gguf).name}: round {i + 1}/{a['runs']} done (load average {load[-1]:.2f})")
    theirs["decode"], theirs["decode_best_fa"] = best_fa(theirs["decode_fa"])
    theirs["k"], theirs["k_best_fa"] = {}, {}
    for k, by_fa in theirs["k_fa"].items():
        theirs["k"][k], theirs["k_best_fa"][k] = best_fa(by_fa)
    return {"ours": ours, "theirs": theirs, "cmds": cmds, "load": load}


def best_fa(by_fa: dict) -> tuple[list, str | None]:
    """llama.cpp at its best: the samples of the flash-attention setting with the lower
    typical time, and that setting."""
    if not by_fa:
        return [], None
    fa = min(by_fa, key=lambda f: typical(by_fa[f]))
    return by_fa[fa], fa


# ---- report --------------------------------------------------------------------------------------

def fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n >= 10 * 2**20 else f"{n / 2**20:.2f}"


def ratio(ours_s, theirs_s):
    """Speed ratio ours / theirs from times (>1: ours faster)."""
    return theirs_s / ours_s if ours_s and theirs_s else None


def report_arch(arch: str, label: str, gguf: Path, work: dict, res: dict, a: dict) -> tuple[str, dict]:
    ours, theirs, N = res["ours"], res["theirs"], a["tokens"]
    L = [f"### {arch}: {label}", ""]
    size = gguf.stat().st_size / 2**20
    lm_share = work["lm_macs"] / (work["lm_macs"] + work["body_macs"])
    L.append(f"`{gguf.name}` ({size:.0f} MiB, {a['outtype']}; GGUF architecture `{work['arch']}`"
             + (f", {work['n_expert_used']} of {work['n_expert']} experts used" if work["n_expert"] else "") + "). "
             f"Load average (1 min) over this arch's rounds: {', '.join(f'{x:.2f}' for x in res['load'])}; "
             f"{a['threads']} threads (ours: runtime reports {ours.get('n_threads', '?')}; llama-bench: "
             f"{theirs['info'].get('n_threads', '?')}).")
    L.append("")
    if ours["error"]:
        L.append(f"**ours failed:** {ours['error']}")
        L.append("")
    if theirs["error"]:
        L.append(f"**llama-bench unavailable:** {theirs['error']}")
        L.append("")

    # decode
    od, td = typical(ours["decode"]), typical(theirs["decode"])
    L.append(f"Plain decoding at context {a['prompt']}..{a['prompt'] + N}: {N} tokens per rep, "
             f"{a['reps']} reps per process, {a['runs']} processes per engine.")
    L.append("")
    L.append("| engine | decode tok/s (N / typical rep) | ms/token | rep tok/s min..max | reps |")
    L.append("|---|---:|---:|---:|---:|")
    for name, reps, med in (("dflash-gguf", ours["decode"], od), ("llama-bench", theirs["decode"], td)):
        if not reps:
            L.append(f"| {name} | – | – | – | 0 |")
            continue
        L.append(f"| {name} | {N / med:.1f} | {1000 * med / N:.2f} | {N / max(reps):.1f}..{N / min(reps):.1f} | "
                 f"{len(reps)} |")
    r = ratio(od, td)
    L.append("")
    L.append(f"Decode speed ratio dflash-gguf / llama-bench: **{fmt(r, '.2f')}x**" if r else
             "Decode speed ratio: –")
    if theirs.get("decode_best_fa") is not None:
        L.append(f" (llama-bench's faster flash-attention setting: -fa {theirs['decode_best_fa']})")
    L.append("")

    # verify
    L.append(f"Verify cost at context {a['prompt']} (typical rep, the lower quartile of {a['reps']} reps x {a['runs']} processes; ms). "
             "Ours verify = verify(k) + argmax of all k rows + commit(0): the LM head runs over all k rows. "
             "llama-bench -p k = one batch of k tokens with logits for the last row only; the like-for-like "
             "row of ours is \"batch, last-row logits\".")
    L.append("")
    L.append("| k | ours verify (all-row logits) | ours batch, last-row logits | ours batch, all-row logits | "
             "llama-bench -p k (last-row logits) | verify speed ratio | like-for-like speed ratio | "
             "ours: LM head over the k-1 other rows | of the verify gap to llama-bench | "
             "all-row LM head extra work (FLOPs) | llama-bench -fa |")
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = {"decode": r, "verify": {}, "like": {}, "lm_gap": {}}
    for k in a["ks"]:
        ok = ours["k"][str(k)]
        v, bl, ba = typical(ok["verify"]), typical(ok["batch_last"]), typical(ok["batch_all"])
        tk = typical(theirs["k"][str(k)])
        lm_extra = (ba - bl) if ba is not None and bl is not None else None
        gap = (v - tk) if v is not None and tk is not None else None
        if lm_extra is None or gap is None:
            of_gap = "–"
        elif gap <= 0:
            of_gap = "no gap (ours faster)"
        else:
            of_gap = f"{100 * lm_extra / gap:.0f}% of {1000 * gap:.2f}"
        flops_extra = (k - 1) * work["lm_macs"] / (k * work["body_macs"] + work["lm_macs"])
        ms = lambda x: fmt(1000 * x if x is not None else None, ".2f")  # noqa: E731
        summary["verify"][k], summary["like"][k] = ratio(v, tk), ratio(bl, tk)
        L.append(f"| {k} | {ms(v)} | {ms(bl)} | {ms(ba)} | {ms(tk)} | {fmt(ratio(v, tk), '.2f')}x | "
                 f"{fmt(ratio(bl, tk), '.2f')}x | {ms(lm_extra)} | {of_gap} | +{100 * flops_extra:.0f}% | "
                 f"{theirs.get('k_best_fa', {}).get(str(k)) or '–'} |")
        summary["lm_gap"][k] = (lm_extra, gap)
    L.append("")
    L.append(f"LM head (`{work['lm_tensor']}`): {work['lm_macs'] / 1e6:.0f} M multiply-adds per row, "
             f"{100 * lm_share:.0f}% of a row's weight matmuls ({(work['lm_macs'] + work['body_macs']) / 1e6:.0f} M); "
             f"{mib(work['lm_bytes'])} of {mib(work['lm_bytes'] + work['body_bytes'])} MiB of weights "
             "read per step. \"LM head over the k-1 other rows\" = ours batch with all-row minus with last-row logits "
             "(measured; negative = noise), and its share of (ours verify - llama-bench -p k) in ms; \"extra work\" = "
             "(k-1)·LM / (k·rest + LM), the weight-matmul FLOPs an all-row batch adds over a last-row one.")
    if ours["graph_builds"]:
        L.append("")
        L.append(f"Note: ours rebuilt {ours['graph_builds']} graph(s) inside timed sections (included in the times).")
    L.append("")
    if res["cmds"]:
        L.append("llama-bench command lines (each run once per round):")
        L.append("")
        L.append("```")
        for m in ("decode", "verify"):
            L.append(shlex.join(res["cmds"][m]))
        L.append("```")
        L.append("")
    return "\n".join(L), summary


def report(args, sections: list[str], summaries: list, exe: Path | None, info: dict, started, load0,
           load1) -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench import cpu_name, git_describe

    try:
        lcp = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        lcp = "?"
    L = [f"## AR decode and verify cost: dflash-gguf vs llama-bench, {started:%Y-%m-%d %H:%M}"
         + (" (--quick)" if args.quick else ""), ""]
    L.append(f"Machine: {cpu_name()}, {os.cpu_count()} CPUs; load average (1 min) {load0:.2f} at the start, "
             f"{load1:.2f} at the end. {args.threads} threads for both engines. dflash-gguf {git_describe()} "
             f"(ggml from llama-cpp-python {lcp}); llama-bench built from the llama-cpp-python "
             f"{LLAMA_CPP_PYTHON_VERSION} sdist (build {info.get('build_commit', '?')}, "
             f"{info.get('backends', '?')}), static, {exe if exe else 'not available'}.")
    L.append("")
    L.append(f"Both: the same GGUF, f16 KV cache, CPU weight repacking; flash attention for ours, llama-bench run "
             f"with -fa {args.fa} and the faster setting kept per test; context {args.prompt} "
             f"tokens prefilled before every timed section (not timed). Decode: {args.tokens} tokens per rep. "
             f"{args.runs} rounds alternating the engines (order flipped each round), {args.reps} reps per process; "
             "typical rep times (the lower quartile of all reps: other processes only ever add time). "
             "Speed ratios are ours / llama-bench (>1: ours faster).")
    L.append("")
    L.append("How llama-bench measures (tools/llama-bench/llama-bench.cpp of the pinned sdist): `-n N` times N "
             "single-token decodes after one untimed warm-up decode, each with logits output (copied to the host) "
             "but no sampling (the next token is random); `-p k` times one batch of k tokens with logits for the "
             "last row only (llama.cpp then skips the LM head, and for qwen3 the last layer's attention output and "
             "FFN, for the other k-1 rows), after one untimed warm-up batch of k at depth 0; `-d D` prefills D "
             "random tokens before each rep (untimed; from the 2nd rep on, a saved state is restored); each "
             "`-r` rep is timed as a whole (samples_ns); the first rep of each test also pays a graph rebuild (llama.cpp "
             "reuses only the previous graph, and the depth prefill comes between warm-up and rep 1), which the "
             "lower quartile drops (1 of --reps samples per process). Ours decode includes the argmax on the device and reading "
             "the token id back (a real greedy step); llama-bench's does not sample.")
    L.append("")
    L.append("Summary: speed ratios ours / llama-bench (>1: ours faster); verify = ours verify(k) with all-row "
             "logits vs `-p k`; like for like = ours plain batch of k with last-row logits vs `-p k`.")
    L.append("")
    ks = args.ks
    L.append("| arch | decode | " + " | ".join(f"verify k={k}" for k in ks) + " | "
             + " | ".join(f"like for like k={k}" for k in ks) + " |")
    L.append("|---|" + "---:|" * (1 + 2 * len(ks)))
    for arch, sm in summaries:
        x = lambda v: f"{v:.2f}x" if v else "–"  # noqa: E731
        L.append(f"| {arch} | {x(sm['decode'])} | " + " | ".join(x(sm["verify"][k]) for k in ks) + " | "
                 + " | ".join(x(sm["like"][k]) for k in ks) + " |")
    L.append("")
    L.extend(sections)
    return "\n".join(L) + "\n"


def parse_ks(text: str, error) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        error(f"bad verify sizes {text!r} (comma-separated integers)")
    if not ks or ks[0] < 1 or ks[-1] > 64:
        error(f"verify sizes must be 1..64, got {text!r}")
    return ks


def bench_targets(exe: Path | None, targets: list, a: dict) -> tuple[list, list, dict, dict]:
    """bench_arch and report_arch over (name, label, gguf) targets with the options `a`:
    (report sections, (name, summary) pairs, raw results by name, llama-bench's build info)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    sections, summaries, raw, info = [], [], {}, {}
    for name, label, gguf in targets:
        work = matmul_work(gguf)
        if name == "given":
            name = work["arch"]
        log(f"{name}: {gguf.name}, {a['runs']} rounds ...")
        res = bench_arch(exe, gguf, {**a, "gguf": str(gguf)})
        info = res["theirs"]["info"] or info
        text, summary = report_arch(name, label, gguf, work, res, a)
        sections.append(text)
        summaries.append((name, summary))
        raw[name] = {"gguf": str(gguf), "work": work, **res}
    return sections, summaries, raw, info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=[*ARCHS, "all"], default="all", help="target architecture(s) (default all)")
    p.add_argument("-t", "--threads", type=int, default=2, help="threads for both engines (default 2)")
    p.add_argument("--outtype", default="q4_k_m", help="GGUF tensor types for our converter (default q4_k_m)")
    p.add_argument("--gguf", type=Path, help="benchmark this GGUF instead of the built shapes")
    p.add_argument("--runs", type=int, default=5, help="rounds: processes per engine and mode (default 5)")
    p.add_argument("--reps", type=int, default=5, help="timed reps per process (llama-bench -r; default 5)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per rep (llama-bench -n; default 64)")
    p.add_argument("--prompt", type=int, default=64, help="context before the timed part (llama-bench -d; default 64)")
    p.add_argument("--ks", default=",".join(map(str, VERIFY_KS)),
                   help=f"verify sizes k (default {','.join(map(str, VERIFY_KS))})")
    p.add_argument("--fa", default="0,1", help="llama-bench -fa settings; the faster one counts (default 0,1)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds, 3 reps, 16 tokens: a sanity run")
    p.add_argument("--keep-hf", action="store_true", help="keep the generated HF checkpoints in .cache/bench")
    p.add_argument("--llama-bench", type=Path, help="use this llama-bench binary instead of building one")
    p.add_argument("--no-build", action="store_true", help="do not build llama-bench when it is missing")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the llama-bench build (default 2)")
    p.add_argument("--no-save", action="store_true", help="print the report only (no results/ files)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default results/)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        print("@@" + json.dumps(worker_ours(json.loads(args.worker))), flush=True)
        return 0

    args.ks = parse_ks(args.ks, p.error)
    if args.quick:
        args.runs, args.reps, args.tokens, args.prompt = min(args.runs, 2), min(args.reps, 3), \
            min(args.tokens, 16), min(args.prompt, 32)
    started = _dt.datetime.now()
    load0 = os.getloadavg()[0]
    log(f"load average {load0:.2f} on {os.cpu_count()} CPUs" +
        (" -- the machine is busy: timings will be noise" if load0 > 0.5 else ""))

    if args.llama_bench:
        exe, note = (args.llama_bench.resolve(), "given") if args.llama_bench.is_file() else \
            (None, f"{args.llama_bench} not found")
    elif args.no_build:
        exe = llama_binary(LLAMA_BENCH)
        note = "not built yet (--no-build)"
    else:
        exe, note = build_llama(LLAMA_BENCH, args.jobs)

    if args.gguf:
        targets = [("given", args.gguf.name, args.gguf.resolve())]
    else:
        archs = list(ARCHS) if args.arch == "all" else [args.arch]
        targets = []
        for arch in archs:
            label = "tiny shape (hidden 256, 4 layers, vocab 2048)" if args.quick else ARCHS[arch][2] + ", random weights"
            targets.append((arch, label, build_gguf(arch, args.quick, args.outtype, args.keep_hf)))

    a = {"threads": args.threads, "tokens": args.tokens, "prompt": args.prompt, "reps": args.reps, "runs": args.runs,
         "ks": args.ks, "fa": args.fa, "outtype": args.outtype if not args.gguf else "given", "llama_bench_note": note}
    sections, summaries, raw, info = bench_targets(exe, targets, a)
    text = report(args, sections, summaries, exe, info, started, load0, os.getloadavg()[0])
    print(text)
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"bench-ar-{started:%Y-%m-%d-%H%M}" + ("-quick" if args.quick else "")
        (args.out / f"{stem}.md").write_text(text)
        (args.out / f"{stem}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           "results": raw}, indent=1, default=str))
        log(f"wrote {args.out / (stem + '.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
