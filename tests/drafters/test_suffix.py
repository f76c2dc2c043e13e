"""SuffixDecoding (--spec-type suffix): the index and its continuation trees, the bounded
corpora and their keys, then greedy output on the demo target equal token for token to
plain decoding, drafting from the request's own text and from earlier requests'."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.decoding import verify as verifying
from dflash_gguf.engine.engine import Engine
from dflash_gguf.engine.options import EngineOptions
from dflash_gguf.speculation.pricing import RunHazard, RunHazards
from dflash_gguf.speculation.suffix import (BYTES_PER_TOKEN, SuffixConfig, SuffixCorpora, SuffixDrafts, SuffixIndex,
                                continuation_tree, corpus_key, draft_tree, is_chain, likeliest_path)

from helpers.decoding_checks import REPEATS, use_cost
from helpers.paths import ROOT

DATA = ROOT / "dflash_gguf" / "data"
TARGET, DRAFT = str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf")
RUN = str(Path(sys.executable).with_name("dflash-run"))
OPTIONS = dict(n_ctx=512, kv_type="f32", n_threads=1)


# ---- the index ------------------------------------------------------------------------------

def test_the_longest_match_and_its_occurrences():
    index = SuffixIndex(2)
    index.extend("a", [1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3, 8])
    m = index.match([4, 1, 2, 3], max_match=64, max_occurrences=64)
    # (2, 3) ends at 3, 6 and 11; only two of them have (1, 2, 3) before, the latest first
    assert m.length == 3 and m.at == [("a", 11), ("a", 3)]
    assert index.continuations(m, 2) == [[8], [9, 2]]  # the latest is one token from the text's end
    assert index.match([4, 1, 2, 3], max_match=2, max_occurrences=64).length == 2  # capped
    assert index.match([6, 6], 64, 64) is None
    # only the most recent occurrences are examined
    assert index.match([4, 1, 2, 3], 64, max_occurrences=1).at == [("a", 11)]


def test_the_index_grows_by_the_new_positions_only():
    index = SuffixIndex(2)
    index.extend("a", [1, 2])
    assert index.match([1, 2], 64, 64) is None  # no token follows (1, 2) yet
    index.extend("a", [3])
    assert index.match([1, 2], 64, 64).at == [("a", 2)]
    before = {k: dict(v) for k, v in index._ends.items()}
    index.extend("a", [1, 2])
    added = {k: [e for e in v if e not in before.get(k, {})] for k, v in index._ends.items()}
    assert sorted(e for es in added.values() for e in es) == [("a", 3), ("a", 4)]
    index.remove("a")
    assert index._ends == {} and len(index) == 0


def test_the_tree_counts_continuations_and_scores_by_frequency():
    conts = [[5, 6, 7], [5, 6, 8], [5, 9], [4]]
    tree = continuation_tree(0, conts, budget=10, min_prob=0.0)
    probs = {tuple(p): math.exp(s) for p, s in zip(tree.paths(), tree.scores)}
    assert probs[(5,)] == pytest.approx(3 / 4)
    assert probs[(5, 6)] == pytest.approx(2 / 4)  # child 2/3 of its parent's 3/4
    assert probs[(5, 6, 7)] == pytest.approx(1 / 4) and probs[(4,)] == pytest.approx(1 / 4)
    assert [tree.tokens[i] for i in tree.pick_order[:2]] == [5, 6]  # best first
    assert all(tree.parents[i] < i for i in range(1, len(tree)))
    assert np.exp(tree.scores[1:]).sum() == pytest.approx((3 + 2 + 1 + 1 + 1 + 1) / 4)
    assert likeliest_path(tree) == [5, 6, 7]
    # a budget keeps the likeliest nodes, a floor drops the unlikely ones
    assert sorted(continuation_tree(0, conts, 2, 0.0).paths()) == [[], [5], [5, 6]]
    assert sorted(continuation_tree(0, conts, 10, 0.5).paths()) == [[], [5], [5, 6]]
    assert continuation_tree(0, [[1, 2]], 10, 0.0).tokens == [0, 1, 2]
    assert is_chain(continuation_tree(0, [[1, 2], [1, 2]], 10, 0.0)) and not is_chain(tree)
    assert continuation_tree(0, [], 10, 0.0) is None


def test_the_trees_depth_follows_the_match():
    index = SuffixIndex(2)
    index.extend("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    config = SuffixConfig(depth_factor=1.5)
    tree, match = draft_tree(index, [1, 2], budget=16, max_depth=16, config=config)
    assert match.length == 2 and tree.tokens == [2, 3, 4, 5]  # 1.5 x 2 deep
    index.extend("b", [0, 8, 9, 1, 2, 3, 5, 6, 7, 8, 9])
    tree, match = draft_tree(index, index.docs["a"], budget=16, max_depth=4, config=config)
    # (8, 9, 1, 2) in b is the longest match: its continuation, cut at max_depth
    assert match.length == 4 and match.at == [("b", 5)] and tree.tokens == [2, 3, 5, 6, 7]


# ---- the corpora ----------------------------------------------------------------------------

def test_the_corpus_evicts_the_least_recently_used_documents():
    doc_tokens = 1000
    corpora = SuffixCorpora(SuffixConfig(cache_mb=1))
    fits = (1 << 20) // BYTES_PER_TOKEN // doc_tokens
    for i in range(fits):
        corpora.add("k", [i] * doc_tokens)
    assert corpora.evicted == 0 and corpora.nbytes <= 1 << 20
    corpora.used("k", [0])  # the first document drafted: the second is now the oldest
    corpora.add("k", [99] * doc_tokens)
    assert corpora.evicted == 1
    kept = {doc[0] for doc in corpora.index("k").docs.values()}
    assert 0 in kept and 1 not in kept and 99 in kept
    assert corpora.nbytes <= 1 << 20
    corpora.add("k", list(range((1 << 20) // BYTES_PER_TOKEN + 1)))  # larger than the bound: not kept
    assert corpora.evicted == 1
    off = SuffixCorpora(SuffixConfig(cache_mb=0))
    off.add(None, [1, 2, 3, 4])
    assert off.index(None) is None


def test_corpus_keys_are_isolated_and_hashed():
    corpora = SuffixCorpora(SuffixConfig())
    corpora.add(corpus_key("alpha"), [1, 2, 3, 4, 5])
    assert corpora.index(corpus_key("beta")) is None and corpora.index(None) is None
    assert corpora.index(corpus_key("alpha")).match([1, 2], 64, 64).length == 2
    assert corpus_key("alpha") != "alpha" and "alpha" not in corpus_key("alpha")
    assert corpus_key(None) is None and corpus_key("") is None


def test_drafts_from_the_corpus_are_priced_by_their_own_hazard():
    """Corpus drafts that break off after their first token teach the corpus's hazard
    only: the same tree from the same run is then priced lower from the corpus than from
    the request's own text, whose hazard is as it was."""
    own, theirs = RunHazard(), RunHazard()
    drafts = SuffixDrafts(SuffixCorpora(SuffixConfig()), None, own, theirs)
    tree = continuation_tree(5, [[6, 7, 8, 9]], 8, 0.0)
    fresh = drafts.probs(tree, 4)
    assert np.array_equal(drafts.probs(tree, 4, corpus=True), fresh)
    for _ in range(40):
        drafts.observe([6, 1], SuffixDrafts.judge(tree, 4, corpus=True))  # kept 6, then the target parted
    assert np.array_equal(drafts.probs(tree, 4), fresh)
    assert drafts.probs(tree, 4, corpus=True)[1:].sum() < 0.5 * fresh[1:].sum()
    drafts.observe([6, 7, 8, 9, 2], SuffixDrafts.judge(tree, 4))  # the own text's hazard learns its own
    assert drafts.probs(tree, 4)[-1] > fresh[-1]


