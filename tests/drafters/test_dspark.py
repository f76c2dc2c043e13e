"""DSpark drafters (csrc/models/dspark.c): the DFlash backbone, a Markov head refining the
block and a confidence head cutting it, on a tiny DSpark GGUF built from the demo
drafter (tests/helpers/dspark_fixtures.py).

Oracles: llama.cpp's draft-dspark through llama-speculative-simple on the same GGUFs (its
drafted and accepted counts, with and without its confidence cut); the demo DFlash
drafter's own logits plus the Markov bias computed in numpy from the file's weights; and
the target's own plain greedy and sampled output."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from helpers.dspark_fixtures import DEMO_DRAFT, DEMO_HF, DEMO_TARGET, make_dspark, make_dspark_hf

from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

RUN = str(Path(sys.executable).with_name("dflash-run"))
TARGET = str(DEMO_TARGET)
N_MAX = 7  # the demo drafter's block of 8: the bonus and seven drafts
TEXTS = ["    def __init__(self, name):\n        self.name = name\n", "import os\n\n\ndef main():\n",
         "class Stack:\n    def push(self, item):\n"]


@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    return str(make_dspark(tmp_path_factory.mktemp("dspark") / "dspark.gguf", seed=7))


@pytest.fixture(scope="module")
def anchor_first(tmp_path_factory):
    """The same heads in llama.cpp's anchor-first layout (sample_from_anchor: the bonus's
    row drafts too). The demo backbone was trained for DFlash's layout, so few of these
    drafts are right: what it shows is that both runtimes draft the same ones."""
    return str(make_dspark(tmp_path_factory.mktemp("dspark") / "anchor.gguf", seed=7, from_anchor=True))


@pytest.fixture(scope="module")
def heads(dspark):
    """The Markov head's weights as the file holds them."""
    import gguf

    t = {x.name: np.asarray(x.data) for x in gguf.GGUFReader(dspark).tensors}
    return t["markov_w1.weight"], t["markov_w2.weight"], float(t["markov_w2.scale"][0])


def load(path, n_seq=1, top_k=0):
    meta = read_draft_metadata(path)
    target = Target(TARGET, TargetConfig(n_ctx=512, n_ubatch=32, n_verify=16, kv_type="f32", n_threads=2,
                                         feature_layers=meta["target_layers"], n_seq=n_seq))
    return target, Draft(path, target, DraftConfig(kv_type="f32", top_k=top_k))


def prefill(target, draft, tokens, seq=0):
    target.prefill(tokens, LOGITS_LAST, on_chunk=lambda s, n: draft.append(tokens[s:s + n], seq=seq), seq=seq)


def test_the_markov_head_biases_the_backbones_logits(dspark, heads):
    """A DSpark GGUF is drafter kind "dspark": its drafted rows' logits are the demo DFlash
    drafter's plus markov_w2 . markov_w1[prev] x scale, prev the bonus, then each row's
    argmax; its drafts are those argmaxes, and some differ from the backbone's own."""
    from dflash_gguf.runtime.tokenizer import Tokenizer

    w1, w2, scale = heads
    prompt = Tokenizer(TARGET).encode(TEXTS[1])
    logits, drafts = {}, {}
    for path in (str(DEMO_DRAFT), dspark):
        target, draft = load(path)
        prefill(target, draft, prompt)
        bonus = int(target.choices(0, 1)[0])
        drafts[path] = draft.propose(bonus)
        logits[path] = draft.logits(0, N_MAX)
        if path == dspark:
            assert read_draft_metadata(path)["kind"] == draft.kind == "dspark"
            assert draft.greedy_only and draft.has_confidence
            conf = draft.confidence(N_MAX)
            assert np.all((conf > 0) & (conf < 1))
        draft.close()
        target.close()
    prev = [bonus] + drafts[dspark][:-1]
    want = logits[str(DEMO_DRAFT)] + scale * (w1[prev] @ w2.T)
    np.testing.assert_allclose(logits[dspark], want, rtol=0, atol=1e-3 * np.abs(want).max())
    assert drafts[dspark] == [int(i) for i in logits[dspark].argmax(1)]
    assert drafts[dspark] != drafts[str(DEMO_DRAFT)]


# ---- llama.cpp's draft-dspark ---------------------------------------------------------------

def llama_draft_dspark(draft_path, text, n_predict, n_max, p_min):
    """llama-speculative-simple --spec-type draft-dspark, greedy: its counts (its p-min is
    DSpark's confidence cut)."""
    from helpers.speculative_simple import llama_speculative_simple

    return llama_speculative_simple(TARGET, text, n_predict, "draft-dspark", n_max, draft=draft_path, p_min=p_min)


