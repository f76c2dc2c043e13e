"""The target's log-probabilities at each emitted token (decoding/logprobs.py) are plain
decoding's under every kind of speculation, bit for bit on the CPU: the rows that chose
the tokens (a chain's, a tree's, the weightless kinds', a batch's) round as one-row
decodes do, and the same host arithmetic turns them into numbers. Checked against the
log-softmax of the one-row decode's whole logits row, computed independently. The
probabilities after the sampler (llama-server's post_sampling_probs) likewise, checked
against llama.cpp's own sampler chain over the one-row decode's row."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from dflash_gguf import Engine
from dflash_gguf.decoding.constraints import Constraint
from dflash_gguf.decoding.logprobs import TokenLogprob, TokenProb, row_logprobs, row_probs
from dflash_gguf.decoding.requests import Request
from dflash_gguf.decoding.sampling import SamplingParams
from helpers.decoding_checks import REPEATS
from helpers.llama_sampler import llama_cpp_distribution, llama_cpp_oracle
from helpers.paths import ROOT

DATA = ROOT / "dflash_gguf" / "data"
TARGET, DRAFT = str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf")
PROMPTS = ["def read_lines(path):\n    ", "class Stack:\n    def push(self, x):\n", REPEATS]
N = 40


def plain_logprobs(engine, prompt, k):
    res = engine.generate(prompt, N, stop_tokens=(), speculative=False, logprobs=k)
    assert len(res.stats.logprobs) == len(res.tokens) == N
    return res.tokens, res.stats.logprobs


@pytest.mark.parametrize("options", [
    {},                                   # the drafter's chain (phased: logprobs read its rows)
    {"tree_budget": 12},                  # a DDTree
    {"spec_type": "ngram-simple", "spec_ngram_simple_size_n": 3},  # weightless drafts (short lookups: the demo repeats short)
    {"spec_type": "suffix"},
], ids=["chain", "tree", "ngram-simple", "suffix"])
def test_logprobs_under_speculation_are_plain_decodings(options):
    draft = None if "spec_type" in options else DRAFT
    accepted = []
    with Engine(TARGET, draft, n_threads=2, **options) as engine:
        for prompt in PROMPTS:
            tokens, plain = plain_logprobs(engine, prompt, 5)
            res = engine.generate(prompt, N, stop_tokens=(), logprobs=5)
            assert res.tokens == tokens
            assert res.stats.logprobs == plain  # every float equal, every alternative in order
            accepted += res.stats.accepted_lengths
    assert max(accepted) > 1  # speculation accepted drafts (the n-gram kinds: on the repeating text)


def test_logprobs_of_a_batch_are_each_sequences_alone():
    with Engine(TARGET, DRAFT, n_threads=2, n_seq=3, tree_budget=8) as engine:
        alone = [plain_logprobs(engine, p, 3) for p in PROMPTS]
        batch = engine.batch()
        seqs = [engine.sequence(Request(engine.encode(p), N, stop_tokens=(), logprobs=3), slot=i)
                for i, p in enumerate(PROMPTS)]
        for s in seqs:
            batch.add(s)
        while len(batch):
            for s, _ in batch.advance():
                assert s.error is None, s.error
    for (tokens, plain), s in zip(alone, seqs):
        assert s.stats.logprobs == plain


def test_a_tokens_logprob_is_the_log_softmax_of_its_one_row_decode():
    """The numbers themselves: each token's logprob and top-3 against its one-row decode's
    whole logits row, read from the target directly and normalised in float64."""
    with Engine(TARGET, n_threads=2) as engine:
        prompt = engine.encode(PROMPTS[0])
        tokens, lps = plain_logprobs(engine, PROMPTS[0], 3)
        target = engine.target
        target.reset()
        target.prefill(prompt)
        for i, (tok, lp) in enumerate(zip(tokens[:8], lps)):
            row = target.logits(0, 1)[0].astype(np.float64)
            ref = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            assert lp.token == tok and abs(lp.logprob - ref[tok]) < 1e-5, i
            order = np.argsort(-ref, kind="stable")[:3]
            assert [t for t, _ in lp.top] == order.tolist(), i
            assert all(abs(v - ref[t]) < 1e-5 for t, v in lp.top), i
            target.decode([tok])


CHANGED = [  # requests whose rows the device changes in place before it chooses
    ("bias-penalties", {}, SamplingParams(logit_bias={13: 2.5, 198: -math.inf}, repeat_penalty=1.3,
                                          presence_penalty=0.4, repeat_last_n=16)),
    ("bias-tree", {"tree_budget": 12}, SamplingParams(logit_bias={13: 2.5, 30: -1.0}, frequency_penalty=0.3)),
    ("grammar-sampled", {}, SamplingParams(temperature=0.7, seed=5,
                                           constraint=Constraint.gbnf('root ::= [a-z_ ():.,\\n]+'))),
]


@pytest.mark.parametrize("options, sampling", [c[1:] for c in CHANGED], ids=[c[0] for c in CHANGED])
def test_logprobs_are_the_models_own_whatever_the_sampling_changes(options, sampling):
    """logprobs are over the model's own logits, as llama-server's are: the request's bias,
    penalties and grammar change which token its rows choose, not the log-probabilities
    reported. Each entry against the log-softmax of a plain one-row decode of the same
    context on a fresh target, whole top list and every float equal."""
    with Engine(TARGET, DRAFT, n_threads=2, **options) as engine:
        context = engine.encode(PROMPTS[0])
        res = engine.generate(context, 24, stop_tokens=(), sampling=sampling, logprobs=4)
        assert len(res.stats.logprobs) == len(res.tokens) > 0
        assert max(res.stats.accepted_lengths) > 1
    with Engine(TARGET, n_threads=2) as fresh:
        target = fresh.target
        target.prefill(context)
        for i, (tok, got) in enumerate(zip(res.tokens, res.stats.logprobs)):
            assert got == row_logprobs(target.logits(0, 1)[0], tok, 4), i
            target.decode([tok])


def test_row_logprobs_orders_ties_by_token_and_maps_a_cut_head():
    row = np.array([1.0, 3.0, 3.0, 2.0, 3.0, 0.5], dtype=np.float32)
    lp = row_logprobs(row, 3, 2)
    assert [t for t, _ in lp.top] == [1, 2]
    assert lp.top[0][1] == lp.top[1][1] and lp.logprob < lp.top[0][1]
    ref = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    assert abs(lp.logprob - ref[3]) < 1e-6
    head = np.array([10, 11, 12, 13, 14, 15], dtype=np.int32)
    cut = row_logprobs(row, 13, 1, head)
    assert cut == TokenLogprob(13, lp.logprob, ((11, lp.top[0][1]),))
    assert row_logprobs(row, 3, 0).top == ()


SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11, repeat_penalty=1.1,
                         repeat_last_n=16, logit_bias={13: 1.5, 198: -2.0})


@pytest.mark.parametrize("options", [{}, {"tree_budget": 12}], ids=["chain", "tree"])
def test_post_sampling_probs_are_plain_decodings_and_llama_cpps(options):
    """post_sampling: each token's probability after the sampler's rules at its row (bias,
    penalties over its window, top-k, top-p, min-p, temperature). Greedy with the bias and
    penalties, speculation's equal plain decoding's, float for float. Sampled, a
    speculative run draws other tokens than a plain one (the same distribution, not the
    same draws), so its tokens are replayed as one-row decodes on a fresh target: each
    entry is what llama.cpp's sampler chain gives the replayed row (float32 there: to 1e-5)."""
    llama_cpp_oracle()
    k = 8
    greedy = replace(SAMPLED, temperature=0.0)
    with Engine(TARGET, DRAFT, n_threads=2, **options) as engine:
        runs = []
        for prompt in PROMPTS[:2]:
            plain, spec = (engine.generate(prompt, 24, stop_tokens=(), speculative=speculative, sampling=greedy,
                                           logprobs=k, post_sampling=True) for speculative in (False, True))
            assert spec.tokens == plain.tokens and spec.stats.logprobs == plain.stats.logprobs
            assert all(p == TokenProb(t, 1.0, ((t, 1.0),)) for p, t in zip(spec.stats.logprobs, spec.tokens))
            res = engine.generate(prompt, 24, stop_tokens=(), sampling=SAMPLED, logprobs=k, post_sampling=True)
            assert max(res.stats.accepted_lengths) > 1
            runs.append((engine.encode(prompt), res))
    with Engine(TARGET, n_threads=2) as fresh:
        target = fresh.target
        for context, res in runs:
            target.reset()
            target.prefill(context)
            for i, (tok, got) in enumerate(zip(res.tokens, res.stats.logprobs)):
                row = target.logits(0, 1)[0].astype(np.float64)
                for t, b in SAMPLED.logit_bias:
                    row[t] += b
                want = llama_cpp_distribution(row, SAMPLED, context[-SAMPLED.repeat_last_n:])
                assert got.token == tok and abs(got.prob - want[tok]) < 1e-5, i
                kept = [t for t in np.argsort(-want, kind="stable")[:k] if want[t] > 0]
                assert [t for t, _ in got.top] == kept, i
                assert all(abs(p - want[t]) < 1e-5 for t, p in got.top), i
                context = context + [tok]
                target.decode([tok])


def test_row_probs_of_a_greedy_row_and_a_filtered_one():
    row = np.array([1.0, 3.0, 2.5, 2.0, 0.0, -1.0])
    assert row_probs(row, 1, 3, SamplingParams()) == TokenProb(1, 1.0, ((1, 1.0),))
    top2 = row_probs(row, 2, 5, SamplingParams(temperature=1.0, top_k=2))
    e = np.exp([3.0, 2.5])
    assert [t for t, _ in top2.top] == [1, 2] and abs(top2.prob - e[1] / e.sum()) < 1e-12
    assert row_probs(row, 4, 5, SamplingParams(temperature=1.0, top_k=2)).prob == 0.0
