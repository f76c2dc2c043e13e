#!/usr/bin/env python3
"""What sampling and a grammar's mask cost a target pass at Qwen3.5's vocabulary (issue
#34's figure 3, issue #40's mask cost).

A random-weight target with Qwen3.5's 248,320-token vocabulary and a few small layers
(dflash_gguf.convert.shape_model: qwen35-27b's structure, 4 layers, hidden 256, q8_0) and a
random drafter of its shape. Times the target pass of a chain step (the drafter's whole
block of 16 verified, handed over on the device) and of a 16-node tree step (17 nodes
with the root), each greedy, sampled (T 0.6 / top-k 20 / top-p 0.95, on the device) and
greedy and sampled under an allowed-token mask on every row (the dense worst case: about
62% of the vocabulary allowed in a fine pattern, so that neither exception list is short),
alternating the four so that drift hits them alike; then, in a loop of its own, greedy passes
alternating with passes masked by a JSON schema's grammar (llguidance walking a document
with a real tokenizer: forced keys and punctuation, free strings; see grammar_masks).
Reports the median pass of each with its range, the sampled / greedy, masked / greedy
and sampled masked / sampled ratios of medians, whether the machine started loaded (the benchmarks' rule: a 1-minute
load above 0.5 per thread), and the bytes the host writes and reads per pass. For scale,
it also times what host sampling over the same rows costs (reading the logits rows back
and numpy's distribution), which the device sampling replaced.

    .venv/bin/python experiments/sampling_cost.py [--threads 2] [--reps 40] [--out results/]

The model files go to .cache/bench/ (about 70 MB); the figures to
results/sampling-cost-<date>-<HHMM>.json. Time only on an idle machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from dflash_gguf.bench.method import MAX_LOAD_PER_THREAD
from dflash_gguf.bench.provenance import write_results
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.decoding.sampling import GREEDY, Sampler, SamplingParams, distribution
from dflash_gguf.runtime.target import CHAIN, LOGITS_LAST, Rows, Target, TargetConfig

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench"
SMALL = ["hidden=256", "heads=4", "kv_heads=2", "head_dim=64", "rot=16", "sections=3,3,2,0", "lin_k_heads=2",
         "lin_v_heads=4", "lin_dim=64", "ffn=512"]
SAMPLED = SamplingParams(0.6, 20, 0.95, seed=0)
TREE_NODES = 17  # 16 nodes and the root


def make_files() -> tuple[Path, Path]:
    target, draft = CACHE / "vocab248k-target-q8_0.gguf", CACHE / "vocab248k-draft-q8_0.gguf"
    make = [sys.executable, "-m", "dflash_gguf.convert.shape_model"]
    CACHE.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        subprocess.run(make + ["qwen35-27b", "--outtype", "q8_0", "--layers", "4", "--outfile", str(target),
                               "--quiet", *[f"--set={s}" for s in SMALL]], check=True, cwd=CACHE)
    if not draft.exists():
        subprocess.run(make + ["qwen35-27b-dflash", "--outtype", "q8_0", "--outfile", str(draft), "--quiet",
                               "--layers", "1", "--set=target_layers=1,3",
                               *[f"--set={s}" for s in SMALL if not s.startswith(("rot", "sections", "lin"))]],
                       check=True, cwd=CACHE)  # not the checkout's root, whose source tree would shadow the package
    return target, draft


def best_first_tree(n: int) -> list:
    """Parents of a bushy 16-node tree (each node's children ordered, depth-first)."""
    return [-1] + [(i - 1) // 3 for i in range(1, n)]


# A JSON schema and a document it accepts, as a structured-output request would produce:
# forced keys and punctuation (a token or a few allowed), strings (nearly every token),
# numbers and booleans in between.
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "additionalProperties": False,
                                     "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                    "zip": {"type": "string"}},
                                     "required": ["street", "city", "zip"]},
                         "active": {"type": "boolean"}, "bio": {"type": "string"}},
          "required": ["name", "age", "email", "tags", "address", "active", "bio"]}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["mathematics", "poetry", "analytical engine"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "active": True,
            "bio": "Wrote the first published algorithm intended for a machine, in her notes on "
                   "Menabrea's account of the Analytical Engine (1843)."}


