"""How every comparison with a peer is taken (dflash-bench, dflash-bench concurrency), so that
a ratio compares engines and not machine states:

  interleaved  every arm (ours and the peer's, at every setting) runs in every repetition
               before the next repetition starts, the arms taking turns a round (every
               prompt once) at a time (taking_turns), so that a machine that changes speed
               for tens of seconds changes it for every arm of the repetition alike; each
               round's order is shuffled (seeded by the repetition), so that no arm always
               goes first or always follows the same arm (what ran just before a round can
               change its speed: a llama.cpp process that has just exited, another engine)
  load         the 1-minute load average is read as each cell (an arm in a repetition)
               starts; above a threshold (per thread of -t) the cell is marked loaded, or,
               with --wait-idle, the run waits for the load to fall (up to a cap)
  long enough  a repetition of a cell decodes for at least --min-seconds, running its
               prompts (or requests) again, a round at a time, until it has
  medians      rows give the median over every kept repetition with its range (min-max);
               each side is reported at its best setting and at its default
  paired       a comparison also gives the median of its per-repetition ratios: this
               machine switches between two speeds (about 2x apart) for tens of seconds at
               a time, and a ratio of medians then mixes them; a repetition's two arms
               take turns within it, and each ratio is over the rounds both arms ran
               (matched_ratios), which met the machine in the same states
"""
from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")
Rounds = Dict[int, List[Tuple[float, float]]]  # a row's (tokens, seconds) of each round, by repetition

MAX_LOAD_PER_THREAD = 0.5
WAIT_IDLE_CAP_S = 600.0
MIN_SECONDS = 1.0
MAX_ROUNDS = 1000  # a cell that decodes nothing cannot repeat forever


def add_load_flags(p) -> None:
    """The load gate's flags, alike in every dflash-bench measurement (an argparse parser)."""
    p.add_argument("--max-load", type=float, default=MAX_LOAD_PER_THREAD,
                   help="1-minute load average per thread of -t above which a cell that starts is marked loaded "
                        "(default 0.5)")
    p.add_argument("--wait-idle", action="store_true",
                   help="before each cell, wait for the load to fall below --max-load (at most --wait-idle-max s)")
    p.add_argument("--wait-idle-max", type=float, default=WAIT_IDLE_CAP_S,
                   help="seconds a cell waits for the load at most (default 600); then it runs, marked loaded")


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def busy_cpus(seconds: float = 1.0, stat: str = "/proc/stat", sleep: Callable[[float], None] = time.sleep) -> float:
    """How many CPUs were busy, on average, over the next `seconds` (the kernel's counters
    in /proc/stat): what else runs now. Unlike the 1-minute load average, it is not raised
    by the benchmark's own cell that has just ended, where a benchmark's servers sit idle
    between cells (dflash-bench workload)."""
    def counters() -> Tuple[int, int]:
        with open(stat) as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # user .. steal: guest time is in user already
        return sum(fields), fields[3] + fields[4]  # all, idle and iowait

    total0, idle0 = counters()
    sleep(seconds)
    total1, idle1 = counters()
    if total1 <= total0:
        return 0.0
    return round((os.cpu_count() or 1) * (1 - (idle1 - idle0) / (total1 - total0)), 2)


@dataclass
class LoadGate:
    """Reads the load as a cell starts. `threshold` is the whole machine's 1-minute load
    average (the benchmark's own threads count in it, so a cell right after a long one may
    start loaded by them); with `wait`, a cell above it waits, polling every `poll_s`
    (the kernel updates the average every 5 s), for at most `cap_s`."""

    threshold: float
    wait: bool = False
    cap_s: float = WAIT_IDLE_CAP_S
    poll_s: float = 5.0
    log: Callable[[str], None] = print
    read: Callable[[], float] = load_1m
    key: str = "load_1m"  # what a cell's record calls the reading
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    cells: List[dict] = field(default_factory=list)  # every cell's record, in running order

    @classmethod
    def per_thread(cls, max_load: float, threads: int, **kw) -> "LoadGate":
        return cls(threshold=max_load * threads, **kw)

    def enter(self, what: str) -> dict:
        """The record of a cell starting now: its load, whether it is loaded, how long it waited."""
        load, waited, t0 = self.read(), 0.0, self.clock()
        if self.wait and load > self.threshold:
            self.log(f"load {load:.2f} is above {self.threshold:.2f}: waiting for it to fall before {what} "
                     f"(at most {self.cap_s:.0f} s)")
            while load > self.threshold and self.clock() - t0 < self.cap_s:
                self.sleep(self.poll_s)
                load = self.read()
            waited = round(self.clock() - t0, 1)
            if load > self.threshold:
                self.log(f"load {load:.2f} still above {self.threshold:.2f} after {waited:.0f} s: running {what} "
                         "anyway, marked loaded")
        cell = {"cell": what, self.key: load, "loaded": load > self.threshold, "waited_s": waited}
        self.cells.append(cell)
        return cell


