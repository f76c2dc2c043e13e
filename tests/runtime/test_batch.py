"""Several sequences in one target and drafter (csrc/dfl_memory.c, dfl_target_step,
dfl_draft_propose): each sequence holds its own context in a slot of their memory, and a
step runs rows of several sequences in one graph, each sequence's rows seeing exactly
what they see in a step of their own. The oracle is the same rows run alone on a target
with one slot, whose results the rest of the suite checks against transformers, PyPI
`dflash` and llama.cpp."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflash_gguf import DflashError
from dflash_gguf.speculation.auto import AutoBudget
from dflash_gguf.runtime.checkpoints import Checkpoint
from dflash_gguf.decoding.step import Sequence, sequence_steps
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.decoding.requests import GenerationStats, Request, collect
from dflash_gguf.decoding.sampling import Sampler, SamplingParams, distribution, draw, penalize
from dflash_gguf.speculation.drafting import tree_proposer
from dflash_gguf.runtime.target import CHAIN, DECODE, LOGITS_ALL, LOGITS_LAST, TREE, Rows, Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

from helpers.decoding_checks import AUTO, PLAIN_FIRST, decode_alone, decode_batch
from helpers.paths import ROOT

DATA = ROOT / "dflash_gguf" / "data"
TARGET, DRAFT = str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf")
LAYERS = read_draft_metadata(DRAFT)["target_layers"]


def load(n_seq: int, top_k: int = 4):
    target = Target(TARGET, TargetConfig(n_ctx=512, n_ubatch=64, n_verify=16, kv_type="f32", feature_layers=LAYERS,
                                         n_threads=2, n_seq=n_seq))
    return target, Draft(DRAFT, target, DraftConfig(kv_type="f32", top_k=top_k))


@pytest.fixture(scope="module")
def many():
    return load(4)


@pytest.fixture(scope="module")
def one():
    return load(1)


def prompts(n, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, int(length)).tolist() for length in rng.integers(20, 300, n)]


def prefill(target, draft, prompt, seq=0):
    target.seq_reset(seq)
    draft.seq_reset(seq)
    target.set_sampling(SamplingParams().native(), seq)
    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda _, n: draft.append(seq=seq), seq=seq)


TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def steps_of(rng):
    """Rows of one sequence for a few steps: a plain decode, a chain verify, a tree
    verify, each followed by its commit."""
    return [("decode", rng.integers(1, 1000, 1).tolist()),
            ("chain", rng.integers(1, 1000, 5).tolist()),
            ("tree", rng.integers(1, 1000, len(TREE_PARENTS)).tolist())]


def rows_of(seq, kind, tokens):
    if kind == "decode":
        return Rows(seq, DECODE, tokens, logits=LOGITS_ALL)
    if kind == "chain":
        return Rows(seq, CHAIN, tokens)
    return Rows(seq, TREE, tokens, TREE_PARENTS)


def commit(target, seq, kind):
    if kind == "chain":
        target.commit(3, seq=seq)
    elif kind == "tree":
        target.commit_path([0, 1, 4], seq=seq)


def test_a_step_of_several_sequences_equals_each_alone(many, one):
    """Decodes, chains and trees of three sequences, mixed in each step (each sequence's
    kind rotating), with their commits carried by the next step: every row's logits and
    features equal those of its sequence run alone."""
    target, draft = many
    alone, alone_draft = one
    texts = prompts(3)
    rng = np.random.default_rng(9)
    plans = [steps_of(rng) for _ in texts]
    expected = []
    for i, text in enumerate(texts):
        prefill(alone, alone_draft, text)
        got = []
        for k in range(3):
            kind, tokens = plans[i][(k + i) % 3]
            alone.step([rows_of(0, kind, tokens)])
            got.append((alone.logits(0, len(tokens)), alone.features(0, len(tokens))))
            commit(alone, 0, kind)
        alone.decode([5], LOGITS_LAST)  # the last commit's graph
        got.append((alone.logits(0, 1), None))
        expected.append(got)
    for i, text in enumerate(texts):
        prefill(target, draft, text, seq=i)
    for k in range(3):
        rows = [rows_of(i, *plans[i][(k + i) % 3]) for i in range(3)]
        target.step(rows)
        row0 = 0
        for i, r in enumerate(rows):
            n = r.n_rows
            np.testing.assert_allclose(target.logits(row0, n), expected[i][k][0], rtol=0, atol=1e-5)
            np.testing.assert_allclose(target.features(0, n, seq=i), expected[i][k][1], rtol=0, atol=1e-5)
            row0 += n
        for i, r in enumerate(rows):
            commit(target, i, plans[i][(k + i) % 3][0])
    target.step([Rows(i, DECODE, [5], logits=LOGITS_LAST) for i in range(3)])
    for i in range(3):
        np.testing.assert_allclose(target.logits(i, 1), expected[i][3][0], rtol=0, atol=1e-5)
        assert target.seq_n_past(i) == len(texts[i]) + 1 + 3 + 3 + 1


def test_a_checkpoint_restores_into_any_slot_and_a_slot_copies(many):
    """A prefix checkpoint of slot 0 restored into slot 2 (drafter context too), and slot
    0 copied into slot 3: each continues as slot 0 does."""
    target, draft = many
    text = prompts(1, seed=11)[0]
    prefill(target, draft, text, seq=0)
    saved = Checkpoint(target, draft, seq=0)
    target.seq_copy(0, 3)
    saved.restore(target, draft, seq=2)
    assert target.seq_n_past(2) == target.seq_n_past(3) == len(text) and draft.n_past(2) == len(text)
    target.step([Rows(s, DECODE, [7, 8], logits=LOGITS_ALL) for s in (0, 2, 3)])
    logits = target.logits(0, 6)
    np.testing.assert_array_equal(logits[2:4], logits[0:2])
    np.testing.assert_array_equal(logits[4:6], logits[0:2])
    draft.propose_many([(0, 9, 8), (2, 9, 8)])  # each takes its own two decoded positions first
    assert draft.block(8, seq=0) == draft.block(8, seq=2)
    saved.close()


def test_a_propose_of_several_sequences_equals_each_alone(many, one):
    """One drafter graph drafting for three sequences, each first taking the positions its
    verify committed: every block and its ranked candidates equal those drafted alone."""
    target, draft = many
    alone, alone_draft = one
    texts = prompts(3, seed=21)
    blocks, ranked = [], []
    for text in texts:
        prefill(alone, alone_draft, text)
        alone.verify(text[-4:])                   # a verify whose kept rows ride in the propose
        alone.commit(2)
        alone_draft.propose(text[0], 8, read=False)
        blocks.append(alone_draft.block(8))
        ranked.append(alone_draft.topk(7))
    for i, text in enumerate(texts):
        prefill(target, draft, text, seq=i)
    target.step([Rows(i, CHAIN, text[-4:]) for i, text in enumerate(texts)])
    for i in range(3):
        target.commit(2, seq=i)
    draft.propose_many([(i, text[0], 8) for i, text in enumerate(texts)])
    for i in range(3):
        assert draft.block(8, seq=i) == blocks[i]
        toks, lps = draft.topk(7, seq=i)
        np.testing.assert_array_equal(toks, ranked[i][0])
        np.testing.assert_allclose(lps, ranked[i][1], rtol=0, atol=1e-5)


def test_rows_of_sequences_that_sample_differently_each_choose_their_own_way(many):
    """One step's rows of four sequences: greedy, sampled with top-k and top-p, sampled over
    the whole vocabulary, greedy with a presence penalty. A greedy row takes the argmax
    (of its penalised logits) exactly; a sampled row the draw the host's rule makes with
    its uniform and its own settings (over its kept candidates, most likely first, when
    it ranks them; over the vocabulary in token order when it does not), up to the odd
    row where float rounding puts the uniform on a boundary."""
    target, draft = many
    texts = prompts(3, seed=31)
    texts.append(texts[0])  # the penalised sequence: the greedy one's context, penalised
    settings = [SamplingParams(), SamplingParams(0.8, 20, 0.9, seed=1), SamplingParams(1.0, seed=2),
                SamplingParams(presence_penalty=1.5, repeat_last_n=-1)]
    samplers = [Sampler(p, text) for p, text in zip(settings, texts)]
    for i, text in enumerate(texts):
        prefill(target, draft, text, seq=i)
    agree = rows_sampled = 0
    for _ in range(4):
        rows = []
        for i, s in enumerate(samplers):
            s.apply(target, seq=i)
            s.prepare(target, 3, lambda: [[], [1], [1, 2]], seq=i)
            rows.append(Rows(i, CHAIN, [1, 2, 3]))
        target.step(rows)
        choices = target.choices(0, 12)
        for i, s in enumerate(samplers):
            for r in range(3):
                logits = target.logits(3 * i + r, 1)[0]
                if s.greedy:
                    assert choices[3 * i + r] == int(np.argmax(logits))
                    continue
                p = distribution(logits, s.params)[0]
                order = np.argsort(-p, kind="stable") if s.params.top_k else np.arange(len(p))
                want = int(order[draw(p[order], float(s._u[r]))])
                agree += int(choices[3 * i + r]) == want
                rows_sampled += 1
            target.commit(1, seq=i)
        paths = [[], [1], [1, 2]]
        for r in range(3):  # the penalised rows are the greedy sequence's rows, penalised over its window
            want = penalize(target.logits(r, 1)[0], texts[0] + paths[r], settings[3])
            np.testing.assert_allclose(target.logits(9 + r, 1)[0], want, rtol=0, atol=1e-4)
    assert agree >= rows_sampled - 1, (agree, rows_sampled)


def test_each_sequence_keeps_its_features_until_its_own_next_call(many, one):
    """A sequence's feature rows are its own: other sequences' graphs (a prefill chunk, a
    batched step) leave them, so its verify's kept positions reach the drafter in its next
    propose whatever ran between (no flush before other graphs); its own next target calls
    keep them while they fit beside theirs (a drafter behind by several calls drafts as one
    that kept up), a call that does not fit replaces them, and a drafter that did not take
    them first is refused with a reason. The target learns how far the drafter is from
    the drafter's own record, through the calls given the drafter (the decoding loop gives
    every call it); the drafter says when it must take them first (catch_up_due)."""
    target, draft = many
    alone, alone_draft = one
    texts = prompts(3, seed=51)
    prefill(alone, alone_draft, texts[0])
    alone.verify(texts[0][-5:])
    alone.commit(3)
    alone_draft.propose(texts[0][1], 8, read=False)
    want = alone_draft.block(8)
    for i in range(2):
        prefill(target, draft, texts[i], seq=i)
    target.verify(texts[0][-5:], seq=0)
    features = target.features(0, 5, seq=0)
    target.commit(3, seq=0)
    prefill(target, draft, texts[2], seq=2)                        # a prefill chunk of another sequence
    target.step([Rows(1, CHAIN, [4, 5, 6]), Rows(2, DECODE, [7], logits=LOGITS_LAST)], draft)
    target.commit(2, seq=1)
    np.testing.assert_array_equal(target.features(0, 5, seq=0), features)
    draft.propose_many([(0, texts[0][1], 8)])
    assert draft.block(8, seq=0) == want
    # sequence 1's drafter stays behind its own next call (by the step's 2 positions and the decode's)
    prefill(alone, alone_draft, texts[1])
    alone.step([Rows(0, CHAIN, [4, 5, 6])])
    alone.commit(2)
    alone_draft.append()
    alone.decode([9], LOGITS_LAST)
    alone_draft.propose(10, 8, read=False)
    assert not draft.catch_up_due(1, 32 - 2) and draft.catch_up_due(1, 32 - 1)  # a slot's 32 rows (2 x n_verify)
    target.step([Rows(1, DECODE, [9], logits=LOGITS_LAST)], draft)
    draft.propose_many([(1, 10, 8)])
    assert draft.block(8, seq=1) == alone_draft.block(8)
    # ... but not behind a call that does not fit: the positions it lacks are gone
    target.step([Rows(1, DECODE, [11], logits=LOGITS_LAST)], draft)
    assert not draft.catch_up_due(1, 32 - 1) and draft.catch_up_due(1, 32)
    target.decode(list(range(20, 84)), LOGITS_LAST, seq=1)
    with pytest.raises(DflashError, match="gone"):
        draft.propose_many([(1, 12, 8)])
    draft.seq_reset(1)


def test_prefill_chunks_share_one_set_of_feature_rows(many):
    """With several slots, each slot's feature rows hold a verify and as many lacking rows
    (2 x n_verify), and a prefill chunk of any slot goes to one set of chunk rows after
    them: the chunk's drafter takes it from there, and a drafter that let another slot's
    chunk replace it first is refused with a reason, not handed the other's features."""
    target, draft = many
    texts = [(p * 10)[:80] for p in prompts(2, seed=57)]
    for seq in (2, 3):
        target.seq_reset(seq)
        draft.seq_reset(seq)
    target.decode(texts[0][:40], LOGITS_LAST, seq=2)
    features = target.features(0, 40, seq=2)
    draft.append(seq=2)  # taken from the chunk rows
    target.decode(texts[1][:40], LOGITS_LAST, seq=3)
    assert not np.array_equal(target.features(0, 40, seq=3), features)
    target.decode(texts[0][40:80], LOGITS_LAST, seq=2)
    target.decode(texts[1][40:80], LOGITS_LAST, seq=3)  # replaces sequence 2's chunk before its drafter took it
    with pytest.raises(DflashError, match="gone"):
        draft.append(seq=2)
    for seq in (2, 3):
        target.seq_reset(seq)
        draft.seq_reset(seq)


