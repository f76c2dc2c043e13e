"""Sampling on the device: the distribution rule against llama.cpp's own sampler chain,
the rejection rule on synthetic distributions, and every decoding mode (plain, the
chain with either accept rule, the tree, auto) producing exactly the target's own
sampled distribution on the bundled demo pair, with truncation, without, with min-p and
with each penalty."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflash_gguf import DflashError
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.decoding.sampling import Sampler, SamplingParams, distribution, penalize
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

from helpers.llama_sampler import llama_cpp_distribution
from helpers.loops import greedy_generate
from helpers.loops import speculative_generate, tree_generate
from helpers.matrix import ci_subset
from helpers.paths import ROOT
from helpers.sampling_checks import DEPTH, SETTINGS, chi2_critical, chi2_stat, exact_joint, run_mode

DATA = ROOT / "dflash_gguf" / "data"


# ---- the rule, against llama.cpp's sampler chain --------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(0.6, 20, 0.95),
    SamplingParams(0.7, 20, 0.8),
    SamplingParams(1.0),
    SamplingParams(1.3, top_p=0.5),
    SamplingParams(0.8, min_p=0.1),
    SamplingParams(0.5, 7, 0.9, 0.2),
    SamplingParams(0.9, 30, presence_penalty=1.5),
    SamplingParams(1.0, frequency_penalty=0.7, repeat_last_n=16),
    SamplingParams(0.6, 20, 0.95, repeat_penalty=1.3, presence_penalty=-0.5),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}-r{p.repeat_penalty}"
                 f"-f{p.frequency_penalty}-pr{p.presence_penalty}")
def test_rule_matches_llama_cpp_sampler_chain(params):
    rng = np.random.default_rng(0)
    V = 300
    for trial in range(4):
        logits = rng.normal(0, 2.5, V) + np.where(rng.random(V) < 0.05, 6.0, 0.0)
        window = rng.integers(0, 40, size=int(rng.integers(1, 80))).tolist()  # seen tokens, repeats among them
        last = window[-params.repeat_last_n:] if params.repeat_last_n > 0 else window
        ours = distribution(penalize(logits, last, params), params)[0]
        theirs = llama_cpp_distribution(logits, params, window)
        assert np.array_equal(ours > 0, theirs > 0), (trial, np.flatnonzero(ours > 0), np.flatnonzero(theirs > 0))
        assert np.allclose(ours, theirs, atol=2e-6), (trial, np.abs(ours - theirs).max())


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
    # llama.cpp's order: top-p looks at the probabilities at temperature 1, not the tempered ones
    p = distribution(logits, SamplingParams(temperature=0.3, top_p=0.6))[0]
    assert np.count_nonzero(p) == 2
    hot = distribution(logits, SamplingParams(temperature=2.0))[0]
    assert hot[4] > 0.05 and np.isclose(hot.sum(), 1)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(min_p=1.0), dict(min_p=-0.1), dict(temperature=float("nan")),
                                 dict(repeat_penalty=0), dict(repeat_penalty=-1.0), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=-3), dict(frequency_penalty=float("inf")),
                                 dict(repeat_last_n=-2)])
def test_invalid_settings(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_rejection_rule_is_exact_on_synthetic_distributions():
    """Drafts drawn from q (top-4 candidates) kept by the rejection rule give the target's
    p (top-5 candidates, a different set) at the first position; keeping every draft
    gives q instead (the test can fail)."""
    rng = np.random.default_rng(0)
    n = 20000
    p_ids = np.array([[3, 1, 4, 0, 2]] * 3)
    p_p = rng.dirichlet(np.ones(5), size=3)
    q_ids = np.array([[1, 5, 3, 6]] * 2)
    q_p = rng.dirichlet(np.ones(4) * 0.5, size=2)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    counts, naive = {}, {}
    for _ in range(n):
        drafts = [int(q_ids[i][np.searchsorted(np.cumsum(q_p[i]), sampler.rng.random())]) for i in range(2)]
        last = int(p_ids[2][np.searchsorted(np.cumsum(p_p[2]), sampler.rng.random())])
        k, nxt = sampler.reject_accept(drafts, (q_ids, q_p), (p_ids, p_p), last)
        first = drafts[0] if k >= 1 else nxt
        counts[first] = counts.get(first, 0) + 1
        naive[drafts[0]] = naive.get(drafts[0], 0) + 1
    want = {int(t): float(p) for t, p in zip(p_ids[0], p_p[0])}
    stat, df = chi2_stat(counts, want, n)
    assert stat < chi2_critical(df), (stat, df)
    stat, df = chi2_stat(naive, want, n)
    assert stat > chi2_critical(df)


# ---- every mode against the target's own sampling, on the demo pair --------------------------

@pytest.fixture(scope="module")
def demo():
    meta = read_draft_metadata(str(DATA / "demo-draft.gguf"))
    # one thread: thousands of short runs, whose graphs are too small for a second thread to pay
    target = Target(str(DATA / "demo-target.gguf"), TargetConfig(
        n_ctx=256, n_ubatch=64, n_verify=17, kv_type="f32", feature_layers=meta["target_layers"], n_threads=1))
    draft = Draft(str(DATA / "demo-draft.gguf"), target, DraftConfig(kv_type="f32", top_k=4))
    return target, draft


@pytest.fixture(scope="module")
def demo_mtp():
    """The demo target with its own MTP layer as the drafter (three drafts a step)."""
    path = str(DATA / "demo-target.gguf")
    target = Target(path, TargetConfig(n_ctx=256, n_ubatch=64, n_verify=17, kv_type="f32", n_threads=1,
                                       feature_layers=read_draft_metadata(path)["target_layers"]))
    return target, Draft(path, target, DraftConfig(kv_type="f32", top_k=4))


@pytest.fixture(scope="module")
def prompt():
    # code the demo pair was trained on, whose continuations repeat what it has seen (so
    # that the penalties change the distribution)
    return Tokenizer(str(DATA / "demo-target.gguf")).encode("    def __init__(self, name):\n        self.name = name\n"
                                                            "        self.", add_bos=False)


@pytest.fixture(scope="module")
def exact(demo, prompt):
    """exact_joint of a setting (computed once per module: every mode compares against it)."""
    cache = {}

    def get(setting):
        if setting not in cache:
            cache[setting] = exact_joint(demo[0], prompt, SETTINGS[setting], DEPTH,
                                         floor=1e-3 if setting == "full" else 2e-4)
        return cache[setting]
    return get


SAMPLED_MODES = [
    ("qwen", "plain"), ("qwen", "chain"), ("qwen", "reject"), ("qwen", "tree"), ("qwen", "auto"),
    ("full", "plain"), ("full", "chain"), ("full", "tree"),
    ("min_p", "chain"), ("min_p", "tree"),
    ("presence", "chain"), ("frequency", "tree"), ("repeat", "plain"), ("repeat", "reject"),
    ("qwen", "mtp chain"), ("full", "mtp tree"),
]
# CI: each accept rule (chain, reject, tree), a truncating and an untruncated setting, a
# penalty, and the MTP drafter; --full every pair
CI_SAMPLED = {("qwen", "reject"), ("qwen", "tree"), ("full", "chain"), ("frequency", "tree"),
              ("repeat", "reject"), ("qwen", "mtp chain")}


@pytest.mark.parametrize("setting,mode", ci_subset(SAMPLED_MODES, lambda c: c in CI_SAMPLED,
                                                   ids=[f"{s}-{m}" for s, m in SAMPLED_MODES]))
def test_every_mode_samples_the_targets_distribution(request, prompt, exact, setting, mode):
    """Every mode's sampled continuations, the MTP drafter's (greedy drafts, kept by the
    argmax rule) too, are distributed as the target's own sampling."""
    target, draft = request.getfixturevalue("demo_mtp" if mode.startswith("mtp") else "demo")
    mode = mode.split()[-1]
    params, depth, n = SETTINGS[setting], DEPTH, 1000
    exact = exact(setting)
    counts = {}
    for seed in range(n):
        out = run_mode(target, draft, prompt, mode, replace(params, seed=seed), depth)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, df = chi2_stat(counts, exact, n)
    assert df >= 4, "too few cells for the test to say anything"
    assert stat < chi2_critical(df), (setting, mode, stat, df)


