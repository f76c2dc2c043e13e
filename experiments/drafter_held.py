#!/usr/bin/env python3
"""What holding a drafter costs a server's plain steps at depth, over two turns: a
process that loaded the target alone decodes plainly, one that loaded the 0.5B beside it
decodes with draft-simple under `--tree-budget auto` (its first turn's cold steps probe,
then it holds plain decoding on this pair), each arm a fresh process, arms taking turns.
Each child runs as dflash-server does: it loads (and prepares auto) on its main thread,
hands that thread's OpenMP team back, and decodes on a second thread. The first turn's
prompt is --depth tokens of Python source and a question; the second's extends it by
--grow tokens more, as an agent's next turn does (and fills its context again:
Engine.generate keeps no prompt cache from call to call, where dflash-server's slots do).

    .venv/bin/python experiments/drafter_held.py [-m qwen2.5-coder-1.5b] [-md qwen2.5-coder-0.5b]
        [-n 128] [-t 2] [-r 3] [--depth 4500] [--grow 3000] [--out results/drafter-held-DATE.json]

The rates are each turn's GenerationStats.decode_tps (greedy, after the first token)."""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_gguf.bench import provenance
from dflash_gguf.tools import real_models

sys.path.insert(0, str(Path(__file__).resolve().parent))
from auto_plain_steps import pair_arguments  # noqa: E402  (a sibling script: the same flags)

ARMS = ("target alone", "drafter held")
CHILD = """
import argparse, sys, threading
from pathlib import Path
from dflash_gguf import Engine
from dflash_gguf.runtime import openmp
arm, model, draft, threads, tokens, depth, grow = sys.argv[1:4] + [int(x) for x in sys.argv[4:8]]
held = arm == "drafter held"
kw = dict(spec_type="draft-simple", tree_budget="auto") if held else {}
with Engine(model, draft if held else None, n_ctx=depth + grow + 2 * tokens + 256, n_threads=threads, **kw) as e:
    if held:
        e.prepare_auto()
    openmp.release_team()  # the main thread is done computing, as the server's Scheduler has it
    source = e.encode(Path(argparse.__file__).read_text())
    while len(source) < depth + grow:
        source += source
    ask = e.encode("\\n\\nWrite a long essay about the history of the Python programming language.\\n")
    out = []
    def turns():
        for n in (depth, depth + grow):
            out.append(e.generate(source[:n] + ask, tokens, stop_tokens=(), speculative=held).stats)
    t = threading.Thread(target=turns)
    t.start()
    t.join()
    for s in out:
        print("TURN", s.decode_tps, s.reused_tokens, s.drafted_tokens)
"""


def run(arm: str, model: str, draft: str, a) -> list:
    argv = [arm, model, draft, str(a.threads), str(a.n_predict), str(a.depth), str(a.grow)]
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=3600,
                         cwd=tempfile.gettempdir())  # not the source tree
    turns = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("TURN ")]
    if len(turns) != 2:
        raise RuntimeError(f"{arm} failed: {out.stderr[-2000:]}")
    return [{"decode_tps": float(t[0]), "reused_prompt_tokens": int(t[1]), "drafted": int(t[2])} for t in turns]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(p, repetitions=3)
    p.add_argument("--depth", type=int, default=4500, help="tokens of context before the first turn (default 4500)")
    p.add_argument("--grow", type=int, default=3000, help="tokens the second turn's prompt adds (default 3000)")
    p.add_argument("--out", type=Path, default=Path("results") / f"drafter-held-{dt.date.today()}.json")
    a = p.parse_args(argv)
    path = lambda name: str(real_models.path(name)) if name in real_models.MODELS else name
    model, draft = path(a.model), path(a.model_draft)
    doc = provenance.results_doc("experiments/drafter_held.py", sys.argv[1:] if argv is None else argv,
                                 model=model, draft=draft, threads=a.threads, n_predict=a.n_predict, depth=a.depth,
                                 grow=a.grow, load_average={"before": provenance.load_average()}, runs=[])
    for rep in range(a.repetitions):
        order = ARMS if rep % 2 == 0 else ARMS[::-1]
        for arm in order:
            for turn, r in enumerate(run(arm, model, draft, a)):
                doc["runs"].append({"rep": rep, "arm": arm, "turn": turn, **r})
                print(f"[drafter-held] rep {rep + 1} {arm} turn {turn + 1}: {r['decode_tps']:.2f} tok/s "
                      f"({r['reused_prompt_tokens']} prompt tokens reused, {r['drafted']} drafted)", flush=True)
    doc["load_average"]["after"] = provenance.load_average()
    doc["summary"] = []
    for turn in (0, 1):
        tps = {arm: [x["decode_tps"] for x in doc["runs"] if x["arm"] == arm and x["turn"] == turn] for arm in ARMS}
        ratios = [h / t for h, t in zip(tps["drafter held"], tps["target alone"])]
        doc["summary"].append({"turn": turn, "target_alone_tps": statistics.median(tps["target alone"]),
                               "drafter_held_tps": statistics.median(tps["drafter held"]),
                               "held_over_alone_per_rep": ratios, "held_over_alone_median": statistics.median(ratios)})
        print(f"turn {turn + 1}: drafter held / target alone per repetition {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]; alone {statistics.median(tps['target alone']):.2f}, "
              f"held {statistics.median(tps['drafter held']):.2f} tok/s")
    provenance.write_results(a.out, doc)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