def our_draft_dspark(target, draft, tokens, n_predict, n_max, conf_min, eog):
    """llama-speculative-simple's loop (speculative_simple_loop) with our target and
    drafter: every step drafts n_max after the last token, cut where the confidence head
    falls below conf_min. Its counts, and the drafts the confidence cut (n_cut)."""
    from dflash_gguf.speculation.proposers import confident_length
    from helpers.speculative_simple import speculative_simple_loop

    target.reset()
    draft.reset()
    prefill(target, draft, tokens[:-1])
    n_cut = 0

    def draft_step(last, pending, room):
        nonlocal n_cut
        drafts = draft.propose(last, n_max + 1, tokens=pending)
        if conf_min > 0:
            kept = confident_length(draft.confidence(len(drafts)), conf_min)
            n_cut += len(drafts) - kept
            drafts = drafts[:kept]
        return drafts

    counts = speculative_simple_loop(target, draft_step, tokens, n_predict, 512, eog)
    return {**counts, "n_cut": n_cut}


@pytest.mark.parametrize("layout,conf_min", [("dflash", 0.0), ("dflash", 0.6), ("anchor", 0.0), ("anchor", 0.6)])
def test_drafted_and_accepted_counts_equal_llama_cpp(request, layout, conf_min):
    """The same steps as llama.cpp's draft-dspark on the same GGUFs draft the same tokens:
    its drafted and accepted counts per prompt, with the whole chain and with the
    confidence head cutting it, in both block layouts (anchor-first: N_MAX + 1 drafts from
    as many rows, the bonus's row the first). The anchor-first file drafts from rows the
    demo backbone was never trained for, whose top two logits can nearly tie (0.008 apart
    on one step of the second prompt), where the two runtimes' float arithmetic may pick
    either: there the counts may differ by one step's worth (one accepted draft, one
    block), no more."""
    from dflash_gguf.runtime.tokenizer import Tokenizer

    path = request.getfixturevalue("dspark" if layout == "dflash" else "anchor_first")
    n_max = N_MAX + (layout == "anchor")  # anchor-first drafts a whole trained block
    tok = Tokenizer(TARGET)
    target, draft = load(path)
    drafted = accepted = cut = 0
    for text in TEXTS[:2]:
        want = llama_draft_dspark(path, text, 40, n_max, conf_min)
        got = our_draft_dspark(target, draft, tok.encode(text), 40, n_max, conf_min, tok.eog_ids)
        if layout == "dflash":
            assert {k: got[k] for k in ("n_drafted", "n_accept", "n_predict")} == \
                {k: want[k] for k in ("n_drafted", "n_accept", "n_predict")}, text
        else:
            assert abs(got["n_accept"] - want["n_accept"]) <= 1 and \
                abs(got["n_drafted"] - want["n_drafted"]) <= n_max and got["n_predict"] == want["n_predict"], \
                (text, got, want)
        drafted, accepted, cut = drafted + got["n_drafted"], accepted + got["n_accept"], cut + got["n_cut"]
    if layout == "dflash":
        assert accepted > drafted / 4  # the backbone's drafts mostly survive the heads
    assert (cut > 0) == (conf_min > 0)  # the confidence head cut some chains


# ---- both converters ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory, convert_model):
    """A DSparkDraftModel checkpoint converted by ours and by llama.cpp's converter (f32)."""
    from helpers.draft_fixtures import convert_dflash_llama_cpp

    root = tmp_path_factory.mktemp("dspark-hf")
    hf = make_dspark_hf(root / "hf", seed=7)
    return {"ours": str(convert_model(hf, "f32", "--target-model-dir", str(DEMO_HF / "target"))),
            "llama.cpp": str(convert_dflash_llama_cpp(hf, DEMO_HF / "target", root / "llama-cpp.gguf"))}


def test_both_converters_write_the_same_dspark_file(converted):
    """Our converter writes llama.cpp's converter's DSpark GGUF: the same tensors (names,
    shapes, values) and DSpark keys; both load here as DSpark drafters and draft the
    same tokens with the same confidences, and llama.cpp drafts from ours what we do."""
    from helpers.fixtures import read_gguf
    from dflash_gguf.runtime.tokenizer import Tokenizer

    (kv_ours, ours), (kv_ref, ref) = read_gguf(converted["ours"]), read_gguf(converted["llama.cpp"])
    assert set(ours) == set(ref)
    for name, (kind, shape, data) in ref.items():
        assert ours[name][:2] == (kind, shape), name
        np.testing.assert_array_equal(ours[name][2], data, err_msg=name)
    for key in ("dflash.sample_from_anchor", "dflash.has_confidence_head", "dflash.block_size"):
        assert kv_ours[key][1] == kv_ref[key][1], key
    prompt = Tokenizer(TARGET).encode(TEXTS[0])
    out = []
    for path in (converted["ours"], converted["llama.cpp"]):
        target, draft = load(path)
        assert draft.kind == "dspark"
        prefill(target, draft, prompt)
        out.append((draft.propose(int(target.choices(0, 1)[0])), draft.confidence(N_MAX).tolist()))
        draft.close()
        target.close()
    assert out[0] == out[1]
    tok = Tokenizer(TARGET)
    target, draft = load(converted["ours"])
    want = llama_draft_dspark(converted["ours"], TEXTS[0], 40, N_MAX, 0.6)
    got = our_draft_dspark(target, draft, tok.encode(TEXTS[0]), 40, N_MAX, 0.6, tok.eog_ids)
    assert {k: got[k] for k in ("n_drafted", "n_accept", "n_predict")} == \
        {k: want[k] for k in ("n_drafted", "n_accept", "n_predict")}


