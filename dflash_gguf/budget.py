"""`--tree-budget auto`: which shape each step verifies, the chain of the drafter's top
choices or a tree of one of a few sizes, chosen for the most tokens per second.

Three ingredients: a verify cost table (how long a verify of n nodes takes on this
machine and model: measured once, cached per model file, runtime build, device and
thread count), which only prices arms not yet run; each arm's measured step time; and
each arm's expected accepted tokens, from the drafter's own probabilities through a
calibration learnt from every verified node (AutoBudget, Calibration).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ._native import _HERE
from .demo import cache_dir
from .sampling import GREEDY
from .target import LOGITS_LAST, Target


# bumped when measure_verify_cost changes what it measures
MEASURE_VERSION = 3


def _key(target: Target, n_threads: int) -> str:
    # the model file, the runtime build that measured it, the device and threads
    st = os.stat(target.path)
    lib = os.stat(_HERE / "libdflash.so")
    raw = (f"{os.path.abspath(target.path)}|{st.st_size}|{int(st.st_mtime)}|{lib.st_size}|{int(lib.st_mtime)}|"
           f"{target.info()['device']}|{n_threads}|{MEASURE_VERSION}")
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def measure_verify_cost(target: Target, sizes: List[int], tree: bool, repeats: int = 5) -> Dict[int, float]:
    """Least seconds of a verify of each size as decoding sees it (the least: other
    processes on the machine only ever add to a time), as a tree
    (chain-shaped) or as a chain: its graph already built and the previous step's commit
    riding along, its rows greedy (a request's own sampling is timed as it runs). The
    target is reset afterwards."""
    target.set_sampling(GREEDY.native())
    cost = {}
    for n in sizes:
        target.reset()
        target.prefill(list(range(1, 65)), LOGITS_LAST)
        tokens = list(range(2, 2 + n))
        times = []
        for _ in range(repeats + 2):  # the first two build the graphs, without and with a commit to carry
            t0 = time.perf_counter()
            if tree:
                target.verify_tree(tokens, list(range(-1, n - 1)))
            else:
                target.verify(tokens)
            target.choices(0, n)
            times.append(time.perf_counter() - t0)
            if tree:
                target.commit_path([0])
            else:
                target.commit(1)
        cost[n] = float(min(times[2:]))
    target.reset()
    return cost


class VerifyCost:
    """Verify time as a function of node count, interpolated from a cached measurement:
    cost(n) for a tree, cost.chain(n) for a chain."""

    def __init__(self, target: Target, n_threads: int = 0, cache: Path | None = None):
        max_n = target.n_verify
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, max_n} & set(range(1, max_n + 1)))
        path = cache or (cache_dir() / "verify-cost.json")
        key = _key(target, n_threads)
        table = json.loads(path.read_text()) if path.exists() else {}
        entry = table.get(key)
        if not (isinstance(entry, dict) and all(sorted(int(k) for k in entry.get(kind, {})) == sizes
                                                for kind in ("tree", "chain"))):
            entry = {kind: {str(k): v for k, v in measure_verify_cost(target, sizes, kind == "tree").items()}
                     for kind in ("tree", "chain")}
            table[key] = entry
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1))
        self.sizes = np.array(sizes, dtype=float)
        self.tree_seconds = np.array([entry["tree"][str(k)] for k in sizes])
        self.chain_seconds = np.array([entry["chain"][str(k)] for k in sizes])

    def __call__(self, n_nodes) -> np.ndarray:
        return np.interp(n_nodes, self.sizes, self.tree_seconds)

    def chain(self, n_tokens) -> np.ndarray:
        return np.interp(n_tokens, self.sizes, self.chain_seconds)


def chain_nodes(top1_logprobs):
    """The chain of the drafter's top choices as (probabilities, spine): each prefix's
    drafter probability of being all right, and all of them on the spine."""
    probs = np.exp(np.cumsum(np.asarray(top1_logprobs, dtype=float)))
    return probs, np.ones(len(probs), dtype=bool)


def tree_nodes(tree, top1_logprobs):
    """A best-first tree's nodes in the order they were picked (the first b are the tree
    of budget b) as (probabilities, spine): each node's drafter path probability, and
    whether it lies on the spine (the chain of top choices, which a tree holds as far
    as it is likely; the other nodes are branches)."""
    if not tree.pick_order:
        return np.zeros(0), np.zeros(0, dtype=bool)
    order = np.asarray(tree.pick_order, dtype=int)
    scores = np.asarray(tree.scores, dtype=float)[order]
    depths = np.asarray(tree.depths, dtype=int)[order]
    spine_scores = np.cumsum(np.asarray(top1_logprobs, dtype=float))
    # a spine node's score is the sum of the top choices' log-probabilities to its depth
    return np.exp(scores), np.abs(scores - spine_scores[depths - 1]) < 1e-5


CHAIN = 0  # AutoBudget's arm for the chain of the drafter's top choices (a chain verify)
TREE_SIZES = (4, 8, 16, 32)  # its tree arms, up to the largest budget


def auto_arms(largest: int) -> List[int]:
    """The arms `auto` chooses among: the chain and a few tree sizes up to `largest`.
    Few, so that their verify graphs stay cached (a graph's shape is its node count and
    the previous step's), and the fixed budgets a user would try, so that the best of
    them is among the arms."""
    return [CHAIN] + sorted({s for s in TREE_SIZES if s < largest} | {largest})


class Calibration:
    """How often the target accepts a drafted node, as a function of the drafter's own
    probability for it (its path probability): the drafter is neither right as often
    as it believes nor equally wrong at every confidence. Nodes are binned by
    probability; each bin maps p to p times its observed / predicted ratio (decayed,
    shrunk to 1 by a prior of PRIOR predicted nodes). AutoBudget keeps one for spine
    nodes and one for branches: at equal drafter probability a deep spine node (the
    drafter right several times over, and its errors come in runs) is accepted far more
    often than a sibling of the top choice."""

    EDGES = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97])
    PRIOR = 2.0
    DECAY = 0.995  # per step (surveys come every few steps)

    def __init__(self):
        self.predicted = np.zeros(len(self.EDGES))
        self.accepted = np.zeros(len(self.EDGES))
        self.ratio = np.ones(len(self.EDGES))

    def __call__(self, probs) -> np.ndarray:
        """The calibrated acceptance probability of nodes the drafter gives `probs`."""
        probs = np.asarray(probs, dtype=float)
        return np.minimum(probs * self.ratio[np.searchsorted(self.EDGES, probs, side="right") - 1], 1.0)

    def update(self, probs, accepted, n_steps: int = 1) -> None:
        """Verified nodes of n_steps steps: each node's drafter probability and whether
        the target accepted it (it lies on the accepted path)."""
        probs = np.asarray(probs, dtype=float)
        b = np.searchsorted(self.EDGES, probs, side="right") - 1
        n = len(self.EDGES)
        decay = self.DECAY ** n_steps
        self.predicted = decay * self.predicted + np.bincount(b, weights=probs, minlength=n)
        self.accepted = decay * self.accepted + np.bincount(b, weights=np.asarray(accepted, dtype=float), minlength=n)
        self.ratio = (self.accepted + self.PRIOR) / (self.predicted + self.PRIOR)


class AutoBudget:
    """`--tree-budget auto`: which arm (the chain, or a tree of one of a few sizes) the
    next step verifies. Kept across requests, so that what one request learnt serves
    the next. Each arm's score is the tokens per second it is expected to give now:

        rate(a) = (1 + drafts_a) / seconds_a

    drafts_a   the expected accepted drafts of arm a: its nodes' drafter probabilities
               through the Calibrations learnt from verified nodes (spine nodes and
               branches apart), summed, and averaged over recent survey steps;
    seconds_a  arm a's measured step time (drafting, verify, host work): the lower
               quartile of its last TIMED steps (other processes only ever add to a
               step's time: a quartile is not moved by the steps they slowed, where a
               median of a trial's few steps taken in a busy spell would condemn the
               arm for good), leaving out the first steps after a switch or a
               request's start, which build graphs. The chain's verify length
               follows the text (a confidence cut, the drafter's run of luck): its
               steps are kept less the cost table's verify of the length they
               verified, and priced with the verify of the length it verifies
               lately; else a chain timed on easy text would be judged by those
               long verifies on hard text. An arm not yet run is priced from the
               verify cost table: a measured arm's step time with its verify
               swapped for arm a's.

    The bookkeeping costs host time, which on a small model is a visible part of a
    step: only some steps are surveys (the drafter's candidates are ranked and a tree
    up to the size the climb would try next is built for the arms' expectations, the
    verified nodes go into the calibration) and decisions: every step of a trial (its
    few steps are all that is learnt of its nodes before the verdict), every
    SURVEY_EVERY-th step while the arm in use is close to a neighbour (the calibration
    must learn fast enough to tell them apart), every SURVEY_SETTLED-th once it leads
    both neighbours by SWITCH_GAIN; and never so often that the surveys' measured
    work (surveyed) exceeds SURVEY_SHARE of the arm in use's step time: on a small
    model a survey costs a fifth of a step, and every fourth step a survey would cost
    5%, more than a close call between two arms is worth. The steps between run the
    chosen arm as a fixed budget would, plus a clock reading.

    The chain runs first; then the tree sizes are tried in increasing order, climbing
    while the largest one tried is the best so far. Tokens per second rise with the
    tree size to one peak and fall past it (a larger tree accepts more at a dearer
    verify), so the climb stops at the first size past the peak, and sizes further on,
    which would cost many slow steps to try, are never run. Trials, not the cost table,
    decide: the table may be off (measured on a busy machine, or before the runtime
    changed). When trials beat the arm in use before them, that arm is timed again
    first: its figures predate them, and a process's first steps, which run cold,
    would otherwise condemn the chain for good. After a trial the best arm tried runs;
    it keeps running until another promises SWITCH_GAIN more (a switch builds graphs;
    small differences are noise).
    Every REFRESH steps the better neighbour of the arm in use (the next size down or
    up), when within REFRESH_WITHIN of it, is tried, so that the figures follow the
    machine and the text and the peak is found again when it moves; each such trial
    that confirms the arm in use doubles the interval, up to REFRESH_MAX (a trial of a
    slower arm costs its steps). The choice only picks the shape verified: the output is
    the target's, whatever the arm."""

    SWITCH_GAIN = 1.1
    REFRESH = 96
    REFRESH_MAX = 384
    REFRESH_WITHIN = 0.9
    TIMED = 15
    SETTLE = 2  # steps after a switch (or a request's start) that are not timed: they build graphs
    PROBE_TIMED = 4  # settled steps an arm on trial runs before it is judged
    SURVEY_EVERY = 4  # steps between surveys and decisions while learning
    SURVEY_SETTLED = 16  # ... and once settled (a survey is a few percent of a small model's step)
    SURVEY_SHARE = 0.01  # the most of the decoding time surveys may take
    SURVEY_COSTS = 9  # surveys whose work is kept for its median
    SMOOTH = 0.4  # weight of the newest survey in the running expectations

    def __init__(self, cost: VerifyCost, largest: int, block: int):
        self.cost = cost
        self.block = block
        self.arms = auto_arms(largest)
        self.largest = self.arms[-1]
        self.spine, self.branch = Calibration(), Calibration()
        self.drafts = {a: None for a in self.arms}  # running expected accepted drafts per arm
        self.chain_drafts = float(block - 1)  # running drafts a chain verifies (a confidence cut shortens it)
        # (seconds, tokens verified) of settled steps; the figures drawn from them are
        # worked out when a decision reads them, not on every step (a step's host work
        # shows on a small model)
        self.times = {a: deque(maxlen=self.TIMED) for a in self.arms}
        self._settled = {}  # settled_seconds of each arm since its times last changed
        self.tried = {CHAIN}
        self.current = CHAIN
        self.probing = True  # the current arm runs to be measured: at the next decision, take the best
        self.steps = 0
        self.run = 0  # steps of the current arm since a switch or a request's start
        self.last_refresh = 0
        self.refresh_every = self.REFRESH
        self.refreshed_from = None  # the arm in use when a refresh trial started
        self.incumbent = CHAIN  # the arm in use before the trials under way
        self.retimed = False  # the incumbent was timed again after those trials
        self.settled = False  # no trial is on and the arm in use leads its neighbours: surveys may be rarer
        self.next_survey = 1  # the step of the next survey
        self.last_survey = 1 - self.SURVEY_EVERY
        self.survey_gap = self.SURVEY_EVERY  # steps from the previous survey to this one
        self.survey_due = False
        self.survey_costs = deque(maxlen=self.SURVEY_COSTS)  # seconds of work of recent surveys

    # ---- scores -------------------------------------------------------------------------
    def verify_seconds(self, arm: int) -> float:
        """The cost table's verify time of an arm (chain: the bonus and the drafts the
        chain verified lately, on average)."""
        return float(self.cost.chain(1 + self.chain_drafts) if arm == CHAIN else self.cost(arm + 1))

    def settled_seconds(self, arm: int) -> Optional[float]:
        """The lower quartile of an arm's settled steps (the chain's less the cost
        table's verify of the tokens each verified), None before any."""
        if arm not in self._settled:
            times, value = self.times[arm], None
            if times:
                seconds = np.array([t for t, _ in times])
                if arm == CHAIN:
                    seconds -= self.cost.chain(np.array([n for _, n in times], dtype=float))
                value = float(np.sort(seconds)[len(seconds) // 4])
            self._settled[arm] = value
        return self._settled[arm]

    def _measured(self, arm: int) -> float:
        """A timed arm's step seconds (the chain's: its steps less their verifies, with
        the verify of its recent length)."""
        return self.settled_seconds(arm) + (self.verify_seconds(CHAIN) if arm == CHAIN else 0.0)

    def step_seconds(self, arm: int) -> float:
        timed = [a for a in self.arms if self.times[a]]
        if not timed:
            return self.verify_seconds(arm)
        if arm in timed:
            return max(self._measured(arm), 1e-6)
        ref = min(timed, key=lambda a: abs(a - arm))  # the nearest measured shape
        return max(self._measured(ref) - self.verify_seconds(ref) + self.verify_seconds(arm), 1e-6)

    def rate(self, arm: int) -> float:
        return (1.0 + (self.drafts[arm] or 0.0)) / self.step_seconds(arm)

    def gains(self, nodes) -> np.ndarray:
        """Each node's calibrated acceptance probability; nodes: (probabilities, spine)."""
        probs, spine = nodes
        return np.where(spine, self.spine(probs), self.branch(probs))

    # ---- the loop's calls ---------------------------------------------------------------
    def start_request(self) -> None:
        """A new request: its first steps build graphs (the prefill took a slot, and the
        first verify carries no commit)."""
        self.run = 0

    def choose(self) -> int:
        """The arm of the next step."""
        self.steps += 1
        # every step of a trial is a survey: branches are calibrated only from verified
        # trees, and a trial's few steps are all that is learnt of them before its verdict
        self.survey_due = self.steps >= self.next_survey or self.probing
        judged = self.probing and self.run == self.SETTLE + self.PROBE_TIMED  # a trial ends on time
        if (judged or self.survey_due) and all(d is not None for d in self.drafts.values()):
            self._decide()
        if self.survey_due:
            self.survey_gap, self.last_survey = self.steps - self.last_survey, self.steps
            self.next_survey = self.steps + self._survey_gap()
        return self.current

    def _survey_gap(self) -> int:
        """Steps to the next survey: the learning rate's, or more when surveys would
        take more than SURVEY_SHARE of the time."""
        gap = self.SURVEY_SETTLED if self.settled else self.SURVEY_EVERY
        if not self.survey_costs:
            return gap
        cost = sorted(self.survey_costs)[len(self.survey_costs) // 2]
        return max(gap, math.ceil(cost / (self.SURVEY_SHARE * self.step_seconds(self.current))))

    def _above_tried(self):
        """The size after the largest tried (None once the largest was tried)."""
        top = max(self.tried)
        return None if top == self.largest else self.arms[self.arms.index(top) + 1]

    def survey_size(self) -> int:
        """The tree a survey builds: up to the size the climb would try next (building
        the largest tree on every survey costs a small model's step a few percent; sizes
        past the next one are not candidates, and their expectations are not needed)."""
        return self._above_tried() or self.largest

    def wants_survey(self) -> bool:
        """Whether this step is a survey: build the survey tree (survey_size) for the
        arms' expectations and report the verified nodes (the step that chose the arm)."""
        return self.survey_due

    def _decide(self) -> None:
        if self.probing and self.run < self.SETTLE + self.PROBE_TIMED:
            return  # an arm on trial is judged by a few settled steps of its own, not one or two
        rates = {a: self.rate(a) for a in self.arms}
        best = max(self.tried, key=rates.get)
        # climb while the largest size tried is the best
        climb = self._above_tried() if max(self.tried) == best else None
        if climb is not None:
            self.tried.add(climb)
            self._run(climb, probe=True)
        elif self.probing and best != self.incumbent and not self.retimed:
            # the trials beat figures of the incumbent taken before them, maybe in a
            # slower spell (a process's first steps run cold): time it again, then judge
            self.retimed = True
            self.times[self.incumbent].clear()
            self._settled.pop(self.incumbent, None)
            self._run(self.incumbent, probe=True)
        elif self.probing or rates[best] > self.SWITCH_GAIN * rates[self.current]:
            confirmed = self.probing and best == self.refreshed_from
            self.refresh_every = min(2 * self.refresh_every, self.REFRESH_MAX) if confirmed else self.REFRESH
            self.refreshed_from = None
            self._run(best)  # after a trial, fresh figures: straight to the best
        elif self.steps - self.last_refresh >= self.refresh_every:
            self.last_refresh = self.steps
            near = max(self._neighbours(self.current), key=rates.get)
            if rates[near] >= self.REFRESH_WITHIN * rates[self.current]:
                self.tried.add(near)
                self.refreshed_from = self.current
                self._run(near, probe=True)
        self.settled = not self.probing and all(rates[self.current] >= self.SWITCH_GAIN * rates[a]
                                                for a in self._neighbours(self.current))

    def _neighbours(self, arm: int) -> List[int]:
        """The next size down and up."""
        i = self.arms.index(arm)
        return self.arms[max(i - 1, 0):i] + self.arms[i + 1:i + 2]

    def _run(self, arm: int, probe: bool = False) -> None:
        if probe and not self.probing:
            self.incumbent = self.current
        if not probe:
            self.retimed = False
        self.probing = probe
        if arm != self.current:
            self.current = arm
            self.run = 0

    def survey(self, tree, chain) -> None:
        """A survey step's expectation of every arm, from the nodes of the survey tree
        (survey_size) in pick order (tree_nodes: the first b are the tree of budget b; a
        size past the tree's own gets the whole tree, an underestimate for sizes past
        the survey's, which are not candidates) and the chain's (chain_nodes: the
        drafts a chain step would verify)."""
        gains = np.concatenate([[0.0], np.cumsum(self.gains(tree))])
        self.chain_drafts += self.SMOOTH * (len(chain[0]) - self.chain_drafts)
        for arm in self.arms:
            drafts = float(self.gains(chain).sum()) if arm == CHAIN else float(gains[min(arm, len(gains) - 1)])
            old = self.drafts[arm]
            self.drafts[arm] = drafts if old is None else old + self.SMOOTH * (drafts - old)

    def verified(self, nodes, accepted) -> None:
        """A survey step's verified nodes (chain_nodes / tree_nodes) and whether the
        target accepted each (it lies on the accepted path)."""
        probs, spine = nodes
        ok = np.asarray(accepted, dtype=bool)
        self.spine.update(probs[spine], ok[spine], self.survey_gap)
        self.branch.update(probs[~spine], ok[~spine], self.survey_gap)

    def surveyed(self, seconds: float) -> None:
        """The work a survey step added (ranking the candidates where the arm does
        not, the survey tree, the expectations, the calibration)."""
        self.survey_costs.append(seconds)

    def timed(self, arm: int, seconds: float, n_verified: int) -> None:
        """Every step's time and the tokens it verified (the bonus and the drafts);
        settled steps of the arm chosen count."""
        self.run += 1
        if arm == self.current and self.run > self.SETTLE:
            self.times[arm].append((seconds, n_verified))
            self._settled.pop(arm, None)


def observe(auto: AutoBudget, record) -> None:
    """A step's record (proposers.StepRecord) reported to `auto`: on a survey step its
    verified nodes go into the calibration and its survey time is counted; its time goes
    to its arm."""
    if record.nodes is not None:
        auto.verified(record.nodes, record.accepted)
        auto.surveyed(record.survey_seconds)
    auto.timed(record.arm, record.seconds, record.n_verified)
