"""draft-simple (--spec-type draft-simple): a smaller model of the target's vocabulary
drafts token by token. Pairs: a tiny seeded Qwen3 target with a smaller seeded Qwen3 of
the same tokenizer (random: its drafts are rarely right), with its own q8_0 and q4_0
copies (mostly right) and with itself (always right); the demo target (qwen35, recurrent) drafting for
itself. Oracles: the target's own decoding (greedy token for token; sampled, the
distribution enumerated exactly, chi-square at 0.1%) and llama.cpp's draft-simple through
llama-speculative-simple on the same GGUFs (its drafted and accepted counts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.runtime.errors import ConfigError
from dflash_gguf.speculation.draft_simple import SimpleDraft, vocab_difference
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.runtime.target import DECODE, LOGITS_LAST, LOGITS_NONE, Rows, Target, TargetConfig

from helpers.decoding_checks import SMALL, our_draft_simple
from helpers.paths import ROOT

DATA = ROOT / "dflash_gguf" / "data"
DEMO = str(DATA / "demo-target.gguf")
DEMO_DRAFT = str(DATA / "demo-draft.gguf")
RUN = str(Path(sys.executable).with_name("dflash-run"))
OPTIONS = dict(n_ctx=512, kv_type="f32", n_threads=1)
TEXTS = ["def quicksort(xs):\n    if len(xs) < 2:\n", "import os\n\n\ndef main():\n"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, convert_model):
    from helpers.fixtures import make_qwen3, make_tokenizer

    root = tmp_path_factory.mktemp("draft_simple")
    target_dir = make_qwen3(root / "target", seed=1)
    # the same shapes, its tokenizer trained to fewer tokens: its special tokens sit where
    # the target has trained ones
    other = make_qwen3(root / "other", seed=2, **SMALL)
    make_tokenizer(other, vocab_size=1000, regex="qwen2")
    return {
        "target": str(convert_model(target_dir, "f32")),
        "small": str(convert_model(make_qwen3(root / "small", seed=2, **SMALL), "f32")),
        "q8": str(convert_model(target_dir, "q8_0")),
        "q4": str(convert_model(target_dir, "q4_0")),  # wrong more often, its second choice often right
        "other": str(convert_model(other, "f32")),
        "bigger": str(convert_model(make_qwen3(root / "bigger", seed=2, vocab_size=1200, **SMALL), "f32")),
    }


@pytest.fixture(scope="module")
def plain(files):
    with Engine(files["target"], **OPTIONS) as engine:
        yield engine


@pytest.mark.parametrize("drafter", ["small", "q8", "target"])
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_output_equals_plain_greedy(files, plain, drafter, tree):
    """Chain and tree (the chain with the second choices beside it) keep plain greedy
    output token for token, also when a request continues the context; the target
    drafting for itself is always right."""
    n_max = 4
    want = [plain.generate(t, 40, stop_tokens=()).tokens for t in TEXTS]
    with Engine(files["target"], files[drafter], spec_draft_n_max=n_max, tree_budget=8 if tree else None,
                **OPTIONS) as engine:
        assert engine.setup.simple is not None and engine.setup.simple.tree == tree  # auto-detected kind
        got = [engine.generate(t, 40, stop_tokens=()) for t in TEXTS]
        assert [g.tokens for g in got] == want
        longer = engine.encode(TEXTS[1]) + got[1].tokens
        again = engine.generate(longer, 20, stop_tokens=())
        assert again.stats.reused_tokens == len(longer) - 1
    assert again.tokens == plain.generate(longer, 20, stop_tokens=()).tokens
    if tree:  # a tree's drafts counted are its nodes below the root, padding left out
        assert all(g.stats.drafts.drafted["draft-simple"] == sum(g.stats.trees.sizes) for g in got)
    lengths = [n for g in got for n in g.stats.accepted_lengths]
    if drafter == "target":
        for g in got:  # every draft right; the last step is cut by max_tokens
            assert set(g.stats.accepted_lengths[:-1]) == {n_max + 1}, g.stats.accepted_lengths
    elif drafter == "q8":
        assert sum(lengths) / len(lengths) > 2, lengths


@pytest.mark.parametrize("spec_type, weightless", [
    ("suffix,draft-simple", ("suffix",)),
    ("draft-simple,suffix,ngram-simple", ("suffix", "ngram-simple")),
])
def test_greedy_weightless_kinds_beside_draft_simple_equal_plain_greedy(files, plain, spec_type, weightless):
    """draft-simple beside the weightless kinds: their likeliest offer where it expects to
    keep more drafts than the small model has lately, else the small model's; the text
    is plain decoding's, the small model drafted, and the weightless drafts were kept."""
    from helpers.decoding_checks import REPEATS

    want = plain.generate(REPEATS, 60, stop_tokens=()).tokens
    with Engine(files["target"], files["q4"], spec_type=spec_type, spec_draft_n_max=4, spec_ngram_simple_size_n=3,
                spec_ngram_mod_n_match=3, spec_ngram_mod_n_min=1, **OPTIONS) as engine:
        assert engine.setup.simple is not None
        got = engine.generate(REPEATS, 60, stop_tokens=())
        again = engine.generate(REPEATS, 60, stop_tokens=(), corpus="other")  # a key with nothing earlier
    assert got.tokens == want and again.tokens == want
    s = got.stats.drafts
    assert sum(s.accepted.get(kind, 0) for kind in weightless) > 0, (s.drafted, s.accepted)
    assert s.drafted.get("draft-simple", 0) > 0, s.drafted


