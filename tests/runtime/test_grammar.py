"""Structured output: the allowed-token mask on the device (dfl_target_set_masks), and
constrained decoding in every mode against llama.cpp's own grammar sampler
(llama-cpp-python's LlamaGrammar at temperature 0, on the same GGUF), the target's
constrained distribution when sampling, and a batch mixing constrained and free requests."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf import DflashError
from dflash_gguf.decoding.constraints import Constraint, GrammarVocab
from dflash_gguf.speculation.ddtree import build_tree
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.requests import Request
from dflash_gguf.decoding.sampling import SamplingParams, distribution, draw
from dflash_gguf.runtime.target import CHAIN, LOGITS_LAST, Rows, Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

from helpers.fixtures import missing_oracle
from helpers.grammar_cases import KEYS, NUMBERS, PROMPTS, grammars
from helpers.paths import ROOT
from helpers.sampling_checks import chi2_critical, chi2_stat

DATA = ROOT / "dflash_gguf" / "data"
TARGET, DRAFT = str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf")


@pytest.fixture(scope="module")
def engines():
    chain = Engine(TARGET, DRAFT, n_ctx=512, n_threads=2)
    tree = Engine(TARGET, DRAFT, n_ctx=512, n_threads=2, tree_budget=8)
    yield {"chain": chain, "tree": tree}
    chain.close()
    tree.close()


@pytest.fixture(scope="module")
def llama():
    try:
        from llama_cpp import Llama
    except ImportError:
        missing_oracle("llama-cpp-python")
    return Llama(TARGET, n_ctx=512, verbose=False, seed=0)


@pytest.fixture(scope="module")
def target():
    t = Target(TARGET, TargetConfig(n_ctx=256, n_threads=2, kv_type="f32"))
    yield t
    t.close()


def words_of(allowed: np.ndarray) -> np.ndarray:
    """A bitmask [rows, ceil(V/32)] of boolean rows [rows, V] (bit t % 32 of word t / 32)."""
    rows, v = allowed.shape
    padded = np.zeros((rows, -(-v // 32) * 32), dtype=bool)
    padded[:, :v] = allowed
    return np.packbits(padded.reshape(rows, -1, 32)[:, :, ::-1], axis=2).view(">u4").astype(np.uint32)[..., 0]


# ---- the mask on the device ---------------------------------------------------------------

def test_masked_rows_choose_among_allowed_tokens_greedy_and_sampled(target):
    tokens = Tokenizer(TARGET).encode(PROMPTS[1])
    rng = np.random.default_rng(0)
    target.reset()
    target.decode(tokens, LOGITS_LAST)
    free = target.logits(0, 1)[0].copy()
    allowed = rng.random((1, target.n_vocab)) < 0.1
    allowed[0, int(np.argmax(free))] = False  # the free argmax is not allowed
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, top_k=40 if temperature else 0, seed=1)
        target.reset()
        target.set_sampling(params.native())
        if temperature:
            target.set_uniforms(np.array([0.3], dtype=np.float32))
        target.set_masks(words_of(allowed))
        target.decode(tokens, LOGITS_LAST)
        masked = target.logits(0, 1)[0]
        choice = int(target.choices(0, 1)[0])
        assert allowed[0, choice]
        if temperature:
            # the row draws from its masked distribution; its logits are masked in place, or
            # left as they are where the mask was looked up at its largest logits
            np.testing.assert_array_equal(masked[allowed[0]], free[allowed[0]])
            assert np.all(np.isneginf(masked[~allowed[0]])) or np.array_equal(masked, free)
            p = distribution(np.where(allowed[0], free, -np.inf), params)[0]
            ranked = np.argsort(-p, kind="stable")  # the device draws in the order of likelihood
            assert choice == ranked[draw(p[ranked], 0.3)]
        else:  # a greedy step looks its masks up where it chooses, the logits left as they are
            np.testing.assert_array_equal(masked, free)
            assert choice == int(np.argmax(np.where(allowed[0], free, -np.inf)))
    # a step without masks runs none: the next decode's logits are the free ones again
    target.reset()
    target.set_sampling(SamplingParams().native())
    target.decode(tokens, LOGITS_LAST)
    np.testing.assert_array_equal(target.logits(0, 1)[0], free)


def test_mask_calls_are_checked(target):
    words = (target.n_vocab + 31) // 32
    with pytest.raises(DflashError, match="words"):
        target.set_masks(np.full((1, words + 1), 0xFFFFFFFF, dtype=np.uint32))
    with pytest.raises(DflashError, match="allows no token"):
        target.set_masks(np.zeros((1, words), dtype=np.uint32))
    target.reset()
    target.set_masks(np.full((2, words), 0xFFFFFFFF, dtype=np.uint32))
    with pytest.raises(DflashError, match="staged for 2 rows"):
        target.decode(Tokenizer(TARGET).encode("x = 1"), LOGITS_LAST)
    target.reset()


SAMPLED = SamplingParams(temperature=1.0, top_k=40, seed=1)


def _masked_verify(target, prompt, drafts, allowed=None, params=SamplingParams()):
    """Logits, choices and host bytes written of one verify of `drafts` after `prompt`,
    greedy or by `params` (each row's uniform 0.5), under the rows' allowed tokens (boolean
    [rows, V]) when given."""
    target.reset()
    target.set_sampling(SamplingParams().native())
    target.decode(prompt, LOGITS_LAST)
    target.set_sampling(params.native())
    if params.temperature:
        target.set_uniforms(np.full(len(drafts), 0.5, dtype=np.float32))
    if allowed is not None:
        target.set_masks(words_of(allowed))
    before = target.info()["n_host_write_bytes"]
    target.verify(drafts)
    wrote = target.info()["n_host_write_bytes"] - before
    n = len(drafts)
    return target.logits(0, n), target.choices(0, n), wrote


def _drafts(text, n):
    """n draft tokens: the text's first, its last repeated where it has fewer."""
    tokens = Tokenizer(TARGET).encode(text)[:n]
    return tokens + [tokens[-1]] * (n - len(tokens))


def _allowing(rng, n_vocab, rows, free=None):
    """Boolean [len(rows), V]: per row ("keep", k) allows k random tokens, ("ban", k)
    all but k (the free argmax among them), ("all",) every token, ("half",) each token by a
    coin, ("miss", k) all but the row's k largest free logits."""
    out = np.ones((len(rows), n_vocab), dtype=bool)
    for r, (kind, *k) in enumerate(rows):
        if kind == "miss":
            out[r, np.argsort(free[r])[-k[0]:]] = False
        elif kind == "keep":
            out[r] = False
            out[r, rng.choice(n_vocab, k[0], replace=False)] = True
        elif kind == "ban":
            out[r, rng.choice(n_vocab, k[0], replace=False)] = False
            if free is not None:
                out[r, int(np.argmax(free[r]))] = False
        elif kind == "half":
            out[r] = rng.random(n_vocab) < 0.5
    return out


MASK_SHAPES = {
    "few allowed (kept lists)": [("keep", 3), ("keep", 40), ("keep", 1), ("keep", 17)],
    "few disallowed (banned lists)": [("ban", 5), ("ban", 60), ("all",), ("ban", 1)],
    "both kinds of row": [("keep", 9), ("ban", 30), ("keep", 2), ("all",)],
    "dense (both lists long)": [("half",), ("half",), ("keep", 7), ("half",)],
    "no candidate allowed (decided again)": [("miss", 40), ("half",), ("miss", 600), ("keep", 3)],
}


@pytest.mark.parametrize("shape", list(MASK_SHAPES))
def test_each_mask_path_is_exact(target, shape):
    """Greedy: the choice is the masked argmax, from the rows' largest logits or their
    allowed lists, or decided again over the whole row where a row allows none of its
    largest (the logits read back are the free ones). Sampled: the masked logits read back
    are the free ones where allowed and exactly -inf elsewhere, whichever way the rows'
    masks are applied: short exception lists upload only their entries (fewer bytes than
    the dense path, which uploads a byte index of the masks)."""
    prompt = Tokenizer(TARGET).encode(PROMPTS[0])
    drafts = _drafts(" return n", 4)
    free, _, _ = _masked_verify(target, prompt, drafts)
    rng = np.random.default_rng(7)
    allowed = _allowing(rng, target.n_vocab, MASK_SHAPES[shape], free)
    logits, choices, _ = _masked_verify(target, prompt, drafts, allowed)
    np.testing.assert_array_equal(logits, free)
    np.testing.assert_array_equal(choices, np.argmax(np.where(allowed, free, -np.inf), axis=1))
    masked, choices, wrote = _masked_verify(target, prompt, drafts, allowed, SAMPLED)
    np.testing.assert_array_equal(masked[allowed], free[allowed])
    assert np.all(np.isneginf(masked[~allowed]))
    assert all(allowed[r, c] for r, c in enumerate(choices))
    dense = _allowing(rng, target.n_vocab, MASK_SHAPES["dense (both lists long)"])
    dense_wrote = _masked_verify(target, prompt, drafts, dense, SAMPLED)[2]
    assert dense_wrote >= len(drafts) * target.n_vocab // 2  # the byte index, 4 bytes per 8 tokens
    if not shape.startswith(("dense", "no candidate")):
        assert wrote < dense_wrote


def test_sparse_masks_reuse_a_graph_and_hold_when_sampling(target):
    """Another mask with as many exceptions reuses the step's graph (its lists are padded to
    a bucket); sampled rows (top-k) choose allowed tokens only."""
    prompt = Tokenizer(TARGET).encode(PROMPTS[2])
    drafts = _drafts("import sys", 3)
    rng = np.random.default_rng(3)
    _masked_verify(target, prompt, drafts, _allowing(rng, target.n_vocab, [("ban", 20), ("keep", 5), ("ban", 9)]))
    builds = target.info()["n_graph_builds"]
    _masked_verify(target, prompt, drafts, _allowing(rng, target.n_vocab, [("ban", 21), ("keep", 4), ("ban", 8)]))
    assert target.info()["n_graph_builds"] == builds
    allowed = _allowing(rng, target.n_vocab, [("keep", 6), ("ban", 2), ("keep", 30)])
    for u in (0.05, 0.5, 0.95):
        target.reset()
        target.set_sampling(SamplingParams().native())
        target.decode(prompt, LOGITS_LAST)
        target.set_sampling(SamplingParams(temperature=1.0, top_k=40, seed=1).native())
        target.set_uniforms(np.full(len(drafts), u, dtype=np.float32))
        target.set_masks(words_of(allowed))
        target.verify(drafts)
        choices = target.choices(0, len(drafts))
        assert all(allowed[r, c] for r, c in enumerate(choices))


# ---- sampled rows by candidates -------------------------------------------------------------

RANKED = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=1, repeat_penalty=1.5, frequency_penalty=0.3)
RANKED_SHAPES = {
    "many allowed among the largest logits": [("half",), ("half",), ("half",)],
    # all but a row's 300 (250) largest allowed: none of its 80 candidates (4 x top_k), fewer than top_k
    "few allowed among the largest logits (sampled again)": [("miss", 300), ("half",), ("miss", 250)],
}


