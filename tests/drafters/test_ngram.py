"""N-gram drafts (--spec-type ngram-simple / ngram-mod): weightless chains copied from a
sequence's own prompt and output, alone or beside the DFlash drafter, on the demo pair.
The oracle is the target's own decoding: greedy output equal token for token, sampled
output distributed as the target's sampling (enumerated exactly, chi-square at 0.1%)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.requests import GenerationStats
from dflash_gguf.speculation.kinds.ngram_mod import NgramMod
from dflash_gguf.speculation.kinds.ngram_simple import NgramSimple
from dflash_gguf.speculation.ngram import MAX_RUN, NgramDrafts
from dflash_gguf.speculation.pricing import RunHazard
from dflash_gguf.decoding.sampling import SamplingParams

from helpers.decoding_checks import REPEATS, solo_and_batched, use_cost
from helpers.paths import ROOT

DATA = ROOT / "dflash_gguf" / "data"
TARGET, DRAFT = str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf")
RUN = str(Path(sys.executable).with_name("dflash-run"))

# short lookups: the demo target's repeats are short
NGRAM = dict(spec_ngram_simple_size_n=3, spec_ngram_mod_n_match=3, spec_ngram_mod_n_min=1)
OPTIONS = dict(n_ctx=512, kv_type="f32", n_threads=1)


def test_the_sources_draft_what_followed_the_last_tokens():
    history = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]  # a sequence's, read where it is as it grows
    simple = NgramSimple(2)
    assert simple.draft(history, 8) == ([5, 6, 1, 2], 2)  # the latest earlier occurrence of (1, 2)
    assert simple.draft(history, 1) == ([5], 2)
    history.append(9)
    assert simple.draft(history, 8) == ([], 0)  # (2, 9) never occurred before
    mod = NgramMod(2, n_min=3)
    assert mod.draft([7, 8, 9, 7, 8, 9, 7, 8], 5) == ([9, 7, 8, 9, 7], 2)  # chained through its own drafts
    assert NgramMod(2, n_min=3).draft([7, 8], 5) == ([], 0)
    short, history = NgramMod(2, n_min=3), [1, 2, 3, 1, 2, 4, 4, 1, 2]
    assert short.draft(history, 5) == ([4, 4, 1, 2, 4], 2)  # the last token to follow (1, 2) wins
    history += [5, 6, 1, 2]
    assert short.draft(history, 5) == ([5, 6, 1, 2, 5], 2)


def test_ngram_simple_measures_how_far_back_its_match_runs():
    """The run a draft is priced by: the n-gram and every agreeing token before it."""
    history = [9, 5, 1, 2, 3, 7, 8, 6, 5, 1, 2, 3]
    assert NgramSimple(2).draft(history, 3) == ([7, 8, 6], 4)  # 5 1 2 3 agree, 9 and 6 do not
    copy = list(range(100, 400))
    assert NgramSimple(2).draft(copy + copy[:-1], 2) == ([399, 100], 299)  # a copy 299 tokens long so far
    copy = list(range(100, 100 + 2 * MAX_RUN))
    assert NgramSimple(2).draft(copy + copy, 2)[1] == MAX_RUN  # measured no further


def test_ngram_drafts_are_judged_by_their_runs():
    """Every source's draft is judged on the emitted tokens it reaches, and a long run's
    draft is priced likelier than a short one's."""
    drafts = NgramDrafts([NgramSimple(2)], [RunHazard()])
    history = [4, 1, 2, 3, 9, 9, 1, 2]
    best, probs, kind, found = drafts.best(history, 4)
    assert (best, kind, found) == ([3, 9, 9, 1], "ngram-simple", [([3, 9, 9, 1], 2)])
    assert list(probs) == sorted(probs, reverse=True) and 0 < probs[-1] < probs[0] < 1
    trials = drafts.hazards[0].trials.copy()
    drafts.observe([3, 9, 5], found)  # two kept, the third missed
    assert drafts.hazards[0].trials.sum() == pytest.approx(trials.sum() + 3)
    long = NgramDrafts([NgramSimple(2)], [RunHazard()])
    copy = list(range(100, 200))
    assert long.best(copy + copy[:50], 4)[1][0] > probs[0]


@pytest.fixture(scope="module")
def plain():
    with Engine(TARGET, **OPTIONS) as engine:
        yield engine