def test_every_part_of_a_step_reads_the_sequences_one_history(files):
    """A sequence's tokens are kept once (decoding.Tokens.text: the prompt, the output,
    the bonus last): the sampler's penalty window, the suffix index's own text and the
    small model's record of what its slot holds are that list itself, never a copy; and
    after every step it is the prompt and the tokens the step returned, in order."""
    from dflash_gguf.decoding.step import sequence_steps
    from dflash_gguf.decoding.requests import Request
    from dflash_gguf.speculation.suffix import OWN
    from helpers.decoding_checks import REPEATS

    sampling = SamplingParams(presence_penalty=0.5, repeat_last_n=-1)
    with Engine(files["target"], files["q4"], spec_type="suffix,draft-simple", spec_draft_n_max=4,
                **OPTIONS) as engine:
        prompt = engine.encode(REPEATS)
        seq = engine.sequence(Request(prompt, 40, stop_tokens=(), sampling=sampling))
        out, steps = [], 0
        for new in sequence_steps(seq):
            out += new
            text = seq.tokens.text
            assert text == prompt + out and seq.tokens.bonus == out[-1] and seq.tokens.n_past == len(text) - 1
            assert seq.sampler.history is text
            assert seq.proposing.weightless.suffix.own.docs.get(OWN, text) is text  # indexed from the first step on
            steps += 1
        assert engine.simple_draft.held[seq.slot].history is seq.tokens.text
        assert seq.proposing.weightless.suffix.own.docs[OWN] is seq.tokens.text
        assert seq.stats.drafts.drafted.get("draft-simple", 0) > 0
    assert steps > 1 and len(out) == 40

def test_the_tree_keeps_second_choices_the_chain_misses(files, plain):
    """Where the drafter's top choice is wrong and its second right, the tree keeps it:
    the same output in fewer steps than the chain."""
    want = [plain.generate(t, 40, stop_tokens=()).tokens for t in TEXTS]
    steps = {}
    for tree in (None, 8):
        with Engine(files["target"], files["q4"], spec_draft_n_max=4, tree_budget=tree, **OPTIONS) as engine:
            got = [engine.generate(t, 40, stop_tokens=()) for t in TEXTS]
        assert [g.tokens for g in got] == want
        steps[tree] = sum(len(g.stats.accepted_lengths) for g in got)
    assert steps[8] < steps[None], steps


def test_constrained_output_equals_plain_constrained_output(files, plain):
    """Under a grammar the chain is cut before the first draft the grammar rejects (forced
    text in place of guesses): the output is plain constrained decoding's."""
    from dflash_gguf.decoding.constraints import Constraint

    params = SamplingParams(constraint=Constraint.gbnf('root ::= "    return sorted(xs)" [a-z ]+'))
    want = plain.generate(TEXTS[0], 30, sampling=params)
    for tree in (None, 8):
        with Engine(files["target"], files["q4"], spec_draft_n_max=4, tree_budget=tree, **OPTIONS) as engine:
            got = engine.generate(TEXTS[0], 30, sampling=params)
        assert got.tokens == want.tokens and got.text.startswith("    return sorted(xs)")
        assert max(got.stats.accepted_lengths) > 1  # the forced text, verified as drafts


