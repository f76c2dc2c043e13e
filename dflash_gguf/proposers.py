"""How a sequence proposes the rows its target verifies in a step (decoding.step): none
(plain decoding: the last token alone), the chain of the drafter's block, or a DDTree of
its top candidates (with `auto`, the chain or a tree of the size it chooses); a chain
copied from the sequence's own history (n-gram kinds, ngram.py), alone or beside the
drafter's chain.

A proposer acts in four phases around the step's two graphs, so that the drafts of every
sequence come from one drafter graph and their verifies from one target graph:
  plan(seq)      the block to draft for it (0: none), before the drafter's graph
  rows(seq)      after it: what the target verifies (a decode, a chain, a tree), its
                 sampling staged for those rows
  accept(seq, c) after the target's graph, c its choices per row: the tokens it keeps
                 (the accepted drafts, then the target's next token), committed to the
                 target (the drafter takes them in the sequence's next drafter graph)
Greedy, every emitted token is the target's argmax given its prefix; sampling, a draw
from the target's distribution given its prefix (see sampling.py for the rules)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from .budget import CHAIN, AutoBudget, chain_nodes, observe, tree_nodes
from .ddtree import accept_path, build_tree, chain_tree
from .ngram import NgramDrafts, expected_chain
from .target import CHAIN as CHAIN_ROWS, DECODE, LOGITS_LAST, TREE as TREE_ROWS, Rows


def accepted_prefix(block: List[int], target_choice) -> int:
    """How many drafts (block[1:]) agree with the target's choice after each position."""
    n = 0
    while n < len(block) - 1 and block[n + 1] == int(target_choice[n]):
        n += 1
    return n


def chain_length(top1_logprobs, p_min: float) -> int:
    """How many of a greedy chain's drafts to verify: those before the first the drafter
    gives less than p_min, and at least one (drafting is paid for already, and a verify
    of two rows costs little more than one). Past an unlikely draft the chain's rows
    rarely survive, and where a verify's cost grows with its rows (a compute-bound
    device) they cost more than they bring."""
    if p_min > 0:
        floor = np.log(p_min)
        for i, lp in enumerate(np.asarray(top1_logprobs).tolist()):  # a few numbers: plain Python is quickest
            if lp < floor:
                return max(i, 1)
    return len(top1_logprobs)


def confident_length(confidence, conf_min: float) -> int:
    """How many of a DSpark chain's drafts to verify: those before the first whose
    confidence (the drafter's estimate that it is accepted) is below conf_min, none at
    all when the first is, as llama.cpp's draft-dspark cuts its drafts."""
    for i, c in enumerate(np.asarray(confidence).tolist()):
        if c < conf_min:
            return i
    return len(confidence)


def _chain_paths(block: List[int]) -> List[List[int]]:
    """Per verified row of a chain block, the drafts it sees after the bonus."""
    return [block[1:i + 1] for i in range(len(block))]


@dataclass
class StepRecord:
    """What a step of a tree proposer was, for its AutoBudget: the arm verified, the
    seconds the step took, the rows verified, and on survey steps the verified nodes'
    drafter probabilities with whether each was accepted and the survey's own seconds."""

    arm: int
    seconds: float
    n_verified: int
    nodes: Optional[tuple] = None
    accepted: Optional[List[bool]] = None
    survey_seconds: float = 0.0


class PlainProposer:
    """No drafts: each step decodes the last token alone, its row choosing the next."""

    lookahead = 0
    drafted_samples = False
    stage = "decoded"

    def plan(self, seq) -> int:
        return 0

    def rows(self, seq) -> Rows:
        seq.sampler.prepare(seq.target, 1, seq=seq.slot)
        return Rows(seq.slot, DECODE, [seq.bonus], logits=LOGITS_LAST)

    def accept(self, seq, choice) -> List[int]:
        return [int(choice[0])]


