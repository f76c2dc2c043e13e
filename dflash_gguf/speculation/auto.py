"""`--tree-budget auto`: what each step of a sequence verifies (plain decoding, the chain
of the drafter's top choices cut where it pays, or a DDTree of a few sizes), chosen per
sequence by a cost model (AutoBudget): expected tokens (Acceptance), from the drafter's
probabilities through a calibration learnt from verified drafts (Calibration), over
expected seconds (StepCosts), from the verify cost table measured once per model and
device (VerifyCost) and the measured parts of a step.

What a step decided is data, not fields changed on the chooser: choose() returns the
step's Decision, the proposer's propose adds what the step drafted to a copy of it
(dataclasses.replace: the chain's cut, the trees it built, a survey's cost, the drafter's
catching up), the step carries it (Plan.auto), and what auto learns from step N is
applied when step N's result is known, in AutoBudget.learn(decision, ...), the one place
auto learns: called by the proposer's verified, which the sequence's next step (or its
end) calls (decoding.step: Sequence.tell_proposer).
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .verify_cost import VerifyCost


def tree_nodes(tree, top1_logprobs):
    """A best-first tree's nodes in the order they were picked (the first b are the tree
    of budget b) as (probabilities, spine) lists: each node's drafter path probability,
    and whether it lies on the spine (the chain of top choices, which a tree holds as far
    as it is likely; the other nodes are branches)."""
    spine, total = [], 0.0
    for lp in np.asarray(top1_logprobs, dtype=float).tolist():
        total += lp
        spine.append(total)  # a spine node's score: the top choices' log-probabilities to its depth
    scores, depths = tree.scores, tree.depths
    probs = [math.exp(scores[i]) for i in tree.pick_order]
    return probs, [abs(scores[i] - spine[depths[i] - 1]) < 1e-5 for i in tree.pick_order]


class Calibration:
    """How often the target accepts a drafted node the drafter gives probability p (its
    path probability): the drafter is neither right as often as it believes nor equally
    wrong at every confidence. Nodes are binned by p; a bin maps p to p times its
    accepted / predicted ratio, both sums decayed (DECAY a step: the text moves on) and
    shrunk to 1 by a prior of PRIOR predicted nodes. Plain Python: the chain arm reads
    and feeds it every step, a handful of nodes, where numpy's calls cost more than the
    arithmetic."""

    EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97)
    PRIOR = 2.0
    DECAY = 0.99

    def __init__(self, like: Optional["Calibration"] = None):
        n = len(self.EDGES)
        self.predicted = list(like.predicted) if like else [0.0] * n
        self.accepted = list(like.accepted) if like else [0.0] * n
        # the weight of this step's nodes: it grows 1/DECAY a step (age), so that a node
        # k steps old weighs DECAY**k as much as a new one without a pass over the bins
        self.weight = like.weight if like else 1.0

    def __call__(self, p: float) -> float:
        """The calibrated acceptance probability of a node the drafter gives p."""
        b = bisect.bisect_right(self.EDGES, p) - 1
        prior = self.PRIOR * self.weight
        return min(p * (self.accepted[b] + prior) / (self.predicted[b] + prior), 1.0)

    def update(self, probs, accepted) -> None:
        """A step's verified nodes: their drafter probabilities and whether the target
        accepted each (it lies on the accepted path)."""
        w = self.weight
        for p, ok in zip(probs, accepted):
            b = bisect.bisect_right(self.EDGES, p) - 1
            self.predicted[b] += w * p
            if ok:
                self.accepted[b] += w

    def age(self) -> None:
        """A step verified drafts: the evidence before it weighs DECAY less. Steps that
        draft nothing leave it as it is: on plain decoding the probes' few nodes are all
        the evidence there is, and it has to add up across them."""
        self.weight /= self.DECAY
        if self.weight > 1e6:  # rescaled now and then, long before the sums could overflow
            self.predicted = [x / self.weight for x in self.predicted]
            self.accepted = [x / self.weight for x in self.accepted]
            self.weight = 1.0


PLAIN, CHAIN = -1, 0  # AutoBudget's arms besides the trees (which are their sizes)
TREE_SIZES = (4, 8, 16, 32)  # its tree arms, up to the largest budget


def auto_arms(largest: int) -> List[int]:
    """The arms `auto` chooses among: plain decoding, the chain, and a few tree sizes up
    to `largest` (none when it is 0: draft-simple's auto). Few, so that their verify
    graphs stay cached (a graph's shape is its node count and the previous step's), and
    the fixed budgets a user would try."""
    trees = sorted({s for s in TREE_SIZES if s < largest} | {largest}) if largest > 0 else []
    return [PLAIN, CHAIN] + trees


def arm_name(arm: int) -> str:
    return "plain" if arm == PLAIN else "chain" if arm == CHAIN else f"tree {arm}"


@dataclass(frozen=True, slots=True)
class ChainCut:
    """A chain's cut at one step (Acceptance.chain_cut): the drafts it keeps (n, at least
    one), the chain's expected tokens at that length, and the drafter's path
    probabilities of the drafts the step verifies (the first n; fewer where the step cuts
    again after it: verifying)."""

    n: int
    tokens: float
    probs: Tuple[float, ...]

    def verifying(self, n: int) -> "ChainCut":
        """The cut of a step that verifies only the first n of its drafts (cut again
        after chain_cut: by a grammar, by n_min)."""
        return ChainCut(self.n, self.tokens, self.probs[:n])


@dataclass(frozen=True, slots=True)
class Decision:
    """What auto decided for one step, and what the step drafted for it to learn from:
    data the step carries (Plan.auto) and hands back with its result to AutoBudget.learn,
    the one place auto learns. choose() makes it:
      arm          the arm the step runs (PLAIN, CHAIN or a tree size)
      probe        a chain step on plain decoding (it tells what drafts would bring there),
                   or a cold chooser's first step
      window       the most committed tokens the drafter catches up on in the step (0:
                   all it lacks): a probe's PROBE_LAG, a cold first step's cold_window(),
                   another's catch_up_window()
      survey       the step surveys the largest tree as well
      until_probe  (the plain arm) the plain steps that may follow it up to the next
                   probe, which nothing can change: its proposer may run them without
                   choose(), telling them in one decision of `unasked` steps
    the step's propose adds, in a copy (dataclasses.replace):
      cut          the chain's cut (chain_cut): the chain arm's, or on a tree's step the
                   chain's expectation that trees' gains are over
      seen         a tree built this step (tree_nodes: a survey's, or the arm's tree)
      surveyed     a survey's host seconds and the nodes it built
      nodes        the verified tree's nodes (tree_nodes: its arm's first picks)
      caught_up    the drafter's catching up in the step: tokens taken, seconds
    unasked: n > 0, a decision standing for n plain steps run without choose() (after a
    plain decision, its until_probe), told together, their seconds summed."""

    arm: int
    probe: bool = False
    survey: bool = False
    window: int = 0
    until_probe: int = 0
    cut: Optional[ChainCut] = None
    seen: Any = None
    surveyed: Optional[Tuple[float, int]] = None
    nodes: Any = None
    caught_up: Optional[Tuple[int, float]] = None
    unasked: int = 0


def _low(old: Optional[float], x: float) -> float:
    """A running low figure of a measured time: other processes only ever add to a time,
    so a lower reading replaces it at once; it creeps up 1% a reading to follow a
    machine (or a text) that got slower."""
    return x if old is None or x < old else old * 1.01


def _at(table: List[float], rows: float) -> float:
    """A verify time by rows, between two whole row counts."""
    i = min(int(rows), len(table) - 2)
    return table[i] + (rows - i) * (table[i + 1] - table[i])


class StepCosts:
    """The seconds side of AutoBudget's model: an arm's step costs the verify table at
    its rows (the chain's by rows, each tree size's) at the sequence's depth (at_depth),
    plus the step's other work measured by kind (`part`, each a running low figure): a
    drafted step's (the drafter's propose and the loop's host work), a plain step's (all
    of it: no drafter runs, verifying.decode_call; kept as at no depth, what the table
    says the depth added taken off), a tree's host work per node (ranking, building,
    walking; before a tree has run, a survey's per node). Besides, what prices probes:
    a probe's whole step, and the drafter's catching up a token; and, where the
    drafter's work was priced at load (draft-simple's model: SimpleDraft.prices), its
    own part of a drafted step (`drafter`), which stands for `drafted` until a chain
    step is timed: the least that part can be."""

    PARTS = ("drafted", "plain", "node", "survey", "probe", "catch_up", "drafter")
    DEPTH_STEP = 64  # the tables are priced anew when the depth has moved this far

    def __init__(self, cost: VerifyCost, block: int, trees: List[int], prior: Optional["StepCosts"] = None):
        self.cost, self.block, self.trees = cost, block, trees
        self.part: Dict[str, Optional[float]] = dict(prior.part) if prior else dict.fromkeys(self.PARTS)
        self.depth = -1
        self.at_depth(0)

    def at_depth(self, depth: int) -> None:
        """Price the verifies after `depth` tokens of context: every row reads each one."""
        depth = depth - depth % self.DEPTH_STEP
        if depth == self.depth:
            return
        self.depth, cost = depth, self.cost
        self.verify_chain = np.asarray(cost.chain(np.arange(self.block + 1), depth)).tolist()  # by rows
        self.verify_tree = {b: float(cost(b + 1, depth)) for b in self.trees}
        self.plain_extra = self.verify_chain[1] - float(cost.chain(1))  # what the depth adds to a plain step

    def drafted(self) -> Optional[float]:
        """A drafted step's work besides its verify: as measured, else the drafter's
        own priced at load (None while neither is known)."""
        part = self.part
        return part["drafted"] if part["drafted"] is not None else part["drafter"]

    def seconds(self, arm: int, drafts: float) -> Optional[float]:
        """An arm's expected step time, the chain's verifying `drafts` drafts (None while
        a part it needs is unmeasured)."""
        part = self.part
        if arm == PLAIN:  # before it has run: priced by a verify of one row, and soon measured if chosen
            return part["plain"] + self.plain_extra if part["plain"] is not None else self.verify_chain[1]
        drafted = self.drafted()
        if drafted is None:
            return None
        if arm == CHAIN:
            return drafted + _at(self.verify_chain, 1 + drafts)
        node = part["node"] if part["node"] is not None else part["survey"]
        return None if node is None else drafted + node * arm + self.verify_tree[arm]

    def measured(self, kind: str, seconds: float) -> None:
        """A reading of one part of a step."""
        self.part[kind] = _low(self.part[kind], seconds)

    def caught_up(self, n: int, seconds: float) -> None:
        """A drafted step's drafter took n committed tokens it lacked in `seconds`."""
        if n > 0:
            self.measured("catch_up", seconds / n)

    def timed(self, arm: int, seconds: float, host: float, drafts: int) -> None:
        """A step of the arm in use, its graphs built, took `seconds` (host: what a survey
        took of them), its chain verifying `drafts` drafts: the part of it besides the
        verify."""
        seconds -= host
        if arm == PLAIN:
            self.measured("plain", seconds - self.plain_extra)
        elif arm == CHAIN:
            # never below nothing, where the table overprices the verify (measured on
            # another occasion)
            self.measured("drafted", max(seconds - self.verify_chain[1 + drafts], 0.0))
        elif self.part["drafted"] is not None and not host:
            extra = seconds - self.part["drafted"] - self.verify_tree[arm]
            self.measured("node", max(extra, 0.0) / arm)

    def restore(self, part: dict) -> None:
        """The parts of a saved state (AutoBudget.state)."""
        self.part = {k: None if part.get(k) is None else float(part[k]) for k in self.part}


