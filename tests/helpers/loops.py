"""One-call decoding loops the tests drive the runtime with: a request through
decoding.Sequence with the proposer of each mode (plain, chain, tree), its tokens
collected. The package's own callers (Engine, serving) build their sequences themselves;
these wrappers exist for tests only, and training/ builds its sequences as Engine does."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, List, Optional

from dflash_gguf.speculation.auto import AutoBudget
from dflash_gguf.decoding.step import Sequence, sequence_steps
from dflash_gguf.runtime.drafter import Draft
from dflash_gguf.decoding.requests import GenerationStats, Placement, Request, collect, prefill_chunks
from dflash_gguf.speculation.proposers import PlainProposer
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.speculation.drafting import chain_proposer, tree_proposer
from dflash_gguf.runtime.target import Target


def autoregressive_steps(target: Target, request: Request, stats: GenerationStats,
                         where: Placement = Placement()) -> Iterator[List[int]]:
    """Plain decoding of a request, yielding each new token as a one-element list; a
    stop token ends generation and is yielded. The target's slot is emptied first
    unless it already holds the first `where.reused` prompt tokens ("prefilled", then
    "decoded" after each token's decode go to where.on_stage)."""
    yield from sequence_steps(Sequence(target, None, PlainProposer(), request, stats, where))


def prefill_prompt(target: Target, prompt: List[int], start: int, draft=None, saver=None,
                   on_stage: Optional[Callable[[str], None]] = None, seq: int = 0) -> None:
    """prefill_chunks, all of them."""
    for _ in prefill_chunks(target, prompt, start, draft, saver, on_stage, seq):
        pass


def greedy_generate(target: Target, prompt: List[int], max_tokens: int, stop_tokens: Iterable[int] = (),
                    on_tokens: Optional[Callable[[List[int]], None]] = None,
                    sampling: Optional[SamplingParams] = None):
    """Plain decoding after `prompt` (greedy unless `sampling` says otherwise). Returns
    (tokens, stats)."""
    stats = GenerationStats()
    out = collect(autoregressive_steps(target, Request(prompt, max_tokens, stop_tokens, sampling), stats), on_tokens)
    return out, stats


def speculative_steps(target: Target, draft: Draft, request: Request, stats: GenerationStats,
                      block_size: Optional[int] = None, p_min: float = 0.0, chain_rule: str = "argmax",
                      where: Placement = Placement()) -> Iterator[List[int]]:
    """Chain speculative decoding of a request (speculative.chain_proposer says how),
    yielding the tokens of each target pass; stats.accepted_lengths records their counts
    (the first token, from the prefill, is not a pass)."""
    proposer = chain_proposer(target, draft, block_size, request.sampling, p_min, chain_rule)
    yield from sequence_steps(Sequence(target, draft, proposer, request, stats, where))


def tree_steps(target: Target, draft: Draft, request: Request, stats: GenerationStats, budget: int,
               block_size: Optional[int] = None, auto: Optional[AutoBudget] = None,
               where: Placement = Placement()) -> Iterator[List[int]]:
    """DDTree speculative decoding of a request (speculative.tree_proposer says how),
    yielding the tokens of each target pass."""
    proposer = tree_proposer(target, draft, budget, block_size, auto)
    yield from sequence_steps(Sequence(target, draft, proposer, request, stats, where))


def speculative_generate(target: Target, draft: Draft, prompt: List[int], max_tokens: int,
                         stop_tokens: Iterable[int] = (), block_size: Optional[int] = None,
                         on_tokens: Optional[Callable[[List[int]], None]] = None,
                         sampling: Optional[SamplingParams] = None, p_min: float = 0.0,
                         chain_rule: str = "argmax"):
    """Chain speculative generation (with p_min > 0: see chain_length; chain_rule: see
    speculative.chain_proposer). Returns (tokens, stats)."""
    stats = GenerationStats()
    steps = speculative_steps(target, draft, Request(prompt, max_tokens, stop_tokens, sampling), stats, block_size,
                              p_min, chain_rule)
    return collect(steps, on_tokens), stats


def tree_generate(target: Target, draft: Draft, prompt: List[int], max_tokens: int, budget: int,
                  stop_tokens: Iterable[int] = (), block_size: Optional[int] = None,
                  on_tokens: Optional[Callable[[List[int]], None]] = None, auto: Optional[AutoBudget] = None,
                  sampling: Optional[SamplingParams] = None):
    """DDTree speculative generation (with `auto`, the sequence's budget.AutoBudget:
    each step's arm chosen by it). Returns (tokens, stats)."""
    stats = GenerationStats()
    steps = tree_steps(target, draft, Request(prompt, max_tokens, stop_tokens, sampling), stats, budget, block_size,
                       auto)
    return collect(steps, on_tokens), stats


def assert_chain_and_tree_keep_greedy(target: Target, draft: Draft, prompt: List[int], max_tokens: int,
                                      budget: int = 8) -> GenerationStats:
    """Chain and tree decoding with `draft` give plain greedy decoding's tokens, each run
    from a fresh context; returns the chain's stats (its accepted lengths)."""
    target.reset()
    plain, _ = greedy_generate(target, prompt, max_tokens)
    target.reset()
    draft.reset()
    chain, stats = speculative_generate(target, draft, prompt, max_tokens)
    target.reset()
    draft.reset()
    tree, _ = tree_generate(target, draft, prompt, max_tokens, budget=budget)
    assert chain == plain, (chain, plain)
    assert tree == plain, (tree, plain)
    return stats