# ---- decoding with it -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_text():
    with Engine(TARGET, n_ctx=512, n_threads=2, kv_type="f32") as plain:
        return [plain.generate(text, 40, stop_tokens=()).tokens for text in TEXTS]


@pytest.mark.parametrize("options", [{}, {"spec_draft_conf_min": 0.6}, {"tree_budget": 6}])
def test_greedy_chain_and_tree_are_the_plain_greedy_text(dspark, plain_text, options):
    """Picked from the file (no --spec-type), the chain (whole, or cut by the confidence
    head) and trees of the refined logits' top-K: the target's own greedy text."""
    with Engine(TARGET, dspark, n_ctx=512, n_threads=2, kv_type="f32", draft_p_min=0.0, **options) as engine:
        assert engine.draft.kind == "dspark"
        for text, want in zip(TEXTS, plain_text):
            got = engine.generate(text, 40, stop_tokens=())
            assert got.tokens == want
            assert got.stats.mean_accepted > (1.1 if options else 1.5)


def test_auto_plain_stretches_are_the_plain_greedy_text(dspark, plain_text):
    """`--tree-budget auto` going plain for a stretch and drafting again: the drafter runs
    no graph over the stretch, catches up in the next propose, and the text is the
    target's own greedy text."""
    from helpers.decoding_checks import check_plain_steps
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(TARGET)
    target, draft = load(dspark, top_k=4)
    for text, want in zip(TEXTS, plain_text):
        check_plain_steps(target, draft, tok.encode(text), want, 6)


def test_sequences_in_a_batch_decode_as_alone(dspark, plain_text):
    """-np: sequences (a chain cut by confidence, a tree, a whole chain) in one drafter
    graph and one target graph per step, joining at different rounds: each gets its solo
    greedy text."""
    from helpers.decoding_checks import batch_outputs
    from dflash_gguf.decoding.step import Sequence
    from dflash_gguf.decoding.requests import GenerationStats, Placement, Request
    from dflash_gguf.speculation.drafting import chain_proposer, tree_proposer
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(TARGET)
    target, draft = load(dspark, n_seq=3, top_k=6)
    proposers = [chain_proposer(target, draft, None, None, conf_min=0.6), tree_proposer(target, draft, 6, None),
                 chain_proposer(target, draft, None, None)]
    seqs = [Sequence(target, draft, p, Request(tok.encode(text), 40, ()), GenerationStats(), Placement(slot=i))
            for i, (p, text) in enumerate(zip(proposers, TEXTS))]
    outs = batch_outputs(target, draft, seqs, join_every=3)
    assert outs == plain_text


def test_anchor_first_decodes_losslessly(anchor_first, plain_text):
    """The anchor-first layout, chain and tree, alone and two sequences in one graph: the
    plain greedy text."""
    for options in ({"n_seq": 2}, {"tree_budget": 6}):
        with Engine(TARGET, anchor_first, n_ctx=512, n_threads=2, kv_type="f32", draft_p_min=0.0,
                    **options) as engine:
            assert engine.draft.block_size == N_MAX + 2  # the bonus and a trained block's drafts
            if "n_seq" in options:
                from dflash_gguf.decoding.requests import Request
                from dflash_gguf.runtime.tokenizer import Tokenizer

                batch, tok = engine.batch(), Tokenizer(TARGET)
                outs = {}
                for i, text in enumerate(TEXTS[:2]):
                    batch.add(engine.sequence(Request(tok.encode(text), 40, ()), slot=i))
                while len(batch):
                    for seq, new in batch.advance():
                        assert seq.error is None, seq.error
                        outs.setdefault(seq.slot, []).extend(new)
                assert [outs[0], outs[1]] == plain_text[:2]
            else:
                assert [engine.generate(t, 40, stop_tokens=()).tokens for t in TEXTS] == plain_text