class Acceptance:
    """The tokens side of AutoBudget's model: what the target is expected to accept.
    The chain makes the bonus and its drafts' calibrated probabilities of being accepted
    (the Calibration of spine nodes), summed to the length it verifies; a tree of b
    nodes the chain's tokens times its gain over the chain at the same steps (its first
    b nodes' calibrated probabilities, spine nodes and branches apart, on steps that
    built a tree: its own arm's, and surveys). Both are running expectations over recent
    steps, as is the number of drafts the chain verifies (which prices its verify)."""

    SMOOTH = 0.2  # weight of the newest step in the running expectations

    def __init__(self, block: int, prior: Optional["Acceptance"] = None):
        p = prior
        self.spine, self.branch = Calibration(p and p.spine), Calibration(p and p.branch)
        # running expectations: the chain's tokens a step and drafts verified, and each
        # tree size's tokens over the chain's at the same steps
        self.tokens: Optional[float] = p.tokens if p else None
        self.drafts = p.drafts if p else float(block - 1)
        self.gains: Dict[int, float] = dict(p.gains) if p else {}

    def expected(self, arm: int) -> Optional[float]:
        """An arm's expected tokens a step (None before it can be told)."""
        if arm == PLAIN or self.tokens is None:
            return 1.0 if arm == PLAIN else None
        gain = 1.0 if arm == CHAIN else self.gains.get(arm)
        return None if gain is None else gain * self.tokens

    def chain_cut(self, top1, costs: StepCosts) -> ChainCut:
        """The drafts a chain step verifies (at least one): the length with the highest
        expected tokens per second, from the drafter's top-1 log-probabilities through
        the spine calibration, priced by the verify table and the drafted step's part.
        Changes nothing: the step's result brings the cut back (expect)."""
        cal, verify_chain = self.spine, costs.verify_chain
        edges, accepted, predicted = cal.EDGES, cal.accepted, cal.predicted
        prior = cal.PRIOR * cal.weight
        base = costs.drafted() or 0.0
        p, tokens, best, n, at_n = 1.0, 1.0, 0.0, 1, 1.0
        probs = []
        for i, lp in enumerate(top1.tolist()):  # a few numbers: plain Python is quickest
            p *= math.exp(lp)
            probs.append(p)
            b = bisect.bisect_right(edges, p) - 1
            tokens += min(p * (accepted[b] + prior) / (predicted[b] + prior), 1.0)
            rate = tokens / (base + verify_chain[i + 2])
            if rate > best:
                best, n, at_n = rate, i + 1, tokens
        return ChainCut(n, at_n, tuple(probs[:n]))

    def expect(self, cut: ChainCut, probe: bool) -> None:
        """A step's chain cut: the chain's running expectations of tokens and drafts take
        it (a probe's replaces them: it tells the text now)."""
        if self.tokens is None or probe:
            self.tokens, self.drafts = cut.tokens, float(cut.n)
        else:
            self.tokens += self.SMOOTH * (cut.tokens - self.tokens)
            self.drafts += self.SMOOTH * (cut.n - self.drafts)

    def seen_tree(self, nodes, sizes, chain_tokens: float) -> None:
        """A tree built at a step whose chain cut expected `chain_tokens`: each tree size
        in `sizes` up to its own gets its expected tokens over the chain's."""
        probs, spine = nodes
        tokens = 1.0
        for i, (p, on_spine) in enumerate(zip(probs, spine)):
            tokens += self.spine(p) if on_spine else self.branch(p)
            if i + 1 in sizes:
                gain = tokens / chain_tokens
                old = self.gains.get(i + 1)
                self.gains[i + 1] = gain if old is None else old + self.SMOOTH * (gain - old)

    def verified(self, arm: int, n_acc: int, probs, nodes, accepted, probing: bool) -> None:
        """A step's outcome (AutoBudget.learn): the calibrations learn from the drafts it
        verified (a chain's: their probabilities `probs`; a tree's: its nodes and which
        the target accepted), and a probe's say what the chain makes of the text now."""
        if arm != PLAIN:
            self.spine.age()
            self.branch.age()
        if arm == CHAIN:
            self.spine.update(probs, [i < n_acc for i in range(len(probs))])
            if probing:
                self.tokens = 1.0 + sum(self.spine(p) for p in probs)
        elif nodes is not None:
            probs, spine = nodes
            self.spine.update([p for p, s in zip(probs, spine) if s], [a for a, s in zip(accepted, spine) if s])
            self.branch.update([p for p, s in zip(probs, spine) if not s], [a for a, s in zip(accepted, spine) if not s])

    def state(self) -> dict:
        """Its part of AutoBudget.state."""
        return {"spine": vars(self.spine), "branch": vars(self.branch), "tokens": self.tokens,
                "drafts": self.drafts, "gains": {str(k): v for k, v in self.gains.items()}}

    def restore(self, state: dict, sizes) -> bool:
        """Its part of a saved state (the gains of the tree sizes in `sizes`); False where
        the calibrations do not fit (another version's)."""
        for name in ("spine", "branch"):
            cal, saved = getattr(self, name), state[name]
            predicted, accepted = [float(x) for x in saved["predicted"]], [float(x) for x in saved["accepted"]]
            if len(predicted) != len(cal.predicted) or len(accepted) != len(cal.accepted):
                return False
            cal.predicted, cal.accepted, cal.weight = predicted, accepted, float(saved["weight"])
        self.tokens = None if state["tokens"] is None else float(state["tokens"])
        self.drafts = float(state["drafts"])
        self.gains = {int(k): float(v) for k, v in state["gains"].items() if int(k) in sizes}
        return True