@pytest.mark.parametrize("kind", ["chain", "tree", "decode"])
def test_a_prompt_chunk_shares_a_step_with_the_others_rows(one, kind):
    """Two slots, -ub 64: a prompt's chunk taking what the other sequence's rows (a
    verify of 7, or a one-token decode) leave of 64 rides in a step after them, in the
    prefill slot's graph, whose compute memory the load reserved: the rows' and the
    chunk's logits and features, and what both sequences compute next, equal each alone;
    a step over 64 rows with a chunk, or with two chunks, is refused."""
    target, draft = load(2)
    alone, alone_draft = one
    running, prompt = prompts(2, seed=71)
    prompt = (prompt * 3)[:150]
    tokens = np.random.default_rng(5).integers(1, 1000, len(TREE_PARENTS) if kind != "decode" else 1).tolist()
    n, chunk = len(tokens), 64 - len(tokens)
    want = {}
    prefill(alone, alone_draft, running)
    alone.step([rows_of(0, kind, tokens)])
    want["rows"] = (alone.logits(0, n), alone.features(0, n))
    commit(alone, 0, kind)
    alone.decode([7], LOGITS_LAST)
    want["running next"] = alone.logits(0, 1)
    prefill(alone, alone_draft, prompt[:82], seq=0)
    alone.decode(prompt[82:82 + chunk], LOGITS_LAST)
    want["chunk"] = (alone.logits(0, 1), alone.features(0, chunk))
    alone.decode([9], LOGITS_LAST)
    want["joining next"] = alone.logits(0, 1)

    prefill(target, draft, running, seq=0)
    prefill(target, draft, prompt[:82], seq=1)
    compute = target.info()["compute_bytes"]
    with pytest.raises(DflashError, match=f"at most the ubatch size 64 rows, got {n + chunk + 1}"):
        target.step([rows_of(0, kind, tokens), Rows(1, DECODE, prompt[82:83 + chunk], logits=LOGITS_LAST)])
    with pytest.raises(DflashError, match="one prompt chunk"):
        target.step([Rows(0, DECODE, prompt[:20]), Rows(1, DECODE, prompt[82:102], logits=LOGITS_LAST)])
    target.step([rows_of(0, kind, tokens), Rows(1, DECODE, prompt[82:82 + chunk], logits=LOGITS_LAST)])
    np.testing.assert_allclose(target.logits(0, n), want["rows"][0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(target.features(0, n, seq=0), want["rows"][1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(target.logits(n, 1), want["chunk"][0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(target.features(0, chunk, seq=1), want["chunk"][1], rtol=0, atol=1e-5)
    commit(target, 0, kind)
    target.step([Rows(0, DECODE, [7], logits=LOGITS_LAST), Rows(1, DECODE, [9], logits=LOGITS_LAST)])
    np.testing.assert_allclose(target.logits(0, 1), want["running next"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(target.logits(1, 1), want["joining next"], rtol=0, atol=1e-5)
    assert target.info()["compute_bytes"] == compute


def test_steps_are_checked(many):
    target, draft = many
    prefill(target, draft, prompts(1, seed=41)[0], seq=1)
    with pytest.raises(DflashError, match="twice"):
        target.step([Rows(1, DECODE, [1], logits=LOGITS_LAST), Rows(1, DECODE, [2], logits=LOGITS_LAST)])
    with pytest.raises(DflashError, match="outside"):
        target.step([Rows(4, DECODE, [1], logits=LOGITS_LAST)])
    with pytest.raises(DflashError, match="at most the ubatch size 64 rows, got 71"):
        target.step([Rows(0, DECODE, list(range(1, 40)), logits=LOGITS_LAST), Rows(1, CHAIN, list(range(1, 17))),
                     Rows(2, CHAIN, list(range(1, 17)))])
    with pytest.raises(DflashError, match="twice"):
        draft.propose_many([(1, 5, 4), (1, 6, 4)])
    with pytest.raises(ValueError, match="outside"):
        target.seq_n_past(9)
    target.verify([1, 2], seq=1)
    with pytest.raises(DflashError, match="commit"):
        target.seq_copy(1, 2)
    target.commit(1, seq=1)


def test_decode_next_is_a_step_of_one_token_decodes_and_their_choices(many, one):
    """Plain decoding's one call a step (Target.decode_next) chooses what a step of
    one-token decodes does, each sequence as alone, and is checked as a step is."""
    target, draft = many
    ps = prompts(3, seed=43)
    for seq, p in enumerate(ps):
        prefill(target, draft, p[:-1], seq)
    got = target.decode_next([0, 1, 2], [p[-1] for p in ps], [-1.0] * 3)
    alone, alone_draft = one
    want = []
    for p in ps:
        prefill(alone, alone_draft, p[:-1])
        alone.decode([p[-1]])
        want.append(int(alone.choices(0, 1)[0]))
    assert got == want
    assert [target.seq_n_past(seq) for seq in range(3)] == [len(p) for p in ps]
    with pytest.raises(DflashError, match="twice"):
        target.decode_next([1, 1], [5, 6], [-1.0, -1.0])
    with pytest.raises(DflashError, match="outside"):
        target.decode_next([4], [5], [-1.0])


# ---- the step loop over several sequences (dflash_gguf.decoding.step) ------------------------------


PLAIN_FIRST.learnt = PLAIN_FIRST.chooser()
PLAIN_FIRST.learnt.current = -1


KINDS = ["chain", "tree", "plain", "chain"]


@pytest.mark.parametrize("kind, n_batch, graphs, tokens", [("plain", None, 1, 63), ("chain", None, 1, None),
                                                           ("tree", 150, 2, 57 + 64)])
def test_a_joining_prompt_goes_in_beside_the_running_steps(one, kind, n_batch, graphs, tokens):
    """A 300-token prompt joining a running sequence (two slots, -ub 64): with -b at -ub,
    each round is one target graph, the running step and as many prompt tokens as its
    rows leave of 64 (a plain decode's one row: 63; a chain's vary with its cut); with -b
    150, whole chunks of 64 follow while the round's budget holds them (150 less the
    shared 64: one), after a tree of 7 nodes and 57 tokens. Both emit what they emit
    alone, and the target's compute memory stays what the load reserved."""
    two = load(2)
    target = two[0]
    running, joining = prompts(2, seed=73)
    joining = (joining * 4)[:300]
    requests = [(kind, running[:30], 40, None), ("plain", joining, 8, None)]
    alone = [decode_alone(*one, k, p, n) for k, p, n, _ in requests]
    rounds = []
    last = [target.info()["n_graphs"], 0]

    def on_round(batch):
        graphs, pos = target.info()["n_graphs"], target.seq_n_past(1)
        if batch.joining or pos != last[1]:
            rounds.append((graphs - last[0], min(pos, len(joining)) - last[1]))
        last[:] = graphs, min(pos, len(joining))

    compute = target.info()["compute_bytes"]
    outs, stats = decode_batch(*two, requests, join_every=1, n_batch=n_batch, on_round=on_round)
    assert target.info()["compute_bytes"] == compute  # the chunks between the reserved extremes fit
    for i, (toks, st) in enumerate(alone):
        assert outs[i] == toks, i
        assert stats[i].accepted_lengths == st.accepted_lengths
    joined = [r for r in rounds if r[1] > 0]
    assert sum(n for _, n in joined) == len(joining)
    assert joined[1:-1] and {g for g, _ in joined[1:-1]} == {graphs}
    if tokens is not None:
        assert {n for _, n in joined[1:-1]} == {tokens}


@pytest.mark.parametrize("join_every", [0, 3])
def test_greedy_sequences_in_a_batch_decode_as_alone(many, one, join_every):
    """Four greedy requests (chains cut by confidence, a tree, plain decoding) in one batch,
    all at once or joining every few rounds, their prompts going in between the others'
    steps: each emits the tokens and accepted lengths it emits alone."""
    texts = prompts(4, seed=61)
    alone = [decode_alone(*one, kind, text, 40) for kind, text in zip(KINDS, texts)]
    outs, stats = decode_batch(*many, [(kind, text, 40, None) for kind, text in zip(KINDS, texts)], join_every)
    for i in range(4):
        assert outs[i] == alone[i][0], (KINDS[i], i)
        assert stats[i].accepted_lengths == alone[i][1].accepted_lengths
        assert stats[i].generated_tokens == 40


def test_auto_sequences_in_a_batch_decode_as_plain_greedy(many, one):
    """Greedy requests under `--tree-budget auto` in one batch (-np), each with a chooser
    of its own started from one memory: whatever each picks step by step (plain
    decoding, the chain and its length, trees), each emits plain greedy decoding's tokens
    and gets its own report of what it ran. The first starts on plain decoding, so that
    steps where it drafts nothing while the others draft come first."""
    texts = prompts(3, seed=67)
    plain = [decode_alone(*one, "plain", text, 48)[0] for text in texts]
    kinds = ["auto, plain first", "auto", "auto"]
    outs, stats = decode_batch(*many, [(kind, text, 48, None) for kind, text in zip(kinds, texts)])
    for i in range(3):
        assert outs[i] == plain[i], i
        assert sum(a["steps"] for a in stats[i].trees.auto["arms"].values()) == len(stats[i].accepted_lengths)
    # the others draft at least until their first decision, after a timed chain step
    drafted = sum(a["steps"] for name, a in stats[1].trees.auto["arms"].items() if name != "plain")
    assert stats[0].trees.auto["arms"]["plain"]["steps"] >= 5 and drafted >= AutoBudget.SETTLE + 1, \
        stats[1].trees.auto["arms"]
    assert AUTO.learnt is not None


def test_auto_plain_steps_take_plain_decodings_path(one, monkeypatch):
    """`auto`'s plain steps are plain decoding's steps: one decode_next call a token and
    no drafter graph while the feature rows keep what the drafter lacks; the probe after
    them drafts once the drafter has taken those positions, and the output is plain
    greedy's."""
    target, draft = one
    text = prompts(1, seed=71)[0]
    want = decode_alone(target, draft, "plain", text, 24)[0]
    calls = {"decode_next": 0, "propose": []}
    decode_next, propose_many = target.decode_next, draft.propose_many

    def counted_decode(*args):
        calls["decode_next"] += 1
        return decode_next(*args)

    def counted_propose(blocks):
        calls["propose"].append([(b, len(committed)) for _, _, b, committed in blocks])
        return propose_many(blocks)

    monkeypatch.setattr(target, "decode_next", counted_decode)
    monkeypatch.setattr(draft, "propose_many", counted_propose)
    chooser = PLAIN_FIRST.chooser()
    chooser.next_decision = chooser.to_probe = 12  # plain decoding until a probe at step 12
    stats = GenerationStats()
    seq = Sequence(target, draft, tree_proposer(target, draft, 8, None, chooser), Request(text, 24), stats)
    assert collect(sequence_steps(seq)) == want
    assert calls["decode_next"] >= 11
    assert calls["propose"][0] == [(8, 11)]  # the probe's block of 8, after the 11 plain steps' tokens
    assert stats.trees.auto["arms"]["plain"]["steps"] == calls["decode_next"]

def test_sampled_sequences_in_a_batch_keep_the_targets_distribution(many):
    """Four sampled requests in flight at once (the chain under both accept rules and two
    trees), each with its own seed: the joint distribution of their first three tokens
    is the target's own sampling distribution (chi-square at 0.1%)."""
    from helpers.sampling_checks import chi2_critical, chi2_stat, exact_joint

    target, draft = many
    text = Tokenizer(TARGET).encode("    def __init__(self, name):\n        self.name = name\n        self.",
                                    add_bos=False)
    params, depth, n = SamplingParams(0.6, 20, 0.95), 3, 1200
    exact = exact_joint(target, text, params, depth)
    kinds = ["chain", "reject", "tree", "tree"]
    counts = {}
    for r in range(n // 4):
        outs, _ = decode_batch(target, draft, [(kind, text, depth, replace(params, seed=4 * r + i))
                                               for i, kind in enumerate(kinds)])
        for out in outs:
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, df = chi2_stat(counts, exact, n)
    assert df >= 4, "too few cells for the test to say anything"
    assert stat < chi2_critical(df), (stat, df)