class ChainProposer:
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

    drafted_samples = False
    stage = None

    def __init__(self, draft, block_size: int, p_min: float = 0.0, rejection_top_k: int = 0,
                 conf_min: float = 0.0):
        self.draft = draft
        self.block_size = block_size
        self.lookahead = block_size
        self.p_min = p_min
        self.conf_min = conf_min
        self.top_k = rejection_top_k
        self.drafted_samples = rejection_top_k > 0
        self.b = 1
        self.tokens: Optional[List[int]] = None  # the block as the grammar lets it be verified

    def plan(self, seq) -> int:
        self.tokens = None
        self.b = min(self.block_size, seq.remaining + 1, seq.room)
        if self.b > 1 and self.top_k:
            self.draft.set_uniforms(seq.sampler.uniforms(self.b - 1), seq=seq.slot)
        return self.b if self.b > 1 else 0

    def drafted(self, seq) -> None:
        """After the drafter's graph: the block cut by the drafter's confidence."""
        if self.conf_min > 0 and self.b > 1:
            self.b = 1 + confident_length(self.draft.confidence(self.b - 1, seq=seq.slot), self.conf_min)
        if self.p_min > 0 and self.b > 2:
            self.b = 1 + chain_length(self.draft.top1_logprobs(self.b - 1, seq=seq.slot), self.p_min)

    def rows(self, seq) -> Rows:
        b = self.b
        if b > 1 and seq.sampler.guided:
            drafts = self.draft.block(b, seq=seq.slot)[1:]
            tokens = self.tokens = [seq.bonus] + seq.sampler.grammar.draft_path(drafts, forced=not self.top_k)
            self.b = len(tokens)
            seq.sampler.prepare(seq.target, len(tokens), lambda: _chain_paths(tokens), seq=seq.slot)
            return Rows(seq.slot, CHAIN_ROWS, tokens)
        if b > 1:
            seq.sampler.prepare(seq.target, b, lambda: _chain_paths(self.draft.block(b, seq=seq.slot)), seq=seq.slot)
            return Rows(seq.slot, CHAIN_ROWS, n=b)
        seq.sampler.prepare(seq.target, 1, seq=seq.slot)
        return Rows(seq.slot, CHAIN_ROWS, [seq.bonus])

    def accept(self, seq, choice) -> List[int]:
        b = self.b
        if self.tokens is not None:
            block = self.tokens
        else:
            block = self.draft.block(b, seq=seq.slot) if b > 1 else [seq.bonus]
        if self.top_k and b > 1:
            n_acc, nxt = seq.sampler.reject_accept(block[1:], self.draft.candidates(b - 1, self.top_k, seq=seq.slot),
                                                   seq.target.candidates(seq.row0, b, self.top_k), choice[b - 1])
        else:
            n_acc = accepted_prefix(block, choice)
            nxt = int(choice[n_acc])
        seq.stage("verified")
        seq.target.commit(n_acc + 1, seq=seq.slot)
        return block[1:n_acc + 1] + [nxt]


def _verify_chain(seq, block: List[int]) -> Rows:
    """The rows of a chain fixed on the host: the bonus, then its drafts (sampled, each
    row's draw is the target's own: exact for drafts fixed in advance)."""
    seq.sampler.prepare(seq.target, len(block), lambda: _chain_paths(block), seq=seq.slot)
    return Rows(seq.slot, CHAIN_ROWS, block)


def _accept_chain(seq, block: List[int], choice) -> List[int]:
    """The drafts the target's choices keep, then its next token; committed."""
    n_acc = accepted_prefix(block, choice)
    seq.stage("verified")
    seq.target.commit(n_acc + 1, seq=seq.slot)
    return block[1:n_acc + 1] + [int(choice[n_acc])]


def _draft_room(seq, n_max: int) -> int:
    """Drafts a chain may have this step: n_max, what the request still wants after the
    target's own next token (so that every committed row is a kept token, and the slot
    holds exactly the request's context for the next one) and the context's room after
    the bonus."""
    return max(0, min(n_max, seq.remaining - 1, seq.room - 1))


class NgramProposer:
    """No drafter: each step verifies the bonus and the chain the sequence's n-gram
    sources propose from its prompt and output (the best expected, see
    ngram.NgramDrafts), or the bonus alone when none finds one."""

    drafted_samples = False
    stage = None

    def __init__(self, sources, n_max: int):
        self.ngram = NgramDrafts(sources)
        self.n_max = n_max
        self.lookahead = n_max + 1
        self.block: List[int] = []

    def plan(self, seq) -> int:
        return 0

    def rows(self, seq) -> Rows:
        self.ngram.sync(seq)
        drafts, _ = self.ngram.best(_draft_room(seq, self.n_max))
        self.block = [seq.bonus] + drafts
        return _verify_chain(seq, self.block)

    def accept(self, seq, choice) -> List[int]:
        out = _accept_chain(seq, self.block, choice)
        self.ngram.observe(out)
        return out


