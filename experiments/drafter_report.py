#!/usr/bin/env python3
"""A drafter's acceptance on a real target, the report dflash-train's issue asks of a
trained drafter: mean accepted length (tokens per target pass) by block size, by prompt
domain (code, prose) and by sampling (greedy, T 0.6 with llama.cpp's default filters),
beside the draft-simple pair's and an n-gram drafter's on the same prompts; then by
context length (a held-out text cut to 512 ... 8192 tokens, then -n tokens greedily).

    .venv/bin/python experiments/drafter_report.py --draft qwen15-dflash.gguf \
        [-m qwen2.5-coder-1.5b] [--simple qwen2.5-coder-0.5b] [--blocks 8,16] \
        [--contexts 512,1024,2048,4096,8192] [-n 64] [--seeds 3] [-t 2] [--out PATH]

-m and --simple take a published model's name (dflash_gguf.tools.real_models) or a path.
Acceptance does not depend on the machine's speed: this is not a timed run (tok/s against
plain decoding, draft-simple and n-gram drafts: experiments/real_pair_bench.py --pair
qwen-trained). The held-out text of the context sweep is the Python standard library's
modules from t to z (dflash-train's runs here train on a to c).
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import sys
import sysconfig
import time
from pathlib import Path

from dflash_gguf import Engine
from dflash_gguf.tools import real_models
from dflash_gguf.bench import provenance
from dflash_gguf.decoding.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parent / "prompts"
DOMAINS = {"code": ["quicksort", "read_config", "stack"],
           "prose": ["explain_recursion", "review_email", "history_python"]}
T06 = dict(temperature=0.6, top_k=40, top_p=0.95, min_p=0.05)  # llama.cpp's default filters


def model_path(name: str) -> str:
    return name if Path(name).exists() else str(real_models.path(name))


def accepted(engine: Engine, prompts: list, n: int, sampling=None) -> dict:
    """Tokens per target pass over the prompts (the first token, the prefill's, apart)."""
    tokens = passes = 0
    for text in prompts:
        r = engine.generate(text, max_tokens=n, stop_tokens=(), sampling=sampling)
        tokens += r.stats.generated_tokens - 1
        passes += len(r.stats.accepted_lengths)
    return {"al": tokens / max(passes, 1), "tokens": tokens, "passes": passes}


def held_out_text(n_tokens: int, engine: Engine) -> tuple[list, list]:
    """At least n_tokens of the standard library's [t-z]*.py, file by file in name order."""
    files, ids = [], []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[t-z]*.py")):
        files.append(f.name)
        ids += engine.encode(f.read_text(encoding="utf-8"))
        if len(ids) >= n_tokens:
            break
    return ids, files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="the DFlash drafter GGUF")
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--simple", default="qwen2.5-coder-0.5b", help="the draft-simple drafter ('' for none)")
    p.add_argument("--blocks", type=lambda v: [int(x) for x in v.split(",")], default=[8, 16])
    p.add_argument("--contexts", type=lambda v: [int(x) for x in v.split(",")], default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--seeds", type=int, default=3, help="T 0.6 runs per prompt")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="default results/drafter-report-<drafter>-DATE.json")
    a = p.parse_args(argv)
    target, draft = model_path(a.model), a.draft
    out = a.out or Path("results") / f"drafter-report-{Path(draft).stem}-{dt.date.today()}.json"
    prompts = {d: [(PROMPTS / f"{name}.txt").read_text() for name in names] for d, names in DOMAINS.items()}
    doc = provenance.results_doc("experiments/drafter_report.py", sys.argv[1:] if argv is None else argv,
                                 models={"target": target, "draft": draft, "simple": a.simple},
                                 draft_sha256=hashlib.sha256(Path(draft).read_bytes()).hexdigest(),
                                 prompts=DOMAINS, n_predict=a.n_predict, threads=a.threads, seeds=a.seeds,
                                 sampling_t06=T06, acceptance=[], by_context=[])

    def measure(label: str, engine: Engine, **cell):
        for domain, texts in prompts.items():
            for sampling in ("greedy", "T0.6"):
                t0 = time.time()
                if sampling == "greedy":
                    r = accepted(engine, texts, a.n_predict)
                else:
                    rs = [accepted(engine, texts, a.n_predict, SamplingParams(**T06, seed=s)) for s in range(a.seeds)]
                    r = {"al": sum(x["tokens"] for x in rs) / sum(x["passes"] for x in rs),
                         "tokens": sum(x["tokens"] for x in rs), "passes": sum(x["passes"] for x in rs)}
                doc["acceptance"].append({"drafter": label, **cell, "domain": domain, "sampling": sampling, **r})
                print(f"{label} {cell} {domain} {sampling}: AL {r['al']:.3f} ({time.time() - t0:.0f} s)",
                      file=sys.stderr, flush=True)

    for block in a.blocks:
        with Engine(target, draft, n_ctx=1024, n_threads=a.threads, block_size=block) as engine:
            measure("dflash (trained)", engine, block=block)
    if a.simple:
        with Engine(target, model_path(a.simple), n_ctx=1024, n_threads=a.threads) as engine:
            measure("draft-simple (default n-max 3)", engine)
    with Engine(target, None, n_ctx=1024, n_threads=a.threads, spec_type="ngram-simple") as engine:
        measure("ngram-simple (default)", engine)

    longest = max(a.contexts)
    for block in a.blocks:  # each context a prefix of the next: the slot reuses what it holds
        with Engine(target, draft, n_ctx=longest + a.n_predict + 64, n_threads=a.threads, block_size=block) as e:
            text, files = held_out_text(longest, e)
            doc["context_text"] = {"files": files, "tokens": len(text)}
            for n_ctx in a.contexts:
                r = accepted(e, [text[:n_ctx]], a.n_predict)
                doc["by_context"].append({"context": n_ctx, "block": block, **r})
                print(f"context {n_ctx} block {block}: AL {r['al']:.3f}", file=sys.stderr, flush=True)
    path = provenance.write_results(out, doc)
    print(f"results: {path or out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