def test_p_min_and_n_min_cut_the_chain(files, plain, monkeypatch):
    """p-min stops drafting before a draft the drafter gives less than p-min (of its top
    10's mass, as llama.cpp counts it); n-min drops a shorter chain."""
    from dflash_gguf.decoding import verify as verifying

    verified = []  # drafts verified per step

    def verify_rows(seq, proposal):
        rows = verify(seq, proposal)
        verified.append(rows.n_rows - 1)
        return rows

    verify = verifying.verify_rows
    monkeypatch.setattr(verifying, "verify_rows", verify_rows)
    want = plain.generate(TEXTS[0], 30, stop_tokens=()).tokens
    sizes = {}
    for p_min, n_min in ((0.0, 0), (0.3, 0), (0.3, 2)):
        with Engine(files["target"], files["small"], spec_type="draft-simple", spec_draft_n_max=4,
                    draft_p_min=p_min, spec_draft_n_min=n_min, **OPTIONS) as engine:
            got = engine.generate(TEXTS[0], 30, stop_tokens=())
        assert got.tokens == want
        # the Engine counts the drafts its steps verified, and those kept
        assert got.stats.drafts.drafted["draft-simple"] == sum(verified)
        assert got.stats.drafts.accepted["draft-simple"] == sum(n - 1 for n in got.stats.accepted_lengths)
        sizes[p_min, n_min], verified[:] = list(verified), []
    assert set(sizes[0.0, 0][:-4]) == {4}  # whole chains (the last steps: what max_tokens leaves)
    assert {1, 2} <= set(sizes[0.3, 0]) and max(sizes[0.3, 0]) < 4
    assert 2 in sizes[0.3, 2] and 1 not in sizes[0.3, 2]


# ---- llama.cpp's draft-simple ---------------------------------------------------------------


@pytest.mark.parametrize("drafter,p_min,truncates", [("small", 0.0, True), ("q8", 0.0, True), ("q8", 0.3, True),
                                                    ("small", 0.5, True), ("q4", 0.3, False)])
def test_drafted_and_accepted_counts_equal_llama_cpp(files, drafter, p_min, truncates):
    """The same steps as llama.cpp's draft-simple on the same GGUFs draft the same tokens:
    its drafted and accepted counts per prompt, with the whole chain and with p-min
    cutting it, the rejected drafts dropped either way."""
    from helpers.speculative_simple import llama_speculative_simple

    drafted = accepted = 0
    for text in TEXTS:
        want = llama_speculative_simple(files["target"], text, 40, "draft-simple", 4, draft=files[drafter],
                                        p_min=p_min)
        got = our_draft_simple(files, drafter, text, 40, 4, p_min, truncates)
        assert {k: got[k] for k in ("n_drafted", "n_accept", "n_predict")} == \
            {k: want[k] for k in ("n_drafted", "n_accept", "n_predict")}, text
        drafted, accepted = drafted + got["n_drafted"], accepted + got["n_accept"]
    if drafter != "small":
        assert accepted > drafted / 2, (accepted, drafted)
    if p_min > 0:
        assert drafted < 4 * 40 / 2  # the cut drafted less than whole chains would


# ---- bad input ------------------------------------------------------------------------------

def test_truncation_is_refused_where_it_cannot_be_exact(files):
    from dflash_gguf.runtime.native import DflashError

    with Target(DEMO, TargetConfig(n_ctx=64, n_threads=1)) as recurrent:
        assert not recurrent.can_truncate()
        recurrent.prefill([1, 2, 3], LOGITS_NONE)
        with pytest.raises(DflashError, match="recurrent state cannot go back"):
            recurrent.seq_truncate(0, 1)
    with Target(files["target"], TargetConfig(n_ctx=64, n_threads=1)) as attention:
        assert attention.can_truncate() and attention.n_past == 0
        attention.prefill([1, 2, 3, 4], LOGITS_NONE)
        with pytest.raises(DflashError, match="cannot truncate sequence 0 of 4 positions to 5"):
            attention.seq_truncate(0, 5)
        attention.verify([5, 6])
        with pytest.raises(DflashError, match="between a verify and its commit"):
            attention.seq_truncate(0, 2)
        attention.commit(1)
        attention.decode([7])
        attention.seq_truncate(0, 2)
        assert attention.n_past == 2
        attention.decode([9])  # continues as if only [1, 2] had been decoded
        after = attention.logits(0, 1)
        attention.reset()
        attention.prefill([1, 2, 9])
        np.testing.assert_allclose(after, attention.logits(0, 1), rtol=0, atol=1e-5)


