"""What a sequence proposes for its target to verify in a step (decoding.step): nothing
(plain decoding: the last token alone), the chain of the drafter's block, or a DDTree of
its top candidates; with `auto`, a policy choosing per step between plain decoding, the
chain and trees of a few sizes (AutoProposer); the drafter's chain beside the weightless
kinds (DrafterWeightlessProposer), or those kinds alone (WeightlessProposer), whose
sources are speculation/weightless.py's; draft-simple's are speculation/draft_simple.py's.

The protocol they follow, and what a step carries between its calls, are decoding/proposal.py's.
Greedy, every emitted token is the target's argmax given its prefix; sampling, a draw
from the target's distribution given its prefix (see decoding/sampling.py for the rules)."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, List, Optional

import numpy as np

from ..decoding.proposal import Plan, Proposal
from ..decoding.tree import DraftTree
from ..runtime.drafter import Draft
from ..runtime.native import ffi, lib
from .auto import CHAIN, PLAIN, AutoBudget, Decision, tree_nodes
from .ddtree import build_tree
from .ngram import expected_chain
from .weightless import Weightless, WeightlessKinds


def chain_length(top1_logprobs, p_min: float) -> int:
    """How many of a greedy chain's drafts to verify: those before the first the drafter
    gives less than p_min, none when the first is (as llama.cpp's draft loops cut: the
    step then verifies the bonus token alone, a plain decode); dfl_confident_drafts, the
    rule the fused chain step cuts by. Past an unlikely draft the chain's rows rarely
    survive, and where a verify's cost grows with its rows (a compute-bound device; a
    mixture of experts, whose every row may route to other experts, nearly doubles from
    one row to two) they cost more than they bring."""
    lp = np.ascontiguousarray(top1_logprobs, dtype=np.float32)
    return lib.dfl_confident_drafts(ffi.from_buffer("float[]", lp), len(lp), float(p_min))


def confident_length(confidence, conf_min: float) -> int:
    """How many of a DSpark chain's drafts to verify: those before the first whose
    confidence (the drafter's estimate that it is accepted) is below conf_min, none at
    all when the first is, as llama.cpp's draft-dspark cuts its drafts."""
    for i, c in enumerate(np.asarray(confidence).tolist()):
        if c < conf_min:
            return i
    return len(confidence)


class Proposer(ABC):
    """What every proposer has: it keeps nothing of a sequence, drafts nothing unless it
    plans a block, and learns nothing from what was verified unless it says so."""

    lookahead = 0            # the most rows past the context a step of it verifies
    drafted_samples = False  # the drafter draws its drafts (the sampler stages its uniforms)
    decodes = False          # its steps verify the last token alone (plain decoding)

    def start(self, seq) -> Any:
        """What it keeps of the sequence from step to step, which the sequence holds
        (Sequence.proposing)."""
        return None

    def plan(self, seq) -> Plan:
        return Plan(decodes=self.decodes)

    @abstractmethod
    def propose(self, seq, plan: Plan) -> Proposal:
        """What the sequence's target verifies this step."""

    def verified(self, seq, plan: Plan, proposal: Proposal, path: List[int], out: List[int],
                 seconds: float) -> None:
        """The sequence's last step kept `path` (node indices, root first) of `proposal`
        and emitted `out` in `seconds`: heard at its next step, before plan, or at its
        finish (VerifiedStep; seq.tokens.text ends with `out`)."""

    def finish(self, seq) -> Optional[dict]:
        """The sequence ended: auto's report for its statistics (None: no auto)."""
        return None


class PlainProposer(Proposer):
    """No drafts: each step decodes the last token alone, its row choosing the next."""

    decodes = True

    def propose(self, seq, plan: Plan) -> Proposal:
        return Proposal([seq.tokens.bonus], decode=True)


class ChainProposer(Proposer):
    """The drafter's block as a chain, from the drafter to the target on the device. Greedy
    or with sampling under the argmax rule, the drafts are kept while the target's choice
    after each equals the next (its draw, exact for drafts fixed in advance); under the
    rejection rule (chain_rule "reject", top_k > 0) the drafter draws its drafts and they
    are kept by speculative rejection sampling. With p_min > 0 (a drafter loaded with
    top_k >= 1) each step verifies the chain_length of its block. Under a grammar, the
    block is read back and verified as the grammar lets it be (GrammarState.draft_path:
    cut before the first draft it rejects, forced text in place of the drafter's
    guesses; under the rejection rule only cut, since its drafts must be the drafter's
    draws). With conf_min > 0 (a DSpark drafter's confidence head) the block is first cut
    before the first draft the head trusts less than conf_min."""

    def __init__(self, draft, block_size: int, p_min: float = 0.0, rejection_top_k: int = 0,
                 conf_min: float = 0.0):
        self.draft = draft
        self.block_size = block_size
        self.lookahead = block_size
        self.p_min = p_min
        self.conf_min = conf_min
        self.top_k = rejection_top_k
        self.drafted_samples = rejection_top_k > 0

    def plan(self, seq) -> Plan:
        b = min(self.block_size, seq.remaining + 1, seq.room)
        if b > 1 and self.top_k:
            self.draft.set_uniforms(seq.sampler.uniforms(b - 1), seq=seq.slot)
        if b < 2:
            return Plan(decodes=True)  # no room left to draft
        return Plan(block=b, fuses=self.fuses(seq), p_min=self.p_min)

    def fuses(self, seq) -> bool:
        """Its steps may run as one call of the library (Plan.fuses)."""
        return isinstance(self.draft, Draft) and not self.top_k and self.conf_min == 0 \
            and seq.sampler.argmax_only and seq.target.head_tokens is None

    def propose(self, seq, plan: Plan) -> Proposal:
        return self._chain(seq, self._cut(seq, plan.block))

    def _cut(self, seq, b: int) -> int:
        """The drafted block of b tokens cut by the drafter's confidence."""
        draft, slot = self.draft, seq.slot
        if self.conf_min > 0 and b > 1:
            b = 1 + confident_length(draft.confidence(b - 1, seq=slot), self.conf_min)
        if self.p_min > 0 and b > 1:
            b = 1 + chain_length(draft.top1_logprobs(b - 1, seq=slot), self.p_min)
        return b

    def _chain(self, seq, b: int) -> Proposal:
        """The first b tokens of the block, as the grammar lets them be verified."""
        draft, slot = self.draft, seq.slot
        if b < 2:
            return Proposal([seq.tokens.bonus])
        if seq.sampler.guided:
            drafts = seq.sampler.grammar.draft_path(draft.block(b, seq=slot)[1:], forced=not self.top_k)
            return Proposal([seq.tokens.bonus] + drafts, draft=draft, reject_top_k=self.top_k)
        return Proposal(draft=draft, n=b, reject_top_k=self.top_k)


class WeightlessProposer(Proposer):
    """The weightless kinds alone (`--spec-type ngram-simple`, `suffix`, `suffix,ngram-mod`
    ...): each step the offer with the most expected tokens per second at the target's
    measured verify cost (Offers.cheapest), cut to its best size, or the last token alone
    when no offer pays (without a cost, every step verifies the likeliest offer whole)."""

    def __init__(self, kinds: WeightlessKinds, cost=None):
        self.kinds = kinds
        self.lookahead = kinds.n_max + 1
        self.cost = cost  # verify_cost.VerifyCost (None: every offer verified whole)

    def start(self, seq) -> Weightless:
        return self.kinds.start()

    def propose(self, seq, plan: Plan) -> Proposal:
        n_max = self.kinds.n_max
        step = seq.proposing.offers(seq.tokens.text, n_max, seq.draft_room(n_max))
        offer = step.cheapest(self.cost, seq.tokens.n_past)[0] if self.cost is not None else step.likeliest()
        plan = replace(plan, judged=step.judged(offer))
        if offer is None:
            return Proposal([seq.tokens.bonus], plan=plan)
        return replace(offer.proposal(seq.tokens.bonus, seq.room, seq.sampler.guide), plan=plan)

    def verified(self, seq, plan, proposal, path, out, seconds) -> None:
        seq.proposing.observe(out, plan.judged)

    def finish(self, seq) -> None:
        seq.proposing.finish(seq)


class DrafterWeightlessProposer(ChainProposer):
    """The drafter's chain beside the weightless kinds (`--spec-type draft-dflash,suffix`,
    `draft-dflash,ngram-mod`, ...): the drafter drafts every step; the step verifies the
    likeliest weightless offer when it expects to keep more drafts than the drafter's
    chain by the drafter's own confidence (ngram.expected_chain), else the chain."""

    def __init__(self, draft, block_size: int, p_min: float, kinds: WeightlessKinds):
        super().__init__(draft, block_size, p_min)
        self.kinds = kinds
        self.lookahead = max(block_size, kinds.n_max + 1)

    def start(self, seq) -> Weightless:
        return self.kinds.start()

    def plan(self, seq) -> Plan:
        # the offers are weighed after the drafter's graph
        return replace(super().plan(seq), decodes=False, fuses=False)

    def propose(self, seq, plan: Plan) -> Proposal:
        b = self._cut(seq, plan.block)
        n_max = self.kinds.n_max
        step = seq.proposing.offers(seq.tokens.text, n_max, seq.draft_room(n_max))
        offer = step.likeliest()
        if offer is not None and (b < 2 or offer.expected >
                                  expected_chain(self.draft.top1_logprobs(b - 1, seq=seq.slot))):
            plan = replace(plan, judged=step.judged(offer))
            return replace(offer.proposal(seq.tokens.bonus, seq.room, seq.sampler.guide), plan=plan)
        return replace(self._chain(seq, b), plan=replace(plan, judged=step.judged(None)))

    def verified(self, seq, plan, proposal, path, out, seconds) -> None:
        seq.proposing.observe(out, plan.judged)

    def finish(self, seq) -> None:
        seq.proposing.finish(seq)


def _fits(seq, size: int) -> bool:
    """A tree padded to `size` nodes below the bonus fits the context's room."""
    return 1 + size <= seq.room


def _best_tree(seq, cand, logp, size: int, depth: int) -> DraftTree:
    """The best-first tree of `size` nodes below the bonus, at most `depth` deep, from the
    drafter's per-position top-K (candidates, log-probabilities), as the grammar lets it be."""
    grammar = seq.sampler.guide
    return build_tree(seq.tokens.bonus, cand, logp, size, max_depth=depth,
                      valid=grammar.accepts if grammar is not None else None,
                      forced=grammar.forced_after if grammar is not None else None)


def _top_chain(seq, cand) -> Proposal:
    """The chain of the drafter's top choices, as the grammar lets it be: what a step
    verifies when a padded tree would not fit the context."""
    drafts = [int(t) for t in cand[:, 0]]
    if seq.sampler.guided:
        drafts = seq.sampler.grammar.draft_path(drafts)
    return Proposal([seq.tokens.bonus] + drafts, nodes=len(drafts), as_chain=True)


def _padded(tree: DraftTree, size: int) -> Proposal:
    return Proposal(tree=tree.padded_to(1 + size), nodes=len(tree) - 1)


class TreeProposer(Proposer):
    """A DDTree of `budget` nodes below the bonus token, built best-first from the
    drafter's per-position top-K; every node's token is chosen by the target (its argmax,
    or its draw), and the walk moves on while the choice is a child. Trees are padded to
    their size so that the target's verify graph depends only on the node count."""

    def __init__(self, draft, budget: int, block_size: int):
        self.draft = draft
        self.budget = budget
        self.block_size = block_size
        self.lookahead = budget + 1

    def plan(self, seq) -> Plan:
        b = min(self.block_size, seq.room)  # near a full context the block (and the tree's depth) shrinks
        depth = min(b - 1, seq.remaining)
        return Plan(decodes=True, depth=depth) if b < 2 else Plan(block=b, depth=depth)

    def propose(self, seq, plan: Plan) -> Proposal:
        if plan.decodes:
            return Proposal([seq.tokens.bonus])
        cand, logp = self.draft.topk(plan.depth, seq=seq.slot)  # the tree is built from the top-K alone
        if not _fits(seq, self.budget):
            return _top_chain(seq, cand)
        return _padded(_best_tree(seq, cand, logp, self.budget, plan.depth), self.budget)


# a plain step auto is not asked about (its decision's until_probe): the bonus alone,
# counted in the sequence's PlainUntilProbe and told to auto with the last of them
UNASKED = Plan(decodes=True, auto=Decision(PLAIN, unasked=1))


@dataclass(slots=True)
class PlainUntilProbe:
    """A sequence's plain steps up to auto's next probe, which auto is not asked about
    (a plain Decision's until_probe): the steps left to run, and the steps and seconds
    run so far, told to auto together (one Decision of `unasked` steps)."""

    left: int = 0
    steps: int = 0
    seconds: float = 0.0


class AutoProposer(Proposer):
    """`--tree-budget auto`: a policy over the drafter's arms. Each step, the sequence's
    budget.AutoBudget chooses what it verifies: plain decoding (nothing drafted; the
    drafter stays behind, to take the positions in its next block), the chain of the
    drafter's top choices (on the device, cut where auto.chain_cut says) or a tree of one
    of a few sizes (padded as TreeProposer's). Its plan carries auto's Decision (Plan.auto),
    its propose adds what the step drafted to a copy (the Proposal's settled plan), and
    its verified hands the decision back with the step's outcome (AutoBudget.learn); the
    sequence's statistics get auto's report at the end. On plain decoding the steps up
    to the next probe (the decision's until_probe, counted in the PlainUntilProbe the
    sequence holds) run without asking auto, their outcomes summed and told with the
    last of them. Now and then a drafting step surveys the largest tree as well, to
    learn what trees would gain."""

    def __init__(self, draft, block_size: int, auto: AutoBudget):
        self.draft = draft
        self.block_size = block_size
        self.auto = auto
        self.lookahead = auto.largest + 1

    def start(self, seq) -> PlainUntilProbe:
        return PlainUntilProbe()

    def plan(self, seq) -> Plan:
        unasked = seq.proposing
        if unasked.left > 0:  # plain again, as the last decision said (until_probe)
            unasked.left -= 1
            return UNASKED
        auto = self.auto
        b = min(self.block_size, seq.room)
        depth = min(b - 1, seq.remaining)
        auto.at_depth(seq.tokens.n_past)
        decision = auto.choose() if b >= 2 else None
        if decision is None or decision.arm == PLAIN:
            if decision is not None:
                unasked.left = decision.until_probe
            return Plan(decodes=True, depth=depth, auto=decision)
        return Plan(block=depth + 1 if decision.arm == CHAIN else b, depth=depth, auto=decision)

    def propose(self, seq, plan: Plan) -> Proposal:
        if plan.decodes:
            return Proposal([seq.tokens.bonus])
        decision = plan.auto
        if decision.arm == CHAIN:
            return self._chain(seq, plan, decision)
        cand, logp = self.draft.topk(plan.depth, seq=seq.slot)
        arm, auto = decision.arm, self.auto
        if not _fits(seq, arm):  # a step auto does not hear of
            return replace(_top_chain(seq, cand), plan=replace(plan, auto=None))
        t = time.perf_counter()
        tree = _best_tree(seq, cand, logp, auto.largest if decision.survey else arm, plan.depth)
        top1 = logp[:, 0]
        cut = auto.chain_cut(top1)  # the chain's expectation, which trees' gains are over
        nodes = tree_nodes(tree, top1)
        surveyed = None
        if decision.survey:
            tree = tree.best(arm)
            surveyed = (time.perf_counter() - t, len(nodes[0]))
        # best(arm) keeps the first arm picks, in order
        decision = replace(decision, cut=cut, seen=nodes, surveyed=surveyed, nodes=(nodes[0][:arm], nodes[1][:arm]))
        return replace(_padded(tree, arm), plan=replace(plan, auto=decision))

    def _chain(self, seq, plan: Plan, decision: Decision) -> Proposal:
        """The chain arm: the drafter's block cut by auto, to the target on the device
        (read back and fixed by the grammar under one)."""
        draft, auto, slot, depth = self.draft, self.auto, seq.slot, plan.depth
        top1 = draft.top1_logprobs(depth, seq=slot)
        cut = auto.chain_cut(top1)
        n, seen, surveyed = cut.n, None, None
        if decision.survey:
            t = time.perf_counter()
            cand, logp = draft.topk(depth, seq=slot)
            tree = build_tree(seq.tokens.bonus, cand, logp, auto.largest, max_depth=depth)
            seen = tree_nodes(tree, top1)
            surveyed = (time.perf_counter() - t, len(tree) - 1)
        plan = replace(plan, auto=replace(decision, cut=cut, seen=seen, surveyed=surveyed))
        if n == 0:
            return Proposal([seq.tokens.bonus], nodes=0, as_chain=True, plan=plan)
        if seq.sampler.guided:
            drafts = seq.sampler.grammar.draft_path(draft.block(1 + n, seq=slot)[1:])
            return Proposal([seq.tokens.bonus] + drafts, nodes=n, as_chain=True, plan=plan)
        return Proposal(draft=draft, n=1 + n, nodes=n, as_chain=True, plan=plan)

    def verified(self, seq, plan, proposal, path, out, seconds) -> None:
        decision = plan.auto
        if decision is None:
            return
        if decision.unasked:
            unasked = seq.proposing
            unasked.steps += 1
            unasked.seconds += seconds
            if not unasked.left:
                self._tell_unasked(unasked)
            return
        accepted = None
        if decision.nodes is not None:
            on_path = set(path)
            accepted = [i in on_path for i in proposal.tree.pick_order]
        self.auto.learn(decision, len(path) - 1, seconds, accepted)

    def _tell_unasked(self, unasked: PlainUntilProbe) -> None:
        """The unasked plain steps run so far, told to auto as one decision."""
        if unasked.steps:
            self.auto.learn(Decision(PLAIN, unasked=unasked.steps), 0, unasked.seconds)
        unasked.steps, unasked.seconds = 0, 0.0

    def finish(self, seq) -> dict:
        """The sequence ended: its statistics get auto's report, and what auto learnt
        goes to the next sequence."""
        self._tell_unasked(seq.proposing)  # unasked steps the sequence's end cut short
        report = self.auto.report()
        self.auto.finish()
        return report