def _ranked_verify(target, prompt, drafts, allowed, penalties, u):
    """Logits, choices and candidates (tokens, probabilities) of one verify of `drafts`
    sampled by RANKED under the rows' allowed tokens, with their penalty entries (tokens,
    counts) and uniforms u; the candidates read first (they decide the step as the choices
    do)."""
    target.reset()
    target.set_sampling(SamplingParams().native())
    target.decode(prompt, LOGITS_LAST)
    target.set_sampling(RANKED.native())
    target.set_uniforms(u)
    target.set_penalties(*penalties)
    target.set_masks(words_of(allowed))
    target.verify(drafts)
    n = len(drafts)
    cand = target.candidates(0, n, RANKED.top_k)
    return target.logits(0, n), target.choices(0, n), cand


@pytest.mark.parametrize("shape", list(RANKED_SHAPES))
def test_sampled_rows_by_candidates_draw_as_their_masked_rows(target, shape):
    """Rows drawing from their own top_k under masks that allow many tokens look the masks
    up at their largest logits (the logits read back stay unmasked). Their choices,
    candidates and probabilities equal those of the same rows masked in place (in a step
    with a row allowing few tokens, which masks in place), and the probabilities are the
    masked rows' distribution (sampling.distribution, checked against llama.cpp's chain in
    test_sampling); so where a row's largest logits hold fewer than top_k allowed tokens
    and the step's sampling runs again, over logits penalized once."""
    prompt = Tokenizer(TARGET).encode(PROMPTS[0])
    drafts = _drafts(" return n", 4)
    free, _, _ = _masked_verify(target, prompt, drafts)
    rng = np.random.default_rng(11)
    allowed = _allowing(rng, target.n_vocab, RANKED_SHAPES[shape] + [("half",)], free)
    in_place = allowed.copy()
    in_place[3] = _allowing(rng, target.n_vocab, [("keep", 5)])[0]
    # each row's 8 most likely allowed tokens penalized: a second penalty would show
    seen = np.argsort(np.where(allowed, free, -np.inf), axis=1)[:, -8:].astype(np.int32)
    penalties = (seen, np.tile(np.arange(1, 9, dtype=np.float32), (4, 1)))
    u = np.array([0.1, 0.5, 0.8, 0.3], dtype=np.float32)
    logits, choices, (cand, cand_p) = _ranked_verify(target, prompt, drafts, allowed, penalties, u)
    ref_logits, ref_choices, (ref_cand, ref_p) = _ranked_verify(target, prompt, drafts, in_place, penalties, u)
    assert np.all(np.isfinite(logits))  # looked up at the candidates
    assert np.all(np.isneginf(ref_logits[~in_place]))  # masked in place
    assert not np.array_equal(logits[:3][allowed[:3]], free[:3][allowed[:3]])  # penalized ...
    np.testing.assert_array_equal(logits[:3][allowed[:3]], ref_logits[:3][allowed[:3]])  # ... alike
    np.testing.assert_array_equal(choices[:3], ref_choices[:3])
    np.testing.assert_array_equal(cand[:3], ref_cand[:3])
    np.testing.assert_array_equal(cand_p[:3], ref_p[:3])
    p = distribution(np.where(allowed, logits, -np.inf), RANKED)
    for r in range(4):
        assert allowed[r, choices[r]]
        assert choices[r] == cand[r][draw(p[r, cand[r]], float(u[r]))]  # in the candidates' order
        np.testing.assert_allclose(cand_p[r], p[r, cand[r]], rtol=1e-4, atol=1e-6)
        assert math.isclose(float(cand_p[r].sum()), 1.0, rel_tol=1e-5)