def test_a_penalty_changes_the_distribution(demo, prompt, exact):
    """The test above has power: sampling without the penalty fails it."""
    target, draft = demo
    params, depth, n = SETTINGS["presence"], DEPTH, 1000
    exact = exact("presence")
    plain = SamplingParams(params.temperature, params.top_k)
    counts = {}
    for seed in range(n):
        out = tuple(run_mode(target, draft, prompt, "chain", replace(plain, seed=seed), depth))
        counts[out] = counts.get(out, 0) + 1
    stat, df = chi2_stat(counts, exact, n)
    assert stat > chi2_critical(df)


def test_seeded_sampling_is_reproducible_and_greedy_is_unchanged(demo):
    target, draft = demo
    prompt = list(range(40, 52))
    for params in (SamplingParams(0.9, top_p=0.9, seed=7), SamplingParams(0.6, 20, 0.95, seed=3, presence_penalty=1.0)):
        a, _ = speculative_generate(target, draft, prompt, 40, sampling=params)
        b, _ = speculative_generate(target, draft, prompt, 40, sampling=params)
        c, _ = tree_generate(target, draft, prompt, 40, budget=6, sampling=params)
        d, _ = tree_generate(target, draft, prompt, 40, budget=6, sampling=params)
        assert a == b and c == d
    greedy, _ = greedy_generate(target, prompt, 40)
    zero, _ = speculative_generate(target, draft, prompt, 40, sampling=SamplingParams(temperature=0.0, seed=3))
    tree0, _ = tree_generate(target, draft, prompt, 40, budget=6, sampling=SamplingParams(temperature=0.0))
    assert greedy == zero == tree0


