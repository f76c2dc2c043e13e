"""Chain speculative decoding: the drafter proposes a block, the target verifies it in
one pass, the longest agreeing prefix plus the target's own next token is kept.
Greedy output equals the target's plain greedy output token for token."""
from __future__ import annotations

import time
from typing import Callable, Iterable, List, Optional

from .draft import Draft
from .generate import GenerationStats
from .target import LOGITS_LAST, Target


def accepted_prefix(block: List[int], target_choice) -> int:
    """How many drafts (block[1:]) agree with the target's choice after each position."""
    n = 0
    while n < len(block) - 1 and block[n + 1] == int(target_choice[n]):
        n += 1
    return n


def speculative_generate(target: Target, draft: Draft, prompt: List[int], max_tokens: int,
                         stop_tokens: Iterable[int] = (), block_size: Optional[int] = None,
                         on_tokens: Optional[Callable[[List[int]], None]] = None):
    """Greedy chain speculative generation (target and drafter are reset first).
    Returns (tokens, stats); stats.accepted_lengths has the tokens produced per step."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    B = draft.block_size if block_size is None else int(block_size)
    if not 1 <= B <= draft.block_size:
        raise ValueError(f"block size {B} is outside 1..{draft.block_size} (the drafter's trained block size)")
    if B > target.n_verify:
        raise ValueError(f"block size {B} exceeds the target's n_verify ({target.n_verify})")
    if len(prompt) + max_tokens + B > target.n_ctx:
        raise ValueError(f"prompt ({len(prompt)}) + max tokens ({max_tokens}) + block ({B}) exceed the context "
                         f"size ({target.n_ctx}); raise n_ctx or generate fewer tokens")
    stops = set(stop_tokens)
    stats = GenerationStats(prompt_tokens=len(prompt))

    target.reset()
    draft.reset()
    t0 = time.perf_counter()
    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda start, n: draft.append_rows(n))
    stats.prefill_seconds = time.perf_counter() - t0

    out: List[int] = []
    stats.stop_reason = "length"
    t_start = time.perf_counter()
    if max_tokens > 0:
        bonus = int(target.argmax(0, 1)[0])
        out.append(bonus)
        if on_tokens is not None:
            on_tokens([bonus])
        if bonus in stops:
            stats.stop_reason = "stop"
    while len(out) < max_tokens and stats.stop_reason != "stop":
        remaining = max_tokens - len(out)
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
        out.extend(new[:produced])
        if on_tokens is not None:
            on_tokens(new[:produced])
        bonus = new[-1]
    stats.decode_seconds = time.perf_counter() - t_start
    stats.generated_tokens = len(out)
    return out, stats
