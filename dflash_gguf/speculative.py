"""Speculative decoding loops: the drafter proposes, the target verifies in one pass,
the part the target agrees with is kept. Chain: one drafted block. Tree: a DDTree of the
drafter's top candidates. Greedy output equals plain greedy decoding token for token;
with sampling, the output is distributed exactly as the target's own sampling."""
from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from .budget import CHAIN, AutoBudget, chain_nodes, tree_nodes
from .ddtree import accept_path, build_tree, chain_tree
from .draft import Draft
from .generate import GenerationStats, check_request, collect, first_token, prefill_prompt, start_context
from .sampling import Sampler, SamplingParams
from .target import Target


def accepted_prefix(block: List[int], target_choice) -> int:
    """How many drafts (block[1:]) agree with the target's choice after each position."""
    n = 0
    while n < len(block) - 1 and block[n + 1] == int(target_choice[n]):
        n += 1
    return n


# the greedy chain's confidence cut (chain_length) where the target computes on the CPU:
# the best of a sweep on this project's CPU benchmark pairs (dflash-bench --draft-p-min with several values)
DEFAULT_DRAFT_P_MIN = 0.3


def default_p_min(target: Target) -> float:
    """The cut for a loaded target: DEFAULT_DRAFT_P_MIN where it computes on the CPU,
    wholly or in part (a verify's cost grows with its rows there); none where an
    accelerator holds all its layers (a verify is bound by reading the weights, and
    the whole block costs about what two rows do)."""
    info = target.info()
    on_device = info["device"] != "CPU" and info["n_gpu_layers"] >= info["n_layer"]
    return 0.0 if on_device else DEFAULT_DRAFT_P_MIN


def chain_length(top1_logprobs, p_min: float) -> int:
    """How many of a greedy chain's drafts to verify: those before the first the drafter
    gives less than p_min, and at least one (drafting is paid for already, and a verify
    of two rows costs little more than one). Past an unlikely draft the chain's rows
    rarely survive, and where a verify's cost grows with its rows (a compute-bound
    device) they cost more than they bring."""
    if p_min > 0:
        floor = math.log(p_min)
        for i, lp in enumerate(np.asarray(top1_logprobs).tolist()):  # a few numbers: plain Python is quickest
            if lp < floor:
                return max(i, 1)
    return len(top1_logprobs)


def check_p_min(p_min: float) -> None:
    if not 0 <= p_min < 1:
        raise ValueError(f"draft p-min must be at least 0 and below 1, got {p_min}")


def _no_stage(stage: str) -> None:
    pass