@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-mod", "ngram-simple,ngram-mod"])
def test_greedy_ngram_equals_plain_greedy(plain, spec_type):
    want = plain.generate(REPEATS, 60, stop_tokens=()).tokens
    with Engine(TARGET, spec_type=spec_type, spec_draft_n_max=8, **NGRAM, **OPTIONS) as engine:
        got = engine.generate(REPEATS, 60, stop_tokens=())
        assert got.tokens == want
        assert got.stats.mean_accepted > 1, got.stats.accepted_lengths
        assert max(got.stats.accepted_lengths) <= 9
        # the held context continues into the next request, as plain decoding's does
        longer = engine.encode(REPEATS) + got.tokens
        again = engine.generate(longer, 20, stop_tokens=())
        assert again.stats.reused_tokens == len(longer) - 1
    assert again.tokens == plain.generate(longer, 20, stop_tokens=()).tokens


def test_greedy_dflash_beside_ngram_equals_plain_greedy(plain):
    want = plain.generate(REPEATS, 60, stop_tokens=()).tokens
    for p_min in (0.0, 0.3):
        with Engine(TARGET, DRAFT, draft_p_min=p_min, **OPTIONS) as engine:
            dflash = engine.generate(REPEATS, 60, stop_tokens=())
        with Engine(TARGET, DRAFT, spec_type="draft-dflash,ngram-simple", draft_p_min=p_min, **NGRAM,
                    **OPTIONS) as engine:
            got = engine.generate(REPEATS, 60, stop_tokens=())
            assert got.tokens == want == dflash.tokens
            assert got.stats.mean_accepted > 1
            # some steps verified the copied chain instead of the drafter's
            assert got.stats.accepted_lengths != dflash.stats.accepted_lengths


def test_sampled_ngram_keeps_the_targets_distribution(plain):
    """Drafts copied from the history are fixed in advance: each row's token is the
    target's draw, so the first three tokens are distributed as the target's sampling."""
    from helpers.sampling_checks import chi2_critical, chi2_stat, exact_joint

    text = plain.tokenizer.encode("    def __init__(self, name):\n        self.name = name\n        self.",
                                  add_bos=False)
    params, depth, n = SamplingParams(0.6, 20, 0.95), 3, 1000
    exact = exact_joint(plain.target, text, params, depth)
    counts, drafted = {}, 0
    with Engine(TARGET, DRAFT, spec_type="draft-dflash,ngram-simple,ngram-mod", spec_ngram_simple_size_n=1,
                spec_ngram_mod_n_match=1, spec_ngram_mod_n_min=1, **OPTIONS) as mixed, \
            Engine(TARGET, spec_type="ngram-simple", spec_ngram_simple_size_n=1, **OPTIONS) as alone:
        for seed in range(n):
            engine = mixed if seed % 2 else alone
            stats = GenerationStats()
            out = engine.generate(text, depth, stop_tokens=(), sampling=replace(params, seed=seed))
            counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
            drafted += sum(n > 1 for n in out.stats.accepted_lengths)
            del stats
    assert drafted > 0, "no draft was ever kept: the test proves nothing"
    stat, df = chi2_stat(counts, exact, n)
    assert df >= 4, "too few cells for the test to say anything"
    assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("draft,spec_type", [(None, "ngram-simple"), (DRAFT, "draft-dflash,ngram-mod")])
def test_a_batch_gives_each_sequence_its_solo_text(draft, spec_type):
    """-np: sequences drafting from their own histories in one batch, joining at
    different rounds, each emit what they emit alone."""
    texts = [REPEATS, "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", REPEATS[20:], "x = 1\nx = 1\nx ="]
    with Engine(TARGET, draft, spec_type=spec_type, n_seq=4, **NGRAM, **OPTIONS) as engine:
        alone, outs, seqs = solo_and_batched(engine, texts, 30)
    assert outs == alone
    assert any(n > 1 for s in seqs for n in s.stats.accepted_lengths)


