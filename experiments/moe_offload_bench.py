#!/usr/bin/env python3
"""Routed experts in host memory beside a device: what a step moves between the devices,
and what a verify of k rows costs against k single-token decodes.

    .venv/bin/python experiments/moe_offload_bench.py --workdir /big/disk      # Qwen3.5-35B-A3B Q4_K_M shape
    .venv/bin/python experiments/moe_offload_bench.py --target a3b.gguf --device CUDA0
    .venv/bin/python experiments/moe_offload_bench.py --bytes      # byte counts only, no timing (any machine)
    .venv/bin/python experiments/moe_offload_bench.py --smoke      # a tiny shape, one repetition: seconds

The target (a GGUF, or the Qwen3.5-35B-A3B Q4_K_M shape model with random weights,
dflash_gguf.convert.shape_model, written to --workdir: 21 GB) runs with every layer on
--device (default: the tests' ggml RPC stand-in for a GPU, started here) and the routed
experts of every layer (or --n-cpu-moe N) on the CPU. After a prefill it times, for each
k of --k, a chain verify of k rows (its commit keeps none, so the context stays put)
against k single-token decodes, the two interleaved in every repetition, and records each
graph's splits and the bytes ggml's scheduler copies between the devices. Medians over
--reps; the load average is recorded per repetition: run it on an idle machine.

--bytes measures no time: the copied bytes of a verify of each k and of a decode, on the
shape model's real widths with 4 and 8 layers (and 16 experts, 8 of them used per token
as in the model: a step copies activations, whose size does not depend on how many
experts there are), so that bytes = fixed + per layer x layers gives the full model's.
Results: results/moe-offload-<date>.json (or moe-offload-bytes-<date>.json).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from rpc_stand_in import rpc_device

ROOT = Path(__file__).resolve().parent.parent
KS = (4, 8, 16)


def shape(smoke: bool, layers=None, experts=None) -> dict:
    """Qwen3.5-35B-A3B's shape (smoke: its structure at hidden 256, 4 layers), with fewer
    layers or experts when given."""
    from dflash_gguf.convert.shapes import QWEN35_35B_A3B, shrunk

    base = QWEN35_35B_A3B
    if smoke:
        base = shrunk(base, 4, hidden=256, vocab=4096, heads=4, kv_heads=2, head_dim=64, rot=16, sections=[3, 3, 2, 0],
                      lin_k_heads=2, lin_v_heads=4, lin_dim=64, experts=8, experts_used=2, expert_ffn=256,
                      shared_ffn=256)
    return shrunk(base, layers, **({"experts": experts} if experts else {}))


def load(path: str, device: str, n_cpu_moe, threads: int, n_ctx: int):
    from dflash_gguf.runtime.placement import expert_rules
    from dflash_gguf.runtime.target import Target, TargetConfig

    rules = expert_rules(cpu_moe=True) if n_cpu_moe is None else expert_rules(n_cpu_moe)
    return Target(path, TargetConfig(n_ctx=n_ctx, n_ubatch=512, n_verify=max(KS) + 1, kv_type="f16",
                                     n_threads=threads, device=device, tensor_overrides=rules))


def verify(target, tokens, k: int) -> dict:
    """A chain verify of k rows whose commit keeps none: (seconds, splits, copied bytes)."""
    t0 = time.perf_counter()
    target.verify(tokens[:k])
    target.choices(0, k)  # the step's one synchronisation
    seconds = time.perf_counter() - t0
    target.commit(0)
    splits, copied = target.graph_copies()
    return {"seconds": seconds, "splits": splits, "copy_bytes": copied}


def decodes(target, tokens, k: int) -> dict:
    """k single-token decodes, each read back as a step of plain decoding is."""
    from dflash_gguf.runtime.target import LOGITS_LAST

    t0 = time.perf_counter()
    copied = 0
    for tok in tokens[:k]:
        target.decode([tok], LOGITS_LAST)
        target.choices(0, 1)
        copied += target.graph_copies()[1]
    return {"seconds": time.perf_counter() - t0, "splits": target.graph_copies()[0], "copy_bytes": copied}


def timed(args, path: str) -> dict:
    from dflash_gguf.bench import provenance

    reps = 1 if args.smoke else args.reps
    prompt = [(37 * i + 11) % 3000 + 100 for i in range(args.prompt_tokens)]
    n_ctx = args.prompt_tokens + reps * (2 * sum(args.k) + 8) + 64
    rows = {k: {"verify": [], "decodes": [], "load_average": []} for k in args.k}
    with load(path, args.device, args.n_cpu_moe, args.threads, n_ctx) as target:
        info = target.info()
        target.prefill(prompt)
        # one k at a time: its verify, the decode carrying its commit and plain decodes are
        # three graph shapes, which the target's three step slots keep (no rebuilds timed)
        for k in args.k:
            verify(target, prompt, k)  # the graphs built, not timed
            decodes(target, prompt, 2)
            builds = target.info()["n_graph_builds"]
            for _ in range(reps):  # the two arms interleaved
                rows[k]["load_average"].append(provenance.load_average())
                rows[k]["verify"].append(verify(target, prompt, k))
                rows[k]["decodes"].append(decodes(target, prompt, k))
            rows[k]["graph_builds_timed"] = target.info()["n_graph_builds"] - builds
    out = []
    for k, r in rows.items():
        v = statistics.median(x["seconds"] for x in r["verify"])
        d = statistics.median(x["seconds"] for x in r["decodes"])
        out.append({"k": k, "verify_ms": 1e3 * v, "decodes_ms": 1e3 * d, "verify_over_decodes": v / d,
                    "graph_builds_timed": r["graph_builds_timed"],
                    "verify_splits": r["verify"][0]["splits"], "verify_copy_bytes": r["verify"][0]["copy_bytes"],
                    "decode_splits": r["decodes"][0]["splits"], "decodes_copy_bytes": r["decodes"][0]["copy_bytes"],
                    "runs": r})
    return {"host_layer_weights": info["host_layer_weights"], "rows": out}


def bytes_only(args, workdir: Path) -> dict:
    """Copied bytes and splits of a verify of each k and of one decode at 4 and 8 layers,
    and the fit fixed + per layer x layers at the model's layer count."""
    from dflash_gguf.convert.shape_model import write_model

    full = shape(False, None)
    counts = {}
    for layers in (4, 8):
        c = shape(args.smoke, layers, experts=2 * full["experts_used"])
        path = write_model(c, args.outtype, workdir / f"bytes-{layers}.gguf", progress=False)
        prompt = [(37 * i + 11) % 3000 + 100 for i in range(64)]
        with load(str(path), args.device, None, args.threads, 256) as target:
            target.prefill(prompt)
            steps = {str(k): verify(target, prompt, k) for k in args.k}
            steps["1 (decode)"] = decodes(target, prompt, 1)
        counts[layers] = {key: {"copy_bytes": r["copy_bytes"], "splits": r["splits"]} for key, r in steps.items()}
        path.unlink()
    fit = {}
    for key in counts[4]:
        at = {layers: {m: counts[layers][key][m] for m in ("copy_bytes", "splits")} for layers in (4, 8)}
        fit[key] = {}
        for m in ("copy_bytes", "splits"):
            per_layer = (at[8][m] - at[4][m]) / 4
            fixed = at[4][m] - 4 * per_layer
            fit[key][m] = {"fixed": fixed, "per_layer": per_layer, "full_model": fixed + per_layer * full["layers"]}
    return {"model_layers": full["layers"], "hidden": full["hidden"], "experts_used": full["experts_used"],
            "measured": counts, "fit": fit}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="a qwen35moe GGUF (default: the Qwen3.5-35B-A3B shape model, written here)")
    p.add_argument("--outtype", default="q4_k_m", help="the shape model's type (default q4_k_m)")
    p.add_argument("--layers", type=int, help="the shape model with fewer layers")
    p.add_argument("--workdir", type=Path, help="where the shape model is written (default: a temporary directory)")
    p.add_argument("--device", help="the device the layers go on (default: the RPC stand-in, started here)")
    p.add_argument("--n-cpu-moe", type=int, help="experts of the first N layers on the CPU (default: every layer's)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all usable)")
    p.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=list(KS),
                   help="verify sizes, a comma list (default 4,8,16)")
    p.add_argument("--reps", type=int, default=15, help="repetitions (default 15)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="context before the steps (default 512)")
    p.add_argument("--bytes", action="store_true", help="count copied bytes only (4 and 8 layers; no timing)")
    p.add_argument("--smoke", action="store_true", help="a tiny shape and one repetition, to check the script")
    p.add_argument("--out", type=Path, help="results file (default: results/moe-offload[-bytes]-<date>.json)")
    args = p.parse_args(argv)
    if any(k < 1 or k > max(KS) for k in args.k):
        p.error(f"--k takes sizes 1..{max(KS)}")
    from dflash_gguf.bench import provenance
    from dflash_gguf.convert.shape_model import write_model

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp, rpc_device() if args.device is None else nullcontext():
        args.device = args.device or "RPC0"
        if args.bytes:
            result = bytes_only(args, Path(tmp))
        else:
            path = args.target or str(write_model(shape(args.smoke, args.layers), args.outtype,
                                                  Path(tmp) / "moe.gguf", progress=not args.smoke))
            result = timed(args, path)
        header = {"tool": "experiments/moe_offload_bench.py", "date": _dt.datetime.now().isoformat(timespec="minutes"),
                  "argv": sys.argv[1:] if argv is None else argv, "checkout": provenance.checkout(),
                  "versions": provenance.versions(), "machine": provenance.machine(args.threads, args.device),
                  "load_average_start": provenance.load_average(), "smoke": args.smoke}
    kind = "moe-offload-bytes" if args.bytes else "moe-offload"
    dest = args.out or ROOT / "results" / f"{kind}-{_dt.date.today()}{'-smoke' if args.smoke else ''}.json"
    provenance.write_results(dest, {"header": header, **result})
    print(json.dumps(result.get("fit") or [{k: v for k, v in r.items() if k != "runs"} for r in result["rows"]],
                     indent=1))
    print(f"(saved to {dest})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