def taking_turns(cells: Sequence[T], one_round: Callable[[T, int], Optional[list]],
                 seconds: Callable[[list], float], min_seconds: float, shuffle: random.Random,
                 consecutive: bool = False) -> Iterator[Tuple[T, list, bool]]:
    """One repetition of `cells`, a round at a time: yields (cell, what its round
    one_round(cell, round) returned, whether the cell is done). Every cell runs its
    round 0; then every cell not yet done its round 1; and so on, each round's order
    shuffled by `shuffle`. A cell is done when its rounds have timed `min_seconds` (at
    least one round, at most MAX_ROUNDS), or when a round returns None (it failed).
    consecutive: a cell's rounds run one after another instead, the cells in a shuffled
    order (what a round needs is held by one cell at a time)."""
    timed = [0.0] * len(cells)
    order = shuffle.sample(range(len(cells)), len(cells))
    groups = [[i] for i in order] if consecutive else [order]
    for group in groups:
        for rnd in range(MAX_ROUNDS):
            for i in shuffle.sample(group, len(group)):
                got = one_round(cells[i], rnd)
                timed[i] += seconds(got) if got is not None else 0.0
                done = got is None or timed[i] >= min_seconds or rnd + 1 == MAX_ROUNDS
                if done:
                    group.remove(i)
                yield cells[i], got or [], done
            if not group:
                break


def _rate(rounds: List[Tuple[float, float]]) -> Optional[float]:
    seconds = sum(s for _, s in rounds)
    return sum(t for t, _ in rounds) / seconds if seconds > 0 else None


def matched_ratios(x: Rounds, y: Rounds) -> List[float]:
    """x's rate over y's in each repetition both ran, over the rounds both ran (the
    first k, k the fewer): rounds of one number took turns seconds apart, so both met
    the machine in the same state. A cell that ran fast needed more rounds to decode
    long enough, and ran its last ones after the other had stopped, in whatever state
    the machine was in by then: left out, so that a speed change late in a repetition
    does not count for one side only."""
    out = []
    for rep in sorted(x.keys() & y.keys()):
        k = min(len(x[rep]), len(y[rep]))
        a, b = _rate(x[rep][:k]), _rate(y[rep][:k])
        if a and b:
            out.append(a / b)
    return out


@dataclass
class Pairing:
    """One side's row against the other's: best vs best, default vs default."""

    name: str              # "best vs best", "default vs default"
    ours: object
    theirs: object
    ratio: Optional[float]                   # ours' median over theirs'
    paired: Optional[Tuple[float, float]]    # min-max of the per-repetition ratios (matched_ratios)
    paired_median: Optional[float] = None    # their median: each ratio's rounds took turns, so a machine that
    # changes speed moves both sides (the ratio of medians can mix its speeds)
    per_rep: Tuple[float, ...] = ()          # the per-repetition ratios themselves (stats.verdict reads them)


def pick(rows: Sequence[T], median: Callable[[T], Optional[float]], is_default: Callable[[T], bool]) -> dict:
    """{"best": the row of the highest median, "default": the default row} (None where absent)."""
    timed = [r for r in rows if median(r) is not None]
    return {"best": max(timed, key=median) if timed else None,
            "default": next((r for r in rows if is_default(r)), None)}


def pairings(ours: Sequence[T], theirs: Sequence[T], median: Callable[[T], Optional[float]],
             rounds: Callable[[T], Rounds], is_default: Callable[[T], bool]) -> List[Pairing]:
    """Best vs best and default vs default of two sides' rows (one sampling, one cell).
    rounds(row) is its Rounds."""
    a, b = pick(ours, median, is_default), pick(theirs, median, is_default)
    out = []
    for which in ("best", "default"):
        x, y = a[which], b[which]
        if x is None or y is None:
            continue
        mx, my = median(x), median(y)
        ratios = matched_ratios(rounds(x), rounds(y))
        out.append(Pairing(f"{which} vs {which}", x, y, mx / my if mx and my else None,
                           (min(ratios), max(ratios)) if ratios else None,
                           statistics.median(ratios) if ratios else None, tuple(ratios)))
    return out