def test_a_vocabulary_mismatch_names_the_first_difference(files, tmp_path):
    assert vocab_difference(files["target"], files["small"]) is None
    why = vocab_difference(files["target"], files["other"])
    assert why is not None and why.startswith("token 1000 differs") and "<|endoftext|>" in why, why
    assert "sizes differ by more than 128" in vocab_difference(files["target"], files["bigger"])
    with pytest.raises(ValueError, match=r"does not share the vocabulary .*: token \d+ differs"):
        Engine(files["target"], files["other"], **OPTIONS)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="GGUF"):
        Engine(files["target"], str(junk), spec_type="draft-simple", **OPTIONS)
    with pytest.raises(ConfigError, match="is a DFlash drafter .* not a model that drafts on its own"):
        Engine(DEMO, DEMO_DRAFT, spec_type="draft-simple", **OPTIONS)
    with pytest.raises(ConfigError, match="needs the small model that drafts"):
        Engine(files["target"], spec_type="draft-simple", **OPTIONS)


def run(*args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([RUN, *args], capture_output=True, text=True, env=env, timeout=300)


def test_the_cli_drafts_with_a_small_model(files):
    base = ["-m", files["target"], "-p", TEXTS[0], "-n", "30", "-c", "512", "-t", "1"]
    plain_run = run(*base)
    simple = run(*base, "-md", files["q8"], "--spec-type", "draft-simple", "--spec-draft-n-max", "5",
                 "--spec-draft-p-min", "0.1", "--spec-draft-n-min", "1", "-cd", "256", "-ngld", "all")
    assert plain_run.returncode == simple.returncode == 0, simple.stderr
    assert plain_run.stdout == simple.stdout
    assert "draft-simple chain" in simple.stderr and "accepted  mean" in simple.stderr
    bad = run(*base, "-md", files["other"])
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "token" in bad.stderr, bad.stderr


# ---- several sequences, a recurrent drafter, sampling ----------------------------------------

def test_a_batch_gives_each_sequence_its_solo_text(files):
    """-np: sequences drafting with one small model (a slot each), joining at different
    rounds, each emit what they emit alone."""
    texts = TEXTS + [TEXTS[0][10:], "x = 1\nx ="]
    from helpers.decoding_checks import solo_and_batched

    for tree_budget in (None, "auto"):  # auto: each sequence chooses plain or chain for itself
        with Engine(files["target"], files["q8"], n_seq=4, spec_draft_n_max=3, tree_budget=tree_budget,
                    **OPTIONS) as engine:
            alone, outs, seqs = solo_and_batched(engine, texts, 24)
        assert outs == alone, tree_budget
        assert all(s.stats.trees.auto is not None for s in seqs) == (tree_budget == "auto")
        if tree_budget is None:  # (auto may decode every batched sequence plainly: it learnt from the solo runs)
            assert any(n > 1 for s in seqs for n in s.stats.accepted_lengths)


def test_a_recurrent_drafter_keeps_in_step():
    """The demo target (qwen35: Gated DeltaNet layers, whose state a chain commit rolls
    back) drafting for itself: every draft right, chain and tree, output as plain."""
    with Engine(DEMO, **OPTIONS) as plain_demo:
        want = plain_demo.generate(TEXTS[0], 30, stop_tokens=()).tokens
    for tree in (None, 8):
        with Engine(DEMO, DEMO, spec_type="draft-simple", spec_draft_n_max=4, tree_budget=tree,
                    **OPTIONS) as engine:
            got = engine.generate(TEXTS[0], 30, stop_tokens=())
        assert got.tokens == want
        assert got.stats.accepted_lengths[:-1] == [5] * (len(got.stats.accepted_lengths) - 1)


def test_a_window_starts_a_lagging_drafter_afresh_from_the_last_tokens(files):
    """draft(window=W) for a drafter that lacks more than W committed tokens (auto's probe
    after plain steps): it takes only the context's last W, drafting as a drafter given
    just those would, and later drafts continue from that window."""
    config = TargetConfig(n_ctx=512, kv_type="f32", n_threads=1)
    target = Target(files["target"], config)
    windowed, fresh = SimpleDraft(files["q8"], config, target), SimpleDraft(files["q8"], config, target)
    try:
        rng = np.random.default_rng(3)
        context, bonus, w = [int(t) for t in rng.integers(10, 900, size=30)], 17, 8
        got = windowed.draft(0, context + [bonus], 3, window=w)[0]
        assert windowed.fed[0] == w + 1  # the window and the bonus
        assert got == fresh.draft(0, context[-w:] + [bonus], 3)[0]
        # the next step: the first draft accepted, a new bonus; the window is kept
        later = context + [bonus, got[0]]
        got2 = windowed.draft(0, later + [7], 3, window=w)[0]
        assert windowed.fed[0] == 1  # the accepted draft was decoded already: the new bonus alone
        assert got2 == fresh.draft(0, later[len(context) - w:] + [7], 3)[0]
    finally:
        windowed.close()
        fresh.close()
        target.close()


class _DearVerify:
    """A verify cost table where a verify of k rows costs 10 k^2 s: one row is plain
    decoding's step, and drafting can never pay."""

    key = "dear"  # what a real table's key names: its file, build, device and threads

    def chain(self, n_tokens, depth=0):
        return 10.0 * np.asarray(n_tokens, dtype=float) ** 2

    def __call__(self, n_nodes, depth=0):
        return 10.0 * (np.asarray(n_nodes, dtype=float) + 1) ** 2


def test_auto_decodes_plainly_where_drafting_cannot_pay(files):
    """--tree-budget auto with draft-simple: greedy output is plain decoding's, auto hears
    of every step that could draft, and where the verify's rows cost more than drafting can
    bring it decodes plainly, with a chain now and then to see whether that changed."""
    with Engine(files["target"], **OPTIONS) as plain:
        want = [plain.generate(t, 40, stop_tokens=()).tokens for t in TEXTS[:2]]
    with Engine(files["target"], files["q8"], spec_draft_n_max=3, tree_budget="auto", **OPTIONS) as engine:
        engine.choice.verify_cost = _DearVerify()  # in place of the measured table
        for text, tokens in zip(TEXTS[:2], want):
            got = engine.generate(text, 40, stop_tokens=())
            assert got.tokens == tokens
            arms = got.stats.trees.auto["arms"]
            assert set(arms) == {"plain", "chain"}
            # every step (the last, whose one token leaves no room for a draft, where a plain
            # stretch ran it)
            steps = len(got.stats.accepted_lengths)
            assert steps - 1 <= arms["plain"]["steps"] + arms["chain"]["steps"] <= steps
        assert arms["plain"]["steps"] > 3 * arms["chain"]["steps"], arms  # the second request starts on plain


def test_auto_prices_the_drafters_work_at_load_and_leaves_it_empty(files, monkeypatch):
    """prepare_auto measures, beside the verify table, what the draft-simple model's work
    costs (a token of catching up, which prices a cold chooser's first step; a drafted
    step's drafting, which prices the chain before a step of it is timed); a sequence's
    chooser starts from them, and the drafter's memory is left empty: the output stays
    plain decoding's."""
    monkeypatch.setenv("DFLASH_AUTO_MEMORY", "off")
    with Engine(files["target"], **OPTIONS) as plain:
        want = plain.generate(TEXTS[0], 24, stop_tokens=()).tokens
    with Engine(files["target"], files["q8"], spec_draft_n_max=3, tree_budget="auto", **OPTIONS) as engine:
        assert engine.choice.draft_prices == {}
        assert engine.prepare_auto()
        prices = engine.choice.draft_prices
        assert set(prices) == {"catch_up", "drafter"} and min(prices.values()) > 0, prices
        # three drafts cost more than a token's share of a 16-token feed
        assert prices["drafter"] > prices["catch_up"], prices
        part = engine.choice.auto_for(None).costs.part
        assert (part["catch_up"], part["drafter"]) == (prices["catch_up"], prices["drafter"])
        assert engine.generate(TEXTS[0], 24, stop_tokens=()).tokens == want


def _first_request_arms(files, text="def f(x):\n"):
    """A new engine's first auto request where drafting cannot pay: its arms' steps."""
    with Engine(files["target"], files["q8"], spec_draft_n_max=3, tree_budget="auto", **OPTIONS) as engine:
        engine.choice.verify_cost = _DearVerify()
        arms = engine.generate(text, 24, stop_tokens=()).stats.trees.auto["arms"]
    return arms["plain"]["steps"], arms["chain"]["steps"]


def test_a_new_engine_starts_from_what_the_last_one_learnt(files, tmp_path, monkeypatch):
    """auto_store: what auto learnt in one engine (process) is where the next engine of
    the same files, settings and machine starts: cold, a first request runs the chain
    until its first decision (SETTLE + 1 steps); warm, it decodes plainly from its first
    step. A memory file that cannot be read is ignored (cold), and then replaced; with
    DFLASH_AUTO_MEMORY=off nothing is kept."""
    from dflash_gguf.speculation.auto import AutoBudget

    memory = tmp_path / "auto-memory.json"
    monkeypatch.setenv("DFLASH_AUTO_MEMORY", "off")
    assert _first_request_arms(files)[1] == AutoBudget.SETTLE + 1
    assert not memory.exists()
    monkeypatch.setenv("DFLASH_AUTO_MEMORY", str(memory))
    memory.write_text("{not json")
    assert _first_request_arms(files)[1] == AutoBudget.SETTLE + 1  # cold
    assert len(json.loads(memory.read_text())) == 1
    plain, chain = _first_request_arms(files)
    assert chain == 0 and plain > 0, (plain, chain)
    # another setting (n-max 4) is another entry, and starts cold
    with Engine(files["target"], files["q8"], spec_draft_n_max=4, tree_budget="auto", **OPTIONS) as engine:
        engine.choice.verify_cost = _DearVerify()
        assert engine.generate("def f(x):\n", 24, stop_tokens=()).stats.trees.auto["arms"]["chain"]["steps"] > 0
    assert len(json.loads(memory.read_text())) == 2


def test_a_saved_state_restores_the_chooser():
    """AutoBudget.state() through JSON and back (AutoBudget.restored) gives the same
    state; a state of arms the setting lacks, or cut short, gives None (start cold)."""
    from dataclasses import replace

    from dflash_gguf.speculation.auto import CHAIN, PLAIN, AutoBudget, Decision

    auto = AutoBudget(_DearVerify(), 0, 4)
    for _ in range(6):
        decision = auto.choose()
        if decision.arm == CHAIN:
            decision = replace(decision, cut=auto.chain_cut(np.log(np.array([0.9, 0.5, 0.2]))))
        auto.learn(decision, 1 if decision.arm == CHAIN else 0, 0.02)
    auto.learn(Decision(CHAIN, caught_up=(2, 0.01)), 0, 0.02)
    state = json.loads(json.dumps(auto.state()))
    assert state["current"] == PLAIN
    again = AutoBudget.restored(_DearVerify(), 0, 4, state)
    assert again is not None and again.state() == auto.state()
    assert AutoBudget.restored(_DearVerify(), 0, 4, {**state, "current": 8}) is None  # no tree arms here
    assert AutoBudget.restored(_DearVerify(), 0, 4, {k: v for k, v in state.items() if k != "part"}) is None


@pytest.mark.parametrize("tree", [None, 8, "auto"])
def test_sampled_output_keeps_the_targets_distribution(tree):
    """The small model's drafts are fixed in advance: each verified row's token is the
    target's draw, so the first three tokens are distributed as the target's sampling."""
    from helpers.sampling_checks import chi2_critical, chi2_stat, exact_joint

    params, depth, n = SamplingParams(0.6, 20, 0.95), 3, 400
    with Engine(DEMO, DEMO, spec_type="draft-simple", spec_draft_n_max=2, tree_budget=tree, **OPTIONS) as engine:
        text = engine.tokenizer.encode("    def __init__(self, name):\n        self.name = name\n        self.",
                                       add_bos=False)
        exact = exact_joint(engine.target, text, params, depth)
        counts, drafted = {}, 0
        for seed in range(n):
            out = engine.generate(text, depth, stop_tokens=(), sampling=replace(params, seed=seed))
            counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
            drafted += sum(k > 1 for k in out.stats.accepted_lengths)
    assert drafted > n / 4, "few drafts were kept: the test proves little"
    stat, df = chi2_stat(counts, exact, n)
    assert df >= 4, "too few cells for the test to say anything"
    assert stat < chi2_critical(df), (stat, df)


# ---- a drafter's head cut to the kept tokens (--spec-draft-vocab, FR-Spec) -----------------

def restricted_drafts(path, kept, context, n_max):
    """The oracle: the uncut drafter's argmax over the kept tokens only, draft by draft,
    from its whole logits (one decode per draft)."""
    kept = np.asarray(kept)
    model = Target(path, TargetConfig(n_ctx=512, kv_type="f32", n_threads=1))
    try:
        model.step([Rows(0, DECODE, list(context), logits=LOGITS_LAST)])
        drafts = []
        while True:
            drafts.append(int(kept[np.argmax(model.logits(0, 1)[0][kept])]))
            if len(drafts) == n_max:
                return drafts
            model.step([Rows(0, DECODE, drafts[-1:], logits=LOGITS_LAST)])
    finally:
        model.close()


@pytest.mark.parametrize("drafter", ["small", "q4"])
def test_a_cut_heads_logits_are_the_kept_rows_of_the_whole_heads(files, drafter):
    """Loaded with kept tokens, a model's logits are the whole head's at those tokens (in
    their order: rows copied whole, quantized ones as their blocks), and its choices and
    candidates come back as token ids: the argmax over the kept tokens."""
    cfg = TargetConfig(n_ctx=512, kv_type="f32", n_threads=1)
    whole = Target(files[drafter], cfg)
    V = whole.n_vocab
    kept = tuple(int(t) for t in np.random.default_rng(0).permutation(V)[:V // 3])
    cut = Target(files[drafter], replace(cfg, head_tokens=kept))
    try:
        assert (cut.n_vocab, cut.n_head, whole.n_head) == (V, len(kept), V)
        for model in (whole, cut):
            model.step([Rows(0, DECODE, list(range(5, 17)))])
        full, part = whole.logits(0, 12), cut.logits(0, 12)
        np.testing.assert_allclose(part, full[:, kept], rtol=1e-5, atol=1e-5)
        want = np.asarray(kept)[np.argmax(full[:, kept], axis=1)]
        assert (cut.choices(0, 12) == want).all()
        assert not (whole.choices(0, 12) == want).all()  # the cut changes some choice: the test can fail
    finally:
        cut.close()
        whole.close()


@pytest.mark.parametrize("tree", [False, True])
def test_a_cut_drafter_keeps_greedy_output_and_drafts_the_kept_argmax(files, plain, tree):
    """--spec-draft-vocab: the output is plain greedy's, token for token (the target
    verifies every draft), and each draft is the uncut drafter's argmax over the kept
    tokens."""
    from dflash_gguf.speculation.draft_simple import kept_tokens

    want = [plain.generate(t, 40, stop_tokens=()).tokens for t in TEXTS]
    n = 300
    with Engine(files["target"], files["q8"], spec_draft_n_max=3, tree_budget=8 if tree else None,
                spec_draft_vocab=n, **OPTIONS) as engine:
        assert engine.simple_draft.model.n_head == n
        got = [engine.generate(t, 40, stop_tokens=()) for t in TEXTS]
        assert [g.tokens for g in got] == want
        context = engine.encode(TEXTS[0])
        drafts, _, _ = engine.simple_draft.draft(0, context, 3)
    kept = kept_tokens(files["q8"], n)
    assert len(kept) == n and set(drafts) <= set(kept)
    assert drafts == restricted_drafts(files["q8"], kept, context, 3)


def test_a_corpus_chooses_the_kept_tokens(files, plain, tmp_path):
    """--spec-draft-vocab-from: the cut head keeps the special tokens and then the tokens
    commonest in the corpus (tokenized as the target tokenizes; ties by lowest id), not the
    lowest ids; the output is still plain greedy's and every draft is a kept token."""
    from dflash_gguf.speculation.draft_simple import corpus_counts, kept_tokens
    from dflash_gguf.runtime.tokenizer import Tokenizer

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.py").write_text(TEXTS[0] * 3)
    (corpus / "sub" / "b.py").write_text(TEXTS[1] + "x = 1\n")
    tok = Tokenizer(files["target"])
    counts = corpus_counts(tok, [str(corpus)], plain.target.n_vocab)
    ids = tok.encode(TEXTS[0] * 3, add_bos=False, special=False) + tok.encode(TEXTS[1] + "x = 1\n", add_bos=False,
                                                                                special=False)
    assert counts.sum() == len(ids) and counts[ids[0]] >= 3
    n = 300
    lowest, chosen = kept_tokens(files["q8"], n), kept_tokens(files["q8"], n, counts)
    assert set(np.flatnonzero(counts)) <= set(chosen)  # every token the corpus has (fewer than n) is kept
    assert set(chosen) != set(lowest)  # the corpus changed the choice: the test can fail
    from gguf import GGUFReader

    from dflash_gguf.speculation.draft_simple import SPECIAL_TOKEN_TYPES

    kinds = np.asarray(GGUFReader(files["q8"]).fields["tokenizer.ggml.token_type"].contents())
    special = set(np.flatnonzero(np.isin(kinds, SPECIAL_TOKEN_TYPES)).tolist())
    # the rest of the n: the lowest ids the corpus lacks
    others = [t for t in range(len(kinds)) if t not in special and counts[t] == 0]
    assert sorted(set(chosen) - special - set(np.flatnonzero(counts))) == others[:n - len(set(chosen) & special)
                                                                              - np.count_nonzero(counts)]
    want = [plain.generate(t, 40, stop_tokens=()).tokens for t in TEXTS]
    with Engine(files["target"], files["q8"], spec_draft_n_max=3, spec_draft_vocab=n,
                spec_draft_vocab_from=[str(corpus)], **OPTIONS) as engine:
        assert [engine.generate(t, 40, stop_tokens=()).tokens for t in TEXTS] == want
        context = engine.encode(TEXTS[0])
        drafts, _, _ = engine.simple_draft.draft(0, context, 3)
    assert set(drafts) <= set(chosen)
    assert drafts == restricted_drafts(files["q8"], chosen, context, 3)
    with pytest.raises(ConfigError, match="give how many with --spec-draft-vocab"):
        Engine(files["target"], files["q8"], spec_draft_vocab_from=[str(corpus)], **OPTIONS)
    with pytest.raises(ConfigError, match="nowhere.txt: no such file"):
        Engine(files["target"], files["q8"], spec_draft_vocab=n, spec_draft_vocab_from=str(tmp_path / "nowhere.txt"),
               **OPTIONS)
    base = ["-m", files["target"], "-md", files["q8"], "-p", TEXTS[0], "-n", "4", "-c", "512", "-t", "1"]
    bad = run(*base, "--spec-draft-vocab-from", str(corpus))
    assert bad.returncode != 0 and "--spec-draft-vocab-from" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_a_cut_head_out_of_range_is_a_clear_error(files):
    with Target(files["small"], TargetConfig(n_ctx=64, n_threads=1)) as whole:
        V = whole.n_vocab
    with pytest.raises(ConfigError, match="spec_draft_vocab|kept tokens"):
        Engine(files["target"], files["q8"], spec_draft_vocab=-1, **OPTIONS)
    with pytest.raises(ConfigError, match="draft-simple and DFlash drafters; this run has none"):
        Engine(files["target"], spec_draft_vocab=100, **OPTIONS)
    with pytest.raises(ValueError, match=f"has {V} tokens; keep 1..{V}"):
        Engine(files["target"], files["small"], spec_draft_vocab=V + 1, **OPTIONS)
    for kept, why in [((0, 3, 0), "listed twice"), ((1, V), "outside the vocabulary"), ((), "at least one")]:
        with pytest.raises((RuntimeError, ValueError), match=why):
            Target(files["small"], TargetConfig(n_ctx=64, n_threads=1, head_tokens=kept))
    base = ["-m", files["target"], "-md", files["q8"], "-p", TEXTS[0], "-n", "4", "-c", "512", "-t", "1"]
    bad = run(*base, "--spec-draft-vocab", str(V + 5))
    assert bad.returncode != 0 and "--spec-draft-vocab" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


@pytest.mark.parametrize("n", [0, 300])
def test_the_replay_gives_the_loops_accepted_lengths(files, n):
    """draft_simple.replayed_lengths (what experiments/draft_vocab_acceptance.py reports for
    each cut N): a greedy chain's steps replayed from the uncut drafter's logits over
    prompt and output are the engine's own, step for step."""
    from dflash_gguf.speculation.draft_simple import kept_tokens, replayed_lengths

    drafter = Target(files["q4"], TargetConfig(n_ctx=512, kv_type="f32", n_threads=1))
    kept = np.arange(drafter.n_vocab) if n == 0 else np.asarray(kept_tokens(files["q4"], n))
    with Engine(files["target"], files["q4"], spec_draft_n_max=3, spec_draft_vocab=n, **OPTIONS) as engine:
        for text in TEXTS:
            ids = engine.encode(text)
            out = engine.generate(ids, 40, stop_tokens=())
            full = list(ids) + list(out.tokens)
            drafter.reset()
            drafter.step([Rows(0, DECODE, full)])
            got = replayed_lengths(drafter.logits(0, len(full)), kept, len(ids), full, 3)
            assert got == out.stats.accepted_lengths
            assert 1 < out.stats.mean_accepted < 4  # some drafts right, some wrong: the test can fail
    drafter.close()