def test_each_corpus_key_learns_its_own_hazards():
    """How long a key's drafts are verified follows its own requests' outcomes only: one
    key's walks leave another's hazards (and the keyless requests') as they were; a key
    keeps one per kind; past MAX_KEYS the least recently used key's go."""
    hazards = RunHazards()
    a, b = corpus_key("alpha"), corpus_key("beta")
    assert hazards.get(a, "suffix") is hazards.get(a, "suffix")
    assert hazards.get(a, "suffix") is not hazards.get(b, "suffix")
    assert hazards.get(a, "suffix") is not hazards.get(a, "ngram-simple")
    before = hazards.get(b, "suffix").survival(4, [20])[0]
    hazards.get(a, "suffix").observe(run=4, walked=20, deepest=20)
    assert hazards.get(a, "suffix").survival(4, [20])[0] > before
    assert before == hazards.get(b, "suffix").survival(4, [20])[0] == hazards.get(None, "suffix").survival(4, [20])[0]
    kept = hazards.get(a, "suffix")
    for i in range(RunHazards.MAX_KEYS):
        hazards.get(i, "suffix")
    assert hazards.get(a, "suffix") is not kept


# ---- decoding -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain():
    with Engine(TARGET, **OPTIONS) as engine:
        yield engine


@pytest.fixture(autouse=True)
def free_rows(monkeypatch):
    """Free rows, so that pricing verifies every likely node and the tests below see trees
    whatever this machine's timings."""
    use_cost(monkeypatch, 0.0)