class MixedProposer(ChainProposer):
    """The drafter's chain and the n-gram kinds' (`--spec-type draft-dflash,ngram-...`):
    the drafter drafts every step; the chain verified is the one with the larger
    expected accepted length. The drafter's estimate is its own confidence (the sum over
    i of the product of its top-1 probabilities up to draft i, ngram.expected_chain);
    an n-gram draft's is its source's measured per-token acceptance r over the
    sequence's steps so far, sum of r^i (ngram.Acceptance). Neither depends on the
    target's draws of the step, so sampled output stays exact (drafts are fixed in
    advance and kept by the argmax rule, whichever chain is verified)."""

    def __init__(self, draft, block_size: int, p_min: float, sources, n_max: int):
        super().__init__(draft, block_size, p_min)
        self.ngram = NgramDrafts(sources)
        self.n_max = n_max
        self.lookahead = max(block_size, n_max + 1)
        self.copied: Optional[List[int]] = None  # the step's n-gram chain, when it is the one verified

    def plan(self, seq) -> int:
        self.ngram.sync(seq)
        return super().plan(seq)

    def drafted(self, seq) -> None:
        super().drafted(seq)
        self.copied = None
        drafts, value = self.ngram.best(_draft_room(seq, self.n_max))
        if drafts and (self.b < 2 or value > expected_chain(self.draft.top1_logprobs(self.b - 1, seq=seq.slot))):
            self.copied = [seq.bonus] + drafts

    def rows(self, seq) -> Rows:
        return super().rows(seq) if self.copied is None else _verify_chain(seq, self.copied)

    def accept(self, seq, choice) -> List[int]:
        out = super().accept(seq, choice) if self.copied is None else _accept_chain(seq, self.copied, choice)
        self.ngram.observe(out)
        return out


@dataclass
class _TreeStep:
    """A tree proposer's step in progress."""

    t0: float
    b: int                       # block proposed (1: the bonus alone)
    arm: int = CHAIN
    survey: bool = False
    depth: int = 0
    tree: object = None          # the verified tree (a chain_tree for the chain)
    device: bool = False         # the chain arm's block read on the device
    n_drafts: int = 0
    ranked: Optional[tuple] = None
    nodes: Optional[tuple] = None
    t_survey: float = 0.0
    extra: dict = field(default_factory=dict)