def _speculate(target: Target, draft: Draft, prompt: List[int], max_tokens: int, stop_tokens: Iterable[int],
               stats: GenerationStats, lookahead: int, sampler: Sampler,
               step: Callable[[int, int, int], Tuple[List[int], float, float]], reused: int,
               context_full: str = "error", on_stage: Optional[Callable[[str], None]] = None,
               saver=None, drafted_samples: bool = False) -> Iterator[List[int]]:
    """The loop around `step(bonus, remaining, room) -> (tokens, draft_seconds,
    verify_seconds)`, which drafts, verifies and commits one pass of at most `room`
    tokens (the context positions left) and returns the accepted tokens followed by the
    target's next token (the new bonus). Target and drafter are reset first unless their
    context holds prompt[:reused].

    context_full: "error" refuses upfront a request that could overflow the context;
    "stop" ends generation with stop_reason "context" when it is full. on_stage (see
    Engine.stage_hook) is called with "prefilled", then each step's stages. When the
    loop is left by an exception, the drafter's deferred rows are dropped, not appended
    (the target may have run a graph since): target and drafter must be reset before
    their next use, as a new run (reused=0) does.

    saver (a checkpoints.PrefillSaver): the prefill stops at its positions for it to
    take checkpoints of target and drafter. sampler: the request's (its settings go to
    the target, and to the drafter when it draws its drafts: drafted_samples)."""
    stage = on_stage or _no_stage
    check_request(target, prompt, max_tokens, lookahead, context_full)
    stops = set(stop_tokens)
    stats.prompt_tokens = len(prompt)
    t0 = time.perf_counter()
    stats.reused_tokens = start_context(target, prompt, reused, draft)
    sampler.apply(target, draft, drafted_samples)
    sampler.prepare(target, 1)  # the prompt's last row chooses the first token
    prefill_prompt(target, prompt, stats.reused_tokens, draft, saver, stage)
    stats.prefill_seconds = time.perf_counter() - t0

    stats.stop_reason = "length"
    t_start = time.perf_counter()
    n_past = len(prompt)  # context positions filled (the bonus is not among them)
    clean = False
    try:
        stage("prefilled")
        if max_tokens == 0:
            clean = True
            return
        bonus = first_token(target, sampler)
        stats.generated_tokens = 1
        sampler.accept([bonus])
        clean = True
        yield [bonus]
        clean = False
        if bonus in stops:
            stats.stop_reason = "stop"
            clean = True
            return
        while stats.generated_tokens < max_tokens:
            remaining = max_tokens - stats.generated_tokens
            room = target.n_ctx - n_past
            if room < 1:
                stats.stop_reason = "context"
                break
            t0 = time.perf_counter()
            new, t_draft, t_verify = step(bonus, remaining, room)
            n_past += len(new)  # the accepted drafts and the old bonus
            stats.draft_seconds += t_draft
            stats.verify_seconds += t_verify
            stats.other_seconds += time.perf_counter() - t0 - t_draft - t_verify
            produced = min(len(new), remaining)
            for i in range(produced):
                if new[i] in stops:
                    produced = i + 1
                    stats.stop_reason = "stop"
                    break
            stats.accepted_lengths.append(produced)
            stats.generated_tokens += produced
            sampler.accept(new[:produced])
            clean = True
            yield new[:produced]
            clean = False
            if stats.stop_reason == "stop":
                break
            bonus = new[-1]
        clean = True
    except GeneratorExit:  # the consumer stopped at a yield: nothing is half done
        clean = True
        raise
    finally:
        if clean:
            draft.flush()  # the features it reads are gone after the target's next graph
        else:
            draft.drop_pending()
        stats.decode_seconds = time.perf_counter() - t_start


def _chain_paths(block: List[int]) -> List[List[int]]:
    """Per verified row of a chain block, the drafts it sees after the bonus."""
    return [block[1:i + 1] for i in range(len(block))]


def _chain_pass(target: Target, draft: Draft, sampler: Sampler, bonus: int, b: int, t0: float, stage,
                top_k: int = 0):
    """The chain's target pass over a block of b the drafter proposed on the device (b = 1:
    the bonus token alone): verified, each row's token chosen on the device, the agreed
    drafts committed on both sides. The drafts are kept while the target's choice after
    each equals the next (greedy: its argmax; sampling: its draw, exact for drafts fixed
    in advance), or, when the drafter drew them (top_k > 0: its candidates and the
    target's are read back), by speculative rejection sampling. Returns the pass's
    tokens, the drafting and the verify seconds."""
    stage("drafted")
    t1 = time.perf_counter()
    if b > 1:
        sampler.prepare(target, b, lambda: _chain_paths(draft.block(b)))
        draft.verify_block(target, b)
        block = draft.block(b)
    else:
        sampler.prepare(target, 1)
        target.verify([bonus])
        block = [bonus]
    choice = sampler.choices(target, 0, b)
    if top_k and b > 1:
        n_acc, nxt = sampler.reject_accept(block[1:], draft.candidates(b - 1, top_k),
                                           target.candidates(0, b, top_k), choice[b - 1])
    else:
        n_acc = accepted_prefix(block, choice)
        nxt = int(choice[n_acc])
    t2 = time.perf_counter()
    stage("verified")
    target.commit(n_acc + 1)
    draft.append_rows(n_acc + 1, defer=True)
    stage("committed")
    return block[1:n_acc + 1] + [nxt], t1 - t0, t2 - t1


