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
A proposer whose plan drafts nothing sets `decodes` when the step verifies the last token
alone: when every sequence of a step does, the step is a plain decode (decoding.
decode_step) and the proposer hears of it through decoded(seq, seconds) instead of rows
and accept.
Greedy, every emitted token is the target's argmax given its prefix; sampling, a draw
from the target's distribution given its prefix (see sampling.py for the rules)."""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from .budget import CHAIN, PLAIN, AutoBudget, tree_nodes
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
    gives less than p_min, none when the first is (as llama.cpp's draft loops cut: the
    step then verifies the bonus token alone, a plain decode). Past an unlikely draft
    the chain's rows rarely survive, and where a verify's cost grows with its rows (a
    compute-bound device; a mixture of experts, whose every row may route to other
    experts, nearly doubles from one row to two) they cost more than they bring."""
    if p_min > 0:
        floor = np.log(p_min)
        for i, lp in enumerate(np.asarray(top1_logprobs).tolist()):  # a few numbers: plain Python is quickest
            if lp < floor:
                return i
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


class Proposer:
    """What every proposer has: a step that drafts nothing (decodes) is heard of
    through decoded()."""

    decodes = False

    def decoded(self, seq, seconds: float) -> None:
        """The step decoded the last token alone, in `seconds`."""


class PlainProposer(Proposer):
    """No drafts: each step decodes the last token alone, its row choosing the next."""

    lookahead = 0
    drafted_samples = False
    stage = "decoded"
    decodes = True

    def plan(self, seq) -> int:
        return 0

    def rows(self, seq) -> Rows:
        seq.sampler.prepare(seq.target, 1, seq=seq.slot)
        return Rows(seq.slot, DECODE, [seq.bonus], logits=LOGITS_LAST)

    def accept(self, seq, choice) -> List[int]:
        return [int(choice[0])]


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
        self.decodes = self.b < 2  # no room left to draft
        if self.b > 1 and self.top_k:
            self.draft.set_uniforms(seq.sampler.uniforms(self.b - 1), seq=seq.slot)
        return self.b if self.b > 1 else 0

    def drafted(self, seq) -> None:
        """After the drafter's graph: the block cut by the drafter's confidence."""
        if self.conf_min > 0 and self.b > 1:
            self.b = 1 + confident_length(self.draft.confidence(self.b - 1, seq=seq.slot), self.conf_min)
        if self.p_min > 0 and self.b > 1:
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


class NgramProposer(Proposer):
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
        b = super().plan(seq)
        self.decodes = False  # the n-gram chain is found after the drafter's graph
        return b

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


class TreeProposer(Proposer):
    """A DDTree of `budget` nodes below the bonus token, built best-first from the
    drafter's per-position top-K; every node's token is chosen by the target (its argmax,
    or its draw), and the walk moves on while the choice is a child. Trees are padded to
    their size so that the target's verify graph depends only on the node count.

    With `auto` (this sequence's budget.AutoBudget, `budget` its largest tree) each step
    runs the arm it chooses: plain decoding (nothing drafted; the bonus is verified alone
    and the drafter stays behind, to take the positions in its next propose), the
    chain of the drafter's top choices (read on the device as the chain proposer reads
    it, cut where auto.chain_cut says) or a tree of one of a few sizes; every step's
    outcome goes back to it (AutoBudget.verified), and the sequence's statistics get its
    report when the sequence ends."""

    drafted_samples = False
    stage = None

    def __init__(self, draft, budget: int, block_size: int, auto: Optional[AutoBudget] = None):
        self.draft = draft
        self.budget = budget
        self.block_size = block_size
        self.lookahead = budget + 1
        self.auto = auto
        # the step under way
        self.b = 1                # the block proposed (1: none, the bonus alone)
        self.arm: Optional[int] = None  # auto's arm (None: no auto, or a step it does not hear of)
        self.depth = 0
        self.device = False       # the chain's block verified from the drafter's device tensor
        self.survey = False
        self.chain = False        # the host tree is a chain (verified as one)
        self.tree = None
        self.nodes = None         # the verified tree's nodes for auto (tree_nodes)
        self.t0 = self.host = 0.0  # the step's start; a survey's work
        # a plain stretch: steps auto has nothing to decide for (AutoBudget.plain_stretch),
        # their outcomes summed and told when it ends
        self.stretch, self.in_stretch, self.heard = 0, False, [0, 0.0]

    def plan(self, seq) -> int:
        self.t0 = time.perf_counter()
        self.in_stretch = self.stretch > 0
        if self.in_stretch:  # plain again, as the stretch's first step set up
            self.stretch -= 1
            return 0
        self.device = self.survey = self.chain = False
        self.tree = self.nodes = None
        self.host = 0.0
        b = min(self.block_size, seq.room)  # near a full context the block (and the tree's depth) shrinks
        self.depth = min(b - 1, seq.remaining)
        auto = self.auto
        self.arm = auto.choose() if auto is not None and b >= 2 else None
        self.decodes = b < 2 or self.arm == PLAIN
        if self.decodes:
            self.b = 1  # the bonus alone
            if self.arm == PLAIN:
                self.stretch = auto.plain_stretch()
            return 0
        self.survey = auto is not None and auto.survey_due
        self.b = b
        if self.arm == CHAIN:
            self.b, self.device = self.depth + 1, True
        return self.b

    def drafted(self, seq) -> None:
        if self.b < 2:
            return
        draft, auto, slot = self.draft, self.auto, seq.slot
        if self.device:  # the chain arm: cut by auto, its block going to the target on the device
            top1 = draft.top1_logprobs(self.depth, seq=slot)
            n = auto.chain_cut(top1)
            if self.survey:
                t = time.perf_counter()
                cand, logp = draft.topk(self.depth, seq=slot)
                tree = build_tree(seq.bonus, cand, logp, auto.largest, max_depth=self.depth)
                auto.seen_tree(tree_nodes(tree, top1))
                self.host = time.perf_counter() - t
                auto.surveyed(self.host, len(tree) - 1)
            self.b = 1 + n
            seq.stats.tree_sizes.append(n)
            seq.stats.chain_steps += 1
            return
        cand, logp = draft.topk(self.depth, seq=slot)  # the tree is built from the top-K alone
        arm = self.budget if auto is None else self.arm
        grammar = seq.sampler.grammar if seq.sampler.guided else None
        if 1 + arm > seq.room:  # a padded tree that does not fit: the chain of top choices
            drafts = cand[:, 0]
            tree = chain_tree(seq.bonus, grammar.draft_path(drafts) if grammar is not None else drafts)
            self.chain, self.arm = True, None
            seq.stats.chain_steps += 1
        else:
            t = time.perf_counter()
            tree = build_tree(seq.bonus, cand, logp, auto.largest if self.survey else arm, max_depth=self.depth,
                              valid=grammar.accepts if grammar is not None else None,
                              forced=grammar.forced_after if grammar is not None else None)
            if auto is not None:
                top1 = logp[:, 0]
                auto.chain_cut(top1, verify=False)  # the chain's expectation, which trees' gains are over
                nodes = tree_nodes(tree, top1)
                auto.seen_tree(nodes)
                if self.survey:
                    tree = tree.best(arm)
                    self.host = time.perf_counter() - t
                    auto.surveyed(self.host, len(nodes[0]))
                self.nodes = nodes[0][:arm], nodes[1][:arm]  # best(arm) keeps the first arm picks, in order
        seq.stats.tree_sizes.append(len(tree) - 1)
        self.tree = tree if self.chain else tree.padded_to(1 + arm)

    def rows(self, seq) -> Rows:
        if self.b < 2:
            seq.sampler.prepare(seq.target, 1, seq=seq.slot)
            return Rows(seq.slot, CHAIN_ROWS, [seq.bonus])
        if self.device and seq.sampler.guided:
            # under a grammar the chain's block comes back to be cut and fixed (see
            # ChainProposer) and is verified as the chain tree of what is left
            drafts = seq.sampler.grammar.draft_path(self.draft.block(self.b, seq=seq.slot)[1:])
            self.device, self.chain = False, True
            self.tree = chain_tree(seq.bonus, drafts)
        if self.device:
            b = self.b
            seq.sampler.prepare(seq.target, b, lambda: _chain_paths(self.draft.block(b, seq=seq.slot)), seq=seq.slot)
            return Rows(seq.slot, CHAIN_ROWS, n=b)
        tree = self.tree
        seq.sampler.prepare(seq.target, len(tree), tree.paths, seq=seq.slot)
        if self.chain:
            return Rows(seq.slot, CHAIN_ROWS, tree.tokens)  # the chain verify: cheaper than the same nodes as a tree
        return Rows(seq.slot, TREE_ROWS, tree.tokens, tree.parents)

    def accept(self, seq, choice) -> List[int]:
        draft = self.draft
        accepted = None
        if self.b < 2 or self.device:
            b = self.b
            block = draft.block(b, seq=seq.slot) if b > 1 else [seq.bonus]
            n_acc = accepted_prefix(block, choice)
            seq.stage("verified")
            seq.target.commit(n_acc + 1, seq=seq.slot)
            out = block[1:n_acc + 1] + [int(choice[n_acc])]
        else:
            tree = self.tree
            path = accept_path(tree, choice)
            seq.stage("verified")
            if self.chain:
                seq.target.commit(len(path), seq=seq.slot)
            else:
                seq.target.commit_path(path, seq=seq.slot)
            out = [tree.tokens[i] for i in path[1:]] + [int(choice[path[-1]])]
            n_acc = len(path) - 1
            if self.nodes is not None:
                on_path = set(path)
                accepted = [i in on_path for i in tree.pick_order]
        if self.arm is not None:
            self._tell(n_acc, time.perf_counter() - self.t0, self.host, self.nodes, accepted)
        return out

    def decoded(self, seq, seconds: float) -> None:
        if self.arm is not None:
            self._tell(0, seconds)

    def _tell(self, n_acc: int, seconds: float, host: float = 0.0, nodes=None, accepted=None) -> None:
        """A step's outcome to auto: at once, or a plain stretch's summed at its end."""
        if not self.in_stretch:
            self.auto.verified(n_acc, seconds, host, nodes, accepted)
            return
        self.heard[0] += 1
        self.heard[1] += seconds
        if not self.stretch:
            self._told_stretch()

    def _told_stretch(self) -> None:
        if self.heard[0]:
            self.auto.plain_ran(*self.heard)
        self.heard = [0, 0.0]

    def finish(self, seq) -> None:
        """The sequence ended: its statistics get auto's report, and what auto learnt
        goes to the next sequence."""
        if self.auto is not None:
            self._told_stretch()  # a stretch the sequence's end cut short
            seq.stats.auto = self.auto.report()
            self.auto.finish()
