"""The weightless kinds together (--spec-type suffix,ngram-mod, beside a drafter model or
alone): each step the offer that pays best at the target's verify cost, every source
judged on every step, and greedy output equal token for token to plain decoding."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflash_gguf.decoding.step import sequence_steps
from dflash_gguf.decoding.tree import DraftTree
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.requests import Request
from dflash_gguf.speculation.suffix import SuffixDrafts
from dflash_gguf.speculation.weightless import Offer, Offers

from helpers.decoding_checks import REPEATS, FlatCost, solo_and_batched, use_cost
from helpers.paths import ROOT

DATA = ROOT / "dflash_gguf" / "data"
TARGET, DRAFT = str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf")
OPTIONS = dict(n_ctx=512, kv_type="f32", n_threads=1)
NGRAM = dict(spec_ngram_simple_size_n=3, spec_ngram_mod_n_match=3, spec_ngram_mod_n_min=1)


def chain_tree(tokens, probs) -> DraftTree:
    """A one-branch suffix tree below token 0 (its nodes' scores: log path probabilities)."""
    n = len(tokens)
    return DraftTree([0] + list(tokens), [-1] + list(range(n)), list(range(n + 1)),
                     [0.0] + [float(np.log(p)) for p in probs], list(range(1, n + 1)))


# ---- the choice -----------------------------------------------------------------------------

SURE = Offer("ngram-mod", np.array([0.97]), drafts=[5])
LONG = Offer("suffix", np.array([0.9, 0.8, 0.7, 0.6, 0.5]), tree=chain_tree([1, 2, 3, 4, 6], [0.9, 0.8, 0.7, 0.6, 0.5]),
             run=6)


@pytest.mark.parametrize("per_row, kind, size", [
    (0.0, "suffix", 5),      # free rows: the longest expectation, whole
    (0.5, "suffix", 3),      # (1 + 2.4) / 2.5 = 1.36 beats 3.5 drafts at 3.0 and the sure one's 1.97 / 1.5
    (0.7, "ngram-mod", 1),   # 1.97 / 1.7 = 1.16 beats the long one's best, 2.7 / 2.4 = 1.125
    (1.0, None, 0),          # rows as dear as a step: nothing beats the last token alone
])
def test_the_offer_with_the_most_tokens_per_second_is_verified(per_row, kind, size):
    cost = FlatCost(per_row)
    chosen, rate = Offers([SURE, LONG]).cheapest(cost)
    assert (chosen.kind if chosen else None, len(chosen.probs) if chosen else 0) == (kind, size)
    if chosen is not None:
        assert rate == pytest.approx((1 + chosen.probs.sum()) / cost(1 + size)) and rate > 1.0
        if chosen.tree is not None:
            assert len(chosen.tree) == 1 + size  # the tree itself is cut
    assert Offers([SURE, LONG]).likeliest() is LONG  # unpriced: the likeliest, whole


def test_every_source_is_judged_on_every_step():
    """The n-gram sources are judged on their drafts, verified or not; suffix's tree as far
    as it was verified, or on its first level when another offer (or none) was."""
    step = Offers([SURE, LONG], ngram=[([5], 3), ([], 0)])
    assert step.judged(SURE) == (step.ngram, SuffixDrafts.judge(LONG.tree, LONG.run, 1))
    assert step.judged(None) == (step.ngram, (LONG.tree, LONG.run, 1, False))
    cut = LONG.cut(2)
    ngram, (tree, run, deepest, corpus) = step.judged(cut)
    assert ngram == step.ngram and tree is cut.tree and (run, deepest, corpus) == (LONG.run, 2, False)
    from_corpus = replace(LONG, corpus=True)  # judged against the corpus's hazard
    assert Offers([SURE, from_corpus]).judged(from_corpus.cut(2))[1][3] is True
    assert Offers([SURE], ngram=[([5], 3)]).judged(None) == ([([5], 3)], None)


# ---- decoding -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain():
    with Engine(TARGET, **OPTIONS) as engine:
        yield engine


@pytest.fixture(autouse=True)
def free_rows(monkeypatch):
    use_cost(monkeypatch, 0.0)


def test_greedy_suffix_beside_ngram_equals_plain(plain):
    """Both kinds offer drafts each step and the better is verified: the text is plain
    decoding's, both kinds' drafts were verified and kept, and a kind was judged on steps
    that verified the other's draft."""
    want = plain.generate(REPEATS, 60, stop_tokens=()).tokens
    with Engine(TARGET, spec_type="suffix,ngram-simple", spec_draft_n_max=8, **NGRAM, **OPTIONS) as engine:
        assert engine.suffix_corpora is not None and engine.setup.weightless.chains == ("ngram-simple",)
        seq = engine.sequence(Request(engine.encode(REPEATS), 60, stop_tokens=()))
        d, got, aside = seq.stats.drafts, [], {"ngram-simple": 0, "suffix": 0}
        hazards = {"ngram-simple": seq.proposing.ngram.hazards[0], "suffix": seq.proposing.suffix.hazard}

        def judged():  # per kind: its hazard's trials, the tokens it has had verified
            return {k: (h.trials.sum(), d.drafted.get(k, 0)) for k, h in hazards.items()}

        before = judged()
        for new in sequence_steps(seq):  # each step runs as the loop asks for it
            got += new
            after = judged()
            for k in aside:
                aside[k] += after[k][0] != before[k][0] and after[k][1] == before[k][1]
            before = after
    assert got == want
    assert d.accepted.get("suffix", 0) > 0 and d.accepted.get("ngram-simple", 0) > 0, (d.drafted, d.accepted)
    assert sum(aside.values()) > 0, "a kind was judged only where it was verified"


@pytest.mark.parametrize("draft, spec_type", [
    (None, "suffix,ngram-mod"),
    (DRAFT, "draft-dflash,suffix,ngram-simple"),
])
def test_a_batch_of_weightless_kinds_gives_each_sequence_its_solo_text(draft, spec_type):
    texts = [REPEATS, "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "x = 1\nx = 1\nx ="]
    with Engine(TARGET, draft, spec_type=spec_type, n_seq=3, spec_suffix_cache_mb=0, **NGRAM, **OPTIONS) as engine:
        alone, outs, seqs = solo_and_batched(engine, texts, 30)
    assert outs == alone
    assert any(n > 1 for s in seqs for n in s.stats.accepted_lengths)


def test_at_depth_every_row_costs_more_and_offers_are_cut_shorter():
    """Each verified row reads the whole context: at depth the table prices every row
    dearer (CostTable's per-cell seconds, the more rows the more), so an offer that pays
    whole at the start of a context pays only in part deep into one, and where a row of
    context costs enough, not at all."""
    from dflash_gguf.speculation.verify_cost import CostTable

    rows = [1, 2, 4, 8]
    base = [1.0, 1.1, 1.3, 1.7]  # rows nearly free at no depth
    cost = CostTable("test", rows, base, base, depth_rows=[1, 8], per_cell=[1e-4, 8e-4])
    shallow, _ = Offers([SURE, LONG]).cheapest(cost, 0)
    deep, deep_rate = Offers([SURE, LONG]).cheapest(cost, 8192)
    assert (shallow.kind, len(shallow.probs)) == ("suffix", 5)
    assert deep is not None and len(deep.probs) < 5
    assert deep_rate == pytest.approx((1 + deep.probs.sum()) / float(cost.chain(1 + len(deep.probs), 8192)))
    assert Offers([SURE, LONG]).cheapest(cost, 10 ** 6) == (None, 0.0)


class Arms:
    """auto's side of the choice beside draft-simple: the rate it expects of its arm."""

    current = 1

    def __init__(self, rate: float):
        self.expected = rate

    def rate(self, arm: int) -> float:
        return self.expected

    def at_depth(self, depth: int) -> None:
        pass


@pytest.mark.parametrize("auto_rate, kept, kind", [
    (1.2, 0.0, "suffix"),   # priced: the long offer cut to 3 (1.36 tokens a unit) beats auto's arm
    (1.5, 0.0, None),       # auto's arm is faster: the small model's turn
    (None, 2.0, "suffix"),  # no auto: the likeliest, where it expects more than the small model keeps
    (None, 4.0, None),
])
def test_beside_draft_simple_an_offer_must_beat_the_small_models_turn(auto_rate, kept, kind):
    from dflash_gguf.speculation.draft_simple import SimpleWeightlessProposer
    from dflash_gguf.speculation.pricing import RunHazards
    from dflash_gguf.speculation.weightless import WeightlessKinds

    auto = Arms(auto_rate) if auto_rate is not None else None
    proposer = SimpleWeightlessProposer(None, 3, 0, 0.0, False, auto, WeightlessKinds(None, None, None, 8, RunHazards()),
                                        FlatCost(0.5))
    chosen = proposer.chosen(Offers([SURE, LONG]), kept)
    assert (chosen.kind if chosen else None) == kind
    if auto is not None and chosen is not None:
        assert len(chosen.probs) == 3