CHAIN_RULES = ("argmax", "reject")
DEFAULT_CHAIN_RULE = "argmax"


def speculative_steps(target: Target, draft: Draft, prompt: List[int], max_tokens: int,
                      stop_tokens: Iterable[int], block_size: Optional[int], stats: GenerationStats,
                      sampling: Optional[SamplingParams] = None, reused: int = 0, context_full: str = "error",
                      on_stage: Optional[Callable[[str], None]] = None, saver=None,
                      p_min: float = 0.0, chain_rule: str = "argmax") -> Iterator[List[int]]:
    """Chain speculative decoding (target and drafter are reset first), yielding the
    tokens of each target pass; stats.accepted_lengths records their counts (the first
    token, from the prefill, is not a pass). The drafter's block goes to the target on
    the device and every row's token is chosen there (see _chain_pass). With sampling,
    chain_rule "argmax" drafts the drafter's argmax and keeps each draft while the
    target's draw equals it; "reject" draws the drafts from the drafter's distribution
    and keeps them by speculative rejection sampling (with top_k > 0, whose candidates
    carry both distributions to the host; without, the argmax rule runs). With p_min > 0 (the
    drafter loaded with top_k >= 1), each pass verifies the chain_length of its block."""
    B = draft.block_size if block_size is None else int(block_size)
    if not 1 <= B <= draft.block_size:
        raise ValueError(f"block size {B} is outside 1..{draft.block_size} (the drafter's trained block size)")
    if B > target.n_verify:
        raise ValueError(f"block size {B} exceeds the target's n_verify ({target.n_verify})")
    check_p_min(p_min)
    if p_min > 0 and draft.top_k < 1:
        raise ValueError("a chain with p_min > 0 needs a drafter loaded with top_k >= 1")
    sampler = Sampler(sampling, prompt)
    rejection = check_chain_rule(chain_rule) == "reject" and not sampler.greedy and sampler.params.top_k > 0
    top_k = sampler.params.top_k if rejection else 0
    stage = on_stage or _no_stage

    def step(bonus: int, remaining: int, room: int):
        # the block goes from the drafter to the target on the device; drafts and the
        # target's choices come back together after the verify (with p_min, the
        # drafter's top choices' probabilities come back before it)
        b = min(B, remaining + 1, room)
        t0 = time.perf_counter()
        if b > 1:
            if rejection:
                draft.set_uniforms(sampler.uniforms(b - 1))
            draft.propose(bonus, b, read=False)
            if p_min > 0 and b > 2:
                b = 1 + chain_length(draft.top1_logprobs(b - 1), p_min)
        else:
            draft.flush()
        return _chain_pass(target, draft, sampler, bonus, b, t0, stage, top_k)

    return _speculate(target, draft, prompt, max_tokens, stop_tokens, stats, B, sampler, step, reused,
                      context_full, on_stage, saver, drafted_samples=rejection)


def check_chain_rule(rule: str) -> str:
    """The chain's accept rule when sampling (see speculative_steps), checked."""
    if rule not in CHAIN_RULES:
        raise ValueError(f"chain rule must be one of {', '.join(CHAIN_RULES)}, got {rule!r}")
    return rule