def test_rows_as_dear_as_a_step_verify_no_unsure_tree(plain, monkeypatch):
    """Priced (speculation/pricing.py): where each row costs a decode step, no tree of counts is sure
    enough to pay, and every step decodes the last token alone; the text is plain's."""
    use_cost(monkeypatch, 1.0)
    want = plain.generate(REPEATS, 60, stop_tokens=()).tokens
    with Engine(TARGET, spec_type="suffix", **OPTIONS) as engine:
        got = engine.generate(REPEATS, 60, stop_tokens=())
    assert got.tokens == want
    assert max(got.stats.accepted_lengths) == 1 and got.stats.drafts.drafted.get("suffix", 0) == 0


@pytest.fixture
def trees_verified(monkeypatch):
    """The branching trees the steps verified (nodes with two children or more)."""
    seen = []
    verify = verifying.accepted

    def spy(seq, p, choice):
        if p.tree is not None and any(len(kids) > 1 for kids in p.tree.children()):
            seen.append(len(p.tree))
        return verify(seq, p, choice)

    monkeypatch.setattr(verifying, "accepted", spy)
    return seen


def test_greedy_suffix_equals_plain_greedy(plain, trees_verified):
    want = plain.generate(REPEATS, 60, stop_tokens=()).tokens
    with Engine(TARGET, spec_type="suffix", spec_draft_n_max=8, **OPTIONS) as engine:
        got = engine.generate(REPEATS, 60, stop_tokens=())
        assert got.tokens == want
        s = got.stats
        d = s.drafts
        assert d.drafted["suffix"] > 0 and d.accepted["suffix"] > 0, (d.drafted, d.accepted)
        assert d.corpus_drafted == 0  # nothing earlier in the corpus
        assert max(s.accepted_lengths) <= 9 and s.mean_accepted > 1
        assert trees_verified, "no branching tree was verified: the test proves nothing about trees"
        # the held context continues into the next request, as plain decoding's does
        longer = engine.encode(REPEATS) + got.tokens
        again = engine.generate(longer, 20, stop_tokens=())
        assert again.stats.reused_tokens == len(longer) - 1
    assert again.tokens == plain.generate(longer, 20, stop_tokens=()).tokens


def test_a_request_drafts_from_an_earlier_ones_response(plain):
    """The second request's prompt is new text whose continuation the first request's
    response holds: its drafts come from the corpus, and output stays the target's."""
    first = "def area(r):\n    return 3.14 * r * r\n\nprint(area("
    second = "x = 2\nprint(area("
    with Engine(TARGET, spec_type="suffix", **OPTIONS) as engine:
        a = engine.generate(first, 40, stop_tokens=())
        b = engine.generate(second, 40, stop_tokens=())
        assert b.tokens == plain.generate(second, 40, stop_tokens=()).tokens
        assert a.tokens == plain.generate(first, 40, stop_tokens=()).tokens
        d = b.stats.drafts
        assert d.corpus_drafted > 0 and d.corpus_accepted > 0, (d.drafted, d.accepted)
        # another key's request sees nothing of them
        c = engine.generate(second, 40, stop_tokens=(), corpus="other")
        assert c.tokens == b.tokens and c.stats.drafts.corpus_drafted == 0


