"""A thread that computed graphs hands its OpenMP team back (runtime/openmp.py): its worker
threads end, as a server's main thread does once its engine is loaded and measured, so that
the engine thread's team is the only one and its barriers spin instead of sleeping.

Counted in a process of its own, as a server runs: the model loaded and a request decoded on
the main thread, then a Scheduler made there. Two threads, as on the two cores here (with
more threads than CPUs and a few tokens, a thread sometimes kept no workers after its graphs:
seen, not understood, and it would count nothing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.real,
              pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")]

THREADS = 2  # a team of two: a worker thread besides the thread that computes

CHILD = """
import json, os, sys, threading, time
from dflash_gguf.decoding.requests import Request
from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime import openmp
from dflash_gguf.serving.scheduler import Job, Scheduler

def tasks():
    return len(os.listdir("/proc/self/task"))

def settled(want):
    # ending threads leave /proc a moment after they are told to
    for _ in range(200):
        if tasks() == want:
            break
        time.sleep(0.02)
    return tasks()

threads = int(sys.argv[2])
out = {"runtime": openmp.loaded_runtime() is not None}
with Engine(sys.argv[1], n_threads=threads, n_ctx=256, exact="off") as engine:
    out["before"] = before = tasks()
    engine.generate("def f(x):\\n", 32, speculative=False)  # as loading and measuring do
    out["with_team"] = settled(before + threads - 1)
    scheduler = Scheduler(engine)  # its engine thread starts, and computes nothing yet
    try:
        out["with_scheduler"] = settled(before + 1)
        done = threading.Event()
        scheduler.submit(Job(Request(engine.encode("def g(y):\\n"), 32),
                             lambda kind, value: kind in ("done", "error") and done.set()))
        assert done.wait(120)
        out["decoded"] = settled(before + 1 + threads - 1)
    finally:
        scheduler.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def counts(real_path, tmp_path_factory):
    # run outside the checkout, which would shadow the installed package
    run = subprocess.run([sys.executable, "-c", CHILD, str(real_path("qwen2.5-coder-0.5b")), str(THREADS)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path_factory.mktemp("openmp"))
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_thread_that_makes_a_scheduler_hands_its_team_back(counts):
    """The server's main thread loads the engine and measures what auto needs; the
    Scheduler it makes decodes on its own thread, and the main thread's team ends."""
    assert counts["runtime"], "ggml's CPU backend is built with OpenMP here (libgomp)"
    assert counts["with_team"] == counts["before"] + THREADS - 1  # kept after the graphs
    assert counts["with_scheduler"] == counts["before"] + 1  # the engine thread alone


def test_the_engine_thread_decodes_with_the_only_team(counts):
    assert counts["decoded"] == counts["before"] + 1 + THREADS - 1