def run(*args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([RUN, *args], capture_output=True, text=True, env=env, timeout=300)


def test_the_cli_drafts_without_a_drafter():
    base = ["-m", TARGET, "-p", REPEATS, "-n", "40", "-c", "512", "--spec-ngram-simple-size-n", "3"]
    plain_run, ngram = run(*base), run(*base, "--spec-type", "ngram-simple", "--spec-draft-n-max", "6")
    assert plain_run.returncode == ngram.returncode == 0, ngram.stderr
    assert plain_run.stdout == ngram.stdout
    assert "ngram-simple" in ngram.stderr and "accepted  mean" in ngram.stderr


@pytest.mark.parametrize("args,words", [
    (["-md", DRAFT, "--spec-type", "draft-mtp"], "drafts with the MTP layer of the model itself"),
    (["-md", DRAFT, "--spec-type", "draft-mtp,draft-dflash"], "one drafter at a time"),
    (["--spec-type", "draft-eagle3"], "draft-eagle3 needs an EAGLE3 drafter (-md)"),
    (["-md", DRAFT, "--spec-type", "draft-eagle3"], "is a DFlash drafter, not an EAGLE3 drafter"),
    (["--spec-type", "draft-dspark"], "draft-dspark needs a DSpark drafter (-md)"),
    (["--spec-type", "ngram-fancy"], "unknown kind 'ngram-fancy'"),
    (["--spec-type", "draft-dflash"], "needs a DFlash drafter"),
    (["-md", DRAFT, "--spec-type", "ngram-mod"], "is a DFlash drafter"),
    (["-md", TARGET, "--spec-type", "draft-dflash"], "is a qwen35 GGUF, not a DFlash drafter"),
    (["-md", DRAFT, "--spec-type", "draft-dflash,ngram-simple", "--tree-budget", "8"], "leave out --tree-budget"),
    (["--spec-type", "ngram-simple", "--spec-draft-n-max", "0"], "--spec-draft-n-max"),
    (["--spec-draft-conf-min", "1.5"], "--spec-draft-conf-min"),
    (["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "0"], "--spec-ngram-mod-n-match"),
])
def test_bad_spec_flags_exit_2_with_one_line(args, words):
    res = run("-m", TARGET, "-p", "x", "-n", "4", *args)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and words in res.stderr, res.stderr


def test_the_server_drafts_with_ngrams_over_slots(tmp_path):
    """dflash-server -np 2 --spec-type ngram-simple, no drafter: concurrent clients each
    get the text plain greedy decoding gives, and the answers report AL > 1."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers.servers import ServerProcess

    prompts = [REPEATS, REPEATS[24:], "x = 1\nx = 1\nx = 1\nx ="]
    with Engine(TARGET, n_ctx=512, n_threads=1) as plain:  # the server's options: each of its slots
        want = [plain.generate(p, 24, stop_tokens=()).text for p in prompts]
    server = ServerProcess(tmp_path, "-m", TARGET, "-c", "1024", "-np", "2", "--spec-type", "ngram-simple",
                           "--spec-ngram-simple-size-n", "3", "-t", "1")
    try:
        def ask(prompt):
            r = server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                          "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, prompts))
    finally:
        server.stop()
    assert server.proc.returncode == 0 and "Traceback" not in server.text, server.text
    assert "ngram-simple" in server.text
    assert [a["choices"][0]["text"] for a in answers] == want
    assert answers[0]["dflash"]["mean_accepted_length"] > 1


def test_spec_draft_n_max_sets_the_dflash_block(plain):
    """--spec-draft-n-max N drafts N tokens a step with DFlash too (a block of N + 1)."""
    with Engine(TARGET, DRAFT, spec_draft_n_max=3, draft_p_min=0.0, **OPTIONS) as engine:
        assert engine.block_size == 4
        got = engine.generate(REPEATS, 40, stop_tokens=())
    assert got.tokens == plain.generate(REPEATS, 40, stop_tokens=()).tokens
    assert max(got.stats.accepted_lengths) <= 4 and got.stats.mean_accepted > 1



@pytest.mark.parametrize("per_row, drafts", [(0.0, True), (1.0, False)])
def test_ngram_steps_verify_what_their_price_says_pays(plain, monkeypatch, per_row, drafts):
    """Rows as dear as a decode step: no draft is sure enough to pay, every step decodes
    plainly; free rows: the drafts go to the target. Either way the text is plain's."""
    use_cost(monkeypatch, per_row)
    want = plain.generate(REPEATS, 60, stop_tokens=()).tokens
    with Engine(TARGET, spec_type="ngram-simple", **NGRAM, **OPTIONS) as engine:
        got = engine.generate(REPEATS, 60, stop_tokens=())
    assert got.tokens == want
    assert (max(got.stats.accepted_lengths) > 1) == drafts, got.stats.accepted_lengths
    assert (got.stats.drafts.drafted.get("ngram-simple", 0) > 0) == drafts
