"""GenerationStats' drafted_tokens and accepted_drafts (llama-server's timings draft_n
and draft_n_accepted) for every kind of speculative step on the demo pair: the fused
greedy chain (Target.chain_step's verified rows), the phased chain of sampling, and a
DDTree (its nodes below the root)."""
from __future__ import annotations

import pytest

from helpers.fixtures import CODE_PROMPT

from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.demo import demo_paths


@pytest.mark.parametrize("options, sampling", [({}, None), ({}, SamplingParams(temperature=0.8, seed=3)),
                                               ({"tree_budget": 8}, None)], ids=["fused-chain", "sampled", "tree"])
def test_drafted_and_accepted_counts(options, sampling):
    target, draft = demo_paths()
    with Engine(target, draft, n_ctx=512, n_threads=1, **options) as e:
        s = e.generate(CODE_PROMPT, 64, stop_tokens=[], sampling=sampling).stats
        block = e.block_size
    passes = len(s.accepted_lengths)
    assert s.generated_tokens == 64 and passes > 0
    assert 0 < s.accepted_drafts <= s.drafted_tokens
    if "tree_budget" in options:
        assert s.drafted_tokens == sum(s.trees.sizes)
    else:
        assert s.drafted_tokens <= passes * (block - 1)
    # each pass makes its accepted drafts, then the target's token (the first token is the
    # prompt's); the last pass's are cut at max_tokens, its accepted drafts counted whole
    last = s.accepted_drafts - sum(n - 1 for n in s.accepted_lengths[:-1])
    assert s.accepted_lengths[-1] - 1 <= last < block
