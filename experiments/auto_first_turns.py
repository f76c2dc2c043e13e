#!/usr/bin/env python3
"""Whether a dflash-server under `--tree-budget auto` (the 0.5B beside the 1.5B,
draft-simple) decodes a new conversation's first turn slower when it has just answered
another request than when the plain server ran last: the first turns of the bundled
stdlib workload's sessions, in pairs, one server taking both prompts of a pair back to
back and then the other (which server goes first alternates, and so does which prompt
of a pair comes second), a second's pause before each request as dflash-bench
workload's load gate makes. Each request's decode rate is the server's own figure.

    .venv/bin/python experiments/auto_first_turns.py [-m qwen2.5-coder-1.5b] [-md qwen2.5-coder-0.5b]
        [-n 128] [-t 2] [-c 8192] [-r 3] [--out results/auto-first-turns-DATE.json]

The summary: auto's rate over plain's for the same prompt and round, by the request's
place in its server's pair (the first, after the other server; the second, right after
the same server's request), median and range."""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

import dflash_gguf
from dflash_gguf.bench import provenance
from dflash_gguf.bench.serving import serve_load, workload
from dflash_gguf.bench.serving.multiturn import WARMUP, chat
from dflash_gguf.tools import real_models

WORKLOAD = Path(dflash_gguf.__file__).parent / "data" / "workloads" / "stdlib.jsonl"
PAUSE_S = 1.0  # dflash-bench workload's load gate reads the CPUs for a second before each cell


def first_turn(session) -> list:
    messages = [{"role": "system", "content": session.system}] if session.system is not None else []
    return messages + [{"role": "user", "content": session.turns[0].user}]


def server(name: str, a, extra: list, log_dir: Path) -> serve_load.ServerProcess:
    port = serve_load.free_port()
    cmd = [sys.executable, "-m", "dflash_gguf.serving.server", "--host", "127.0.0.1", "--port", str(port),
           "-t", str(a.threads), "-c", str(a.ctx_size), "--queue", "1", "-m", a.model] + extra
    s = serve_load.ServerProcess(cmd, port, log_dir / f"{name}.log")
    with httpx.Client(trust_env=False, timeout=600) as http:
        chat(http, s.url, WARMUP, 4)  # graphs and caches made before anything is timed
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    p.add_argument("-md", "--model-draft", default="qwen2.5-coder-0.5b")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-c", "--ctx-size", type=int, default=8192)
    p.add_argument("-r", "--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results") / f"auto-first-turns-{dt.date.today()}.json")
    a = p.parse_args(argv)
    path = lambda name: str(real_models.path(name)) if name in real_models.MODELS else name
    a.model, a.model_draft = path(a.model), path(a.model_draft)
    os.environ["DFLASH_AUTO_MEMORY"] = "off"  # as dflash-bench runs its servers: every chooser cold
    sessions = workload.load(WORKLOAD).sessions
    pairs = [(sessions[i], sessions[i + 1]) for i in range(0, len(sessions) - 1, 2)]
    doc = provenance.results_doc("experiments/auto_first_turns.py", sys.argv[1:] if argv is None else argv,
                                 model=a.model, draft=a.model_draft, threads=a.threads, n_predict=a.n_predict,
                                 load_average={"before": provenance.load_average()}, requests=[])
    log_dir = Path(tempfile.mkdtemp(prefix="auto-first-turns-"))
    servers = {"plain": server("plain", a, ["--no-spec"], log_dir),
               "auto": server("auto", a, ["-md", a.model_draft, "--spec-type", "draft-simple",
                                          "--tree-budget", "auto"], log_dir)}
    try:
        with httpx.Client(trust_env=False, timeout=600) as http:
            for rnd in range(a.rounds):
                for j, pair in enumerate(pairs):
                    order = ("auto", "plain") if (rnd + j) % 2 == 0 else ("plain", "auto")
                    prompts = pair if rnd % 2 == 0 else pair[::-1]
                    for name in order:
                        for place, session in zip(("after the other server", "right after its own"), prompts):
                            time.sleep(PAUSE_S)
                            got = chat(http, servers[name].url, first_turn(session), a.n_predict)
                            rate = got["completion_tokens"] / got["decode_s"]
                            doc["requests"].append({"round": rnd, "server": name, "session": session.name,
                                                    "place": place, "decode_tps": rate,
                                                    "completion_tokens": got["completion_tokens"],
                                                    "prefill_s": got["prefill_s"], "drafted": got["drafted"]})
                            print(f"[auto-first-turns] round {rnd + 1} {name:5} {session.name:26} {place:22} "
                                  f"{rate:5.2f} tok/s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    doc["load_average"]["after"] = provenance.load_average()
    by = {(r["round"], r["session"], r["place"], r["server"]): r["decode_tps"] for r in doc["requests"]}
    doc["summary"] = {}
    for place in ("after the other server", "right after its own"):
        ratios = [by[(rnd, s, pl, "auto")] / by[(rnd, s, pl, "plain")] for (rnd, s, pl, srv) in by
                  if srv == "auto" and pl == place and (rnd, s, pl, "plain") in by]
        doc["summary"][place] = {"auto_over_plain_median": statistics.median(ratios), "min": min(ratios),
                                 "max": max(ratios), "n": len(ratios)}
        print(f"{place}: auto / plain {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
              f"over {len(ratios)}")
    provenance.write_results(a.out, doc)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