def test_a_step_of_two_sequences_sampled_again_keeps_each_ones_masks_and_settings():
    """Two sequences' sampled rows in one step by candidates, one masked (its first row
    allowing none of its 80 largest logits: the step sampled again), the other free at
    another temperature: each row's choice and probabilities are its own masked
    distribution's."""
    prompt = Tokenizer(TARGET).encode(PROMPTS[2])
    drafts = _drafts("import sys", 3)
    hot = SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=2)
    with Target(TARGET, TargetConfig(n_ctx=256, n_threads=2, kv_type="f32", n_seq=2)) as t:
        for seq in (0, 1):
            t.set_sampling(SamplingParams().native(), seq=seq)
            t.decode(prompt, LOGITS_LAST, seq=seq)
        t.step([Rows(0, CHAIN, drafts), Rows(1, CHAIN, drafts)])
        free = t.logits(0, 6)
        t.commit(0, seq=0)
        t.commit(0, seq=1)
        allowed = _allowing(np.random.default_rng(5), t.n_vocab, [("miss", 300), ("half",), ("half",)], free[:3])
        u = [np.array([0.2, 0.6, 0.9], dtype=np.float32), np.array([0.4, 0.7, 0.1], dtype=np.float32)]
        for seq, params in ((0, RANKED), (1, hot)):
            t.set_sampling(params.native(), seq=seq)
            t.set_uniforms(u[seq], seq=seq)
        t.set_masks(words_of(allowed), seq=0)
        t.step([Rows(0, CHAIN, drafts), Rows(1, CHAIN, drafts)])
        choices = t.choices(0, 6)
        cand, cand_p = t.candidates(0, 6, 20)
        logits = t.logits(0, 6)
    np.testing.assert_array_equal(logits, free)  # looked up at the candidates, no penalties
    masked = np.vstack([np.where(allowed, free[:3], -np.inf), free[3:]])
    for r in range(6):
        params, uniform = (RANKED, u[0][r]) if r < 3 else (hot, u[1][r - 3])
        p = distribution(masked[r], replace(params, repeat_penalty=1.0, frequency_penalty=0.0))[0]
        assert choices[r] == cand[r][draw(p[cand[r]], float(uniform))]
        np.testing.assert_allclose(cand_p[r], p[cand[r]], rtol=1e-4, atol=1e-6)
        assert math.isclose(float(cand_p[r].sum()), 1.0, rel_tol=1e-5)


