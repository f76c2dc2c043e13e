"""Chain speculative decoding: the drafter proposes a block, the target verifies it in
one pass, the longest agreeing prefix plus the target's own next token is kept.
Greedy output equals the target's plain greedy output token for token."""
from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, List, Optional

from .budget import AcceptanceCalibration, VerifyCost, choose_budget
from .ddtree import accept_path, build_tree
from .draft import Draft
from .generate import GenerationStats, check_request, collect
from .target import LOGITS_LAST, Target


def accepted_prefix(block: List[int], target_choice) -> int:
    """How many drafts (block[1:]) agree with the target's choice after each position."""
    n = 0
    while n < len(block) - 1 and block[n + 1] == int(target_choice[n]):
        n += 1
    return n


def speculative_steps(target: Target, draft: Draft, prompt: List[int], max_tokens: int,
                      stop_tokens: Iterable[int], block_size: Optional[int],
                      stats: GenerationStats) -> Iterator[List[int]]:
    """Greedy chain speculative decoding (target and drafter are reset first), yielding
    the tokens each target pass produces; stats.accepted_lengths records their counts
    (the first token, from the prefill, is not a pass)."""
    B = draft.block_size if block_size is None else int(block_size)
    if not 1 <= B <= draft.block_size:
        raise ValueError(f"block size {B} is outside 1..{draft.block_size} (the drafter's trained block size)")
    if B > target.n_verify:
        raise ValueError(f"block size {B} exceeds the target's n_verify ({target.n_verify})")
    check_request(target, prompt, max_tokens, B)
    stops = set(stop_tokens)
    stats.prompt_tokens = len(prompt)

    target.reset()
    draft.reset()
    t0 = time.perf_counter()
    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda start, n: draft.append_rows(n))
    stats.prefill_seconds = time.perf_counter() - t0

    stats.stop_reason = "length"
    t_start = time.perf_counter()
    try:
        if max_tokens == 0:
            return
        bonus = int(target.argmax(0, 1)[0])
        stats.generated_tokens = 1
        yield [bonus]
        if bonus in stops:
            stats.stop_reason = "stop"
            return
        while stats.generated_tokens < max_tokens:
            remaining = max_tokens - stats.generated_tokens
            b = min(B, remaining + 1)
            t0 = time.perf_counter()
            block = [bonus] + (draft.propose(bonus, b) if b > 1 else [])
            t1 = time.perf_counter()
            target.verify(block)
            choice = target.argmax(0, b)
            t2 = time.perf_counter()
            n_acc = accepted_prefix(block, choice)
            new = block[1:n_acc + 1] + [int(choice[n_acc])]
            produced = min(n_acc + 1, remaining)
            for i in range(produced):
                if new[i] in stops:
                    produced = i + 1
                    stats.stop_reason = "stop"
                    break
            target.commit(n_acc + 1)
            draft.append_rows(n_acc + 1)
            t3 = time.perf_counter()
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            stats.commit_seconds += t3 - t2
            stats.accepted_lengths.append(produced)
            stats.generated_tokens += produced
            yield new[:produced]
            if stats.stop_reason == "stop":
                return
            bonus = new[-1]
    finally:
        stats.decode_seconds = time.perf_counter() - t_start


