"""Sampling against oracles nobody here wrote, where the claims are:

- the probabilities our rule (sampling.distribution, and the device's ranked candidates)
  gives every row of a full verified block equal those llama.cpp's own sampler chain
  gives the same real logits (the demo target's; the real Qwen2.5-Coder 1.5B's);
- the chain's sampled output is distributed as the target's own sampling at every
  position of a full block (a randomized probability integral transform per position,
  against the target's distribution given the emitted prefix), and the test has power:
  accept rules off by a small, stated amount fail it at the same sample size.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.decoding.sampling import Sampler, SamplingParams, distribution, draw
from dflash_gguf.runtime.target import LOGITS_ALL, LOGITS_LAST, Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

from helpers.llama_sampler import llama_cpp_oracle, llama_cpp_distribution
from helpers.loops import speculative_generate
from helpers.matrix import ci_subset
from helpers.paths import ROOT
from helpers.sampling_checks import chi2_critical

DATA = ROOT / "dflash_gguf" / "data"
BLOCK = 8  # a full block: the demo drafter's trained block size, the bonus row included
CODE = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
        "        self.items.append(item)\n")

# the settings of the issue: Qwen's recommended, plain temperature 1, min-p
SETTINGS = {"qwen": SamplingParams(0.6, 20, 0.95), "plain": SamplingParams(1.0),
            "min_p": SamplingParams(1.0, min_p=0.05)}


@pytest.fixture(scope="module")
def llama_cpp():
    return llama_cpp_oracle()


# ---- the rule on real logits, every row of a full block --------------------------------------

def block_rows(path: str, params: SamplingParams, n_threads: int = 2):
    """Prefill CODE's first tokens and verify the next BLOCK as one block, sampling with
    `params` on the device: the block's logits rows, and the device's ranked candidates
    (tokens, probabilities; top_k of them) where params has a top-k."""
    tokens = Tokenizer(path).encode(CODE, add_bos=False)
    assert len(tokens) > 12 + BLOCK
    with Target(path, TargetConfig(n_ctx=256, n_ubatch=64, n_verify=BLOCK, n_threads=n_threads)) as target:
        target.set_sampling(params.native())
        target.set_uniforms(np.full(1, 0.5, dtype=np.float32))
        target.prefill(tokens[:12], LOGITS_LAST)
        target.set_uniforms(np.random.default_rng(0).random(BLOCK, dtype=np.float32))
        target.verify(tokens[12:12 + BLOCK])
        rows = target.logits(0, BLOCK)
        cands = target.candidates(0, BLOCK, params.top_k) if params.top_k > 0 else None
    return rows, cands


def float32_tolerance(row: np.ndarray, params: SamplingParams, p: np.ndarray) -> np.ndarray:
    """How far llama.cpp's float32 probabilities may lie from our float64 ones: it rounds
    each logit / T (relative 2^-24), subtracts the largest and takes expf (a few ulp), so
    an exponent is off by at most (2 * spread / T + 4) * 2^-24, spread the kept logits'
    range; a probability, the ratio of one such term to their sum, by twice that,
    relative; the float32 sum of the n kept terms rounds at each addition (n * 2^-24,
    which the order of a vectorised sum moves: an AVX2 build exceeded the bound without
    it by 1%); the stored float32 p rounds once more."""
    kept = row[p > 0].astype(np.float64)
    rel = (2 * (2 * np.ptp(kept) / params.temperature + 4) + len(kept) + 1) * 2.0 ** -24
    return rel * p + 1e-12


def check_rows_against_llama_cpp(rows, cands, params):
    choosing = 0  # rows that keep more than one token
    for i, row in enumerate(rows):
        ours = distribution(row, params)[0]
        theirs = llama_cpp_distribution(row, params)
        assert np.array_equal(ours > 0, theirs > 0), (i, np.flatnonzero(ours > 0)[:20], np.flatnonzero(theirs > 0)[:20])
        choosing += np.count_nonzero(ours) >= 2
        err = np.abs(ours - theirs)
        tol = float32_tolerance(row, params, ours)
        assert (err <= tol).all(), (i, err.max(), tol[np.argmax(err - tol)])
        if cands is not None:  # the device's draw: its candidates, most likely first, at llama.cpp's p
            toks, probs = cands
            kept = probs[i] > 0
            assert set(toks[i][kept].tolist()) == set(np.flatnonzero(theirs > 0).tolist()), i
            # the device computes in float32 as llama.cpp does, its sums in another order
            np.testing.assert_allclose(probs[i][kept], theirs[toks[i][kept]], rtol=1e-4, atol=1e-7)
    assert choosing >= 2, choosing  # (code is predictable: a confident row keeps one token under min-p)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_demo_block_rows_match_llama_cpp_sampler_chain(llama_cpp, setting):
    params = SETTINGS[setting]
    rows, cands = block_rows(str(DATA / "demo-target.gguf"), params)
    check_rows_against_llama_cpp(rows, cands, params)


@pytest.fixture(scope="module")
def qwen_rows(real_path):
    """The real 1.5B's block rows, read once (the logits do not depend on the setting;
    the candidates are read with the Qwen setting's top-k)."""
    return block_rows(str(real_path("qwen2.5-coder-1.5b")), SETTINGS["qwen"])


