#!/usr/bin/env python3
"""A DFlash drafter's head cut to kept tokens (--spec-draft-vocab N, or the kept set a
dflash-train --draft-vocab file carries): what it costs in acceptance and what it saves a
propose.

1. Acceptance (no timings): the bundled demo pair (a 4,096-token vocabulary), greedy chain
   at the drafter's block (every draft verified: --draft-p-min 0), on the code and prose
   prompts of experiments/prompts/, the head whole and cut to N of the tokens commonest in the
   standard library's modules a-c (--spec-draft-vocab-from): AL, and whether each output
   is the whole head's.
2. Cost (timed: run it on an idle machine): the real Qwen2.5-Coder-1.5B Q4_K_M target
   (151,936 tokens) with a seeded, untrained DFlash drafter of dflash-train's default
   shape (2 layers), one propose after a 256-token prompt at blocks 8 and 16, the head
   whole and cut to each N: milliseconds a propose, arms taking turns, medians over
   --reps rounds.

    .venv/bin/python experiments/dflash_head_cut.py [--keep 2048 1024 512] [--keep-real 32768 8192] [-t 2] [--reps 30]
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from dflash_gguf.bench import provenance
from dflash_gguf.runtime.demo import demo_paths

MODELS = Path(os.path.expanduser("~/.cache/dflash-gguf/models"))
REAL = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
PROMPTS = Path(__file__).resolve().parent / "prompts"
CODE = ("quicksort", "read_config", "stack")
PROSE = ("explain_recursion", "history_python", "review_email")


def corpus() -> list:
    return sorted(str(f) for f in Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))


def acceptance(keeps, threads: int, n_tokens: int) -> dict:
    from dflash_gguf.engine.engine import Engine

    target, draft = (str(p) for p in demo_paths())
    out = {}
    whole_text = {}
    for n in [0, *keeps]:
        extra = dict(spec_draft_vocab=n, spec_draft_vocab_from=corpus()) if n else {}
        with Engine(target, draft, n_ctx=1024, n_threads=threads, draft_p_min=0.0, **extra) as engine:
            rows = {}
            for name in CODE + PROSE:
                r = engine.generate((PROMPTS / f"{name}.txt").read_text(), n_tokens, stop_tokens=())
                if not n:
                    whole_text[name] = r.tokens
                rows[name] = {"al": round(r.stats.mean_accepted, 4), "same_output": r.tokens == whole_text[name]}
            out[str(n or "whole")] = {
                "kept": engine.draft.n_head_tokens, "prompts": rows,
                "al_code": round(statistics.mean(rows[k]["al"] for k in CODE), 4),
                "al_prose": round(statistics.mean(rows[k]["al"] for k in PROSE), 4)}
        print(f"demo pair, head {n or 'whole'}: AL code {out[str(n or 'whole')]['al_code']:.3f}, "
              f"prose {out[str(n or 'whole')]['al_prose']:.3f}", file=sys.stderr, flush=True)
    return out


def cost(keeps, threads: int, reps: int) -> dict:
    from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
    from dflash_gguf.speculation.draft_simple import corpus_counts, kept_tokens
    from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
    from dflash_gguf.runtime.tokenizer import Tokenizer
    from dflash_gguf.train import export

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "untrained.gguf"
        export.write_untrained(str(REAL), path, mask_token="<|fim_pad|>")
        meta = read_draft_metadata(str(path))
        target = Target(str(REAL), TargetConfig(n_ctx=512, n_verify=16, n_threads=threads,
                                                feature_layers=meta["target_layers"]))
        tok = Tokenizer(str(REAL))
        counts = corpus_counts(tok, corpus(), target.n_vocab)
        prompt = tok.encode((PROMPTS / "read_config.txt").read_text() * 8)[:256]
        arms = {"whole": None, **{str(n): kept_tokens(str(REAL), n, counts) for n in keeps}}
        drafts = {name: Draft(str(path), target, DraftConfig(n_threads=threads, head_tokens=kept))
                  for name, kept in arms.items()}
        try:
            target.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: [d.append() for d in drafts.values()])
            bonus = int(target.choices()[0])
            times = {(name, b): [] for name in arms for b in (8, 16)}
            for _ in range(2):  # warm-up: graphs built, caches filled
                for (name, b) in times:
                    drafts[name].propose(bonus, b)
            for _ in range(reps):
                for (name, b), got in times.items():
                    t0 = time.perf_counter()
                    drafts[name].propose(bonus, b)
                    got.append((time.perf_counter() - t0) * 1e3)
        finally:
            for d in drafts.values():
                d.close()
            target.close()
    out = {}
    for b in (8, 16):
        whole = statistics.median(times[("whole", b)])
        out[f"block{b}"] = {name: {"ms_median": round(statistics.median(times[(name, b)]), 3),
                                   "ms": [round(x, 3) for x in times[(name, b)]],
                                   "vs_whole": round(statistics.median(times[(name, b)]) / whole, 4)}
                            for name in arms}
        print(f"1.5B, block {b}: " + ", ".join(f"{k} {v['ms_median']:.2f} ms" for k, v in out[f'block{b}'].items()),
              file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", type=int, nargs="+", default=[2048, 1024, 512], help="kept sets of the demo pair")
    p.add_argument("--keep-real", type=int, nargs="+", default=[32768, 8192], help="kept sets of the real 1.5B")
    p.add_argument("-n", "--n-predict", type=int, default=96)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--skip-cost", action="store_true", help="acceptance only (no timings)")
    p.add_argument("--out", type=Path, default=None, help="default results/dflash-head-cut-DATE.json")
    a = p.parse_args(argv)
    out = a.out or Path("results") / f"dflash-head-cut-{dt.date.today()}.json"
    load_before = provenance.load_average()
    doc = {"acceptance_demo_pair": acceptance(a.keep, a.threads, a.n_predict)}
    if not a.skip_cost:
        doc["propose_ms_real_1_5b"] = cost(a.keep_real, a.threads, a.reps)
    doc = provenance.results_doc("experiments/dflash_head_cut.py", sys.argv[1:] if argv is None else argv,
                                 models={"demo": [str(p) for p in demo_paths()], "real_target": str(REAL)},
                                 machine=provenance.machine(a.threads, "CPU"), load_average_before=load_before,
                                 load_average_after=provenance.load_average(), **doc)
    path = provenance.write_results(out, doc)
    print(f"results: {path or out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
