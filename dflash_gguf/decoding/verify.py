"""The verify half of a step (decoding.step), after the proposers: one library call runs
every sequence's rows, each sequence keeps what its target's choices agree with, and the
step is recorded alike whichever call ran it (record).

The calls, lightest first:
  decode_call  every sequence verifies its last token alone (plain decoding, auto's plain
               arm): the target's next tokens in one crossing into the library
  chain_call   every sequence drafts a greedy chain of the drafter's block (Plan.fuses):
               propose, verify, accept and commit in one crossing
  verify_call  anything else, in phases: the target's graph over every sequence's
               proposal (chains and trees mixed, a joining prompt chunk after them), then
               each one's choices, accepted path (accepted: one rule for every kind of
               proposal) and commit"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence as Seq, Tuple

from ..runtime.target import CHAIN, DECODE, INVARIANT_STEP_ROWS, LOGITS_LAST, TREE, Rows
from .proposal import VerifiedStep, Plan, Proposal
from .tree import accept_path, accepted_prefix


@dataclass(slots=True)
class Ran:
    """What a step's library call did, told alike by every kind of call:
      new        per sequence, the tokens the step emitted: the accepted drafts, then the
                 target's next token (the step committed the old bonus and the drafts)
      copies     the step's graph splits and the bytes it copied (Target.graph_copies)
      proposals  per sequence, the Proposal its proposer hears of the step as (VerifiedStep),
      paths      and its accepted node path; None: the proposers hear nothing (plain
                 decoding's PlainProposer, the fused chain's ChainProposer learn nothing)
      seconds    the step's (drafting, verifying) seconds; None: all of it verifying
      drafted    per sequence, the drafts the fused chain verified (its proposals untold)
      decoded    every sequence verified its last token alone (its stage: "decoded")"""

    new: List[List[int]]
    copies: Tuple[int, int]
    proposals: Optional[List[Proposal]] = None
    paths: Optional[List[List[int]]] = None
    seconds: Optional[Tuple[float, float]] = None
    decoded: bool = False
    drafted: Optional[List[int]] = None


SPEC_STAGES = ("drafted", "verified", "committed")
DECODE_STAGES = ("decoded",)


def decode_call(target, seqs: Seq, draft=None, told: bool = False) -> Ran:
    """The step of sequences that all decode plainly (the last token alone, as PlainProposer
    proposes): their last tokens in one call of the target, which returns their choices.
    The per-token host work is what bounds plain decoding's speed on a small model, so
    this call crosses into the library once and stages and reads through buffers
    allocated once.

    told: speculative sequences that draft nothing this step, each one's committed token
    waiting for its drafter (`draft`, which the target is told of so that it keeps the
    feature rows the drafter lacks); each proposer hears of the step as of a proposal of
    the last token alone."""
    uniforms, slots, bonuses = [], [], []
    for s in seqs:
        sampler, slot = s.sampler, s.slot
        uniforms.append(-1.0 if sampler.greedy else sampler.next_uniform())
        sampler.prepare_context(target, 1, seq=slot)
        slots.append(slot)
        bonuses.append(s.tokens.bonus)
    choices = target.decode_next(slots, bonuses, uniforms, draft)
    copies = target.last_copies()
    if min(choices) < 0:  # a kept set reached past the ranked candidates: drawn again
        for row, c in enumerate(choices):
            if c < 0:
                choices[row] = int(target.redraw([row], [uniforms[row]], slots[row])[0])
    new = [[c] for c in choices]
    for row, s in enumerate(seqs):
        if s.logprobs_top is not None:
            s.read_logprobs([row], new[row])
    if not told:
        return Ran(new, copies, decoded=True)
    return Ran(new, copies, [Proposal([b], decode=True) for b in bonuses], [[0] for _ in seqs], decoded=True)


def fused(plans: List[Plan], blocks: List[tuple]) -> bool:
    """The step may run as chain_call: every sequence drafts a block this step, every one's
    plan fuses, and they cut their chains alike."""
    return len(blocks) == len(plans) and all(b for _, _, b, _ in blocks) \
        and all(plan.fuses for plan in plans) and len({plan.p_min for plan in plans}) == 1


def chain_call(target, draft, blocks: List[tuple], p_min: float) -> Ran:
    """The step of greedy chains of the drafter's blocks (fused): the same propose,
    verify, accept and commit as the phased step's in one call of the library
    (Target.chain_step), with one read of the host's results; each sequence's stages
    follow the call, in the order its phases ran inside it."""
    new = target.chain_step(draft, blocks, p_min)
    return Ran(new, target.last_copies(), seconds=target.chain_seconds, drafted=target.chain_drafted)


def verify_call(target, draft, seqs: Seq, proposals: List[Proposal], joining, t0: float) -> Ran:
    """The step's verify after its proposals (the drafter's graph ran since t0, the step's
    start): the target's graph for all their rows (and the joining sequence's chunk),
    then each sequence's choices, accepted path and commit.

    A step's rows stay at INVARIANT_STEP_ROWS or fewer, where each rounds as a one-row
    decode does (past it, flash attention takes its tiled kernel): sequences whose rows
    together go past it verify in passes, each pass a graph of whole proposals, its
    choices read and its sequences committed before the next. The joining chunk rides
    in the last pass, in the room the proposals leave (a pass of its own when they
    leave none); a chunk that its solo prefill would take past those rows is that very
    chunk, in a pass of its own."""
    rows = [verify_rows(s, p) for s, p in zip(seqs, proposals)]
    passes = step_passes([r.n_rows for r in rows], INVARIANT_STEP_ROWS)
    chunk = None
    if joining is not None:
        prefill = joining.prefill
        if prefill.span(target.n_ubatch) > INVARIANT_STEP_ROWS:
            # a chunk past the invariant rows rounds by its own boundaries (the tiled
            # attention kernel): it is cut where the prompt alone would be cut, in a pass
            # of its own, so that the prompt's rows equal its solo prefill's
            passes.append([])
            chunk = prefill.rows(target.n_ubatch)
        else:  # rows that round as one-row decodes do, wherever the chunk is cut
            room = min(target.n_ubatch, INVARIANT_STEP_ROWS) - sum(rows[i].n_rows for i in passes[-1])
            if room <= 0:
                passes.append([])
                room = min(target.n_ubatch, INVARIANT_STEP_ROWS)
            chunk = prefill.rows(room)
    t1 = time.perf_counter()
    new, paths, verifying, copies = [None] * len(seqs), [None] * len(seqs), 0.0, (0, 0)
    for k, members in enumerate(passes):
        t_pass = time.perf_counter()
        pass_rows, row0 = [], 0
        for i in members:
            seqs[i].row0 = row0
            row0 += rows[i].n_out
            pass_rows.append(rows[i])
        if chunk is not None and k == len(passes) - 1:
            joining.row0 = row0
            pass_rows.append(chunk)
        target.step(pass_rows, draft)  # one target graph: this pass's sequences' rows
        choices = target.choices(0, row0) if row0 else ()  # a pass of the joining chunk alone chooses nothing here
        verifying += time.perf_counter() - t_pass
        splits, copied = target.graph_copies()  # the pass's graph's, before any redraw
        copies = (copies[0] + splits, copies[1] + copied)
        for i in members:
            s, p = seqs[i], proposals[i]
            choice = s.sampler.resolve(target, choices[s.row0:s.row0 + rows[i].n_out], s.row0, s.slot)
            paths[i], new[i] = accepted(s, p, choice)
            if s.logprobs_top is not None:  # row path[j] chose token j
                s.read_logprobs([s.row0 + r for r in paths[i]], new[i])
            commit(s, p, paths[i])
    return Ran(new, copies, proposals, paths, (t1 - t0, verifying))


def step_passes(n_rows: List[int], most: int) -> List[List[int]]:
    """The sequences (indices, in order) of each pass of a step: as many whole proposals
    as fit in `most` rows, in the order given; one proposal larger than `most` is a pass
    alone (Engine settings keep each proposal within it)."""
    passes: List[List[int]] = [[]]
    used = 0
    for i, n in enumerate(n_rows):
        if passes[-1] and used + n > most:
            passes.append([])
            used = 0
        passes[-1].append(i)
        used += n
    return passes


def verify_rows(seq, p: Proposal) -> Rows:
    """The target's rows for a proposal, their sampling staged (a uniform per row; with
    penalties or a grammar, what each row sees after the history: the drafts before it)."""
    target, sampler, slot = seq.target, seq.sampler, seq.slot
    if p.decode:
        sampler.prepare(target, 1, seq=slot)
        return Rows(slot, DECODE, p.tokens, logits=LOGITS_LAST)
    if p.tree is not None:
        sampler.prepare(target, len(p.tree), p.tree.paths, seq=slot)
        return Rows(slot, TREE, p.tree.tokens, p.tree.parents)
    n = p.n if p.tokens is None else len(p.tokens)
    sampler.prepare(target, n, lambda: _chain_paths(p.chain(slot)), seq=slot)
    return Rows(slot, CHAIN, p.tokens, n=None if p.tokens is not None else n)


def _chain_paths(block: List[int]) -> List[List[int]]:
    """Per verified row of a chain, the drafts it sees after the bonus."""
    return [block[1:i + 1] for i in range(len(block))]


def accepted(seq, p: Proposal, choice) -> Tuple[List[int], List[int]]:
    """What the target's choices (one per verified row) keep of a proposal: the accepted
    node path (root first; a chain's rows are its nodes) and the tokens emitted, the
    accepted drafts then the target's own next token."""
    if p.tree is not None:
        path = accept_path(p.tree, choice)
        return path, [p.tree.tokens[i] for i in path[1:]] + [int(choice[path[-1]])]
    block = p.chain(seq.slot)
    b = len(block)
    if p.reject_top_k and b > 1:
        k = p.reject_top_k
        n_acc, nxt = seq.sampler.reject_accept(block[1:], p.draft.candidates(b - 1, k, seq=seq.slot),
                                               seq.target.candidates(seq.row0, b, k), choice[b - 1])
    else:
        n_acc = accepted_prefix(block, choice)
        nxt = int(choice[n_acc])
    return list(range(n_acc + 1)), block[1:n_acc + 1] + [nxt]


def commit(seq, p: Proposal, path: List[int]) -> None:
    """Keep the accepted path's rows in the target's memory, drop the rest (a decode's
    row was appended: nothing to drop)."""
    if p.decode:
        return
    if p.tree is not None:
        seq.target.commit_path(path, seq=seq.slot)
    else:
        seq.target.commit(len(path), seq=seq.slot)


def record(seqs: Seq, ran: Ran, plans: Optional[List[Plan]] = None, t0: Optional[float] = None) -> List[List[int]]:
    """After a step's call, for every sequence: its graph, its stages (told after the call,
    in the order its phases ran), its tokens (Tokens.advance: the one history, which the
    proposers then read), its proposal's counts and what its proposer hears of the step
    at its next (ran.proposals, with its plan as propose settled it: Sequence.verified_step), its step's seconds (t0:
    the step's start; None: not timed), and what the request keeps of them."""
    splits, copied = ran.copies
    if t0 is not None:
        seconds = time.perf_counter() - t0
        drafting, verifying = ran.seconds or (0.0, seconds)
        other = seconds - drafting - verifying
    out = []
    for i, s in enumerate(seqs):
        new, stats = ran.new[i], s.stats
        stats.graphs.record(splits, copied)
        if s.where.on_stage is not None:
            for name in DECODE_STAGES if ran.decoded or not s.speculative else SPEC_STAGES:
                s.stage(name)
        s.tokens.advance(new)  # the old bonus and the accepted drafts committed, the next bonus
        if ran.proposals is not None:
            p, path = ran.proposals[i], ran.paths[i]
            drafted = _drafted(p)
            stats.drafted_tokens += drafted
            stats.accepted_drafts += len(path) - 1
            kind = p.kind or _drafter_kind(s)
            if kind is not None:
                stats.drafts.count(kind, drafted, len(path) - 1, p.corpus)
            if p.nodes is not None:
                stats.trees.sizes.append(p.nodes)
                stats.trees.chain_steps += p.as_chain
            # the plan as propose settled it (Proposal.plan), else as planned
            s.verified_step = VerifiedStep(plans[i] if p.plan is None else p.plan, p, path, new, seconds)
        elif ran.drafted is not None:  # the fused chain: its accepted drafts, then the target's token
            stats.drafted_tokens += ran.drafted[i]
            stats.accepted_drafts += len(new) - 1
            kind = _drafter_kind(s)
            if kind is not None:
                stats.drafts.count(kind, ran.drafted[i], len(new) - 1)
        if t0 is not None and s.speculative:
            stats.draft_seconds += drafting
            stats.verify_seconds += verifying
            stats.other_seconds += other
        out.append(s.emitted(new, record=s.speculative))
    return out


def _drafter_kind(s) -> Optional[str]:
    """The kind of the drafter model a sequence drafts with (dflash, eagle3, mtp, dspark,
    ...), for drafts whose proposal names no kind of its own."""
    return getattr(s.draft, "kind", None)  # None: no drafter, or one that names no kind


def _drafted(p: Proposal) -> int:
    """The drafts a proposal put to the target: a tree's nodes below the root (padding
    left out), a chain's tokens after the bonus."""
    if p.tree is not None:
        return len(p.tree) - 1 - sum(p.tree.dummy or ())
    return len(p.tokens) - 1 if p.tokens is not None else p.n - 1
