#!/usr/bin/env python3
"""The real pair on this machine: the published Qwen2.5-Coder 1.5B alone and with its 0.5B
sibling drafting (draft-simple), ours against llama.cpp's own tools on the same files and
threads, greedy, every arm once per repetition in a shuffled order (arms taking turns).

    .venv/bin/python scripts/real_pair_bench.py [-r 3] [-n 64] [-t 2] [--out results/real-pair-DATE.json]

Arms: our plain decoding; our draft-simple chain at llama.cpp's default n-max (3) and at
4; our draft-simple tree; llama-completion; llama-speculative-simple --spec-type
draft-simple at its default and at n-max 4; llama-bench's plain decoding (-n N after the
prompts' mean length). Each figure is decode tok/s (the prefill apart), and for drafting
arms the tokens per target pass (AL). The file keeps every run and the load average at
every cell; a cell that starts above --max-load per core waits (up to a minute) first.
Ratios are medians over repetitions of each repetition's ratio.
"""
from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import time
from pathlib import Path

from dflash_gguf import Engine, real_models
from dflash_gguf.bench import llama_cpp, provenance
from dflash_gguf.bench.runs import Run, Sampling

PROMPTS = [  # code, the pair's own domain
    ("quicksort", "def quicksort(xs):\n    \"\"\"Sort a list of numbers with quicksort.\"\"\"\n"),
    ("read_config", "import json\n\n\ndef read_config(path):\n    \"\"\"Load a JSON config file and fill in "
                    "defaults.\"\"\"\n"),
    ("stack", "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n"),
]


class Ours:
    """One of our engines, kept loaded: plain, or draft-simple chain/tree."""

    side, speculative = "ours", False

    def __init__(self, name: str, target: str, draft, threads: int, n: int, **options):
        self.name, self.n = name, n
        self.speculative = draft is not None
        self.engine = Engine(target, draft, n_ctx=1024, n_threads=threads, **options)
        self.engine.generate(PROMPTS[0][1], max_tokens=8, stop_tokens=())  # graphs built, caches touched

    def one_round(self, rep: int) -> list:
        runs = []
        for name, text in PROMPTS:
            r = self.engine.generate(text, max_tokens=self.n, stop_tokens=())
            s = r.stats
            passes = len(s.accepted_lengths) if self.speculative else max(s.generated_tokens - 1, 1)
            runs.append(Run(engine="ours", mode=self.name, sampling="greedy", rep=rep, prompt=name,
                            prompt_tokens=len(self.engine.encode(text)), tokens=s.generated_tokens - 1,
                            decode_s=s.decode_seconds, passes=passes, token_ids=list(r.tokens), text=r.text,
                            speculative=self.speculative))
        return runs


class Theirs:
    """A llama.cpp arm of dflash-bench (its command lines and log parsing)."""

    side = "llama.cpp"

    def __init__(self, arm):
        self.arm, self.name, self.speculative = arm, arm.name, arm.speculative

    def one_round(self, rep: int) -> list:
        return self.arm.one_round(None if isinstance(self.arm, llama_cpp.BenchArm) else Sampling(), rep, 0)