def test_greedy_with_penalties_equals_the_penalised_argmax(demo):
    """Greedy decoding with a penalty takes each step's argmax after the penalty, in every
    mode: the reference recomputes it from the logits."""
    target, draft = demo
    params = SamplingParams(0.0, repeat_penalty=1.3, presence_penalty=0.8, repeat_last_n=16)
    prompt = list(range(300, 312))
    plain, _ = greedy_generate(target, prompt, 24, sampling=params)
    ref = []
    for _ in range(24):
        target.reset()
        target.set_sampling(SamplingParams().native())
        target.prefill(prompt + ref, LOGITS_LAST)
        seen = (prompt + ref)[-16:]
        ref.append(int(np.argmax(penalize(target.logits(0, 1)[0], seen, params))))
    assert plain == ref
    chain, _ = speculative_generate(target, draft, prompt, 24, sampling=params)
    tree, _ = tree_generate(target, draft, prompt, 24, budget=6, sampling=params)
    assert chain == tree == ref


def test_device_and_host_choose_alike_and_only_token_ids_come_back(demo, prompt):
    """The device's draw for a row, given its uniform, is the draw the host rule makes with
    that uniform (up to rows where float rounding puts the uniform on a boundary); a
    sampled verify reads back token ids, not logits rows."""
    target, _ = demo
    params = SamplingParams(0.8, 30, 0.9, 0.02)
    target.reset()
    target.set_sampling(params.native())
    target.set_uniforms(np.zeros(1, dtype=np.float32))
    target.prefill(prompt, LOGITS_LAST)
    tokens = list(range(500, 516))
    u = np.random.default_rng(1).random(len(tokens), dtype=np.float32)
    target.set_uniforms(u)
    reads = target.info()["n_host_reads"]
    target.verify(tokens)
    got = target.choices(0, len(tokens))
    assert target.info()["n_host_reads"] == reads + 1
    p = distribution(target.logits(0, len(tokens)), params)
    want = []
    for row, ui in zip(p, u):  # the device draws over the candidates, most likely first
        order = np.argsort(-row, kind="stable")
        cum = np.cumsum(row[order])
        want.append(int(order[np.searchsorted(cum, ui * cum[-1], side="right")]))
    assert sum(g == w for g, w in zip(got.tolist(), want)) >= len(tokens) - 1, (got, want)
    toks, probs = target.candidates(0, len(tokens), 30)
    for i in range(len(tokens)):
        assert np.allclose(probs[i], p[i][toks[i]], atol=1e-5)
    target.commit(1)