def test_sampled_chain_samples_the_targets_distribution(dspark):
    """Sampled requests keep the Markov chain's drafts by the argmax rule: the continuations
    are distributed as the target's own sampling (the chi-square test of test_sampling)."""
    from helpers.sampling_checks import DEPTH, SETTINGS, chi2_critical, chi2_stat, exact_joint
    from helpers.loops import speculative_generate
    from dflash_gguf.runtime.tokenizer import Tokenizer

    prompt = Tokenizer(TARGET).encode("    def __init__(self, name):\n        self.name = name\n        self.",
                                      add_bos=False)
    meta = read_draft_metadata(dspark)
    target = Target(TARGET, TargetConfig(n_ctx=256, n_ubatch=64, n_verify=17, kv_type="f32", n_threads=1,
                                         feature_layers=meta["target_layers"]))
    draft = Draft(dspark, target, DraftConfig(kv_type="f32", top_k=4))
    params, n = SETTINGS["qwen"], 600
    exact = exact_joint(target, prompt, params, DEPTH)
    counts = {}
    for seed in range(n):
        out = speculative_generate(target, draft, prompt, DEPTH, sampling=replace(params, seed=seed))[0]
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, df = chi2_stat(counts, exact, n)
    assert df >= 4, "too few cells for the test to say anything"
    assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("layout", ["dflash", "anchor-first"])
def test_the_rpc_device_decodes_as_the_cpu(request, layout):
    """The whole drafter on ggml's RPC backend (the tests' stand-in for a GPU), in both
    block layouts (their graphs differ in the rows the head drafts from): the CPU's greedy
    chain and tree."""
    from helpers.rpc_local import local_rpc_server
    from helpers.target_workers import run_isolated

    path = request.getfixturevalue("dspark" if layout == "dflash" else "anchor_first")
    placements = [{"device": "CPU", "n_gpu_layers": -1}, {"device": "RPC0", "n_gpu_layers": -1}]
    for endpoint in local_rpc_server():
        res = run_isolated("offload_trace", endpoint, TARGET, path, placements, 24)
    cpu, rpc = res["runs"]
    assert rpc["chain"] == cpu["chain"] == cpu["plain"] and rpc["tree"] == cpu["tree"] == cpu["plain"]


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["-md", "{dspark}", "--spec-type", "draft-dflash"], "is a DSpark drafter, not a DFlash drafter"),
    (["-md", str(DEMO_DRAFT), "--spec-type", "draft-dspark"], "is a DFlash drafter, not a DSpark drafter"),
    (["--spec-type", "draft-dspark"], "draft-dspark needs a DSpark drafter (-md)"),
    (["-md", "{dspark}", "--spec-type", "draft-dspark,draft-dflash"], "one drafter at a time"),
    (["-md", str(DEMO_DRAFT), "--spec-draft-conf-min", "0.5"], "no DSpark drafter"),
    (["-md", "{dspark}", "--spec-draft-conf-min", "2"], "--spec-draft-conf-min"),
])
def test_bad_input_is_one_line(dspark, tmp_path, args, words):
    args = [a.format(dspark=dspark) for a in args]
    res = subprocess.run([RUN, "-m", TARGET, "-p", "x", "-n", "4", "-t", "2", *args], capture_output=True,
                         text=True, timeout=120, env={**os.environ})
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and words in res.stderr, res.stderr


def test_the_cli_drafts_with_it(dspark, plain_text):
    """dflash-run -md <DSpark GGUF>: the kind from the file, the plain greedy text."""
    from dflash_gguf.runtime.tokenizer import Tokenizer

    res = subprocess.run([RUN, "-m", TARGET, "-md", dspark, "--spec-draft-conf-min", "0.6", "-p", TEXTS[0],
                          "-n", "40", "-t", "2", "--temp", "0"], capture_output=True, text=True, timeout=300,
                         env={**os.environ})
    assert res.returncode == 0, res.stderr
    assert Tokenizer(TARGET).decode(plain_text[0]).startswith(res.stdout.rstrip("\n"))


def test_the_server_drafts_with_it_over_slots(dspark, plain_text, tmp_path):
    """dflash-server -np 2 -md <DSpark GGUF> with its confidence cut: concurrent clients
    each get the plain greedy text, several tokens a step."""
    from dflash_gguf.runtime.tokenizer import Tokenizer
    from helpers.servers import ServerProcess

    server = ServerProcess(tmp_path, "-m", TARGET, "-md", dspark, "--spec-draft-conf-min", "0.6", "-c", "1024",
                           "-np", "2", "-t", "2", "-ctk", "f32")
    answers = server.greedy_texts(TEXTS, 40)
    tok = Tokenizer(TARGET)
    assert [a["choices"][0]["text"] for a in answers] == [tok.decode(t) for t in plain_text]
    assert all(a["dflash"]["mean_accepted_length"] > 1.1 for a in answers)
