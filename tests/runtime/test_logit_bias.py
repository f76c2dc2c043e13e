"""llama.cpp's logit_bias, applied in the target's sampling graph: the same tokens in plain
decoding, speculative decoding (the demo drafter, an n-gram kind) and llama.cpp itself."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.runtime.errors import ConfigError

PROMPT = "The quick brown fox"
N = 24


@pytest.fixture(scope="module")
def engines():
    target, draft = demo_paths()
    with Engine(target, n_ctx=512, n_threads=1) as plain, Engine(target, draft, n_ctx=512, n_threads=1) as spec, \
            Engine(target, n_ctx=512, n_threads=1, spec_type="ngram-simple") as ngram:
        yield plain, spec, ngram


def _gen(engine, bias=None, speculative=True, **sampling):
    params = SamplingParams(logit_bias=bias, **sampling)
    return engine.generate(PROMPT, N, stop_tokens=(), speculative=speculative, sampling=params).tokens


def test_a_bias_forbidding_the_third_token_is_exact_under_speculation(engines):
    plain, spec, ngram = engines
    base = _gen(plain, speculative=False)
    third = base[2]
    biased = _gen(plain, {third: -math.inf}, speculative=False)
    assert biased[:2] == base[:2] and biased[2] != third
    assert third not in biased
    assert _gen(spec, {third: -math.inf}) == biased
    assert _gen(ngram, {third: -math.inf}) == biased
    # a finite bias composed with the penalties, in llama.cpp's order
    mixed = {base[1]: -3.5, base[4]: 2.0, third: -math.inf}
    want = _gen(plain, mixed, speculative=False, repeat_penalty=1.3, frequency_penalty=0.2)
    assert _gen(spec, mixed, repeat_penalty=1.3, frequency_penalty=0.2) == want
    assert _gen(ngram, mixed, repeat_penalty=1.3, frequency_penalty=0.2) == want
    # and no bias leaves the plain output as it was (the slot's bias is cleared)
    assert _gen(spec) == base


def test_greedy_bias_equals_llama_cpp(engines):
    from llama_cpp import Llama

    plain = engines[0]
    base = _gen(plain, speculative=False)
    bias = {base[2]: -math.inf, base[5]: -2.0, base[7]: 1.5}
    ours = _gen(plain, bias, speculative=False)
    llm = Llama(demo_paths()[0], n_ctx=512, n_threads=1, flash_attn=True, verbose=False)
    try:
        out = llm.create_completion(PROMPT, max_tokens=N, temperature=0.0, top_k=1, repeat_penalty=1.0,
                                    logit_bias={t: (b if math.isfinite(b) else -1e30) for t, b in bias.items()})
        theirs = out["choices"][0]["text"]
    finally:
        llm.close()
    assert plain.tokenizer.decode(ours) == theirs


def test_sampled_never_draws_a_forbidden_token(engines):
    plain, spec, _ = engines
    free = set()
    for seed in range(3):
        free |= set(_gen(plain, speculative=False, temperature=1.5, seed=seed))
    banned = sorted(free)[:4]
    for engine, speculative in ((plain, False), (spec, True)):
        for seed in range(3):
            out = _gen(engine, {t: -math.inf for t in banned}, speculative=speculative, temperature=1.5, seed=seed)
            assert not set(out) & set(banned)


@pytest.mark.parametrize("bad", [{-1: 1.0}, {1: float("nan")}, {1: math.inf}, {"1": 1.0}, [(1,)]])
def test_invalid_biases_are_refused(bad):
    with pytest.raises(ConfigError):
        SamplingParams(logit_bias=bad)


def test_an_id_outside_the_vocabulary_is_refused(engines):
    plain = engines[0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _gen(plain, {plain.target.n_vocab: 1.0}, speculative=False)


def test_pairs_sum_and_zero_biases_drop():
    p = SamplingParams(logit_bias=[(3, 1.0), (3, 0.5), (4, 0.0), (1, -math.inf)])
    assert p.logit_bias == ((1, -math.inf), (3, 1.5))
    assert SamplingParams(logit_bias={5: 0}).logit_bias is None
    assert np.isfinite(p.logit_bias[1][1])