def test_invalid_grammars_and_schemas_name_the_problem():
    with pytest.raises(ValueError, match="invalid grammar.*foo"):
        Constraint.gbnf("root ::= foo")
    with pytest.raises(ValueError, match="invalid JSON schema"):
        Constraint.json_schema({"type": "objectx"})
    with pytest.raises(ValueError, match="not valid JSON"):
        Constraint("json_schema", "{nope")
    with pytest.raises(ValueError, match="empty"):
        Constraint.gbnf("  ")
    with pytest.raises(ValueError, match="Unimplemented keys"):
        Constraint.json_schema({"not": {"type": "string"}})
    with pytest.raises(ValueError, match="constraint must be"):
        SamplingParams(constraint="root ::= x")


# ---- greedy: every mode equals llama.cpp's constrained greedy --------------------------------

@pytest.mark.parametrize("name", ["json", "list", "numbers"])
def test_constrained_greedy_equals_llama_cpp_in_every_mode(engines, llama, name):
    from llama_cpp import LlamaGrammar

    text = grammars()[name]
    params = SamplingParams(constraint=Constraint.gbnf(text))
    for prompt in PROMPTS:
        # llama.cpp's grammar sampler allows an end-of-generation token only where the
        # grammar may end, as llguidance does; both stop there
        ref = llama.create_completion(prompt, max_tokens=40, temperature=0, repeat_penalty=1.0,
                                      grammar=LlamaGrammar.from_string(text, verbose=False))["choices"][0]
        runs = [("plain", engines["chain"], False), ("chain", engines["chain"], True),
                ("tree", engines["tree"], True)]
        for mode, engine, speculative in runs:
            r = engine.generate(prompt, 40, sampling=params, speculative=speculative)
            assert r.text == ref["text"], (name, prompt, mode)
            assert r.stats.stop_reason == ref["finish_reason"], (name, prompt, mode)


