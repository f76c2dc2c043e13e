"""What a sequence proposes for its target to verify in a step (decoding.step): nothing
(plain decoding: the last token alone), the chain of the drafter's block, or a DDTree of
its top candidates; with `auto`, a policy choosing per step between plain decoding, the
chain and trees of a few sizes (AutoProposer). The weightless kinds (n-gram, suffix),
alone or beside a drafter, are weightless.py's; draft-simple's, draft_simple.py's.

A proposer only proposes, and holds only its configuration and the long-lived things it
drafts with (a drafter, corpora, auto's budget): what it keeps of a sequence from step to
step is the sequence's (start, Sequence.proposing), and what it keeps of a step travels in
the step's Plan, which decoding.step carries from plan to verified. Around the step's two
graphs, so that the drafts of every sequence come from one drafter graph and their
verifies from one target graph:
  plan(seq)       the step's Plan, before the drafter's graph: the block to draft for it
                  (0: none), whether the step verifies the last token alone (decodes)
  propose(seq, plan)
                  after it: the Proposal the target verifies
  verified(seq, plan, proposal, path, out, seconds)
                  after the step accepted and committed (decoding.step, once for every
                  kind): the accepted node path, the tokens kept, the step's seconds; what
                  a proposer learns from (auto, the n-gram sources' acceptance)
When every sequence of a step decodes, the step is a plain decode (decoding.decode_call)
and each proposer hears of it through verified() as of a proposal of the last token alone.
Greedy, every emitted token is the target's argmax given its prefix; sampling, a draw
from the target's distribution given its prefix (see sampling.py for the rules)."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np

from ._native import ffi, lib
from .budget import CHAIN, PLAIN, AutoBudget, tree_nodes
from .ddtree import DraftTree, build_tree
from .draft import Draft


@dataclass(slots=True)
class Proposal:
    """What one sequence puts to its target in a step, and the rule that keeps it:
      tokens  the bonus token then its drafts: a chain, or with `tree` the tree's nodes
      n       with tokens None, a chain of the first n tokens of `draft`'s block, which goes
              to the target on the device (read back only where the host needs it)
      reject_top_k  a sampled chain of the drafter's own draws, kept by speculative
              rejection sampling over both models' top-k; otherwise each draft (or tree
              child) is kept while the target's choice before it equals it
      decode  plain decoding's row: the bonus alone, appended, its logits only
      kind    the kind that drafted it (an n-gram kind, suffix, draft-simple): its drafted
              and accepted tokens are counted under that name (GenerationStats.drafts: DraftCounts.count)
      corpus  suffix's drafts came from the corpus of earlier requests, not the
              sequence's own text
      nodes   in tree mode (a tree budget, auto, draft-simple's tree), the nodes below the
              root the step verifies (GenerationStats.trees: TreeSteps.sizes)
      as_chain  a tree-mode step that verifies a chain instead (TreeSteps.chain_steps)"""

    tokens: Optional[List[int]] = None
    tree: Optional[DraftTree] = None
    draft: Any = None
    n: int = 1
    reject_top_k: int = 0
    decode: bool = False
    kind: Optional[str] = None
    corpus: bool = False
    nodes: Optional[int] = None
    as_chain: bool = False

    def chain(self, slot: int) -> List[int]:
        """A chain's tokens, the device block read back on first use."""
        if self.tokens is None:
            self.tokens = self.draft.block(self.n, seq=slot)
        return self.tokens


@dataclass(slots=True)
class Plan:
    """One sequence's step as its proposer plans it, carried by decoding.step from plan
    through propose to verified:
      block    the drafter's block to draft for it before the drafter's graph (0: none)
      decodes  the step verifies the last token alone
      depth    how deep its drafts may go (a tree's, auto's chain's)
      arm      auto's arm for the step (budget.PLAIN, CHAIN or a tree size; None: a step
               auto does not hear of)
      judged   what verified judges the step's drafts by: the n-gram sources' drafts
               (NgramDrafts.best), the suffix tree and its depth (SuffixDrafts.judge)
      fuses    the step may run as one call of the library (decoding.chain_call): a
               greedy chain of the drafter's block, kept by the target's argmax alone"""

    block: int = 0
    decodes: bool = False
    depth: int = 0
    arm: Optional[int] = None
    judged: Any = None
    fuses: bool = False


def accepted_prefix(block: List[int], target_choice) -> int:
    """How many drafts (block[1:]) agree with the target's choice after each position
    (dfl_agreed_drafts: the rule the fused chain step keeps by)."""
    block = np.asarray(block, dtype=np.int32)
    choice = np.ascontiguousarray(target_choice, dtype=np.int32)
    b = min(len(block), len(choice) + 1)
    return lib.dfl_agreed_drafts(ffi.from_buffer("int32_t[]", block), ffi.from_buffer("int32_t[]", choice), b)


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


def draft_room(seq, n_max: int) -> int:
    """Drafts a chain may have this step: n_max, what the request still wants after the
    target's own next token (so that every committed row is a kept token, and the slot
    holds exactly the request's context for the next one) and the context's room after
    the bonus."""
    return max(0, min(n_max, seq.remaining - 1, seq.room - 1))


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
        """The step kept `path` (node indices, root first) of `proposal` and emitted `out`;
        called after the sequence took them (seq.tokens.text ends with `out`)."""

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
        return Plan(block=b, fuses=self.fuses(seq))

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


def _fits(seq, size: int) -> bool:
    """A tree padded to `size` nodes below the bonus fits the context's room."""
    return 1 + size <= seq.room


def _best_tree(seq, cand, logp, size: int, depth: int) -> DraftTree:
    """The best-first tree of `size` nodes below the bonus, at most `depth` deep, from the
    drafter's per-position top-K (candidates, log-probabilities), as the grammar lets it be."""
    grammar = seq.sampler.grammar if seq.sampler.guided else None
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


@dataclass(slots=True)
class AutoPlan(Plan):
    """An `auto` step's Plan, besides the arm and depth: whether it surveys the largest
    tree, the host seconds its survey took, a verified tree's nodes for auto
    (budget.tree_nodes), and whether it is a step of a plain stretch."""

    survey: bool = False
    host: float = 0.0
    nodes: Any = None
    stretch: bool = False


# a step of a plain stretch: the bonus alone, auto told when the stretch ends (read only)
IN_STRETCH = AutoPlan(decodes=True, arm=PLAIN, stretch=True)


@dataclass(slots=True)
class PlainStretch:
    """A sequence's plain stretch under `auto` (AutoBudget.plain_stretch): the steps left
    in it, and the steps and seconds run so far, told to auto together."""

    left: int = 0
    steps: int = 0
    seconds: float = 0.0


class AutoProposer(Proposer):
    """`--tree-budget auto`: a policy over the drafter's arms. Each step, the sequence's
    budget.AutoBudget chooses what it verifies: plain decoding (nothing drafted; the
    drafter stays behind, to take the positions in its next block), the chain of the
    drafter's top choices (on the device, cut where auto.chain_cut says) or a tree of one
    of a few sizes (padded as TreeProposer's). Every step's outcome goes back to it
    (AutoBudget.verified), and the sequence's statistics get its report at the end.
    A plain stretch (AutoBudget.plain_stretch, a PlainStretch the sequence holds) runs
    steps auto has nothing to decide for, their outcomes summed and told when it ends.
    Now and then a drafting step surveys the largest tree as well, to learn what trees
    would gain."""

    def __init__(self, draft, block_size: int, auto: AutoBudget):
        self.draft = draft
        self.block_size = block_size
        self.auto = auto
        self.lookahead = auto.largest + 1

    def start(self, seq) -> PlainStretch:
        return PlainStretch()

    def plan(self, seq) -> AutoPlan:
        stretch = seq.proposing
        if stretch.left > 0:  # plain again, as the stretch's first step set up
            stretch.left -= 1
            return IN_STRETCH
        auto = self.auto
        b = min(self.block_size, seq.room)
        depth = min(b - 1, seq.remaining)
        arm = auto.choose() if b >= 2 else None
        if b < 2 or arm == PLAIN:
            if arm == PLAIN:
                stretch.left = auto.plain_stretch()
            return AutoPlan(decodes=True, depth=depth, arm=arm)
        return AutoPlan(block=depth + 1 if arm == CHAIN else b, depth=depth, arm=arm, survey=auto.survey_due)

    def propose(self, seq, plan: AutoPlan) -> Proposal:
        if plan.decodes:
            return Proposal([seq.tokens.bonus])
        if plan.arm == CHAIN:
            return self._chain(seq, plan)
        cand, logp = self.draft.topk(plan.depth, seq=seq.slot)
        arm, auto = plan.arm, self.auto
        if not _fits(seq, arm):
            plan.arm = None
            return _top_chain(seq, cand)
        t = time.perf_counter()
        tree = _best_tree(seq, cand, logp, auto.largest if plan.survey else arm, plan.depth)
        top1 = logp[:, 0]
        auto.chain_cut(top1, verify=False)  # the chain's expectation, which trees' gains are over
        nodes = tree_nodes(tree, top1)
        auto.seen_tree(nodes)
        if plan.survey:
            tree = tree.best(arm)
            plan.host = time.perf_counter() - t
            auto.surveyed(plan.host, len(nodes[0]))
        plan.nodes = nodes[0][:arm], nodes[1][:arm]  # best(arm) keeps the first arm picks, in order
        return _padded(tree, arm)

    def _chain(self, seq, plan: AutoPlan) -> Proposal:
        """The chain arm: the drafter's block cut by auto, to the target on the device
        (read back and fixed by the grammar under one)."""
        draft, auto, slot, depth = self.draft, self.auto, seq.slot, plan.depth
        top1 = draft.top1_logprobs(depth, seq=slot)
        n = auto.chain_cut(top1)
        if plan.survey:
            t = time.perf_counter()
            cand, logp = draft.topk(depth, seq=slot)
            tree = build_tree(seq.tokens.bonus, cand, logp, auto.largest, max_depth=depth)
            auto.seen_tree(tree_nodes(tree, top1))
            plan.host = time.perf_counter() - t
            auto.surveyed(plan.host, len(tree) - 1)
        if n == 0:
            return Proposal([seq.tokens.bonus], nodes=0, as_chain=True)
        if seq.sampler.guided:
            drafts = seq.sampler.grammar.draft_path(draft.block(1 + n, seq=slot)[1:])
            return Proposal([seq.tokens.bonus] + drafts, nodes=n, as_chain=True)
        return Proposal(draft=draft, n=1 + n, nodes=n, as_chain=True)

    def verified(self, seq, plan, proposal, path, out, seconds) -> None:
        if plan.arm is None:
            return
        if plan.stretch:
            stretch = seq.proposing
            stretch.steps += 1
            stretch.seconds += seconds
            if not stretch.left:
                self._told(stretch)
            return
        accepted = None
        if plan.nodes is not None:
            on_path = set(path)
            accepted = [i in on_path for i in proposal.tree.pick_order]
        self.auto.verified(len(path) - 1, seconds, plan.host, plan.nodes, accepted)

    def _told(self, stretch: PlainStretch) -> None:
        if stretch.steps:
            self.auto.plain_ran(stretch.steps, stretch.seconds)
        stretch.steps, stretch.seconds = 0, 0.0

    def finish(self, seq) -> dict:
        """The sequence ended: its statistics get auto's report, and what auto learnt
        goes to the next sequence."""
        self._told(seq.proposing)  # a stretch the sequence's end cut short
        report = self.auto.report()
        self.auto.finish()
        return report
