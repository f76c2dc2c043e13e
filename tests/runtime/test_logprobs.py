"""The target's log-probabilities at each emitted token (decoding/logprobs.py) are plain
decoding's under every kind of speculation, bit for bit on the CPU: the rows that chose
the tokens (a chain's, a tree's, the weightless kinds', a batch's) round as one-row
decodes do, and the same host arithmetic turns them into numbers. Checked against the
log-softmax of the one-row decode's whole logits row, computed independently."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf import Engine
from dflash_gguf.decoding.logprobs import TokenLogprob, row_logprobs
from dflash_gguf.decoding.requests import Request
from helpers.decoding_checks import REPEATS
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
