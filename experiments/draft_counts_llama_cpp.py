#!/usr/bin/env python3
"""The Engine's drafted and accepted counts against llama-speculative-simple --spec-type
draft-simple, results on file (CI runs a subset: test_counts_equal_llama_cpp in
tests/drafters/test_real_pair.py and test_real_gemma3_pair.py): the real pair (the
Qwen2.5-Coder 0.5B drafting for the 1.5B) and Gemma 3 270M drafting for its f16 copy, on
PROMPTS, greedy, the same n-max and p-min. Each run goes through the Engine's own step and
is compared with llama.cpp's modulo the start and end of its loop (the tests' oracle,
tests/helpers/speculative_simple.py: engine_draft_simple_counts says how and why).

    .venv/bin/python experiments/draft_counts_llama_cpp.py --out results/draft-counts-llama-cpp-DATE.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dflash_gguf.tools import real_models
from dflash_gguf.bench.provenance import load_average, machine, results_doc, versions, write_results
from dflash_gguf.tools.invariance import TIE_PRONE_PROMPTS

# the tests' oracle: llama-speculative-simple's run and the comparison
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.speculative_simple import engine_draft_simple_counts  # noqa: E402

# of the tie-prone prompts: code openings, docstrings, a list of numbers, a numbered list,
# repeated lines, prose
PROMPTS = [TIE_PRONE_PROMPTS[i] for i in (26, 12, 2, 9, 3, 8, 5, 25)]


def pairs() -> dict:
    """Each target and its drafter: the real pair, and the published Gemma 3 270M for an
    f16 copy of itself (as tests/drafters/test_real_gemma3_pair.py pairs them)."""
    return {"qwen2.5-coder-1.5b": (str(real_models.path("qwen2.5-coder-1.5b")),
                                   str(real_models.path("qwen2.5-coder-0.5b"))),
            "gemma-3-270m": (str(real_models.retyped("gemma-3-270m", "f16")),
                             str(real_models.path("gemma-3-270m")))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results file (JSON)")
    p.add_argument("--n-new", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--n-max", type=int, default=4, help="drafts a step at most (default 4)")
    p.add_argument("--p-min", type=float, default=0.0, help="draft p-min (default 0)")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[draft-counts] {msg}", file=sys.stderr, flush=True)

    rows = []
    for name, (target, small) in pairs().items():
        for prompt in PROMPTS:
            t0 = time.perf_counter()
            got = engine_draft_simple_counts(target, small, prompt, args.n_new, args.n_max, args.p_min)
            log(f"{name} {prompt[:30]!r}: ours {got['ours']}, llama.cpp {got['llama']}, "
                f"{'equal' if got['equal'] and got['tokens_equal'] else 'DIFFERENT'}")
            rows.append({"target": name, "prompt": prompt, **got, "seconds": round(time.perf_counter() - t0, 1),
                         "load_average": load_average()})
    doc = results_doc("draft_counts_llama_cpp", sys.argv, machine=machine(1, "CPU"), versions=versions(),
                      n_new=args.n_new, n_max=args.n_max, p_min=args.p_min, rows=rows)
    write_results(args.out, doc)
    bad = [r for r in rows if not (r["equal"] and r["tokens_equal"])]
    log(f"results in {args.out}; {'all equal' if not bad else f'{len(bad)} of {len(rows)} differ'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