def test_sampling_calls_are_checked(demo, prompt):
    target, draft = demo
    target.reset()
    target.set_sampling(SamplingParams(0.7).native())
    with pytest.raises(DflashError, match="uniform"):
        target.prefill(prompt, LOGITS_LAST)  # no uniform for the row it chooses
    with pytest.raises(DflashError, match="outside"):
        target.set_uniforms(np.array([1.0], dtype=np.float32))
    with pytest.raises(DflashError, match="twice"):
        target.set_penalties(np.array([[5, 5]], dtype=np.int32), np.array([[1, 1]], dtype=np.float32))
    with pytest.raises(DflashError, match="vocabulary"):
        target.set_penalties(np.array([[10 ** 7]], dtype=np.int32), np.array([[1]], dtype=np.float32))
    target.set_penalties(np.array([[5], [6]], dtype=np.int32), np.array([[1], [2]], dtype=np.float32))
    target.set_uniforms(np.array([0.5], dtype=np.float32))
    with pytest.raises(DflashError, match="staged for 2 rows"):
        target.prefill(prompt, LOGITS_LAST)
    bad = SamplingParams(0.7).native()
    bad.top_p = 0.0
    with pytest.raises(DflashError, match="top_p"):
        target.set_sampling(bad)
    with pytest.raises(ValueError, match="chain rule"):
        speculative_generate(target, draft, prompt, 4, sampling=SamplingParams(0.7), chain_rule="rejection")
    target.set_sampling(SamplingParams().native())
    target.reset()


def test_auto_learns_per_sampling_setting():
    """`--tree-budget auto` keeps what it learns per sampling setting: a sampled request
    does not reuse (or disturb) what greedy requests taught it, and each request starts
    from what the last one at its setting learnt."""
    from dflash_gguf.engine.engine import Engine

    key = (0.6, 20, 0.95, 0.0)
    with Engine(str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf"), tree_budget="auto", n_ctx=512,
                n_threads=1) as engine:
        prompt = "class Stack:\n    def __init__(self):\n"
        engine.generate(prompt, 24)
        assert list(engine.choice.autos) == [None]
        greedy = engine.choice.autos[None]
        first = greedy.learnt
        assert first is not None and first.steps > 0
        qwen = SamplingParams(0.6, 20, 0.95, seed=1)
        engine.generate(prompt, 24, sampling=qwen)
        sampled = engine.choice.autos[key].learnt
        engine.generate(prompt, 24, sampling=replace(qwen, seed=2))
        assert set(engine.choice.autos) == {None, key}
        assert engine.choice.autos[None] is greedy and greedy.learnt is first  # greedy's untouched
        later = engine.choice.autos[key].learnt
        assert sampled is not first and later is not sampled and later.steps > 0
        assert later.acceptance.spine is not sampled.acceptance.spine  # a copy of what the request before learnt, its own
        assert engine.choice.autos[key].cost is greedy.cost  # measured once per engine


# ---- a kept set past the ranked candidates: drawn again on the device ------------------------

def ranked_draw(row_p: np.ndarray, u: float) -> int:
    """The device's rule: the draw over the kept tokens, most likely first."""
    order = np.argsort(-row_p, kind="stable")
    cum = np.cumsum(row_p[order])
    return int(order[min(np.searchsorted(cum, u * cum[-1], side="right"), len(order) - 1)])