def grammar_masks(n_vocab: int) -> np.ndarray:
    """The allowed-token bitmasks [positions, words] of a JSON-schema grammar at each token
    of DOCUMENT, from llguidance walking it with a real tokenizer (llama.cpp's
    ggml-vocab-qwen35.gguf, 151,936 tokens; at each position the longest allowed token
    that spells the document on), laid onto n_vocab tokens by repeating the tokenizer's
    (token t allowed as token t mod 151,936 is), so that a position allows the same share
    of the larger vocabulary as of the real one."""
    from llguidance.numpy import fill_next_token_bitmask

    from dflash_gguf.decoding.constraints import Constraint, GrammarVocab
    from dflash_gguf.tools.llama_cpp_tree import source_dir
    from dflash_gguf.runtime.tokenizer import Tokenizer

    src = source_dir()
    if src is None:
        sys.exit("sampling_cost.py: llama.cpp's sources (models/ggml-vocab-qwen35.gguf) are missing: run "
                 "scripts/setup.sh")
    tok = Tokenizer(str(src / "models" / "ggml-vocab-qwen35.gguf"))
    n_tok = tok._llama.n_vocab()
    state = Constraint.json_schema(SCHEMA).state(GrammarVocab(tok, n_tok))
    spelled: dict = {}
    for t in range(n_tok):
        spelled.setdefault(tok.token_bytes([t]), t)
    longest = max(len(b) for b in spelled)
    text, pos, rows = json.dumps(DOCUMENT).encode(), 0, []
    words = (n_tok + 31) // 32
    while pos < len(text):
        row = np.zeros((1, words), dtype=np.int32)
        fill_next_token_bitmask(state.matcher, row, 0)
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:n_tok].astype(bool)
        for n in range(min(longest, len(text) - pos), 0, -1):
            t = spelled.get(text[pos:pos + n])
            if t is not None and allowed[t]:
                break
        else:
            raise RuntimeError(f"the grammar allows no token spelling {text[pos:pos + 20]!r}")
        state.matcher.consume_token(t)
        rows.append(allowed[np.arange(n_vocab) % n_tok])
        pos += n
    bits = np.zeros((len(rows), (n_vocab + 31) // 32 * 32), dtype=bool)
    bits[:, :n_vocab] = rows
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint32)


def half_mask(n_vocab: int, rows: int) -> np.ndarray:
    """An allowed-token bitmask for `rows` rows letting about half the vocabulary through."""
    words = (n_vocab + 31) // 32
    mask = np.full((rows, words), 0xFFFFFFFF, dtype=np.uint32)
    mask[:, 1::2] = 0x0F0F0F0F
    return mask


def pass_seconds(target: Target, draft: Draft, sampler: Sampler, tree: bool,
                 mask: Optional[np.ndarray] = None) -> tuple[float, int, int]:
    """One target pass as decoding runs it: staging (with a mask: uploading it), verify
    (carrying the last commit), the choices read back; then a commit of one row for the
    next pass to carry."""
    info = target.info()
    w0, r0 = info["n_host_write_bytes"], info["n_host_read_bytes"]
    rows = TREE_NODES if tree else draft.block_size
    t0 = time.perf_counter()
    sampler.prepare(target, rows)
    if mask is not None:
        target.set_masks(mask[:rows])
    if tree:
        target.verify_tree(list(range(500, 500 + rows)), best_first_tree(rows))
    else:
        target.step([Rows(0, CHAIN, n=rows)], draft)  # the drafter's block, read on the device
    sampler.choices(target, 0, rows)
    dt = time.perf_counter() - t0
    info = target.info()
    if tree:
        target.commit_path([0])
    else:
        target.commit(1)
    return dt, info["n_host_write_bytes"] - w0, info["n_host_read_bytes"] - r0


def measure(target: Target, draft: Draft, reps: int) -> dict:
    prompt = list(range(1000, 1064))
    out = {}
    mask = half_mask(target.n_vocab, TREE_NODES)
    grammar = grammar_masks(target.n_vocab)
    for tree in (False, True):
        samplers = {"greedy": Sampler(GREEDY), "sampled": Sampler(SAMPLED), "masked": Sampler(GREEDY),
                    "sampled_masked": Sampler(SAMPLED)}
        times = {k: [] for k in samplers}
        traffic = {}
        target.reset()
        draft.reset()
        target.set_sampling(GREEDY.native())
        target.prefill(prompt, LOGITS_LAST)
        draft.append()
        draft.propose(7, draft.block_size, read=False)
        for rep in range(reps + 3):  # the first passes build graphs
            for kind, sampler in samplers.items():
                sampler.apply(target)
                dt, wrote, read = pass_seconds(target, draft, sampler, tree, mask if kind.endswith("masked") else None)
                if rep >= 3:
                    times[kind].append(dt)
                    traffic[kind] = {"write_bytes": wrote, "read_bytes": read}
        name = "tree16" if tree else "chain16"
        med = {k: statistics.median(v) for k, v in times.items()}
        out[name] = {"rows": TREE_NODES if tree else draft.block_size, "median_seconds": med,
                     "range_seconds": {k: [min(v), max(v)] for k, v in times.items()},
                     "ratio": med["sampled"] / med["greedy"], "mask_ratio": med["masked"] / med["greedy"],
                     "sampled_mask_ratio": med["sampled_masked"] / med["sampled"],
                     "host_bytes_per_pass": traffic, "seconds": times,
                     "grammar": measure_grammar(target, draft, reps, tree, grammar)}
    # host sampling as it was: the logits rows read back and numpy's rule over them
    target.reset()
    target.set_sampling(GREEDY.native())
    target.prefill(prompt, LOGITS_LAST)
    target.verify(list(range(500, 500 + TREE_NODES)))
    host = []
    for _ in range(max(3, reps // 4)):
        t0 = time.perf_counter()
        distribution(target.logits(0, TREE_NODES), SAMPLED)
        host.append(time.perf_counter() - t0)
    target.commit(1)
    out["host_sampling_seconds"] = statistics.median(host)
    out["host_logits_bytes"] = TREE_NODES * target.n_vocab * 4
    return out


def measure_grammar(target: Target, draft: Draft, reps: int, tree: bool, masks: np.ndarray) -> dict:
    """Greedy passes alternating unmasked and masked by the JSON-schema grammar's masks
    (grammar_masks): each masked pass's rows are consecutive positions of the document
    (a chain's rows are; a tree's rows are taken alike), starting 5 positions after the
    last pass's, so that passes mix forced and free rows as decoding does. Its own loop:
    the dense worst case's graphs are not competing for the graph slots."""
    rows = TREE_NODES if tree else draft.block_size
    windows = [masks[(5 * i) % (len(masks) - rows + 1):][:rows] for i in range(reps + 3)]
    times = {"greedy": [], "masked": []}
    wrote = []
    target.reset()
    draft.reset()
    target.set_sampling(GREEDY.native())
    target.prefill(list(range(1000, 1064)), LOGITS_LAST)
    draft.append()
    draft.propose(7, draft.block_size, read=False)
    sampler = Sampler(GREEDY)
    builds = target.info()["n_graph_builds"]
    for rep, window in enumerate(windows):  # the first passes build graphs
        for kind in times:
            dt, w, _ = pass_seconds(target, draft, sampler, tree, window if kind == "masked" else None)
            if rep >= 3:
                times[kind].append(dt)
                if kind == "masked":
                    wrote.append(w)
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :target.n_vocab].mean(axis=1)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"positions": len(masks), "allowed_share_per_position": [round(float(a), 4) for a in allowed],
            "median_seconds": med, "range_seconds": {k: [min(v), max(v)] for k, v in times.items()},
            "mask_ratio": med["masked"] / med["greedy"], "masked_write_bytes_median": statistics.median(wrote),
            "graph_builds": target.info()["n_graph_builds"] - builds, "seconds": times}


def provenance(threads: int) -> dict:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    load = os.getloadavg()
    # the benchmarks' load rule (dflash_gguf/bench/method.py): above 0.5 per thread the figures are marked
    return {"commit": commit, "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": "CPU",
            "cpu": cpu, "threads": threads, "loadavg_before": load,
            "loaded": load[0] > MAX_LOAD_PER_THREAD * threads}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=40, help="passes timed per kind (default 40)")
    p.add_argument("--out", default=str(ROOT / "results"), help="folder for the results file")
    args = p.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        p.error("--reps and --threads must be >= 1")
    target_path, draft_path = make_files()
    prov = provenance(args.threads)
    meta = read_draft_metadata(str(draft_path))
    with Target(str(target_path), TargetConfig(n_ctx=512, n_ubatch=64, n_verify=TREE_NODES, kv_type="f16",
                                               feature_layers=meta["target_layers"], n_threads=args.threads)) as t, \
            Draft(str(draft_path), t, DraftConfig(top_k=4)) as d:
        res = measure(t, d, args.reps)
    prov["loadavg_after"] = os.getloadavg()
    doc = {"what": "sampled and masked vs greedy target pass at a 248,320-token vocabulary (issues #34, #40)",
           "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
           "model": {"target": target_path.name, "draft": draft_path.name, "vocab": 248320},
           "sampling": SAMPLED.__dict__, **prov, "results": res}
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    out = Path(args.out) / f"sampling-cost-{stamp}.json"
    if out.exists():  # a second run within the minute keeps the first's file
        out = Path(args.out) / f"sampling-cost-{datetime.datetime.now().strftime('%Y-%m-%d-%H%M%S')}.json"
    write_results(out, doc)
    for name in ("chain16", "tree16"):
        r = res[name]
        lo, hi = (r["range_seconds"]["sampled"][i] * 1e3 for i in (0, 1))
        print(f"{name}: greedy {r['median_seconds']['greedy'] * 1e3:.2f} ms, sampled "
              f"{r['median_seconds']['sampled'] * 1e3:.2f} ms [{lo:.2f}-{hi:.2f}], ratio of medians "
              f"{r['ratio']:.3f}; masked (dense worst case) {r['median_seconds']['masked'] * 1e3:.2f} ms, ratio "
              f"{r['mask_ratio']:.3f}; sampled and masked, ratio to sampled {r['sampled_mask_ratio']:.3f}; "
              f"masked by a JSON schema {r['grammar']['median_seconds']['masked'] * 1e3:.2f} "
              f"ms, ratio {r['grammar']['mask_ratio']:.3f} ({r['grammar']['graph_builds']} graph builds); "
              f"host bytes per pass "
              f"(sampled) written {r['host_bytes_per_pass']['sampled']['write_bytes']}, read "
              f"{r['host_bytes_per_pass']['sampled']['read_bytes']}")
    print(f"host sampling of {TREE_NODES} rows (for scale): {res['host_sampling_seconds'] * 1e3:.1f} ms and "
          f"{res['host_logits_bytes']} bytes of logits read")
    print(f"load average {prov['loadavg_before'][0]:.2f} -> {prov['loadavg_after'][0]:.2f}"
          + (" (loaded: the figures are not a measurement)" if prov["loaded"] else "") + f"; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