def test_forced_text_is_its_canonical_tokens_in_every_mode(engines):
    # inside forced text (a literal) llguidance allows only the text's own tokenization
    # ("name" as one token), where llama.cpp's GBNF sampler would also take "n", "ame":
    # the modes agree with each other and with the grammar
    params = SamplingParams(constraint=Constraint.gbnf(KEYS))
    for prompt in PROMPTS:
        texts = {engines["chain"].generate(prompt, 40, sampling=params, speculative=False).text,
                 engines["chain"].generate(prompt, 40, sampling=params).text,
                 engines["tree"].generate(prompt, 40, sampling=params).text}
        assert len(texts) == 1
        assert texts.pop().startswith('{"name": "')


def test_grammar_aware_drafting_keeps_every_verified_draft_inside_the_grammar(engines):
    engine = engines["chain"]
    vocab = engine.grammar_vocab()
    state = Constraint.gbnf(KEYS).state(vocab)
    tok = engine.tokenizer
    drafts = tok.encode('{"name": "fo$o", "args": []}', add_bos=False)
    path = state.draft_path(drafts)
    assert 0 < len(path) < len(drafts) and state.accepts(path)
    assert tok.decode(path) == '{"name": "fo'
    # a forced stretch replaces the drafter's guesses: the opening is forced whatever is drafted
    assert tok.decode(state.draft_path(tok.encode("x", add_bos=False) * 8)).startswith('{"name":')
    # the tree takes only candidates the grammar accepts along their path
    cand = np.array([tok.encode("{", add_bos=False)[:1] * 2 + [tok.encode("x", add_bos=False)[0]]] * 3)
    cand[0, 0] = tok.encode("x", add_bos=False)[0]
    logp = np.log(np.full(cand.shape, 1.0 / cand.shape[1]))
    tree = build_tree(tok.encode("a", add_bos=False)[0], cand, logp, 6, valid=state.accepts)
    assert all(state.accepts(p) for p in tree.paths()[1:])
    assert len(tree) > 1
    # forced text enters the tree whatever the drafter guessed: its tokens are the spine
    x = tok.encode("x", add_bos=False)[0]
    guesses = np.full((6, 3), x)
    tree = build_tree(x, guesses, np.log(np.full((6, 3), 1 / 3)), 6, valid=state.accepts, forced=state.forced_after)
    assert tok.decode(max(tree.paths(), key=len)).startswith('{"name":')
    assert all(state.accepts(p) for p in tree.paths()[1:])


