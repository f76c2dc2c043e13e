#!/usr/bin/env python3
"""How far a target's logits move with the attention cache's precision, in llama.cpp and in
ours, on the same tokens: for a model whose greedy text differs between the engines,
whether the difference is the model's (llama.cpp against itself moves as much) or ours.

For the tiny GPT-OSS bench target (experiments/gptoss_bench_pair.py) and a bench prompt, the
prompt and three tokens after it are decoded, every row's logits kept, by llama.cpp
(llama-cpp-python) with an f16 and with an f32 cache and by ours with each; it reports
each row's largest absolute difference between llama.cpp's two runs and between the two
engines at each cache type, and the argmax of the last rows.

    .venv/bin/python experiments/cache_sensitivity.py [--model GGUF] [--prompt NAME] [--out results/F.json]

It wrote results/cache-sensitivity-2026-11-25-gptoss.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dflash_gguf.bench import provenance
from dflash_gguf.bench.prompts import PROMPTS
from dflash_gguf.runtime.target import LOGITS_ALL, Target, TargetConfig

CACHES = {"f16": {}, "f32": {"type_k": 0, "type_v": 0}}  # llama.cpp's: 0 is GGML_TYPE_F32


def llama_logits(model: str, tokens: list, cache: str) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model, n_ctx=512, n_threads=2, logits_all=True, verbose=False, **CACHES[cache])
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def our_logits(model: str, tokens: list, cache: str) -> np.ndarray:
    with Target(model, TargetConfig(n_ctx=512, kv_type=cache)) as t:
        t.decode(tokens, LOGITS_ALL)
        return t.logits(0, len(tokens))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path.home() / ".cache" / "dflash-gguf" / "gptoss-bench" /
                                          "gptoss-target-mxfp4_moe.gguf"))
    p.add_argument("--prompt", default="comment", help="a built-in bench prompt's name (default comment)")
    p.add_argument("--after", default="639,20,175", help="token ids decoded after the prompt")
    p.add_argument("--out", type=Path, help="results JSON")
    args = p.parse_args(argv)
    from llama_cpp import Llama

    text = dict(PROMPTS)[args.prompt]
    vocab = Llama(args.model, vocab_only=True, verbose=False)
    tokens = vocab.tokenize(text.encode(), add_bos=True, special=False) + [int(t) for t in args.after.split(",")]
    llama = {c: llama_logits(args.model, tokens, c) for c in CACHES}
    ours = {c: our_logits(args.model, tokens, c) for c in CACHES}

    def row_max(a, b):
        return [round(float(x), 4) for x in np.abs(a - b).max(1)]

    doc = provenance.results_doc("experiments/cache_sensitivity.py", sys.argv[1:] if argv is None else argv,
                                 model=args.model, prompt=args.prompt, tokens=tokens,
                                 largest_logit=round(float(np.abs(llama["f32"]).max()), 4),
                                 llama_f16_vs_f32=row_max(llama["f16"], llama["f32"]),
                                 ours_vs_llama={c: row_max(ours[c], llama[c]) for c in CACHES},
                                 argmax_last_rows={**{f"llama {c}": llama[c][-4:].argmax(1).tolist() for c in CACHES},
                                                   **{f"ours {c}": ours[c][-4:].argmax(1).tolist() for c in CACHES}})
    print(json.dumps({k: doc[k] for k in ("largest_logit", "llama_f16_vs_f32", "ours_vs_llama", "argmax_last_rows")}))
    if args.out:
        provenance.write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