def test_a_batch_gives_each_sequence_its_solo_text():
    from helpers.decoding_checks import solo_and_batched

    texts = [REPEATS, "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "x = 1\nx = 1\nx ="]
    with Engine(TARGET, spec_type="suffix", n_seq=3, spec_suffix_cache_mb=0, **OPTIONS) as engine:
        alone, outs, seqs = solo_and_batched(engine, texts, 30)
    assert outs == alone
    assert any(s.stats.drafts.drafted.get("suffix", 0) for s in seqs)


def run(*args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([RUN, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("draft,spec_type,options,words", [
    (DRAFT, "draft-dflash,suffix", {"tree_budget": 4}, "leave out --tree-budget"),
    (DRAFT, "suffix", {}, "loads no drafter file"),
])
def test_kinds_suffix_does_not_run_beside(draft, spec_type, options, words):
    from dflash_gguf.engine.setup import EngineSetup
    from dflash_gguf.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        EngineSetup.of(TARGET, draft, EngineOptions.of(spec_type=spec_type, **options))


def test_greedy_dflash_beside_suffix_equals_plain_greedy(plain, trees_verified):
    """The drafter's chain or the suffix tree, whichever is expected to keep more: the
    output is the target's, and both were verified."""
    text = "x = 1\ny = 2\nx = 1\ny = 3\nx = 1\ny ="  # two continuations of "y =": a tree
    want = plain.generate(text, 60, stop_tokens=()).tokens
    with Engine(TARGET, DRAFT, **OPTIONS) as engine:
        dflash = engine.generate(text, 60, stop_tokens=())
    with Engine(TARGET, DRAFT, spec_type="draft-dflash,suffix", **OPTIONS) as engine:
        got = engine.generate(text, 60, stop_tokens=())
    assert got.tokens == want == dflash.tokens
    assert got.stats.drafts.drafted["suffix"] > 0 and got.stats.drafts.accepted["suffix"] > 0
    assert got.stats.accepted_lengths != dflash.stats.accepted_lengths  # some steps verified suffix's drafts
    assert trees_verified, "no branching suffix tree was verified beside the drafter"
    assert sum(got.stats.accepted_lengths) - len(got.stats.accepted_lengths) > got.stats.drafts.accepted["suffix"], \
        "no drafter chain was ever accepted"


def test_the_cache_bound_is_checked():
    from dflash_gguf.engine.setup import EngineSetup
    from dflash_gguf.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"suffix corpora's memory in MiB .* must be >= 0, got -1"):
        EngineSetup.of(TARGET, None, EngineOptions.of(spec_type="suffix", spec_suffix_cache_mb=-1))


def test_the_cli_drafts_from_suffix_trees():
    base = ["-m", TARGET, "-p", REPEATS, "-n", "40", "-c", "512", "-t", "1"]
    plain_run, suffix = run(*base), run(*base, "--spec-type", "suffix", "--spec-draft-n-max", "6")
    assert plain_run.returncode == suffix.returncode == 0, suffix.stderr
    assert plain_run.stdout == suffix.stdout
    assert "suffix (corpus 64 MiB)" in suffix.stderr and "drafts    suffix:" in suffix.stderr


@pytest.mark.parametrize("args,words", [
    (["--spec-type", "suffix", "--spec-suffix-cache-mb", "-1"], "--spec-suffix-cache-mb: the suffix corpora's memory"),
    (["--spec-type", "suffix,ngram-mod", "--spec-ngram-mod-n-match", "0"], "--spec-ngram-mod-n-match"),
])
def test_the_cli_says_what_is_wrong(args, words):
    r = run("-m", TARGET, "-p", "hi", "-n", "4", "-c", "512", "-t", "1", *args)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_greedy_suffix_under_a_grammar_equals_plain(plain):
    """Under a grammar the likeliest branch is verified as a chain, cut where the grammar
    rejects it."""
    from dflash_gguf.decoding.constraints import check_constraint
    from dflash_gguf.decoding.sampling import SamplingParams

    grammar = check_constraint(grammar='root ::= ("x = 1\\n" | "y = 2\\n")+')
    greedy = SamplingParams(0.0, 0, 1.0, 0.0, None, constraint=grammar)
    text = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"
    want = plain.generate(text, 40, stop_tokens=(), sampling=greedy).tokens
    with Engine(TARGET, spec_type="suffix", **OPTIONS) as engine:
        got = engine.generate(text, 40, stop_tokens=(), sampling=greedy)
    assert got.tokens == want and got.stats.drafts.accepted["suffix"] > 0


def test_sampled_suffix_keeps_the_targets_distribution(plain, trees_verified):
    """Trees of earlier samples' continuations (the corpus) and of the prompt, fixed
    before the target's draws: the first three tokens are distributed as the target's
    sampling (enumerated exactly, chi-square at 0.1%)."""
    from dataclasses import replace

    from dflash_gguf.decoding.sampling import SamplingParams
    from helpers.sampling_checks import chi2_critical, chi2_stat, exact_joint

    text = plain.tokenizer.encode("    def __init__(self, name):\n        self.name = name\n        self.",
                                  add_bos=False)
    params, depth, n = SamplingParams(0.6, 20, 0.95), 3, 1000
    exact = exact_joint(plain.target, text, params, depth)
    counts, drafted = {}, 0
    with Engine(TARGET, spec_type="suffix", **OPTIONS) as alone, \
            Engine(TARGET, DRAFT, spec_type="draft-dflash,suffix", **OPTIONS) as mixed:
        for seed in range(n):
            engine = mixed if seed % 2 else alone
            out = engine.generate(text, depth, stop_tokens=(), sampling=replace(params, seed=seed))
            counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
            drafted += out.stats.drafts.accepted.get("suffix", 0)
    assert drafted > 0 and trees_verified, "no suffix draft kept or no tree verified: the test proves nothing"
    stat, df = chi2_stat(counts, exact, n)
    assert df >= 4, "too few cells for the test to say anything"
    assert stat < chi2_critical(df), (stat, df)
