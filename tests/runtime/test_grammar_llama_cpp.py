"""Sampled grammar output against llama.cpp's grammar sampler (through llama-cpp-python),
an engine other than llguidance, which the runtime uses.

Along seeded sampled generations of ours, step by step:
- every token we emit is one llama.cpp's grammar sampler leaves finite there, and the
  whole output is a sentence of its grammar (it allows an end-of-generation token where
  we stopped, or the output ran to its length);
- the set our runtime allows (llguidance's mask) is a subset of llama.cpp's, and equal
  to it where the grammar holds no literal longer than a character: inside a literal
  ("true", a key) llguidance allows only the literal's canonical tokens, where llama.cpp
  takes any tokenization of it.
And the sampled first token follows the target's distribution masked by llama.cpp's set.
"""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.decoding.constraints import Constraint
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.sampling import SamplingParams, distribution
from dflash_gguf.runtime.target import LOGITS_LAST

from helpers.grammar_cases import KEYS, NUMBERS, PROMPTS, grammars
from helpers.llama_sampler import llama_cpp_oracle, apply_to_row
from helpers.paths import ROOT
from helpers.sampling_checks import chi2_critical, chi2_stat

DATA = ROOT / "dflash_gguf" / "data"
TARGET, DRAFT = str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf")


@pytest.fixture(scope="module")
def lc():
    return llama_cpp_oracle()


@pytest.fixture(scope="module")
def engine():
    with Engine(TARGET, DRAFT, n_ctx=512, n_threads=1) as e:
        yield e


class LlamaGrammar:
    """llama.cpp's grammar sampler over the target's vocabulary, fed the tokens emitted."""

    def __init__(self, lc, engine, text: str):
        self.lc = lc
        self.vocab = engine.tokenizer._llama._model.vocab  # the vocabulary llama.cpp loaded from the GGUF
        self.n = lc.llama_vocab_n_tokens(self.vocab)
        self.sampler = lc.llama_sampler_init_grammar(self.vocab, text.encode(), b"root")
        assert self.sampler, "llama.cpp refused the grammar"

    def allowed(self) -> np.ndarray:
        """Boolean [n_tokens]: the tokens its grammar leaves finite from here."""
        kept = apply_to_row(self.sampler, np.zeros(self.n, dtype=np.float32))
        out = np.zeros(self.n, dtype=bool)
        out[kept["id"][np.isfinite(kept["logit"])]] = True
        return out

    def accept(self, token: int) -> None:
        # only ever an allowed token: llama.cpp throws (and aborts the process) otherwise
        self.lc.llama_sampler_accept(self.sampler, int(token))

    def close(self):
        self.lc.llama_sampler_free(self.sampler)


@pytest.fixture(scope="module")
def whole(engine, lc):
    """Boolean [n_tokens]: tokens whose bytes are whole UTF-8 characters, none NUL. The
    engines part on the others: llama.cpp's grammar reads a token's text as a C string
    (a NUL ends it, and it refuses b"\\x00" where a grammar allows any character), and on
    a token that ends inside a character, where the list grammar's [^\\r\\n:] allows
    any character, llguidance allows b" \\xe2\\x80" (a space, then the first bytes of "—"
    and its kin), and llama.cpp's grammar sampler refuses it. The sets are compared on
    whole tokens."""
    n = lc.llama_vocab_n_tokens(engine.tokenizer._llama._model.vocab)
    out = np.zeros(n, dtype=bool)
    for t in range(n):
        try:
            text = engine.tokenizer.token_bytes([t])
            text.decode("utf-8")
            out[t] = b"\x00" not in text
        except UnicodeDecodeError:
            pass
    return out


def our_allowed(state, n: int) -> np.ndarray:
    """Boolean [n]: the tokens our runtime's mask allows next (llguidance's, as the target
    gets it)."""
    words = state.masks([[]])[0]
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
    assert not bits[n:].any()  # no token past the tokenizer's (padding rows of the target)
    return bits[:n]