def tree_steps(target: Target, draft: Draft, prompt: List[int], max_tokens: int, stop_tokens: Iterable[int],
               budget: int, block_size: Optional[int], stats: GenerationStats,
               auto: Optional[AutoBudget] = None, sampling: Optional[SamplingParams] = None,
               reused: int = 0, context_full: str = "error",
               on_stage: Optional[Callable[[str], None]] = None, saver=None,
               p_min: float = 0.0) -> Iterator[List[int]]:
    """DDTree speculative decoding: the drafter's per-position top-K candidates become a
    best-first tree of `budget` nodes below the bonus token, the target verifies all of
    them in one pass, and the longest path the target agrees with is kept.

    With `auto` (budget.AutoBudget, `budget` its largest tree), every step verifies
    the arm it chooses: the plain chain of the drafter's top choices (verified as the
    chain decoder does, the block going from the drafter to the target on the device,
    a greedy chain cut to its chain_length by p_min) or a tree of one of a few sizes;
    each step's time goes back to it, and on its survey steps the nodes verified and
    the expectations of every arm.

    Trees are padded with dummy leaves to their budget (or the arm's size): the target's
    verify graph depends only on the node count, so steps reuse it.

    With sampling, every node's token is drawn on the device from the target's own
    distribution there (a uniform of its own per node), and the walk moves on while the
    draw is a child: every emitted token is a draw from the target's conditional, so the
    output is distributed exactly as plain sampling, whatever the tree. (Recursive
    rejection over siblings would accept more often; this rule needs no drafter
    probabilities to stay exact.) auto's chain arm keeps its drafts by the same rule."""
    B = draft.block_size if block_size is None else int(block_size)
    if not 2 <= B <= draft.block_size:
        raise ValueError(f"block size {B} is outside 2..{draft.block_size} (the drafter's trained block size)")
    if draft.top_k < 1:
        raise ValueError("tree decoding needs a drafter loaded with top_k >= 1")
    if not 1 <= budget or budget + 1 > target.n_verify:
        raise ValueError(f"tree budget {budget} needs n_verify >= {budget + 1} (target has {target.n_verify})")
    if auto is not None and auto.largest != budget:
        raise ValueError(f"the auto budget's largest tree ({auto.largest}) is not the tree budget ({budget})")
    check_p_min(p_min)
    sampler = Sampler(sampling, prompt)
    stage = on_stage or _no_stage

    def device_chain(bonus: int, b: int, t0: float, survey: bool):
        # the chain arm: the chain decoder's step (the block goes from the drafter to
        # the target on the device), cut by p_min; a survey reads the drafter's top-K as
        # well. Returns what _chain_pass does, the drafts verified and accepted, and the
        # top-K when read with the seconds that took.
        draft.propose(bonus, b, read=False)
        ranked, t_rank = None, 0.0
        if survey:
            t_rank = time.perf_counter()
            ranked = draft.topk(b - 1)
            t_rank = time.perf_counter() - t_rank
        if p_min > 0 and b > 2:
            b = 1 + chain_length(ranked[1][:, 0] if survey else draft.top1_logprobs(b - 1), p_min)
        out, t_draft, t_verify = _chain_pass(target, draft, sampler, bonus, b, t0, stage)
        return out, t_draft, t_verify, b - 1, len(out) - 1, ranked, t_rank

    if auto is not None:
        auto.start_request()

    def step(bonus: int, remaining: int, room: int):
        t0 = time.perf_counter()
        b = min(B, room)  # near a full context the block (and the tree's depth) shrinks
        if b < 2:  # room for the bonus alone
            draft.flush()
            return _chain_pass(target, draft, sampler, bonus, 1, t0, stage)
        arm = budget if auto is None else auto.choose()
        survey = auto is not None and auto.wants_survey()
        depth = min(b - 1, remaining)
        if arm == CHAIN:
            out, t_draft, t_verify, n_drafts, n_acc, ranked, t_rank = device_chain(bonus, depth + 1, t0, survey)
            stats.tree_sizes.append(n_drafts)
            stats.chain_steps += 1
            if survey:
                t_survey = time.perf_counter()
                cand, logp = ranked
                nodes = chain_nodes(logp[:n_drafts, 0])
                auto.survey(tree_nodes(build_tree(bonus, cand, logp, auto.survey_size(), max_depth=depth), logp[:, 0]),
                            nodes)
                auto.verified(nodes, np.arange(n_drafts) < n_acc)
                auto.surveyed(t_rank + time.perf_counter() - t_survey)
            auto.timed(CHAIN, time.perf_counter() - t0, 1 + n_drafts)
            return out, t_draft, t_verify
        draft.propose(bonus, b, read=False)  # the tree is built from the top-K alone
        cand, logp = draft.topk(b - 1)
        chain = arm == CHAIN or 1 + arm > room  # a padded tree that does not fit: the chain does
        t_survey = 0.0  # the survey's work: its tree (in full: a little more than its extra), expectations, calibration
        if survey or not chain:
            t_build = time.perf_counter() if survey else 0.0
            tree = build_tree(bonus, cand, logp, auto.survey_size() if survey else arm, max_depth=depth)
            if survey:
                cut = chain_length(logp[:depth, 0], p_min)
                auto.survey(tree_nodes(tree, logp[:depth, 0]), chain_nodes(logp[:cut, 0]))
                tree = tree.best(arm)
                t_survey = time.perf_counter() - t_build
        if chain:
            tree = chain_tree(bonus, cand[:depth, 0])
            stats.chain_steps += 1
        stats.tree_sizes.append(len(tree) - 1)
        if not chain:
            tree = tree.padded_to(1 + arm)
        stage("drafted")
        t1 = time.perf_counter()
        sampler.prepare(target, len(tree), tree.paths)
        if chain:
            target.verify(tree.tokens)  # the chain verify: cheaper than the same nodes as a tree
        else:
            target.verify_tree(tree.tokens, tree.parents)
        choice = sampler.choices(target, 0, len(tree))
        path = accept_path(tree, choice)
        t2 = time.perf_counter()
        stage("verified")
        if chain:
            target.commit(len(path))
        else:
            target.commit_path(path)
        draft.append_rows(len(path), rows=path, defer=True)
        stage("committed")
        if survey:
            t_calibrate = time.perf_counter()
            if chain:
                auto.verified(chain_nodes(logp[:depth, 0]), np.arange(depth) < len(path) - 1)
            else:
                on_path = set(path)
                auto.verified(tree_nodes(tree, logp[:depth, 0]), [i in on_path for i in tree.pick_order])
            auto.surveyed(t_survey + time.perf_counter() - t_calibrate)
        if auto is not None:
            auto.timed(CHAIN if chain else arm, time.perf_counter() - t0, len(tree))
        return [tree.tokens[i] for i in path[1:]] + [int(choice[path[-1]])], t1 - t0, t2 - t1

    return _speculate(target, draft, prompt, max_tokens, stop_tokens, stats, budget + 1, sampler, step, reused,
                      context_full, on_stage, saver)


