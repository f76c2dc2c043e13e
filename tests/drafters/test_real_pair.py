"""The real pair: the published Qwen2.5-Coder 0.5B drafting for its 1.5B sibling
(dflash_gguf.tools.real_models), `--spec-type draft-simple`, on real activations, a real
vocabulary and Q4_K_M files someone else quantized:

- greedy chain and tree output equal plain greedy output token for token;
- the Engine's drafted and accepted counts equal llama-speculative-simple --spec-type
  draft-simple's on the same files (same n-max, p-min 0), modulo its loop's start and end.

Outside CI a file that has not been fetched skips; under CI=true it is fetched.
"""
from __future__ import annotations

import pytest

from dflash_gguf import Engine

pytestmark = pytest.mark.real

PROMPT = "def quicksort(xs):\n"
N_NEW = 48
N_MAX = 4


@pytest.fixture(scope="module")
def pair(real_path):
    return {"target": str(real_path("qwen2.5-coder-1.5b")), "small": str(real_path("qwen2.5-coder-0.5b"))}


@pytest.fixture(scope="module")
def plain_tokens(pair):
    with Engine(pair["target"], n_ctx=512) as engine:
        return engine.generate(PROMPT, N_NEW, stop_tokens=()).tokens


@pytest.mark.parametrize("tree", [False, True])
def test_draft_simple_keeps_plain_greedy_output(pair, plain_tokens, tree):
    with Engine(pair["target"], pair["small"], n_ctx=512, spec_draft_n_max=N_MAX,
                tree_budget=8 if tree else None) as engine:
        assert engine.setup.simple is not None  # a model file as -md drafts as draft-simple
        got = engine.generate(PROMPT, N_NEW, stop_tokens=())
    assert got.tokens == plain_tokens
    # the 0.5B agrees with its sibling on most of this code: far more than one token a pass
    assert got.stats.mean_accepted > 1.5, got.stats.mean_accepted


# CI's two of experiments/draft_counts_llama_cpp.py's prompts: code, and a list of numbers
COUNT_PROMPTS = ["def quicksort(xs):\n", "Primes below 200: 2, 3, 5, 7, 11,"]


@pytest.mark.parametrize("prompt", COUNT_PROMPTS)
def test_counts_equal_llama_cpp(pair, prompt):
    """The Engine's own steps draft and accept as many as llama-speculative-simple
    --spec-type draft-simple (same n-max, p-min 0), modulo the start and end of llama.cpp's
    loop (speculative_simple.engine_draft_simple_counts), with the same greedy tokens."""
    from helpers.speculative_simple import engine_draft_simple_counts

    got = engine_draft_simple_counts(pair["target"], pair["small"], prompt, 32, N_MAX)
    assert got["tokens_equal"]
    assert got["ours"] == got["llama"]
    assert got["ours"]["n_accept"] > got["ours"]["n_drafted"] / 2


def test_a_cut_drafter_head_keeps_plain_greedy_output(pair, plain_tokens):
    """--spec-draft-vocab 8192: the drafter's head keeps 8192 of 151936 rows; the output
    is still plain greedy's, and code's common tokens are among the kept ones (the chain:
    a tree drafts from the same head; test_real_exactness's cut-head mode runs on Gemma 3)."""
    with Engine(pair["target"], pair["small"], n_ctx=512, spec_draft_n_max=N_MAX, spec_draft_vocab=8192) as engine:
        assert engine.simple_draft.model.n_head == 8192
        got = engine.generate(PROMPT, N_NEW, stop_tokens=())
    assert got.tokens == plain_tokens
    assert got.stats.mean_accepted > 1.5, got.stats.mean_accepted


def test_a_cut_heads_logits_are_the_whole_heads_kept_rows(pair):
    """The 0.5B's Q8_0 head cut to kept rows (repacked on the CPU as the whole one is):
    its logits are the whole head's at those tokens."""
    import numpy as np

    from dflash_gguf.speculation.draft_simple import kept_tokens
    from dflash_gguf.runtime.target import DECODE, Rows, Target, TargetConfig

    kept = kept_tokens(pair["small"], 4096)
    logits = []
    for head in (None, kept):
        with Target(pair["small"], TargetConfig(n_ctx=64, head_tokens=head)) as model:
            model.step([Rows(0, DECODE, list(range(1000, 1008)))])
            logits.append(model.logits(0, 8))
    np.testing.assert_allclose(logits[1], logits[0][:, kept], rtol=1e-4, atol=1e-4)