def test_max_tokens_mid_structure_ends_with_length(engines):
    params = SamplingParams(constraint=Constraint.json_schema(
        {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
         "required": ["items"]}))
    r = engines["chain"].generate(PROMPTS[0], 5, sampling=params)
    assert r.stats.stop_reason == "length" and r.stats.generated_tokens == 5


# ---- sampled: the target's own constrained distribution --------------------------------------

def test_sampled_first_tokens_follow_the_targets_constrained_distribution(engines, target):
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    engine = engines["chain"]
    constraint = Constraint.gbnf(KEYS.replace('"{\\"name\\": \\""', '[a-z_]+ "{\\"name\\": \\""'))
    params = SamplingParams(temperature=1.0, constraint=constraint)
    prompt = PROMPTS[1]
    # the oracle: the target's logits at the prompt's last row, masked by llguidance's own
    # numpy helpers, under the sampling rule
    target.reset()
    target.set_sampling(SamplingParams().native())
    target.decode(engine.tokenizer.encode(prompt), LOGITS_LAST)
    logits = target.logits(0, 1).copy()
    matcher = LLMatcher(GrammarVocab(engine.tokenizer, target.n_vocab).lltokenizer, constraint.grammar)
    mask = allocate_token_bitmask(1, target.n_vocab)
    fill_next_token_bitmask(matcher, mask)
    apply_token_bitmask_inplace(logits, mask)
    p = distribution(logits, params)[0]
    n = 600
    counts: dict = {}
    for seed in range(n):
        for speculative in (False, True):
            r = engine.generate(prompt, 1, sampling=SamplingParams(temperature=1.0, seed=seed, constraint=constraint),
                                speculative=speculative)
            counts[(speculative, r.tokens[0])] = counts.get((speculative, r.tokens[0]), 0) + 1
    for speculative in (False, True):
        seen = {t: c for (s, t), c in counts.items() if s == speculative}
        assert all(p[t] > 0 for t in seen)
        cells = {int(t): float(p[t]) for t in np.flatnonzero(p > 0)}
        stat, df = chi2_stat(seen, cells, n)
        assert stat < chi2_critical(max(df, 1)), (speculative, stat, df)


# ---- a batch of constrained and free requests ------------------------------------------------