def speculative_generate(target: Target, draft: Draft, prompt: List[int], max_tokens: int,
                         stop_tokens: Iterable[int] = (), block_size: Optional[int] = None,
                         on_tokens: Optional[Callable[[List[int]], None]] = None,
                         sampling: Optional[SamplingParams] = None, p_min: float = 0.0,
                         chain_rule: str = "argmax"):
    """Chain speculative generation (with p_min > 0: see chain_length; chain_rule: see
    speculative_steps). Returns (tokens, stats)."""
    stats = GenerationStats()
    steps = speculative_steps(target, draft, prompt, max_tokens, stop_tokens, block_size, stats, sampling,
                              p_min=p_min, chain_rule=chain_rule)
    return collect(steps, on_tokens), stats


def tree_generate(target: Target, draft: Draft, prompt: List[int], max_tokens: int, budget: int,
                  stop_tokens: Iterable[int] = (), block_size: Optional[int] = None,
                  on_tokens: Optional[Callable[[List[int]], None]] = None, auto: Optional[AutoBudget] = None,
                  sampling: Optional[SamplingParams] = None, p_min: float = 0.0):
    """DDTree speculative generation (with `auto`: each step's arm chosen by it, its
    chains cut by p_min). Returns (tokens, stats)."""
    stats = GenerationStats()
    steps = tree_steps(target, draft, prompt, max_tokens, stop_tokens, budget, block_size, stats, auto, sampling,
                       p_min=p_min)
    return collect(steps, on_tokens), stats
