"""Threads by load (csrc/dfl_threads.h): the CPU runtime times each graph at the thread
counts it may use and moves to fewer threads while they compute faster (another process
holding cores), back when the load lifts. The policy is replayed on made-up times
(dfl_threads_replay), so these tests time nothing; the engine's part is that the count
in use is reported and that DFLASH_FIXED_THREADS keeps the one asked for."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dflash_gguf.runtime.native import DflashError, check, ffi, lib


def replay(n_threads: int, times, builds=None) -> np.ndarray:
    """The thread count of each compute, compute i taking times[i][level] seconds at a level,
    of the graph built builds[i]-th (None: all of one graph)."""
    secs = np.ascontiguousarray(times, dtype=np.float64)
    out = np.zeros(len(secs), dtype=np.int32)
    ids = ffi.NULL if builds is None else ffi.from_buffer("uint64_t[]", np.ascontiguousarray(builds, dtype=np.uint64))
    check(lib.dfl_threads_replay(n_threads, secs.shape[1], ffi.from_buffer("double[]", secs), ids, len(secs),
                                 ffi.from_buffer("int32_t[]", out)))
    return out


def spent(threads: np.ndarray, times, counts) -> float:
    """Seconds the replayed computes took."""
    level = {c: i for i, c in enumerate(counts)}
    return float(sum(times[i][level[t]] for i, t in enumerate(threads)))


IDLE = (1.0e-3, 1.5e-3)   # 2 threads, 1 thread: an idle 2-core machine
BUSY = (100e-3, 1.0e-3)   # a core taken: 2 threads wait at every op's barrier


def test_an_idle_machine_keeps_the_threads_asked_for():
    times = [IDLE] * 5000
    threads = replay(2, times)
    assert threads[-1] == 2 and np.mean(threads == 2) > 0.97
    assert spent(threads, times, (2, 1)) < 1.01 * 5000 * IDLE[0]  # probes cost under 1%


def test_a_machine_busy_from_the_start_moves_to_one_thread_at_once():
    times = [BUSY] * 5000
    threads = replay(2, times)
    assert list(threads[3:]).count(2) < 5  # the first computes, then a rare probe at most
    assert spent(threads, times, (2, 1)) < 5000 * BUSY[1] + 6 * BUSY[0]


def test_load_coming_and_going_is_followed():
    times = [IDLE] * 2000 + [BUSY] * 2000 + [IDLE] * 20000
    threads = replay(2, times)
    assert np.mean(threads[:2000] == 2) > 0.97
    assert list(threads[2010:4000]).count(2) < 3  # moved within a few computes
    assert np.mean(threads[-1000:] == 2) > 0.97  # back once a probe finds two threads fast again


def test_more_cores_settle_on_the_count_that_runs_fastest():
    # 8 threads: levels 8, 4, 2, 1; half the cores taken, 4 threads run best
    times = [(20e-3, 2.0e-3, 3.0e-3, 5.0e-3)] * 5000
    threads = replay(8, times)
    assert np.mean(threads[-4000:] == 4) > 0.97


def speculative_session(steps: int = 6000, seed: int = 0):
    """An idle machine's times for a speculative session: each step a decode or a verify
    of 2-40 rows, its cost growing with the rows and the context (a 40-row verify ~10x a
    decode; 2x more for every 4K cells), one thread 1.5x two; and the graphs' builds as
    the runtime numbers them: a graph per step shape, built again each time its cache
    length (256-cell buckets) changes."""
    rng = np.random.default_rng(seed)
    times, builds, numbers, depth = [], [], {}, 0
    for _ in range(steps):
        rows = 1 if rng.random() < 0.3 else int(rng.integers(2, 41))
        two = 1e-3 * (1 + 0.25 * (rows - 1)) * (1 + depth / 4096)
        times.append((two, 1.5 * two))
        builds.append(numbers.setdefault((rows, depth // 256), len(numbers) + 1))
        depth += 1 + rows // 4
    return times, builds


def test_graphs_of_other_shapes_and_depths_are_not_taken_for_contention():
    """Timed as one graph (a slot's graph is rebuilt at the same address for each shape),
    a 40-row verify after a decode looked 1.5x slower than the graph's best, and an idle
    machine moved to one thread: on the real 1.5B at 2K of context, verifies of 4-64 rows
    then ran at 2.2x llama-bench's time. Timed per build, the threads stay."""
    times, builds = speculative_session()
    threads = replay(2, times, builds)
    assert np.mean(threads == 2) > 0.97
    assert spent(threads, times, (2, 1)) < 1.02 * sum(t[0] for t in times)


def test_bad_replays_are_refused():
    with pytest.raises(DflashError, match="levels"):
        replay(2, [(1.0, 1.0, 1.0)])
    with pytest.raises(DflashError, match="2 or more threads"):
        replay(1, [(1.0,)])
    with pytest.raises(DflashError, match="numbered from 1"):
        replay(2, [(1.0, 1.0)], builds=[0])


@pytest.mark.parametrize("fixed", [False, True])
def test_the_engine_reports_the_threads_in_use(fixed, tmp_path):
    """With DFLASH_FIXED_THREADS the count in use is the one asked for; either way the
    text is the same (the count does not change the arithmetic)."""
    code = ("from dflash_gguf import Engine\nfrom dflash_gguf.runtime.demo import demo_paths\n"
            "with Engine(demo_paths()[0], n_threads=2) as e:\n"
            "    r = e.generate('def f(x):', 32, stop_tokens=(), speculative=False)\n"
            "    i = e.target.info()\n    print(i['n_threads'], i['n_threads_in_use'], r.tokens)\n")
    env = {**os.environ, **({"DFLASH_FIXED_THREADS": "1"} if fixed else {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    asked, in_use, tokens = out.stdout.strip().split(" ", 2)
    assert asked == "2" and in_use in ("1", "2") and (in_use == "2" or not fixed)
    test_the_engine_reports_the_threads_in_use.tokens = getattr(test_the_engine_reports_the_threads_in_use,
                                                                 "tokens", tokens)
    assert tokens == test_the_engine_reports_the_threads_in_use.tokens