@pytest.mark.real
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_real_qwen_block_rows_match_llama_cpp_sampler_chain(llama_cpp, qwen_rows, setting):
    rows, cands = qwen_rows
    assert rows.shape == (BLOCK, 151936)
    check_rows_against_llama_cpp(rows, cands if setting == "qwen" else None, SETTINGS[setting])


# ---- every position of a full block, against the target's own sampling ----------------------

@pytest.fixture(scope="module")
def demo():
    meta = read_draft_metadata(str(DATA / "demo-draft.gguf"))
    assert meta["block_size"] == BLOCK
    # one thread: thousands of short runs, whose graphs are too small for a second thread to pay
    target = Target(str(DATA / "demo-target.gguf"), TargetConfig(
        n_ctx=256, n_ubatch=64, n_verify=BLOCK, kv_type="f32", feature_layers=meta["target_layers"], n_threads=1))
    draft = Draft(str(DATA / "demo-draft.gguf"), target, DraftConfig(kv_type="f32", top_k=20))
    yield target, draft
    draft.close()
    target.close()


# code the demo pair knows well (its drafts are kept often enough to fill whole blocks)
PROMPT = "    def __init__(self, name):\n        self.name = name\n        self."
N_SAMPLES = 400
N_TOKENS = 1 + 3 * BLOCK
PIT_BINS = 10


def sample_passes(target, draft, prompt, params, rule, n=N_SAMPLES):
    """n seeded chain generations of N_TOKENS: each output, and for each of its tokens
    the chain position that emitted it (0: the prefill's token; k: row k of a pass's
    block, its k-1 drafts before it kept), None for a pass cut by the token budget."""
    outs, where = [], []
    for seed in range(n):
        out, stats = speculative_generate(target, draft, prompt, N_TOKENS, sampling=replace(params, seed=seed),
                                          chain_rule=rule)
        pos = [0]
        for length in stats.accepted_lengths:
            pos += list(range(1, length + 1)) if len(pos) + length <= len(out) else [None] * length
        outs.append(tuple(out))
        where.append(pos[:len(out)])
    return outs, where


def conditionals(target, prompt, outs, params):
    """The target's own sampling distribution at each output position given the prefix
    emitted before it: {path: [len(path), V]}, row j after prompt + path[:j] (one prefill
    of the whole path, its logits at every row, per distinct path)."""
    from dflash_gguf.decoding.sampling import GREEDY

    out = {}
    for path in set(outs):
        target.reset()
        target.set_sampling(GREEDY.native())
        target.prefill(prompt + list(path), LOGITS_ALL)
        n = len(prompt) + len(path)
        out[path] = distribution(target.logits(len(prompt) - 1, len(path)), params)
        assert n <= target.config.n_ubatch  # one chunk: its rows are the path's and the prompt's
    target.reset()
    return out


def pit_stats(outs, where, exact):
    """Per chain position (0..BLOCK), then over all of them: the chi-square statistic
    (PIT_BINS - 1 degrees of freedom) of the randomized probability integral transform
    of each token emitted there under the target's distribution given its prefix, tokens
    ranked most likely first. With u = F(before t) + v * p(t), v uniform, u is exactly
    uniform when t is drawn from p, whatever p is, so every token counts however the
    prefixes spread. Whether row k is reached is decided by the rows before it, so the
    tokens it emits are draws from the target's conditional too."""
    rng = np.random.default_rng(12345)
    us = [[] for _ in range(BLOCK + 1)]
    for path, pos in zip(outs, where):
        for j, k in enumerate(pos):
            if k is None:
                continue
            p = exact[path][j]
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            rank = int(np.flatnonzero(order == path[j])[0])
            us[k].append(cum[rank] - p[path[j]] * (1 - rng.random()))
    stats = []
    for u in us + [sum(us, [])]:
        counts = np.bincount(np.minimum((np.array(u) * PIT_BINS).astype(int), PIT_BINS - 1), minlength=PIT_BINS)
        e = len(u) / PIT_BINS
        stats.append(float(((counts - e) ** 2 / e).sum()))
    return stats, [len(u) for u in us]


