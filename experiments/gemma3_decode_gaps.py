#!/usr/bin/env python3
"""How far llama.cpp's one-token decode logits of the published Gemma 3 270M Q4_K_M are from
ours, by how llama.cpp is opened (docs/parity.md):

- as its own tools run on the CPU: flash attention on, the sliding-window layers' cache a
  ring of window + ubatch cells (768 here), which is how our runtime always runs;
- without flash attention (llama-cpp-python's default): K and V as two matrix products;
- with a full-size sliding-window cache (llama-cpp-python's default, `--swa-full`): the
  local layers attend over the cells in position order, ours in ring order.

Each setting decodes greedily after two prompts, a short code prompt and the first 700
tokens of a Python module (past the 512-token window, and past the 768-cell ring once the
continuation runs on), taking llama.cpp's tokens; ours decodes the same tokens one at a
time. Per step: the largest difference over the whole vocabulary; where the two engines'
best tokens first differ (and llama.cpp's margin there). Writes
results/gemma3-decode-gaps-<date>.json:

    .venv/bin/python experiments/gemma3_decode_gaps.py [--steps 32] [--long-steps 256] [-o PATH]
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import numpy as np

from dflash_gguf.tools import real_models
from dflash_gguf.bench import provenance
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

N_CTX, N_UBATCH = 1024, 256  # the ring: 512-token window + a ubatch = 768 cells
RING = 768
SETTINGS = {
    "tools (flash attention, ring)": dict(flash_attn=True, swa_full=False),
    "no flash attention": dict(flash_attn=False, swa_full=False),
    "full-size window cache": dict(flash_attn=True, swa_full=True),
}
SHORT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
LONG_SOURCE = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "textwrap.py"
LONG_TOKENS = 700


def llama_decode(llm, prompt, steps):
    """llama.cpp's greedy continuation, one token a call: each step's whole logits."""
    import llama_cpp

    n_vocab = llm.n_vocab()
    llm.reset()
    llm.eval(prompt)
    for _ in range(steps):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
        yield logits
        llm.eval([int(logits.argmax())])


def compare(llm, target, prompt, steps) -> dict:
    """llama.cpp's greedy steps, ours decoding the same tokens beside them."""
    target.reset()
    target.prefill(prompt, LOGITS_LAST)
    mine = target.logits(0, 1)[0]
    gaps, parted = [], None
    for step, logits in enumerate(llama_decode(llm, prompt, steps)):
        token = int(logits.argmax())
        gaps.append(float(np.abs(mine - logits).max()))
        if parted is None and int(mine.argmax()) != token:
            top2 = np.sort(logits)[-2:]
            parted = {"step": step, "position": len(prompt) + step, "ours": int(mine.argmax()), "theirs": token,
                      "their_margin": float(top2[1] - top2[0])}
        if step + 1 < steps:
            target.decode([token], LOGITS_LAST)
            mine = target.logits(0, 1)[0]
    positions = len(prompt) + np.arange(steps)
    gaps_at = np.asarray(gaps)

    def span(where):
        return [float(gaps_at[where].min()), float(gaps_at[where].max())] if where.any() else None

    return {"prompt_tokens": len(prompt), "steps": steps, "largest_gap_per_step": [round(g, 4) for g in gaps],
            "steps_bit_equal": int((gaps_at == 0).sum()), "largest_gap_range": span(positions >= 0),
            "before_ring_range": span(positions < RING), "past_ring_range": span(positions >= RING),
            "best_tokens_first_differ": parted}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=32, help="decode steps after the short prompt (default 32)")
    p.add_argument("--long-steps", type=int, default=256, help="decode steps after the long one (default 256)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-o", "--out", type=Path, default=Path("results") / f"gemma3-decode-gaps-{dt.date.today()}.json")
    a = p.parse_args(argv)
    from llama_cpp import Llama

    path = str(real_models.path("gemma-3-270m"))
    tokenizer = Tokenizer(path)
    long_ids = tokenizer.encode(LONG_SOURCE.read_text())[:LONG_TOKENS]
    prompts = {"short code": (tokenizer.encode(SHORT), a.steps),
               f"{LONG_SOURCE.name}, first {LONG_TOKENS} tokens": (long_ids, a.long_steps)}
    target = Target(path, TargetConfig(n_ctx=N_CTX, n_ubatch=N_UBATCH, n_threads=a.threads))
    doc = provenance.results_doc("experiments/gemma3_decode_gaps.py", sys.argv[1:] if argv is None else argv,
                                 model=path, threads=a.threads, n_ctx=N_CTX, n_ubatch=N_UBATCH, settings={})
    try:
        for name, options in SETTINGS.items():
            llm = Llama(path, n_ctx=N_CTX, n_batch=N_UBATCH, n_ubatch=N_UBATCH, n_threads=a.threads, verbose=False,
                        **options)
            try:
                doc["settings"][name] = {"llama_cpp_options": options, "prompts": {
                    label: compare(llm, target, ids, steps) for label, (ids, steps) in prompts.items()}}
            finally:
                llm.close()
            for label, r in doc["settings"][name]["prompts"].items():
                lo, hi = r["largest_gap_range"]
                print(f"{name:>32} | {label}: largest gap {lo:.3g}-{hi:.3g}, {r['steps_bit_equal']}/{r['steps']} "
                      f"steps bit equal, past the ring {r['past_ring_range']}, parted {r['best_tokens_first_differ']}")
    finally:
        target.close()
    provenance.write_results(a.out, doc)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