# names, commas and spaces: one-character literals, and runs long enough to compare many steps
NAMES = 'root ::= [a-z_]+ ("," [ ]? [a-z_]+)* "\\n"'

# (grammar, whether every literal in it is a single character)
CASES = {"numbers": (lambda: NUMBERS, True), "names": (lambda: NAMES, True), "list": (lambda: grammars()["list"], False),
         "json": (lambda: grammars()["json"], False), "keys": (lambda: KEYS, False)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampled_output_follows_llama_cpp_grammar_at_every_step(lc, engine, whole, name):
    text, single_chars = CASES[name][0](), CASES[name][1]
    vocab = engine.grammar_vocab()
    n_steps = n_strict = 0
    for seed in range(6):
        prompt = PROMPTS[seed % len(PROMPTS)]
        params = SamplingParams(1.0, 40, seed=seed, constraint=Constraint.gbnf(text))
        r = engine.generate(prompt, 32, sampling=params, speculative=seed % 2 == 0)
        ours = Constraint.gbnf(text).state(vocab)
        theirs = LlamaGrammar(lc, engine, text)
        try:
            for i, tok in enumerate(r.tokens):
                mine, allowed = our_allowed(ours, theirs.n) & whole, theirs.allowed() & whole
                if not whole[tok]:  # a part of a character: llama.cpp may refuse it, and would abort on it
                    break
                assert mine[tok] and allowed[tok], (name, seed, i, tok)
                extra = np.flatnonzero(mine & ~allowed)
                assert not len(extra), (name, seed, i, [engine.tokenizer.token_bytes([t]) for t in extra[:5]])
                if single_chars:
                    assert np.array_equal(mine, allowed), (name, seed, i, np.flatnonzero(mine != allowed)[:10])
                    n_strict += 1
                n_steps += 1
                theirs.accept(tok)
                ours.consume([tok])
            else:
                if r.stats.stop_reason != "stop":
                    continue
                # ended where the grammar may end: llama.cpp's grammar agrees
                assert any(theirs.allowed()[t] for t in vocab.eog), (name, seed)
        finally:
            theirs.close()
    assert n_steps >= 6 * 3 and (n_strict == n_steps if single_chars else n_strict == 0)


def test_sampled_first_tokens_follow_the_distribution_under_llama_cpps_grammar(lc, engine):
    """The first sampled token of a constrained request, chain and plain, is distributed
    as the target's row masked by llama.cpp's grammar sampler (not llguidance's) under the
    sampling rule."""
    constraint_text = KEYS.replace('"{\\"name\\": \\""', '[a-z_]+ "{\\"name\\": \\""')
    constraint = Constraint.gbnf(constraint_text)
    prompt = PROMPTS[1]
    target = engine.target
    target.reset()
    target.set_sampling(SamplingParams().native())
    target.decode(engine.tokenizer.encode(prompt), LOGITS_LAST)
    logits = target.logits(0, 1)[0].astype(np.float64)
    target.reset()
    g = LlamaGrammar(lc, engine, constraint_text)
    allowed = np.zeros(len(logits), dtype=bool)
    allowed[:g.n] = g.allowed()
    g.close()
    assert 5 < allowed.sum() < len(allowed) // 2
    p = distribution(np.where(allowed, logits, -np.inf), SamplingParams(1.0))[0]
    n = 500
    cells = {int(t): float(p[t]) for t in np.flatnonzero(p > 0)}
    for speculative in (False, True):
        counts: dict = {}
        for seed in range(n):
            r = engine.generate(prompt, 1, sampling=SamplingParams(1.0, seed=seed, constraint=constraint),
                                speculative=speculative)
            counts[r.tokens[0]] = counts.get(r.tokens[0], 0) + 1
        assert all(p[t] > 0 for t in counts)
        stat, df = chi2_stat(counts, cells, n)
        assert df >= 3 and stat < chi2_critical(df), (speculative, stat, df)