def tree_steps(target: Target, draft: Draft, prompt: List[int], max_tokens: int, stop_tokens: Iterable[int],
               budget: int, block_size: Optional[int], stats: GenerationStats,
               cost: Optional[VerifyCost] = None) -> Iterator[List[int]]:
    """Greedy speculative decoding with DDTree verification: the drafter's per-position
    top-K candidates become a best-first tree of `budget` nodes below the bonus token,
    the target verifies all of them in one pass, and the longest path the target agrees
    with is kept. Same tokens as plain greedy decoding.

    With a verify cost model (`cost`), `budget` is the largest tree and every step uses
    the size with the best expected tokens per second (budget.choose_budget)."""
    B = draft.block_size if block_size is None else int(block_size)
    if not 2 <= B <= draft.block_size:
        raise ValueError(f"block size {B} is outside 2..{draft.block_size} (the drafter's trained block size)")
    if draft.top_k < 1:
        raise ValueError("tree decoding needs a drafter loaded with top_k >= 1")
    if not 1 <= budget or budget + 1 > target.n_verify:
        raise ValueError(f"tree budget {budget} needs n_verify >= {budget + 1} (target has {target.n_verify})")
    check_request(target, prompt, max_tokens, budget + 1)
    stops = set(stop_tokens)
    stats.prompt_tokens = len(prompt)
    calibration = AcceptanceCalibration()

    target.reset()
    draft.reset()
    t0 = time.perf_counter()
    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda start, n: draft.append_rows(n))
    stats.prefill_seconds = time.perf_counter() - t0

    stats.stop_reason = "length"
    t_start = time.perf_counter()
    try:
        if max_tokens == 0:
            return
        bonus = int(target.argmax(0, 1)[0])
        stats.generated_tokens = 1
        yield [bonus]
        if bonus in stops:
            stats.stop_reason = "stop"
            return
        while stats.generated_tokens < max_tokens:
            remaining = max_tokens - stats.generated_tokens
            t0 = time.perf_counter()
            draft.propose(bonus, B)
            cand, logp = draft.topk(B - 1)
            tree = build_tree(bonus, cand, logp, budget, max_depth=min(B - 1, remaining))
            expected = None
            if cost is not None:
                draft_time = (stats.draft_seconds / len(stats.accepted_lengths)) if stats.accepted_lengths else 0.0
                expected = tree.expected_accepted()
                size = choose_budget(expected, cost, draft_time, calibration)
                tree, expected = tree.best(size), expected[size]
            stats.tree_sizes.append(len(tree) - 1)
            t1 = time.perf_counter()
            target.verify_tree(tree.tokens, tree.parents)
            choice = target.argmax(0, len(tree))
            t2 = time.perf_counter()
            path = accept_path(tree, choice)
            if expected is not None:
                calibration.update(expected - 1.0, len(path) - 1)
            new = [tree.tokens[i] for i in path[1:]] + [int(choice[path[-1]])]
            produced = min(len(new), remaining)
            for i in range(produced):
                if new[i] in stops:
                    produced = i + 1
                    stats.stop_reason = "stop"
                    break
            target.commit_path(path)
            draft.append_rows(len(path), rows=path)
            t3 = time.perf_counter()
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            stats.commit_seconds += t3 - t2
            stats.accepted_lengths.append(produced)
            stats.generated_tokens += produced
            yield new[:produced]
            if stats.stop_reason == "stop":
                return
            bonus = new[-1]
    finally:
        stats.decode_seconds = time.perf_counter() - t_start


def speculative_generate(target: Target, draft: Draft, prompt: List[int], max_tokens: int,
                         stop_tokens: Iterable[int] = (), block_size: Optional[int] = None,
                         on_tokens: Optional[Callable[[List[int]], None]] = None):
    """Greedy chain speculative generation. Returns (tokens, stats)."""
    stats = GenerationStats()
    out = collect(speculative_steps(target, draft, prompt, max_tokens, stop_tokens, block_size, stats), on_tokens)
    return out, stats


def tree_generate(target: Target, draft: Draft, prompt: List[int], max_tokens: int, budget: int,
                  stop_tokens: Iterable[int] = (), block_size: Optional[int] = None,
                  on_tokens: Optional[Callable[[List[int]], None]] = None, cost: Optional[VerifyCost] = None):
    """Greedy DDTree speculative generation. Returns (tokens, stats)."""
    stats = GenerationStats()
    out = collect(tree_steps(target, draft, prompt, max_tokens, stop_tokens, budget, block_size, stats, cost),
                  on_tokens)
    return out, stats
