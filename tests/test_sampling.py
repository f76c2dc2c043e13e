"""Sampling: the target distribution's filters, and speculative sampling (chain
rejection sampling, tree walks) producing exactly the target's distribution."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from test_speculative import pair  # noqa: F401 (fixture)

from dflash_gguf.draft import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.generate import greedy_generate
from dflash_gguf.sampling import Sampler, SamplingParams, distribution
from dflash_gguf.speculative import speculative_generate, tree_generate
from dflash_gguf.target import LOGITS_LAST, Target, TargetConfig


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: dict, probs: dict, n: int):
    """Chi-square statistic and degrees of freedom, cells with expected < 5 pooled."""
    cells = sorted(probs, key=lambda c: -probs[c])
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for c in cells:
        e = probs[c] * n
        if e >= 5:
            obs.append(counts.get(c, 0))
            exp.append(e)
        else:
            pool_o += counts.get(c, 0)
            pool_e += e
    unexpected = sum(v for c, v in counts.items() if c not in probs)
    pool_o += unexpected
    if pool_e > 0 or pool_o > 0:
        obs.append(pool_o)
        exp.append(max(pool_e, 1e-9))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(obs) - 1


# ---- the distribution ----------------------------------------------------------------

def test_distribution_filters():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = distribution(logits, SamplingParams(temperature=1.0))[0]
    assert np.allclose(p, [0.5, 0.2, 0.15, 0.1, 0.05])
    p = distribution(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert np.allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    p = distribution(logits, SamplingParams(temperature=1.0, top_p=0.8))[0]  # 0.5+0.2 < 0.8: keep three
    assert np.allclose(p, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = distribution(logits, SamplingParams(temperature=1.0, min_p=0.3))[0]  # >= 0.15
    assert np.allclose(p, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    hot = distribution(logits, SamplingParams(temperature=2.0))[0]
    assert hot[4] > 0.05 and np.isclose(hot.sum(), 1)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(min_p=1.0), dict(min_p=-0.1)])
def test_invalid_settings(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_chain_rejection_sampling_is_exact_on_synthetic_distributions():
    rng = np.random.default_rng(0)
    V, n = 5, 20000
    p = rng.dirichlet(np.ones(V), size=3)
    q = rng.dirichlet(np.ones(V) * 0.5, size=2)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    counts = {}
    for _ in range(n):
        drafts = [sampler.draw(q[0]), sampler.draw(q[1])]
        k, nxt = sampler.chain_accept(drafts, q, p)
        first = drafts[0] if k >= 1 else nxt
        counts[first] = counts.get(first, 0) + 1
    stat, df = chi2_stat(counts, {t: p[0][t] for t in range(V)}, n)
    assert stat < chi2_critical(df), (stat, df)

    # the test has power: keeping every draft gives the drafter's distribution instead
    naive = {}
    for _ in range(n):
        first = sampler.draw(q[0])
        naive[first] = naive.get(first, 0) + 1
    stat, df = chi2_stat(naive, {t: p[0][t] for t in range(V)}, n)
    assert stat > chi2_critical(df)


# ---- end to end on a tiny model ---------------------------------------------------------

PARAMS = dict(temperature=1.3, top_k=3)


def exact_joint(target, prompt, params, depth):
    """P(t1..t_depth) of plain sampling from the target, by enumeration."""
    probs = {}

    def rec(prefix, prob):
        if len(prefix) == depth:
            probs[tuple(prefix)] = prob
            return
        target.reset()
        target.prefill(prompt + prefix, LOGITS_LAST)
        p = distribution(target.logits(0, 1), params)[0]
        for tok in np.flatnonzero(p > 0):
            rec(prefix + [int(tok)], prob * p[tok])

    rec([], 1.0)
    return probs


@pytest.fixture(scope="module")
def sampling_pair(pair):
    meta = read_draft_metadata(pair["draft"])
    target = Target(pair["target"], TargetConfig(n_ctx=128, n_ubatch=32, n_verify=8, kv_type="f32",
                                                 feature_layers=meta["target_layers"]))
    draft = Draft(pair["draft"], target, DraftConfig(kv_type="f32", top_k=3))
    return target, draft


@pytest.mark.parametrize("mode", ["plain", "chain", "tree"])
def test_speculative_sampling_matches_target_distribution(sampling_pair, mode):
    target, draft = sampling_pair
    prompt = [101, 202, 303, 404, 505, 606]
    depth, n = 3, 1500
    exact = exact_joint(target, prompt, SamplingParams(**PARAMS), depth)
    counts = {}
    for seed in range(n):
        params = SamplingParams(**PARAMS, seed=seed)
        if mode == "plain":
            out, _ = greedy_generate(target, prompt, depth, sampling=params)
        elif mode == "chain":
            out, _ = speculative_generate(target, draft, prompt, depth, sampling=params)
        else:
            out, _ = tree_generate(target, draft, prompt, depth, budget=6, sampling=params)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, df = chi2_stat(counts, exact, n)
    assert stat < chi2_critical(df), (mode, stat, df)


def test_seeded_sampling_is_reproducible_and_greedy_is_unchanged(sampling_pair):
    target, draft = sampling_pair
    prompt = list(range(40, 52))
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    a, _ = speculative_generate(target, draft, prompt, 40, sampling=params)
    b, _ = speculative_generate(target, draft, prompt, 40, sampling=params)
    assert a == b
    greedy, _ = greedy_generate(target, prompt, 40)
    zero, _ = speculative_generate(target, draft, prompt, 40, sampling=SamplingParams(temperature=0.0, seed=3))
    tree0, _ = tree_generate(target, draft, prompt, 40, budget=6, sampling=SamplingParams(temperature=0.0))
    assert greedy == zero == tree0