class TreeProposer:
    """A DDTree of `budget` nodes below the bonus token, built best-first from the
    drafter's per-position top-K; every node's token is chosen by the target (its argmax,
    or its draw), and the walk moves on while the choice is a child. Trees are padded to
    their size so that the target's verify graph depends only on the node count.

    With `auto` (an AutoBudget, `budget` its largest tree) each step verifies the arm it
    chooses: the chain of the drafter's top choices (read on the device as the chain
    proposer does, cut by p_min) or a tree of one of a few sizes; each step's record
    goes back to it (StepRecord)."""

    drafted_samples = False
    stage = None

    def __init__(self, draft, budget: int, block_size: int, auto: Optional[AutoBudget] = None, p_min: float = 0.0):
        self.draft = draft
        self.budget = budget
        self.block_size = block_size
        self.lookahead = budget + 1
        self.auto = auto
        self.p_min = p_min
        self.step: Optional[_TreeStep] = None

    def start(self) -> None:
        if self.auto is not None:
            self.auto.start_request()

    def plan(self, seq) -> int:
        t0 = time.perf_counter()
        b = min(self.block_size, seq.room)  # near a full context the block (and the tree's depth) shrinks
        st = self.step = _TreeStep(t0, b)
        if b < 2:  # room for the bonus alone
            st.b = 1
            return 0
        auto = self.auto
        st.arm = self.budget if auto is None else auto.choose()
        st.survey = auto is not None and auto.wants_survey()
        st.depth = min(b - 1, seq.remaining)
        if st.arm == CHAIN:
            st.b = st.depth + 1
            st.device = True
        return st.b

    def drafted(self, seq) -> None:
        st, draft, auto = self.step, self.draft, self.auto
        if st.b < 2:
            return
        if st.device:
            # the chain arm: the block goes from the drafter to the target on the device,
            # cut by p_min; a survey reads the drafter's top-K as well
            if st.survey:
                t_rank = time.perf_counter()
                st.ranked = draft.topk(st.b - 1, seq=seq.slot)
                st.t_survey = time.perf_counter() - t_rank
            if self.p_min > 0 and st.b > 2:
                top1 = st.ranked[1][:, 0] if st.survey else draft.top1_logprobs(st.b - 1, seq=seq.slot)
                st.b = 1 + chain_length(top1, self.p_min)
            st.n_drafts = st.b - 1
            seq.stats.tree_sizes.append(st.n_drafts)
            seq.stats.chain_steps += 1
            return
        cand, logp = draft.topk(st.b - 1, seq=seq.slot)  # the tree is built from the top-K alone
        depth, arm = st.depth, st.arm
        chain = arm == CHAIN or 1 + arm > seq.room  # a padded tree that does not fit: the chain does
        if st.survey or not chain:
            t_build = time.perf_counter() if st.survey else 0.0
            grammar = seq.sampler.grammar if seq.sampler.guided else None
            tree = build_tree(seq.bonus, cand, logp, auto.survey_size() if st.survey else arm, max_depth=depth,
                              valid=grammar.accepts if grammar is not None else None,
                              forced=grammar.forced_after if grammar is not None else None)
            if st.survey:
                cut = chain_length(logp[:depth, 0], self.p_min)
                auto.survey(tree_nodes(tree, logp[:depth, 0]), chain_nodes(logp[:cut, 0]))
                tree = tree.best(arm)
                st.t_survey = time.perf_counter() - t_build
        if chain:
            drafts = cand[:depth, 0]
            if seq.sampler.guided:
                drafts = seq.sampler.grammar.draft_path(drafts)
            tree = chain_tree(seq.bonus, drafts)
            seq.stats.chain_steps += 1
        seq.stats.tree_sizes.append(len(tree) - 1)
        if not chain:
            tree = tree.padded_to(1 + arm)
        st.tree, st.extra["chain"], st.extra["logp"] = tree, chain, logp

    def rows(self, seq) -> Rows:
        st = self.step
        if st.b < 2:
            seq.sampler.prepare(seq.target, 1, seq=seq.slot)
            return Rows(seq.slot, CHAIN_ROWS, [seq.bonus])
        if st.device and seq.sampler.guided:
            # under a grammar the chain arm's block comes back to be cut and fixed (see
            # ChainProposer) and is verified as the chain tree of what is left
            drafts = seq.sampler.grammar.draft_path(self.draft.block(st.b, seq=seq.slot)[1:])
            st.device, st.extra["chain"] = False, True
            if st.survey:
                st.extra["logp"] = st.ranked[1]
            st.tree = chain_tree(seq.bonus, drafts)
            st.b = len(st.tree)
        if st.device:
            b = st.b
            seq.sampler.prepare(seq.target, b, lambda: _chain_paths(self.draft.block(b, seq=seq.slot)), seq=seq.slot)
            return Rows(seq.slot, CHAIN_ROWS, n=b)
        tree = st.tree
        seq.sampler.prepare(seq.target, len(tree), tree.paths, seq=seq.slot)
        if st.extra["chain"]:
            return Rows(seq.slot, CHAIN_ROWS, tree.tokens)  # the chain verify: cheaper than the same nodes as a tree
        return Rows(seq.slot, TREE_ROWS, tree.tokens, tree.parents)

    def accept(self, seq, choice) -> List[int]:
        st, draft, auto = self.step, self.draft, self.auto
        if st.b < 2 or st.device:
            b = st.b
            block = draft.block(b, seq=seq.slot) if b > 1 else [seq.bonus]
            n_acc = accepted_prefix(block, choice)
            seq.stage("verified")
            seq.target.commit(n_acc + 1, seq=seq.slot)
            out = block[1:n_acc + 1] + [int(choice[n_acc])]
            if auto is not None and st.b >= 2:
                record = StepRecord(CHAIN, 0.0, 1 + st.n_drafts, survey_seconds=st.t_survey)
                if st.survey:
                    t_survey = time.perf_counter()
                    cand, logp = st.ranked
                    nodes = chain_nodes(logp[:st.n_drafts, 0])
                    auto.survey(tree_nodes(build_tree(seq.bonus, cand, logp, auto.survey_size(), max_depth=st.depth),
                                           logp[:, 0]), nodes)
                    record.nodes, record.accepted = nodes, np.arange(st.n_drafts) < n_acc
                    record.survey_seconds += time.perf_counter() - t_survey
                record.seconds = time.perf_counter() - st.t0
                observe(auto, record)
            return out
        tree, chain = st.tree, st.extra["chain"]
        path = accept_path(tree, choice)
        seq.stage("verified")
        if chain:
            seq.target.commit(len(path), seq=seq.slot)
        else:
            seq.target.commit_path(path, seq=seq.slot)
        out = [tree.tokens[i] for i in path[1:]] + [int(choice[path[-1]])]
        if auto is not None:
            record = StepRecord(CHAIN if chain else st.arm, 0.0, len(tree), survey_seconds=st.t_survey)
            if st.survey:
                t_calibrate = time.perf_counter()
                logp, depth = st.extra["logp"], st.depth
                if chain:
                    record.nodes = chain_nodes(logp[:depth, 0])
                    record.accepted = np.arange(depth) < len(path) - 1
                else:
                    on_path = set(path)
                    record.nodes = tree_nodes(tree, logp[:depth, 0])
                    record.accepted = [i in on_path for i in tree.pick_order]
                record.survey_seconds += time.perf_counter() - t_calibrate
            record.seconds = time.perf_counter() - st.t0
            observe(auto, record)
        return out