def wait_for_quiet(max_load: float, threads: int) -> float:
    t0 = time.time()
    while provenance.load_average()[0] > max_load * threads and time.time() - t0 < 60:
        time.sleep(5)
    return provenance.load_average()[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--max-load", type=float, default=0.5, help="per thread, at each cell's start (default 0.5)")
    p.add_argument("--out", type=Path, default=Path("results") / f"real-pair-{dt.date.today()}.json")
    a = p.parse_args(argv)
    target, small = str(real_models.path("qwen2.5-coder-1.5b")), str(real_models.path("qwen2.5-coder-0.5b"))
    tools = llama_cpp.Tools.find(None)
    missing = [t for t in ("llama-completion", "llama-speculative-simple", "llama-bench") if t not in tools.found]
    if missing:
        print(f"error: llama.cpp's {', '.join(missing)} not built (scripts/llama_cpp_build.py {' '.join(missing)})",
              file=sys.stderr)
        return 2
    setup = llama_cpp.Setup(target, a.threads, 1024, a.n_predict, "f16", small, None, (), "draft-simple")
    prompts = list(PROMPTS)
    depth = 40  # about the prompts' mean length in tokens
    arms = [
        Ours("plain", target, None, a.threads, a.n_predict),
        Ours("draft-simple chain (n-max 3, default)", target, small, a.threads, a.n_predict),
        Ours("draft-simple chain (n-max 4)", target, small, a.threads, a.n_predict, spec_draft_n_max=4),
        Ours("draft-simple tree (n-max 3)", target, small, a.threads, a.n_predict, tree_budget=8),
        Theirs(llama_cpp.CompletionArm(tools.found["llama-completion"], setup, prompts)),
        Theirs(llama_cpp.SpeculativeArm(tools.found["llama-speculative-simple"], setup, prompts, None, None)),
        Theirs(llama_cpp.SpeculativeArm(tools.found["llama-speculative-simple"], setup, prompts, None, 4)),
        Theirs(llama_cpp.BenchArm(tools.found["llama-bench"], setup, depth)),
    ]
    doc = provenance.results_doc("scripts/real_pair_bench.py", sys.argv[1:] if argv is None else argv,
                                 models={"target": target, "draft": small}, n_predict=a.n_predict,
                                 threads=a.threads, repetitions=a.repetitions, load_average={"before":
                                 provenance.load_average()}, runs=[])
    for rep in range(a.repetitions):
        order = list(range(len(arms)))
        random.Random(rep).shuffle(order)
        for i in order:
            load = wait_for_quiet(a.max_load, a.threads)
            for run in arms[i].one_round(rep):
                run.load_1m, run.loaded = load, load > a.max_load * a.threads
                run.extra = {**run.extra, "side": arms[i].side}
                doc["runs"].append(run.__dict__)
            last = doc["runs"][-1]
            print(f"rep {rep + 1} {arms[i].side} {arms[i].name}: {last['tokens'] / last['decode_s']:.1f} tok/s "
                  f"(load {load:.2f})", file=sys.stderr, flush=True)
    doc["load_average"]["after"] = provenance.load_average()

    def tps(mode, rep):
        rs = [r for r in doc["runs"] if r["mode"] == mode and r["rep"] == rep]
        return sum(r["tokens"] for r in rs) / sum(r["decode_s"] for r in rs) if rs else None

    rows = {}
    for arm in arms:
        per_rep = [tps(arm.name, rep) for rep in range(a.repetitions)]
        rs = [r for r in doc["runs"] if r["mode"] == arm.name]
        rows[f"{arm.side} {arm.name}"] = {
            "tok_s_median": statistics.median(per_rep), "tok_s_per_rep": per_rep,
            "al": sum(r["tokens"] for r in rs) / sum(r["passes"] for r in rs),
            "vs_ours_plain": statistics.median([x / tps("plain", rep) for rep, x in enumerate(per_rep)]),
            "vs_llama_completion": statistics.median([x / tps("plain (llama-completion)", rep)
                                                      for rep, x in enumerate(per_rep)])}
    doc["rows"] = rows
    # lossless: every arm of ours gives one output a prompt, greedy
    doc["ours_distinct_outputs"] = {name: len({tuple(r["token_ids"]) for r in doc["runs"]
                                              if r["engine"] == "ours" and r["prompt"] == name}) for name, _ in PROMPTS}
    path = provenance.write_results(a.out, doc)
    for name, row in rows.items():
        print(f"{name:>60}: {row['tok_s_median']:6.2f} tok/s  AL {row['al']:.2f}  x ours plain "
              f"{row['vs_ours_plain']:.3f}  x llama-completion {row['vs_llama_completion']:.3f}")
    print(f"results: {path or a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