class AutoBudget:
    """`--tree-budget auto` for one sequence: which arm each step runs, from

        rate(arm) = tokens(arm) / seconds(arm)

    tokens as Acceptance expects them, seconds as StepCosts prices them. No arm is tried
    to be timed: a tree is priced by the table and the parts before it ever runs.

    Every step a chain verifies the length with the highest rate (chain_cut: the drafts'
    probabilities are what every propose returns), which replaces --draft-p-min's fixed
    cut. Every DECIDE_EVERY steps the arm with the highest rate is taken when it promises
    SWITCH_GAIN more than the arm in use (a switch builds graphs). Exploration
    is what the model cannot do without: survey steps (the drafter's top-K ranked and
    the largest tree built, so that trees have gains) spaced by their measured cost to
    take at most EXPLORE_SHARE of the time, less the further the trees are behind, and on
    plain decoding a chain step now and then (nothing is drafted otherwise), spaced
    likewise by what it loses against plain (its measured time, which includes catching
    the drafter up on at most PROBE_LAG of the plain steps before it; before one has run,
    priced from the drafted steps' catching up) and how far drafting is behind.

    One per sequence, so that sequences decoded together (-np) choose each for its own
    text; it starts from what the last sequence of its engine and sampling setting learnt
    (AutoMemory) and hands its own back when it ends.

    Its fields are what it has learnt (costs, acceptance, tally) and its schedule (the
    arm in use, the step counts, when it next decides, surveys and probes), never the
    step under way: choose() returns the step's Decision, propose adds to a copy of it,
    and learn(decision, ...) takes it back with the step's result, once per decision."""

    SWITCH_GAIN = 1.05
    DECIDE_EVERY = 8
    SETTLE = 2  # steps after a switch (or a sequence's start) not timed: they build graphs
    EXPLORE_SHARE = 0.01  # the most of the decoding time surveys and probes may take
    # the most tokens a probe catches a drafter up on (draft-simple's window: plain steps
    # leave its drafter behind, and a probe after a long stretch would otherwise pay for
    # every token since its last draft)
    PROBE_LAG = 128
    # ... and a cold chooser's first step at least (cold_window): enough context to time
    # a drafted step and see its drafts, which is what the first steps are for (a drafter
    # far behind on the whole prompt took 3.6 s to catch up on 832 tokens of the 0.5B
    # beside the 1.5B on two cores, 0.66 s on 128 and 0.24 s on 32, where a request may
    # never win back what drafting costs; probes tell later what drafts from more
    # context bring)
    COLD_LAG = 8
    SURVEY_FLOOR, PROBE_FLOOR = 0.1, 0.5  # _share's floors: drafts that come back must be found soon

    def __init__(self, cost: VerifyCost, largest: int, block: int, prior: Optional["AutoBudget"] = None,
                 memory: Optional["AutoMemory"] = None, prices: Optional[Dict[str, float]] = None):
        """prices: step parts priced at load (the drafter's catching up a token and its
        drafting a step: SimpleDraft.prices), for those the prior has not measured."""
        self.memory = memory
        self.arms = auto_arms(largest)
        p = prior
        self.costs = StepCosts(cost, block, self.trees, p and p.costs)
        for kind, seconds in (prices or {}).items():
            if self.costs.part[kind] is None:
                self.costs.part[kind] = seconds
        self.acceptance = Acceptance(block, p and p.acceptance)
        self.current = p.current if p else CHAIN
        self.probed = False  # the last step chosen was a probe: the decision after it spaces the next
        self.steps = self.run = 0  # steps, and steps since a switch
        # cold (not decided): no chooser before it decided anything (none, or ones whose sequences all
        # ended first: a short warm-up request hands on the chain it started on, not a
        # choice). A cold chooser decides as soon as one chain step is timed (the steps
        # before build graphs): a short first request would otherwise spend most of its
        # steps on an arm that may not pay; and its first step is a probe (choose). Where
        # the chain has a price (the drafter's work priced at load, or a drafted step an
        # earlier sequence timed), it decides after that probe already:
        # the chain priced at the least it can cost may lose to plain decoding from what
        # the probe's drafts say, with no chain step timed (on two cores, a 0.5B drafting
        # for the 1.5B made a chain step cost three plain ones)
        self.decided = p.decided if p else False
        self.next_decision = self.DECIDE_EVERY if self.decided else self._first_decision()
        self.next_survey = self.SETTLE + 1
        self.probe_gap = p.probe_gap if p else self.DECIDE_EVERY  # plain steps between probes
        # plain steps left before the next probe: carried from sequence to sequence, since
        # the gap may be longer than a request
        self.to_probe = p.to_probe if p else self.probe_gap
        self.tally = {a: [0, 0] for a in self.arms}  # per arm: the steps that ran it, the tokens they made

    @property
    def largest(self) -> int:
        return self.arms[-1]

    @property
    def trees(self) -> List[int]:
        return self.arms[2:]

    # ---- the model ------------------------------------------------------------------
    def seconds(self, arm: int) -> Optional[float]:
        """An arm's expected step time (None while a part it needs is unmeasured)."""
        return self.costs.seconds(arm, self.acceptance.drafts)

    def rate(self, arm: int) -> float:
        tokens, seconds = self.acceptance.expected(arm), self.seconds(arm)
        return 0.0 if tokens is None or not seconds else tokens / seconds

    # ---- the proposer's calls -------------------------------------------------------
    def at_depth(self, depth: int) -> None:
        """The next step verifies after `depth` tokens of context: its arms priced there."""
        self.costs.at_depth(depth)

    def choose(self) -> Decision:
        """The next step's Decision: its arm, whether it probes or surveys, and on the
        plain arm the plain steps that may follow it unasked (until_probe: on plain
        decoding nothing but a probe changes a decision)."""
        self.steps += 1
        if self.steps >= self.next_decision:
            self._decide()
        self.run += 1
        arm, probe = self.current, False
        if arm == PLAIN:
            self.to_probe -= 1
            if self.to_probe <= 0:  # a probe: on plain decoding nothing else says what drafts would bring
                arm, probe, self.to_probe = CHAIN, True, self.probe_gap
                self.next_decision = self.steps + 1
        elif not self.decided and self.steps == 1:
            # a cold chooser drafts its first step as a probe, its drafter caught up on
            # the last cold_window() tokens, not on the whole prompt
            probe = True
        self.probed = probe
        if arm == PLAIN:
            return Decision(PLAIN, until_probe=max(self.to_probe - 1, 0))
        window = (self.PROBE_LAG if self.current == PLAIN else self.cold_window()) if probe else self.catch_up_window()
        return Decision(arm, probe, bool(self.trees) and self.steps >= self.next_survey, window=window)

    def cold_window(self) -> int:
        """The most committed tokens a cold chooser's first step catches the drafter up
        on: as many as cost a plain step's time at the cost a token measured (the step
        then loses about one plain step to them), at least COLD_LAG, at most PROBE_LAG;
        COLD_LAG before a cost is measured. A drafter cheap beside its target drafts the
        first steps from more context, whose drafts say more of what drafting brings; a
        0.5B beside the 1.5B on two cores catches up on COLD_LAG."""
        tokens = self._catch_up_per_plain_step()
        return self.COLD_LAG if tokens is None else min(self.PROBE_LAG, max(self.COLD_LAG, int(tokens)))

    def catch_up_window(self) -> int:
        """The most committed tokens a drafted step catches the drafter up on: all it
        lacks while that costs at most DECIDE_EVERY plain steps at the cost a token
        measured, else the last PROBE_LAG (and PROBE_LAG before a cost is measured). A
        turn's new prompt behind a chain in use (a tool's output of hundreds of tokens)
        would otherwise cost seconds on a CPU that a short reply never wins back: a 37-token
        reply after 700 new tokens ran at 0.26x plain."""
        tokens = self._catch_up_per_plain_step()
        return self.PROBE_LAG if tokens is None else max(self.PROBE_LAG, int(self.DECIDE_EVERY * tokens))

    def _catch_up_per_plain_step(self) -> Optional[float]:
        """How many committed tokens the drafter catches up on in a plain step's time, at
        the cost a token measured (None before both are known)."""
        per, plain = self.costs.part["catch_up"], self.seconds(PLAIN)
        return plain / per if per and plain else None

    def _first_decision(self) -> int:
        """The step a cold chooser first decides at: right after its probe where the
        chain has a price (a drafted step timed by an earlier sequence, or the drafter's
        work priced at load), else after its first timed chain step."""
        return 2 if self.costs.drafted() is not None else self.SETTLE + 2

    def _decide(self) -> None:
        self.next_decision = self.steps + self.DECIDE_EVERY
        self.decided = True
        rates = {a: self.rate(a) for a in self.arms}
        best = max(rates, key=rates.get)
        switch = best != self.current and rates[best] > self.SWITCH_GAIN * rates[self.current]
        if switch:
            self.current, self.run = best, 0
        elif self.current == CHAIN and self.costs.part["drafted"] is None:
            # the chain kept on its least price: decided again once a step of it is timed
            self.next_decision = self.SETTLE + 2
        if self.current == PLAIN and rates[CHAIN] and (switch or self.probed):
            # on plain decoding the next probe comes as late as keeps what probes lose
            # against plain within their share of the time (_share, by how close the
            # best drafting arm comes to plain); never sooner than the last
            loss = max(self.probe_seconds() - self.acceptance.tokens * self.seconds(PLAIN), 0.0)
            drafting = max(rates[a] for a in self.arms if a != PLAIN)
            share = self._share(drafting / rates[PLAIN], self.PROBE_FLOOR)
            gap = max(self.DECIDE_EVERY, math.ceil(loss / (share * self.seconds(PLAIN))))
            self.probe_gap = gap if switch else max(gap, self.probe_gap)
            self.to_probe = self.probe_gap

    def probe_seconds(self) -> float:
        """What a probe costs: as measured, or before one has run a chain step plus
        catching the drafter up on PROBE_LAG tokens at the cost a token measured on
        drafted steps (caught_up; nothing where the drafter does not catch up)."""
        part = self.costs.part
        if part["probe"] is not None:
            return part["probe"]
        return self.seconds(CHAIN) + self.PROBE_LAG * (part["catch_up"] or 0.0)

    def chain_cut(self, top1) -> ChainCut:
        """The drafts a chain step verifies (Acceptance.chain_cut), from the drafter's
        top-1 log-probabilities: part of the step's decision (Decision.cut), learnt from
        with its result."""
        return self.acceptance.chain_cut(top1, self.costs)

    def learn(self, decision: Decision, n_acc: int, seconds: float, accepted=None) -> None:
        """What auto learns from one step, applied when the step's result is known: the
        step's Decision (choose's, with what its propose added), the drafts the target
        accepted (n_acc), the step's seconds and, for a tree, which of its nodes (the
        decision's `nodes`) the target accepted. The one place auto learns, once per
        decision, in the order the step's parts came: the drafter's catching up, the
        chain's cut (its running expectations), a tree built (the trees' gains), a
        survey's cost (when the next comes), then the outcome (the tally, the
        calibrations, a probe's cost and the step's time). A decision of `unasked`
        plain steps counts them as choose() and learning each would have."""
        d = decision
        if d.unasked:
            self._unasked(d.unasked, seconds)
            return
        acceptance, costs, cut = self.acceptance, self.costs, d.cut
        if d.caught_up is not None:
            costs.caught_up(*d.caught_up)
        if cut is not None:
            acceptance.expect(cut, d.probe)
        if d.seen is not None:
            acceptance.seen_tree(d.seen, costs.verify_tree, cut.tokens)
        host = 0.0
        if d.surveyed is not None:
            host = d.surveyed[0]
            self._surveyed(*d.surveyed)
        arm = d.arm
        probs = cut.probs if cut is not None and arm == CHAIN else ()
        self.tally[arm][0] += 1
        self.tally[arm][1] += n_acc + 1
        acceptance.verified(arm, n_acc, probs, d.nodes, accepted, d.probe)
        if d.probe and arm != self.current:  # a probe's cost (what it says of the text, Acceptance took);
            costs.part["probe"] = seconds  # not a cold chooser's first step's, which builds graphs
        if arm != self.current or self.run <= self.SETTLE:
            return  # a probe, or a step that builds graphs
        costs.timed(arm, seconds, host, len(probs))

    def _unasked(self, n: int, seconds: float) -> None:
        """n plain steps run without choose() after a plain decision (its until_probe),
        `seconds` in all, counted as choose() and learn() would have counted each."""
        self.steps += n
        self.run += n
        self.to_probe -= n
        self.tally[PLAIN][0] += n
        self.tally[PLAIN][1] += n
        if self.current == PLAIN and self.run > self.SETTLE:
            self.costs.measured("plain", seconds / n - self.costs.plain_extra)

    def _surveyed(self, seconds: float, n_nodes: int) -> None:
        """A survey's own work (ranking the candidates where the arm does not, building
        the largest tree): priced per node for trees not yet run; the next survey comes
        as late as keeps surveys within their share of the time (_share, by how close the
        best tree comes to the arm in use)."""
        self.costs.measured("survey", seconds / max(n_nodes, 1))
        step, now = self.seconds(self.current) or seconds or 1.0, self.rate(self.current)
        share = self._share(max(self.rate(t) for t in self.trees) / now if now else 1.0, self.SURVEY_FLOOR)
        self.next_survey = self.steps + max(self.DECIDE_EVERY, math.ceil(seconds / (share * step)))

    def _share(self, close: float, floor: float) -> float:
        """The share of the time one kind of exploration may take, by how close the arms it
        prices come to the arm it would replace (their rate over its): at most
        EXPLORE_SHARE, times the square of that ratio (an arm far behind needs a large
        change in the text to win, so it is looked at less often), floored so that an
        arm coming back is still found."""
        return self.EXPLORE_SHARE * min(max(close, floor), 1.0) ** 2

    # ---- what it learnt -------------------------------------------------------------
    def report(self) -> dict:
        """Per arm: the steps that ran it and the tokens a step they made, and the model's
        expected tokens a step, milliseconds a step and tokens per second now; the
        measured parts of a step (ms)."""
        arms = {}
        for a in self.arms:
            tokens, seconds = self.acceptance.expected(a), self.seconds(a)
            steps, made = self.tally[a]
            arms[arm_name(a)] = {
                "steps": steps, "tokens_per_step": made / steps if steps else None,
                "expected_tokens": tokens, "expected_ms": seconds * 1e3 if seconds else None,
                "expected_tok_s": tokens / seconds if tokens and seconds else None}
        return {"arms": arms, "parts_ms": {k: v * 1e3 for k, v in self.costs.part.items() if v is not None}}

    def finish(self) -> None:
        """The sequence ended: what it learnt is what the next one starts from."""
        if self.memory is not None:
            self.memory.remember(self)

    def state(self) -> dict:
        """What a later chooser starts from (the prior's fields), as plain data."""
        return {**self.acceptance.state(), "part": self.costs.part,
                "current": self.current, "probe_gap": self.probe_gap, "to_probe": self.to_probe,
                "decided": self.decided}

    @classmethod
    def restored(cls, cost: VerifyCost, largest: int, block: int, state: dict) -> Optional["AutoBudget"]:
        """A chooser holding a state() to start others from; None where the state does
        not fit (another version's, or arms this setting does not have)."""
        try:
            b = cls(cost, largest, block)
            if not b.acceptance.restore(state, b.costs.verify_tree):
                return None
            b.costs.restore(state["part"])
            b.current, b.probe_gap, b.to_probe = int(state["current"]), int(state["probe_gap"]), int(state["to_probe"])
            b.decided = bool(state["decided"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return b if b.current in b.arms else None


def describe(report: dict) -> str:
    """One line of an AutoBudget report (or several summed, see bench.report): each
    arm's share of the steps and the tokens a step it made, beside the model's tokens
    and milliseconds a step."""
    arms = report["arms"]
    total = sum(a["steps"] for a in arms.values()) or 1
    out = []
    for name, a in arms.items():
        made = f"{a['tokens_per_step']:.2f} tok/step, " if a["tokens_per_step"] else ""
        model = (f"model {a['expected_tokens']:.2f} tok in {a['expected_ms']:.3f} ms"
                 if a["expected_tokens"] and a["expected_ms"] else "model -")
        out.append(f"{name} {100 * a['steps'] / total:.0f}% ({made}{model})")
    return "; ".join(out)


class AutoMemory:
    """What `auto` keeps across the requests of one engine and sampling setting: the
    verify cost table, and the AutoBudget of the last sequence to end, which the next
    ones start from (read when a sequence starts, written when it ends: sequences
    decoded together never share live counters). With a `saved` state (auto_store: what
    an earlier process learnt) the first starts from it; `save` gets the new state
    when a sequence ends, at most every SAVE_EVERY seconds."""

    def __init__(self, cost: VerifyCost, largest: int, block: int, saved: Optional[dict] = None,
                 save: Optional[Callable[[dict], None]] = None, prices: Optional[Dict[str, float]] = None):
        """prices: step parts priced at load (AutoBudget's), for choosers whose prior has
        not measured them."""
        self.cost, self.largest, self.block, self.save, self.prices = cost, largest, block, save, prices
        self._saved_at = -math.inf  # the first sequence to end is written at once
        self.learnt: Optional[AutoBudget] = AutoBudget.restored(cost, largest, block, saved) if saved else None

    def chooser(self) -> AutoBudget:
        return AutoBudget(self.cost, self.largest, self.block, self.learnt, self, self.prices)

    SAVE_EVERY = 10.0  # seconds: a server ending many sequences a second writes the file seldom

    def remember(self, budget: AutoBudget) -> None:
        self.learnt = budget
        now = time.monotonic()
        if self.save is not None and now - self._saved_at >= self.SAVE_EVERY:
            self._saved_at = now
            self.save(budget.state())

    def flush(self) -> None:
        """The engine closes: what the last sequence learnt is written, however recent."""
        if self.save is not None and self.learnt is not None:
            self.save(self.learnt.state())
