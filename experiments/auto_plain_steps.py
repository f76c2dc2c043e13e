#!/usr/bin/env python3
"""What `--tree-budget auto`'s plain arm costs a token against plain decoding, in one
process and one engine (draft-simple beside the target), requests taking turns: the same
prompt decoded plainly (speculative=False) and through auto once it holds plain decoding
(its first request, which drafts its cold steps, is not timed). Both run the library's
one-row decode call; auto's arm adds the speculative loop's bookkeeping around it.

    .venv/bin/python experiments/auto_plain_steps.py [-m qwen2.5-coder-1.5b] [-md qwen2.5-coder-0.5b]
        [-n 128] [-t 2] [-r 8] [--depth TOKENS] [--out results/auto-plain-steps-DATE.json]

--depth puts that many tokens of context before the request (Python's own argparse.py,
repeated as needed), where a step reads the whole cache; each request fills it again
(Engine.generate keeps no prompt cache from call to call: reused_prompt_tokens 0), which
takes most of the run's time at depth. The rate is GenerationStats.decode_tps (greedy,
after the first token)."""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
from pathlib import Path

from dflash_gguf import Engine
from dflash_gguf.bench import provenance
from dflash_gguf.tools import real_models

PROMPT = "Write a long essay about the history of the Python programming language.\n"


def prompt_at(engine: Engine, depth: int) -> list:
    """PROMPT's tokens after `depth` tokens of Python source: a request at depth."""
    source = Path(argparse.__file__).read_text()  # the stdlib's own text
    tokens = []
    while len(tokens) < depth:
        tokens += engine.encode(source)
    return tokens[:depth] + engine.encode("\n\n" + PROMPT)


def pair_arguments(p: argparse.ArgumentParser, repetitions: int) -> None:
    """The flags of an experiment on the 1.5B beside its 0.5B drafter (drafter_held.py's too)."""
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    p.add_argument("-md", "--model-draft", default="qwen2.5-coder-0.5b")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-r", "--repetitions", type=int, default=repetitions)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(p, repetitions=8)
    p.add_argument("--depth", type=int, default=0, help="tokens of context before the request (default 0)")
    p.add_argument("--out", type=Path, default=Path("results") / f"auto-plain-steps-{dt.date.today()}.json")
    a = p.parse_args(argv)
    path = lambda name: str(real_models.path(name)) if name in real_models.MODELS else name
    os.environ["DFLASH_AUTO_MEMORY"] = "off"  # this process's auto only
    doc = provenance.results_doc("experiments/auto_plain_steps.py", sys.argv[1:] if argv is None else argv,
                                 model=path(a.model), draft=path(a.model_draft), threads=a.threads,
                                 n_predict=a.n_predict, depth=a.depth,
                                 load_average={"before": provenance.load_average()}, runs=[])
    with Engine(path(a.model), path(a.model_draft), spec_type="draft-simple", tree_budget="auto",
                n_ctx=4096 + a.depth, n_threads=a.threads) as engine:
        engine.prepare_auto()
        prompt = prompt_at(engine, a.depth)
        engine.generate(prompt, a.n_predict, stop_tokens=())  # auto's cold steps and the prompt's fill: not timed
        for rep in range(a.repetitions):
            order = ("plain", "auto") if rep % 2 == 0 else ("auto", "plain")
            for arm in order:
                r = engine.generate(prompt, a.n_predict, stop_tokens=(), speculative=arm == "auto")
                doc["runs"].append({"rep": rep, "arm": arm, "decode_tps": r.stats.decode_tps,
                                    "drafted": r.stats.drafted_tokens,
                                    "reused_prompt_tokens": r.stats.reused_tokens})
                print(f"[auto-plain-steps] rep {rep + 1} {arm}: {r.stats.decode_tps:.2f} tok/s, "
                      f"{r.stats.drafted_tokens} drafted", flush=True)
    doc["load_average"]["after"] = provenance.load_average()
    tps = {arm: [x["decode_tps"] for x in doc["runs"] if x["arm"] == arm] for arm in ("plain", "auto")}
    ratios = [x / y for x, y in zip(tps["auto"], tps["plain"])]
    doc["summary"] = {"plain_tps": statistics.median(tps["plain"]), "auto_tps": statistics.median(tps["auto"]),
                      "auto_over_plain_per_rep": ratios, "auto_over_plain_median": statistics.median(ratios)}
    provenance.write_results(a.out, doc)
    print(f"auto / plain per repetition: {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]; "
          f"plain {doc['summary']['plain_tps']:.2f}, auto {doc['summary']['auto_tps']:.2f} tok/s")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
