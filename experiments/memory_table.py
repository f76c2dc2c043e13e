#!/usr/bin/env python3
"""What fits on a 24 GB card: the memory planner over Qwen3.5-27B Q4_K_M with its DFlash
drafter (q8_0), Gemma 3 27B Q4_K_M with Gemma 3 270M or 1B Q4_K_M drafting (draft-simple),
Qwen3.5-35B-A3B Q4_K_M, gpt-oss-20b and gpt-oss-120b (MXFP4 experts, q8_0
elsewhere: the published GGUFs' mxfp4_moe), from their published shapes (metadata-only
GGUFs, dflash_gguf.convert.shape_model), for KV type x context x tree budget; then the MoE
models whose routed experts must partly stay in host memory (Qwen3.5-35B-A3B,
Qwen3.5-122B-A10B and Gemma 4 26B-A4B Q4_K_M, gpt-oss-120b mxfp4_moe): the smallest
--n-cpu-moe that fits the card, and what the host then holds.

    .venv/bin/python experiments/memory_table.py     # markdown on stdout; results/memory-24gb-<date>.json

The first tables are planned for this machine's CPU device and counted as a GPU gets it:
the token embedding stays in host memory (it is only gathered from) and the drafter's
cache is f16, as on every non-CPU device. The MoE tables are planned with a device beside
the CPU, as the split is: the ggml RPC stand-in of the tests (tests/helpers/rpc_server.py, a
server on loopback running the CPU backend), which the script starts. Weights, caches,
states and scratch are exact; compute buffers are what ggml's allocator reserves for the
graphs (when one device runs every op, as CUDA does; with the experts on the CPU, what
each side computes), measured on the CPU backend. Usable memory: 24 GiB less 0.5 GiB for
the driver's context.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
import tempfile
from pathlib import Path

from rpc_stand_in import rpc_device

from dflash_gguf.bench import provenance
from dflash_gguf.convert.shape_model import write_header_only
from dflash_gguf.convert.shapes import (GEMMA3_1B, GEMMA3_27B, GEMMA3_270M, GEMMA4_26B_A4B, GPT_OSS_20B, GPT_OSS_120B, QWEN35_27B, QWEN35_27B_DFLASH,
                                        QWEN35_35B_A3B, QWEN35_122B_A10B, tensor_nbytes, tensor_table)
from dflash_gguf.engine.options import EngineOptions

ROOT = Path(__file__).resolve().parent.parent

USABLE_MIB = 24 * 1024 - 512
GIB = 1 << 30
CONTEXTS = (32768, 65536, 131072)
KV_TYPES = ("f16", "q8_0", "q4_0")
BUDGETS = (None, 8, 16, 32)  # None: the plain chain
# draft-simple's: its chain (llama.cpp's default n-max 3) and, as --tree-budget, the chain
# with the drafter's second choices beside it (1 + 2 x n-max rows whatever the number)
SIMPLE_BUDGETS = (None, 8)


EMBEDDING = {}  # target path -> bytes of its token embedding, which stays in host memory
EXPERTS = {}    # target path -> bytes of its routed experts' matrices
MAX_CTX = {}    # target path -> the longest context it takes (YaRN's reach), when below 256K


class OnCard:
    def __init__(self, need: int):
        self.need = need


def plan(target: str, draft: str | None, n_ctx: int, kv: str, budget: int | None, window: int) -> OnCard:
    from dataclasses import replace

    from dflash_gguf.engine.engine import EngineSetup
    from dflash_gguf.engine.memory import plan_memory

    from dflash_gguf.engine.memory import plan_setup

    setup = EngineSetup.of(target, draft, EngineOptions.of(n_ctx=n_ctx, kv_type=kv, tree_budget=budget,
                                                           draft_window=window))
    if setup.simple is not None:
        # draft-simple: a second model with its own weights and cache (f16, as llama.cpp's
        # -ctkd/-ctvd default), planned as the target it is and counted as the drafter
        small = replace(setup.simple, config=replace(setup.simple.config, kv_type="f16"))
        need = plan_setup(target, replace(setup, simple=small)).devices[0].need
        return OnCard(need - EMBEDDING[target] - EMBEDDING.get(draft, 0))
    draft_config = replace(setup.draft_config, kv_type="f16") if setup.draft_config else None
    need = plan_memory(target, draft, setup.target_config, draft_config).devices[0].need
    return OnCard(need - EMBEDDING[target])


def largest_context(target, draft, kv, budget, window) -> int:
    lo, hi = 0, MAX_CTX.get(target, 262144) // 4096
    while lo < hi:  # the largest multiple of 4096 that fits
        mid = (lo + hi + 1) // 2
        if plan(target, draft, mid * 4096, kv, budget, window).need <= USABLE_MIB << 20:
            lo = mid
        else:
            hi = mid - 1
    return lo * 4096


def arm(budget: int | None) -> str:
    return "chain" if budget is None else f"tree {budget}"


def table(name: str, target: str, draft: str | None, simple: bool = False) -> tuple[list[str], dict]:
    """The markdown of one model's tables and their numbers (bytes on the card per KV type,
    context and arm; the largest context that fits per KV type and arm). simple: the
    drafter is a small model drafting draft-simple (no drafter window: its own cache is
    the model's, sliding-window layers and all)."""
    window = 4096 if draft and not simple else 0
    budgets = SIMPLE_BUDGETS if simple else BUDGETS if draft else (None,)
    data = {"model": name, "draft_window": window, "usable_bytes": USABLE_MIB << 20, "need_bytes": {},
            "largest_context": {}}
    lines = [f"### {name}", "",
             "GiB on the card (target on the device, "
             + ("token embedding on the host" if EMBEDDING[target] else "its embedding too: it is the tied LM head")
             + (f", drafter window {window}" if window else "") + f"); fits = at most {USABLE_MIB / 1024:.1f} GiB.", ""]
    head = "| KV | " + " | ".join(f"{c // 1024}K {arm(b)}" for c in CONTEXTS for b in budgets) + " |"
    lines += [head, "|---|" + "---:|" * (len(CONTEXTS) * len(budgets))]
    for kv in KV_TYPES:
        cells = []
        for c in CONTEXTS:
            for b in budgets:
                need = plan(target, draft, c, kv, b, window).need
                data["need_bytes"].setdefault(kv, {})[f"{c // 1024}K {arm(b)}"] = need
                cells.append(f"{need / GIB:.1f} {'✓' if need <= USABLE_MIB << 20 else '✗'}")
        lines.append(f"| {kv} | " + " | ".join(cells) + " |")
    lines += ["", "Largest context that fits:", "",
              "| KV | " + " | ".join(arm(b) for b in budgets) + " |",
              "|---|" + "---:|" * len(budgets)]
    for kv in KV_TYPES:
        largest = {arm(b): largest_context(target, draft, kv, b, window) for b in budgets}
        data["largest_context"][kv] = largest
        lines.append(f"| {kv} | " + " | ".join(f"{n // 1024}K" if n else "none" for n in largest.values()) + " |")
    if target in EXPERTS:
        experts = EXPERTS[target]
        data["expert_bytes"] = experts
        lines += ["", f"Of that, {experts / GIB:.1f} GiB are the routed experts' matrices; without them (experts "
                  "in host memory) the card holds:", "",
                  "| KV | " + " | ".join(f"{c // 1024}K" for c in CONTEXTS) + " |",
                  "|---|" + "---:|" * len(CONTEXTS)]
        for kv in KV_TYPES:
            cells = [data["need_bytes"][kv][f"{c // 1024}K {arm(None)}"] - experts for c in CONTEXTS]
            lines.append(f"| {kv} | " + " | ".join(f"{n / GIB:.1f} {'✓' if n <= USABLE_MIB << 20 else '✗'}"
                                                  for n in cells) + " |")
    return lines + [""], data


# ---- MoE models with experts in host memory -------------------------------------------

MOE_CONTEXTS = (32768, 131072)
MOE_KV_TYPES = ("f16", "q8_0")
MOE_ARMS = {"chain": 16, "tree 16": 17}  # rows a verify holds: a 16-token block, a 16-node tree and its root


def moe_plan(target: str, n_ctx: int, kv: str, n_verify: int, n_cpu_moe: int):
    """(bytes on the card, bytes in host memory) of the target with every layer on the
    device and the routed experts of the first n_cpu_moe layers on the CPU."""
    from dflash_gguf.engine.memory import plan_memory
    from dflash_gguf.runtime.placement import expert_rules
    from dflash_gguf.runtime.target import TargetConfig

    cfg = TargetConfig(n_ctx=n_ctx, n_verify=n_verify, kv_type=kv, device="RPC0",
                       tensor_overrides=expert_rules(n_cpu_moe))
    device, host = plan_memory(target, None, cfg).devices
    return device.need, host.need


def smallest_n_cpu_moe(target: str, n_layers: int, n_ctx: int, kv: str, n_verify: int):
    """The fewest layers whose experts go to host memory for the card to hold the rest, with
    its plan (None when even every layer's experts there is not enough)."""
    fits = lambda n: moe_plan(target, n_ctx, kv, n_verify, n)[0] <= USABLE_MIB << 20  # noqa: E731
    if not fits(n_layers):
        return None
    lo, hi = -1, n_layers
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi, moe_plan(target, n_ctx, kv, n_verify, hi)


def moe_table(name: str, target: str, shape: dict, outtype: str) -> tuple[list[str], dict]:
    n_layers = shape["layers"]
    per_layer = sum(tensor_nbytes(s, q) for n, s, q in tensor_table(shape, outtype) if "_exps" in n) / n_layers
    data = {"model": name, "layers": n_layers, "expert_bytes_per_layer": per_layer, "usable_bytes": USABLE_MIB << 20,
            "cells": {}}
    lines = [f"### {name}", "",
             f"{n_layers} layers, routed experts {per_layer / GIB:.2f} GiB a layer. Smallest `--n-cpu-moe` for the "
             "card to hold the rest (every layer on the device), then GiB on the card / in host memory (the target "
             "alone: a drafter adds its own weights and cache, about one more layer's experts on the host per "
             f"{per_layer / GIB:.2f} GiB it takes):", "",
             "| context | KV | " + " | ".join(MOE_ARMS) + " |", "|---|---|" + "---:|" * len(MOE_ARMS)]
    for n_ctx in MOE_CONTEXTS:
        for kv in MOE_KV_TYPES:
            cells = []
            for arm, n_verify in MOE_ARMS.items():
                found = smallest_n_cpu_moe(target, n_layers, n_ctx, kv, n_verify)
                key = f"{n_ctx // 1024}K {kv} {arm}"
                if found is None:
                    data["cells"][key] = None
                    cells.append("does not fit")
                    continue
                n, (device, host) = found
                data["cells"][key] = {"n_cpu_moe": n, "device_bytes": device, "host_bytes": host}
                cells.append(f"{n} ({device / GIB:.1f} / {host / GIB:.1f})")
            lines.append(f"| {n_ctx // 1024}K | {kv} | " + " | ".join(cells) + " |")
    return lines + [""], data


def main(argv=None) -> int:
    # no options: the parser gives --help, and refuses an argument rather than ignoring it
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        t27 = str(write_header_only(Path(tmp) / "27b.gguf", QWEN35_27B, "q4_k_m"))
        d27 = str(write_header_only(Path(tmp) / "27b-dflash.gguf", QWEN35_27B_DFLASH, "q8_0"))
        moe = str(write_header_only(Path(tmp) / "35b-a3b.gguf", QWEN35_35B_A3B, "q4_k_m"))
        oss20 = str(write_header_only(Path(tmp) / "gpt-oss-20b.gguf", GPT_OSS_20B, "mxfp4_moe"))
        oss120 = str(write_header_only(Path(tmp) / "gpt-oss-120b.gguf", GPT_OSS_120B, "mxfp4_moe"))
        g27 = str(write_header_only(Path(tmp) / "gemma3-27b.gguf", GEMMA3_27B, "q4_k_m"))
        g1b = str(write_header_only(Path(tmp) / "gemma3-1b.gguf", GEMMA3_1B, "q4_k_m"))
        g270m = str(write_header_only(Path(tmp) / "gemma3-270m.gguf", GEMMA3_270M, "q4_k_m"))
        for path, shape, outtype in ((t27, QWEN35_27B, "q4_k_m"), (moe, QWEN35_35B_A3B, "q4_k_m"),
                                     (oss20, GPT_OSS_20B, "mxfp4_moe"), (oss120, GPT_OSS_120B, "mxfp4_moe"),
                                     (g27, GEMMA3_27B, "q4_k_m"), (g1b, GEMMA3_1B, "q4_k_m"),
                                     (g270m, GEMMA3_270M, "q4_k_m")):
            table_ = tensor_table(shape, outtype)
            # a tied embedding is the LM head too: it stays on the card
            EMBEDDING[path] = 0 if shape.get("tied") else \
                next(tensor_nbytes(s, q) for n, s, q in table_ if n == "token_embd.weight")
            if shape["arch"] == "gpt-oss":
                EXPERTS[path] = sum(tensor_nbytes(s, q) for n, s, q in table_ if n.endswith("_exps.weight"))
                MAX_CTX[path] = int(shape["yarn_factor"] * shape["yarn_orig_ctx"])
        MAX_CTX[g27] = GEMMA3_27B["ctx"]  # 128K
        out = [f"## Memory on a 24 GB card ({_dt.date.today()}, experiments/memory_table.py)", ""]
        tables = []
        for name, target, draft, simple in (("Qwen3.5-27B Q4_K_M + DFlash drafter q8_0", t27, d27, False),
                                            ("Gemma 3 27B Q4_K_M + Gemma 3 270M Q4_K_M (draft-simple)", g27, g270m, True),
                                            ("Gemma 3 27B Q4_K_M + Gemma 3 1B Q4_K_M (draft-simple)", g27, g1b, True),
                                            ("Qwen3.5-35B-A3B Q4_K_M, plain decoding", moe, None, False),
                                            ("gpt-oss-20b mxfp4_moe, plain decoding", oss20, None, False),
                                            ("gpt-oss-120b mxfp4_moe, plain decoding", oss120, None, False)):
            lines, data = table(name, target, draft, simple)
            out += lines
            tables.append(data)
        out += ["## MoE models with routed experts in host memory", ""]
        with rpc_device():
            for name, shape, outtype in (("Qwen3.5-35B-A3B Q4_K_M", QWEN35_35B_A3B, "q4_k_m"),
                                         ("Qwen3.5-122B-A10B Q4_K_M", QWEN35_122B_A10B, "q4_k_m"),
                                         ("gpt-oss-120b mxfp4_moe", GPT_OSS_120B, "mxfp4_moe"),
                                         ("Gemma 4 26B-A4B Q4_K_M", GEMMA4_26B_A4B, "q4_k_m")):
                path = str(write_header_only(Path(tmp) / f"moe-{shape['arch']}-{shape['layers']}.gguf", shape,
                                             outtype))
                lines, data = moe_table(name, path, shape, outtype)
                out += lines
                tables.append(data)
    text = "\n".join(out)
    print(text)
    dest = ROOT / "results" / f"memory-24gb-{_dt.date.today()}.json"
    provenance.write_results(dest, {"tool": "experiments/memory_table.py", "date": str(_dt.date.today()),
                                    "checkout": provenance.checkout(), "versions": provenance.versions(),
                                    "tables": tables, "markdown": text})
    print(f"\n(saved to {dest.relative_to(ROOT)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