def test_a_batch_mixing_constrained_and_free_requests_gives_each_its_solo_text():
    requests = [(PROMPTS[0], Constraint.gbnf(NUMBERS)), (PROMPTS[1], None), (PROMPTS[2], Constraint.gbnf(KEYS)),
                (PROMPTS[1], Constraint.gbnf(grammars()["list"]))]
    with Engine(TARGET, DRAFT, n_ctx=256, n_threads=2, n_seq=len(requests)) as engine:
        solo = [engine.generate(p, 24, sampling=SamplingParams(constraint=c)).tokens for p, c in requests]
        batch = engine.batch()
        seqs = [engine.sequence(Request(engine.encode(p), 24, sampling=SamplingParams(constraint=c)), slot=i)
                for i, (p, c) in enumerate(requests)]
        out = {id(s): [] for s in seqs}
        for s in seqs:
            batch.add(s)
        while len(batch):
            for s, new in batch.advance():
                assert s.error is None, s.error
                out[id(s)].extend(new)
        assert [out[id(s)] for s in seqs] == solo


# ---- dflash-run's flags ------------------------------------------------------------------------

def dflash_run(*args):
    import os
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("dflash-run")
    return subprocess.run([str(exe), "-m", TARGET, "-md", DRAFT, "-c", "256", "-t", "2", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_cli_grammar_and_json_schema_flags(tmp_path):
    grammar = tmp_path / "numbers.gbnf"
    grammar.write_text(NUMBERS)
    for flags in (["--grammar", NUMBERS], ["--grammar-file", str(grammar)], ["--grammar", NUMBERS, "--no-spec"]):
        res = dflash_run("-p", "def fib(n):", "-n", "40", *flags)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "[0]"
    schema = '{"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}}, "required": ["a"], ' \
             '"additionalProperties": false}'
    res = dflash_run("-p", "def fib(n):", "-n", "40", "-j", schema)
    assert res.returncode == 0, res.stderr
    assert set(__import__("json").loads(res.stdout)) == {"a"}


@pytest.mark.parametrize("flags, needle", [
    (["--grammar", "root ::= foo"], "--grammar: invalid grammar"),
    (["-j", '{"type": "objectx"}'], "-j/--json-schema: invalid JSON schema"),
    (["-j", "{nope"], "not valid JSON"),
    (["-j", '{"type": "object"}', "--grammar", 'root ::= "a"'], "not both"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "cannot read --grammar file"),
])
def test_cli_bad_constraints_exit_2_with_one_line(flags, needle):
    res = dflash_run("-p", "x", "-n", "4", *flags)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr


def test_lazy_grammar_waits_for_its_opening(engines):
    engine = engines["chain"]
    tok = engine.tokenizer
    state = Constraint("lark", 'start: "<call>" /[0-9]+/ "</call>"', lazy_from="<call>").state(engine.grammar_vocab())
    free = tok.encode("hello world ", add_bos=False)
    assert not state.active and state.masks([[]]) is None
    # drafts stop before the opening: no verified row may see it in its path
    drafts = free + tok.encode("<call>12", add_bos=False)
    assert state.valid_prefix(drafts) < len(drafts) and not state.opens(drafts[:state.valid_prefix(drafts)])
    state.consume(free + tok.encode("<call>", add_bos=False))
    assert state.active
    assert state.valid_prefix(tok.encode("12x", add_bos=False)) < len(tok.encode("12x", add_bos=False))
    state.consume(tok.encode("7</call>", add_bos=False))
    assert state.ended


def test_a_grammar_after_thinking_holds_the_answer_only(engines):
    engine = engines["chain"]
    tok = engine.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    state = Constraint.json_schema(schema).__class__("json_schema", json.dumps(schema), after="</think>").state(
        engine.grammar_vocab())
    thoughts = tok.encode("<think>\nsome {free} text\n", add_bos=False)
    assert not state.active and state.valid_prefix(thoughts) == len(thoughts)
    state.consume(thoughts + tok.encode("</think>", add_bos=False))
    assert state.active and state.masks([[]]) is not None
    assert state.valid_prefix(tok.encode('{"a": 1}', add_bos=False)) == len(tok.encode('{"a": 1}', add_bos=False))
    assert state.valid_prefix(tok.encode("x", add_bos=False)) == 0
    with pytest.raises(ValueError, match="not both"):
        Constraint("regex", "a+", lazy_from="<", after=">")