def test_a_kept_set_past_the_candidates_is_drawn_on_the_device(demo, prompt):
    """top_k 0 with top_p near 1 keeps more tokens than a step ranks (4 here): the step
    chooses -1 there, and the redraw ranks those rows' logits in full on the device. Its
    tokens are the draws of the host rule with the same uniforms, and only their ids are
    read back."""
    target, _ = demo
    params = SamplingParams(1.5, top_p=0.995)
    native = params.native()
    native.n_candidates = 4
    target.reset()
    target.set_sampling(native)
    target.set_uniforms(np.zeros(1, dtype=np.float32))
    target.prefill(prompt, LOGITS_LAST)
    tokens = list(range(600, 616))
    u = np.random.default_rng(2).random(len(tokens), dtype=np.float32)
    target.set_uniforms(u)
    target.verify(tokens)
    got = target.choices(0, len(tokens))
    undecided = np.flatnonzero(got < 0)
    assert len(undecided) >= 4, got  # the path under test is taken
    before = target.info()
    redrawn = target.redraw(undecided, u[undecided])
    after = target.info()
    assert after["n_host_reads"] == before["n_host_reads"] + 1
    assert after["n_host_read_bytes"] - before["n_host_read_bytes"] == 4 * len(undecided)  # token ids alone
    p = distribution(target.logits(0, len(tokens)), params)
    want = [ranked_draw(p[i], float(u[i])) for i in undecided]
    assert sum(g == w for g, w in zip(redrawn.tolist(), want)) >= len(want) - 1, (redrawn, want)
    assert target.choices(0, len(tokens)).tolist() == got.tolist()  # the step's results stay readable
    target.commit(1)


def test_redraw_at_a_large_vocabulary_reads_only_ids(tmp_path):
    """At Qwen3.5's 248,320-token vocabulary, a nearly flat distribution (a random small
    target at temperature 4) keeps tens of thousands of tokens under top_p 0.9: every row
    is drawn again on the device, and the host reads 4 bytes a row."""
    from dflash_gguf.convert.shape_model import write_model
    from dflash_gguf.convert.shapes import CONFIGS, shrunk

    small = dict(hidden=64, heads=2, kv_heads=1, head_dim=32, rot=8, sections=[2, 1, 1, 0], lin_k_heads=1,
                 lin_v_heads=2, lin_dim=32, ffn=128)
    path = write_model(shrunk(CONFIGS["qwen35-27b"], 4, **small), "f16", tmp_path / "v248k.gguf", progress=False)
    params = SamplingParams(4.0, top_p=0.9)
    with Target(str(path), TargetConfig(n_ctx=64, n_ubatch=16, n_verify=8, n_threads=1)) as target:
        assert target.n_vocab == 248320
        target.set_sampling(params.native())
        target.set_uniforms(np.zeros(1, dtype=np.float32))
        target.prefill([1, 2, 3, 4], LOGITS_LAST)
        tokens = list(range(1000, 1008))
        u = np.random.default_rng(3).random(len(tokens), dtype=np.float32)
        target.set_uniforms(u)
        target.verify(tokens)
        before = target.info()
        sampler = Sampler(params)
        sampler._u = u
        got = sampler.choices(target, 0, len(tokens))
        after = target.info()
        assert after["n_host_read_bytes"] - before["n_host_read_bytes"] == 2 * 4 * len(tokens)  # choices, redraw
        assert ((got >= 0) & (got < target.n_vocab)).all()
        p = distribution(target.logits(0, len(tokens)), params)
        assert (np.count_nonzero(p, axis=1) > 10000).all()  # the kept sets are far past any ranked candidates
        for i, g in enumerate(got.tolist()):
            # f32 sums over 10^5 nearly equal probabilities part from numpy's by a few
            # tokens' worth: the draw lands where the uniform says, within a 1% band
            order = np.argsort(-p[i], kind="stable")
            rank = int(np.flatnonzero(order == g)[0])
            kept = np.count_nonzero(p[i])
            want = int(np.searchsorted(np.cumsum(p[i][order]), u[i], side="right"))
            assert p[i][g] > 0 and abs(rank - want) <= 0.01 * kept, (i, rank, want, kept)