CRITICAL = chi2_critical(PIT_BINS - 1)


@pytest.fixture(scope="module")
def prompt_tokens():
    return Tokenizer(str(DATA / "demo-target.gguf")).encode(PROMPT, add_bos=False)


@pytest.mark.parametrize("rule", ["reject", "argmax"])
def test_every_block_position_samples_the_targets_distribution(demo, prompt_tokens, rule):
    """The token every row of a full block emits (row k: the k-1 drafts before it kept,
    then this row's draft kept or its rejection's draw, or the bonus) is distributed as
    the target's own sampling given the prefix emitted before it, rows 1-8 alike (and
    the prefill's token); every row emits often enough for the test to have power."""
    target, draft = demo
    params = SETTINGS["qwen"]
    outs, where = sample_passes(target, draft, prompt_tokens, params, rule)
    stats, reached = pit_stats(outs, where, conditionals(target, prompt_tokens, outs, params))
    assert min(reached) >= 80, reached  # every row of the block, the last one included, emits often
    assert max(stats) < CRITICAL, (stats, CRITICAL)


# ---- power: a slightly wrong accept rule fails the test above --------------------------------

def wrong_reject_accept(factor: float = 1.0, clip: bool = True):
    """Sampler.reject_accept made wrong by a stated amount: keep a draft with probability
    min(1, factor * p / q) instead of min(1, p / q); with clip False, draw a rejected
    position's token from p - q without its max(0, .) (tokens the drafter over-proposes
    carry negative weight, which the inverse-CDF draw mishandles)."""
    def reject_accept(self, drafts, q, p, last):
        (q_ids, q_p), (p_ids, p_p) = q, p
        for i, tok in enumerate(drafts):
            pi = float(p_p[i][p_ids[i] == tok].sum())
            qi = float(q_p[i][q_ids[i] == tok].sum())
            if qi > 0 and self.rng.random() * qi < factor * pi:
                continue
            residual = p_p[i] - (p_ids[i][:, None] == q_ids[i][None, :]) @ q_p[i]
            if clip:
                residual = np.maximum(residual, 0.0)
            weights = residual if residual.sum() > 0 else p_p[i]
            return i, int(p_ids[i][draw(weights, self.rng.random())])
        return len(drafts), int(last)
    return reject_accept


def test_the_tests_copy_of_the_rule_is_the_rule(demo, prompt_tokens, monkeypatch):
    """Unchanged (factor 1, clipped), the copy below draws what Sampler.reject_accept
    does, seed for seed: what fails the test below is the change alone."""
    target, draft = demo
    params = SETTINGS["qwen"]
    runs = [speculative_generate(target, draft, prompt_tokens, N_TOKENS, sampling=replace(params, seed=s),
                                 chain_rule="reject")[0] for s in range(20)]
    monkeypatch.setattr(Sampler, "reject_accept", wrong_reject_accept())
    assert runs == [speculative_generate(target, draft, prompt_tokens, N_TOKENS, sampling=replace(params, seed=s),
                                         chain_rule="reject")[0] for s in range(20)]


# CI keeps the subtler change (its statistic nearer the threshold); the unclipped residual,
# which fails it by more, only under --full (each case is 400 seeded generations: the
# figures below do not move unless the pair, the rule or this test does)
@pytest.mark.parametrize("factor,clip", ci_subset([(1.1, True), (1.0, False)], lambda c: c[1],
                                                  ids=["accept 1.1 p over q", "residual without max(0, .)"]))
def test_a_slightly_wrong_accept_rule_fails_the_block_test(demo, prompt_tokens, monkeypatch, factor, clip):
    """The block test's power: each change of the rule fails it at the same sample size
    and threshold (measured: the statistic over all rows 42 for 1.1 p / q, 63 for the
    unclipped residual, against 28.1; 27 for 1.05 p / q, below it; the right rule's
    largest of the ten statistics 22)."""
    target, draft = demo
    params = SETTINGS["qwen"]
    monkeypatch.setattr(Sampler, "reject_accept", wrong_reject_accept(factor, clip))
    outs, where = sample_passes(target, draft, prompt_tokens, params, "reject")
    stats, _ = pit_stats(outs, where, conditionals(target, prompt_tokens, outs, params))
    assert max(stats) > CRITICAL, (stats, CRITICAL)
