"""dflash-train on a tiny seeded target: training beats a random drafter's acceptance,
the written GGUF is lossless under chain and tree decoding, a resumed run repeats an
uninterrupted one, the recipe's weights and masks match a direct computation, the HF
output loads in z-lab's DFlashDraftModel with our GGUF's logits, and bad input gets one
clear line."""
from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np

import pytest
import torch

from helpers.loops import assert_chain_and_tree_keep_greedy
from helpers.paths import ROOT

from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata, tokenizer_fingerprint
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
from dflash_gguf.train import TrainOptions, train
from dflash_gguf.train import recipe
from dflash_gguf.train.cli import main as cli_main

BLOCK = 8
# small enough for ~1 minute on a loaded 2-core machine: windows of 64, 4 per step, 16
# anchors each; one thread (two spin against each other under load)
SMALL = dict(block_size=BLOCK, ctx_size=64, batch=4, anchors=16, draft_layers=1, lr=1e-2, eval_prompts=3,
             eval_tokens=32, checkpoint_every=0, eval_every=0, threads=1, progress=False)
# the bundled demo target: a trained model whose greedy text a drafter can learn (the
# tiny seeded targets are random functions: nothing to learn in a few hundred steps)
DEMO_TARGET = ROOT / "dflash_gguf" / "data" / "demo-target.gguf"


@pytest.fixture(scope="module")
def target(qwen35_dir, convert_model):
    return convert_model(qwen35_dir("base"), "f32")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of stdlib text (plain files) and one JSONL of chats."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "string.py", "bisect.py", "colorsys.py", "keyword.py", "this.py"):
        (root / name.replace(".py", ".txt")).write_text((stdlib / name).read_text(encoding="utf-8")[:6000])
    chats = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": f"{w} " * 5}]}
             for w in ("one", "two", "three", "four")]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A drafter for the demo target (trained on the standard library's code), trained on
    its own continuations of other code, held-out AL over 4 documents."""
    out = tmp_path_factory.mktemp("trained")
    code = out / "code"
    code.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "string.py", "bisect.py", "colorsys.py", "keyword.py", "shlex.py", "fnmatch.py",
                 "glob.py", "heapq.py", "queue.py", "sched.py", "stat.py", "graphlib.py", "numbers.py"):
        (code / name).write_text((stdlib / name).read_text(encoding="utf-8")[:6000])
    opts = TrainOptions.from_flags(model=str(DEMO_TARGET), data=[str(code)], output=str(out / "draft.gguf"),
                                   steps=STEPS, seed=1, regenerate=True,
                                   **{**SMALL, "eval_prompts": 4, "eval_tokens": 48})
    return train(opts), out


@pytest.fixture(scope="module")
def tiny(target, corpus, tmp_path_factory):
    """A few steps on the tiny seeded target, with the HF layout too."""
    out = tmp_path_factory.mktemp("tiny")
    opts = TrainOptions.from_flags(model=str(target), data=[str(corpus)], output=str(out / "draft.gguf"), steps=20,
                                   seed=2, hf_out=str(out / "hf"), **{**SMALL, "eval_prompts": 1, "eval_tokens": 8})
    return train(opts), out


STEPS = 200


def test_training_beats_a_random_drafter(trained):
    report, out = trained
    before, after = report["acceptance"][0]["al"], report["acceptance"][-1]["al"]
    assert report["steps"] == STEPS and report["acceptance"][-1]["step"] == STEPS
    # a random drafter accepts nothing (AL 1); these 200 small steps reached 1.41
    assert before < 1.05 and after > before + 0.2, f"held-out AL {before:.3f} -> {after:.3f}"
    saved = json.loads((out / "draft.json").read_text())
    assert saved["heldout_al"] == after and len(saved["curve"]) == STEPS
    assert saved["data"]["sha256"] and saved["settings"]["block_size"] == BLOCK


def test_written_gguf_is_paired_and_lossless_under_chain_and_tree(trained):
    _, out = trained
    target = DEMO_TARGET
    meta = read_draft_metadata(str(out / "draft.gguf"))
    assert meta["kind"] == "dflash" and meta["block_size"] == BLOCK
    assert meta["target"]["tokenizer_sha256"] == tokenizer_fingerprint(str(target))
    assert meta["train_window"] == SMALL["ctx_size"]  # what --draft-window auto takes
    t = Target(str(target), TargetConfig(n_ctx=256, n_verify=16, kv_type="f32",
                                         feature_layers=meta["target_layers"]))
    d = Draft(str(out / "draft.gguf"), t, DraftConfig(kv_type="f32", top_k=4))
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(str(target))
    for prompt in [tok.encode(text) for text in ("def fibonacci(n):", "class Stack:\n    def __init__(self):")]:
        stats = assert_chain_and_tree_keep_greedy(t, d, prompt, 48, budget=12)
        assert max(stats.accepted_lengths) > 1


def test_hf_output_loads_in_zlab_dflash_with_our_logits(tiny, target, qwen35_dir):
    from dflash.model import DFlashDraftModel, extract_context_feature
    from transformers import Qwen3_5ForCausalLM

    _, out = tiny
    ref_target = Qwen3_5ForCausalLM.from_pretrained(str(qwen35_dir("base")), dtype=torch.float32).eval()
    ref = DFlashDraftModel.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()
    meta = read_draft_metadata(str(out / "draft.gguf"))
    assert [i + 1 for i in ref.target_layer_ids] == meta["target_layers"]
    t = Target(str(target), TargetConfig(n_ctx=128, n_verify=BLOCK, kv_type="f32",
                                         feature_layers=meta["target_layers"]))
    d = Draft(str(out / "draft.gguf"), t, DraftConfig(kv_type="f32"))
    prompt = list(range(200, 230))
    t.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: d.append())
    bonus = int(t.choices()[0])
    d.propose(bonus)
    ours = d.logits(0, BLOCK - 1)
    with torch.no_grad():
        hs = ref_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        feats = extract_context_feature(hs, ref.target_layer_ids)
        noise = ref_target.get_input_embeddings()(torch.tensor([[bonus] + [ref.mask_token_id] * (BLOCK - 1)]))
        hidden = ref(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(len(prompt) + BLOCK)[None])
        theirs = ref.compute_logits(hidden[:, 1:], ref_target.lm_head)[0].numpy()
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-3
    assert ours.argmax(1).tolist() == theirs.argmax(1).tolist()


def test_gguf_is_what_our_converter_writes_from_the_hf_output(tiny, target, qwen35_dir, convert_model):
    """The same keys, values and tensor bytes as convert-hf-to-gguf on the --hf-out
    directory with the target's checkpoint (only the target's recorded name differs: the
    converter takes the directory's, we the GGUF's file name)."""
    from helpers.fixtures import read_gguf

    _, out = tiny
    ours_kv, ours_t = read_gguf(out / "draft.gguf")
    conv_kv, conv_t = read_gguf(convert_model(out / "hf", "f32", "--target-model-dir", str(qwen35_dir("base"))))
    # the fixture's HF config has no mrope_section (its GGUF has the default sections):
    # the converter writes the drafter's degenerate sections only when the config has them
    skip = {"general.name", "dflash.target.name", "general.size_label", "general.type", "dflash.rope.dimension_sections"}
    assert {k: v for k, v in ours_kv.items() if k not in skip} == {k: v for k, v in conv_kv.items() if k not in skip}
    assert list(ours_t) == list(conv_t)
    for name, (kind, shape, data) in ours_t.items():
        assert (kind, shape) == conv_t[name][:2] and np.array_equal(data, conv_t[name][2]), name


def test_resume_ends_with_the_weights_of_an_uninterrupted_run(target, corpus, tmp_path):
    common = dict(model=str(target), data=[str(corpus)], steps=12, seed=3, **{**SMALL, "eval_prompts": 1,
                                                                               "eval_tokens": 8})
    whole = TrainOptions.from_flags(output=str(tmp_path / "whole.gguf"), **common)
    train(whole)
    cut = TrainOptions.from_flags(output=str(tmp_path / "cut.gguf"), **common)

    def stop(step, rec):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cut, on_step=stop)
    assert torch.load(cut.files.checkpoint_path, weights_only=False)["step"] == 5
    cut.files.resume = cut.files.checkpoint_path
    train(cut)
    a = torch.load(whole.files.checkpoint_path, weights_only=False)["model"]
    b = torch.load(cut.files.checkpoint_path, weights_only=False)["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_draft_vocab_carries_a_kept_set_the_runtime_cuts_the_head_by(target, corpus, tmp_path):
    """--draft-vocab N: the file carries the special tokens and the data's commonest, N
    in all, ascending (dflash.head_tokens); the held-out probe and any later load draft
    over those rows of the head only."""
    import gguf

    from dflash_gguf.speculation.draft_simple import SPECIAL_TOKEN_TYPES

    n = 64
    out = tmp_path / "kept.gguf"
    train(TrainOptions.from_flags(model=str(target), data=[str(corpus)], output=str(out), steps=2, seed=4,
                                  draft_vocab=n, **{**SMALL, "eval_prompts": 1, "eval_tokens": 8}))
    fields = gguf.GGUFReader(str(out)).fields
    kept = fields["dflash.head_tokens"].contents()
    types = np.asarray(fields["tokenizer.ggml.token_type"].contents())
    assert len(kept) == n and kept == sorted(set(kept))
    assert set(np.flatnonzero(np.isin(types, SPECIAL_TOKEN_TYPES)).tolist()) <= set(kept)
    meta = read_draft_metadata(str(out))
    t = Target(str(target), TargetConfig(n_ctx=128, kv_type="f32", feature_layers=meta["target_layers"]))
    try:
        d = Draft(str(out), t, DraftConfig(kv_type="f32"))
        assert d.n_head_tokens == n
        d.close()
    finally:
        t.close()


def test_a_gemma3_drafter_trains_through_the_embedding_scale_and_softcap(corpus, tmp_path, convert_model):
    """A Gemma 3 target (its embedding scaled by sqrt(hidden), its logits softcapped):
    the file records both, and the drafter as trained (torch, from the checkpoint) gives
    our runtime's logits for a block, so what is trained is what is served; greedy output
    stays plain greedy's under chain and tree."""
    import gguf
    from helpers.gemma3_fixtures import make_gemma3

    from dflash_gguf.train.model import Drafter, DrafterShape
    from dflash_gguf.train.target import TargetFeatures, embedding_and_head, read_target_meta

    target = convert_model(make_gemma3(tmp_path / "gemma3", seed=6), "f32")
    meta = read_target_meta(str(target))
    assert meta["arch"] == "gemma3" and meta["softcap"] == 5.0 and abs(meta["embd_scale"] - 128 ** 0.5) < 1e-2
    out = tmp_path / "draft.gguf"
    text = [str(f) for f in sorted(corpus.glob("*.txt"))]  # the tiny Gemma has no chat template
    report = train(TrainOptions.from_flags(model=str(target), data=text, output=str(out), steps=6, seed=5,
                                           **{**SMALL, "eval_prompts": 1, "eval_tokens": 8}))
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["dflash.embedding_scale"].contents() == pytest.approx(meta["embd_scale"])
    assert fields["dflash.final_logit_softcapping"].contents() == pytest.approx(5.0)

    ck = torch.load(str(out) + ".ckpt", weights_only=False)
    model = Drafter(DrafterShape(**report["settings"]["shape"]))
    model.load_state_dict(ck["model"])
    model.eval()
    layer_ids, mask_id = report["settings"]["layer_ids"], report["settings"]["mask_id"]
    prompt = list(range(40, 70))
    features = TargetFeatures(str(target), layer_ids, len(prompt), 1)
    feats, greedy, _ = features(prompt)
    features.close()
    embd, head = embedding_and_head(meta["gguf"])
    bonus = int(greedy[-1])
    with torch.no_grad():
        block = torch.tensor([bonus] + [mask_id] * (BLOCK - 1))
        visible = torch.ones(1, 1, BLOCK, len(prompt) + BLOCK, dtype=torch.bool)
        hidden = model(torch.from_numpy(feats)[None], torch.from_numpy(embd)[block][None] * meta["embd_scale"],
                       torch.arange(len(prompt) + BLOCK)[None], visible)
        theirs = recipe.softcap(hidden[0, 1:] @ torch.from_numpy(head).T, meta["softcap"]).numpy()

    draft_meta = read_draft_metadata(str(out))
    t = Target(str(target), TargetConfig(n_ctx=128, n_verify=16, kv_type="f32",
                                         feature_layers=draft_meta["target_layers"]))
    try:
        d = Draft(str(out), t, DraftConfig(kv_type="f32", top_k=4))
        t.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: d.append())
        assert int(t.choices()[0]) == bonus
        d.propose(bonus)
        ours = d.logits(0, BLOCK - 1)
        assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-3
        assert ours.argmax(1).tolist() == theirs.argmax(1).tolist()
        assert np.abs(theirs).max() > 0.5 * 5.0  # the softcap bends these logits: the test can fail
        for p in (prompt, list(range(90, 110))):
            assert_chain_and_tree_keep_greedy(t, d, p, 24)
        d.close()
    finally:
        t.close()


def test_position_weights_and_anchor_mask_match_a_direct_computation():
    gamma, B = 3.0, 4
    w = recipe.position_weights(B, gamma)
    assert torch.allclose(w, torch.tensor([np.exp(-(k - 1) / gamma) for k in range(1, B)], dtype=torch.float32))
    L, A, mask_id = 10, 2, 99
    x = torch.arange(L)[None] + 10
    greedy = x.roll(-1, 1).clone()
    greedy[0, 4] = 0  # the text leaves the target's path after position 4
    noise, pos, mask, labels, exact, p = recipe.anchor_batch(x, greedy, A, B, mask_id, torch.Generator().manual_seed(0))
    anchors = p[0].tolist()
    Q = A * B
    for j, a in enumerate(anchors):
        assert 1 <= a <= L - B + 1
        assert noise[0, j * B:(j + 1) * B].tolist() == [x[0, a].item()] + [mask_id] * (B - 1)
        assert pos[0, L + j * B:L + (j + 1) * B].tolist() == list(range(a, a + B))
        for k in range(1, B):
            assert labels[0, j, k - 1] == greedy[0, a + k - 1]
            assert exact[0, j, k - 1] == all(x[0, a + i] == greedy[0, a + i - 1] for i in range(1, k))
        for r in range(j * B, (j + 1) * B):
            want = [c < a for c in range(L)] + [j * B <= c < (j + 1) * B for c in range(Q)]
            assert mask[0, 0, r].tolist() == want
    assert pos[0, :L].tolist() == list(range(L))
    # the loss is the weighted mean of per-label cross-entropies
    logits = torch.randn(1, A, B - 1, 7)
    lab = torch.randint(0, 7, (1, A, B - 1))
    ex = torch.ones(1, A, B - 1, dtype=torch.bool)
    ex[0, 1, 2] = False
    loss, _ = recipe.weighted_loss(logits, lab, ex, w)
    num = den = 0.0
    for j in range(A):
        for k in range(B - 1):
            ce = -torch.log_softmax(logits[0, j, k], -1)[lab[0, j, k]].item()
            wk = w[k].item() * (1.0 if ex[0, j, k] else recipe.INEXACT_WEIGHT)
            num, den = num + wk * ce, den + wk
    assert abs(loss.item() - num / den) < 1e-5


def test_loss_over_a_kept_vocabulary_keeps_the_labels():
    counts = torch.tensor([5, 0, 9, 1, 7, 0])
    kept = recipe.kept_vocab(counts, 3)
    assert kept.tolist() == [0, 2, 4]
    hidden, head = torch.randn(2, 4), torch.randn(6, 4)
    labels = torch.tensor([2, 5])
    logits, sub, _ = recipe.subset_logits(hidden, head, labels, kept)
    assert logits.shape == (2, 4)  # 0, 2, 4 and the label 5
    assert torch.allclose(logits[torch.arange(2), sub], (hidden * head[labels]).sum(-1))


def test_top_k_labels_are_the_targets_distribution_at_each_label():
    """--top-k-labels: the target's k most probable tokens and their renormalized
    probabilities, gathered at each block label's row, and a loss that is the
    cross-entropy against them (with k = 1: the argmax loss)."""
    from dflash_gguf.train.target import top_k_distribution

    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]], dtype=np.float32)
    ids, probs = top_k_distribution(logits, 2)
    assert [sorted(r) for r in ids.tolist()] == [[1, 3], [0, 3]]
    order = np.argsort(ids, 1)
    e = np.exp([[3.0, 2.0], [5.0, 4.0]])
    assert np.allclose(np.take_along_axis(probs, order, 1), e / e.sum(1, keepdims=True))

    S, L, B, K = 2, 12, 4, 3
    rows = torch.arange(S * L * K).view(S, L, K)
    anchors = torch.tensor([[1, 5], [2, 8]])
    got = recipe.label_rows(rows, anchors, B)
    assert got.shape == (S, 2, B - 1, K)
    for s_ in range(S):
        for a in range(2):
            for k in range(1, B):
                assert torch.equal(got[s_, a, k - 1], rows[s_, anchors[s_, a] + k - 1])  # label k: row p+k-1

    torch.manual_seed(0)
    logits = torch.randn(S, 2, B - 1, 7)
    labels = torch.randint(0, 7, (S, 2, B - 1))
    exact = torch.rand(S, 2, B - 1) > 0.3
    w = recipe.position_weights(B, 2.0)
    hard, acc_hard = recipe.weighted_loss(logits, labels, exact, w)
    ones = torch.ones(S, 2, B - 1, 1)
    soft1, acc_soft = recipe.weighted_loss(logits, labels, exact, w, (labels[..., None], ones))
    assert torch.allclose(hard, soft1) and torch.equal(acc_hard, acc_soft)
    ids = torch.randint(0, 7, (S, 2, B - 1, K))
    probs = torch.softmax(torch.randn(S, 2, B - 1, K), -1)
    soft, _ = recipe.weighted_loss(logits, labels, exact, w, (ids, probs))
    ce = -(probs * torch.log_softmax(logits, -1).gather(-1, ids)).sum(-1)
    wt = w * torch.where(exact, 1.0, recipe.INEXACT_WEIGHT)
    assert torch.allclose(soft, (ce * wt).sum() / wt.sum())
    # the kept vocabulary takes the top-k ids in, remapped
    hidden, head = torch.randn(1, 3, 5), torch.randn(9, 5)
    sub_logits, _, sub_ids = recipe.subset_logits(hidden, head, torch.tensor([[2, 2, 2]]), torch.tensor([0, 1]),
                                                  torch.tensor([[[7, 8]] * 3]))
    assert torch.allclose(sub_logits.gather(-1, sub_ids), (hidden @ head.T)[..., [7, 8]])


def test_a_run_with_top_k_labels_learns(target, corpus, tmp_path):
    """A short run distilling the tiny target's top-4: the loss (which has the teacher's
    entropy as its floor) falls and the file is written."""
    opts = TrainOptions.from_flags(model=str(target), data=[str(corpus)], output=str(tmp_path / "d.gguf"), steps=30,
                                   seed=4, top_k_labels=4, **{**SMALL, "eval_prompts": 1, "eval_tokens": 8})
    report = train(opts)
    losses = [c["loss"] for c in report["curve"]]
    assert report["settings"]["top_k_labels"] == 4 and Path(opts.files.output).stat().st_size > 0
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses


def test_a_time_budget_warms_up_in_steps_and_decays_over_its_minutes():
    """The first run on the real 1.5B (28 steps of 55 s in 25 minutes) spent its whole
    budget inside a 100-step warmup: a time budget warms up over a few steps and decays
    with the minutes spent; a step budget keeps its schedule."""
    peak = 1e-3
    assert recipe.timed_lr(peak, 0, 0.0) == pytest.approx(peak / 20)
    assert recipe.timed_lr(peak, 19, 0.02) == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.02))))
    assert recipe.timed_lr(peak, 500, 0.5) == pytest.approx(peak * 0.55)
    assert recipe.timed_lr(peak, 900, 1.2) == pytest.approx(peak * 0.1)  # past the deadline: the floor
    assert recipe.cosine_lr(peak, 9, 200, 20) == pytest.approx(peak * 10 / 20)
    assert recipe.cosine_lr(peak, 200, 200, 20) == pytest.approx(peak * 0.1)


def test_bad_input_gets_one_clear_line(target, corpus, tmp_path, capsys, monkeypatch):
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00junk")
    base = ["-m", str(target), "-o", str(tmp_path / "d.gguf"), "--steps", "1"]
    cases = [
        (["--data", str(binary)], "not UTF-8"),
        (["--data", str(tmp_path / "missing")], "no such file"),
        (["--data", str(corpus), "--mask-token", "<|nope|>"], "--mask-token"),
    ]
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    cases.append((["--data", str(bad_jsonl)], "known role"))
    cases += [(["--data", str(corpus), "--top-k-labels", "-1"], "--top-k-labels"),
              (["--data", str(corpus), "--top-k-labels", "999999"], "exceeds the vocabulary"),
              (["--data", str(corpus), "--train-device", "nowhere"], "--train-device"),
              (["--data", str(corpus), "--draft-vocab", "-1"], "--draft-vocab"),
              (["--data", str(corpus), "--draft-vocab", "99999999"], "--draft-vocab")]
    if not torch.cuda.is_available():
        cases.append((["--data", str(corpus), "--train-device", "cuda"], "sees no CUDA device"))
    for args, words in cases:
        assert cli_main(base + args) == 2
        # llama.cpp's own log lines (its tokenizer's load) may come before ours
        ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train")]
        assert len(ours) == 1 and ours[0].startswith("dflash-train: error: ") and words in ours[0], ours
    # a drafter is no target
    draft = ROOT / "dflash_gguf" / "data" / "demo-draft.gguf"
    assert cli_main(["-m", str(draft), "-o", str(tmp_path / "d.gguf"), "--steps", "1", "--data", str(corpus)]) == 2
    assert "'dflash'" in capsys.readouterr().err
    # no torch
    import builtins
    real_import = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert cli_main(base + ["--data", str(corpus)]) == 2
    assert "pip install dflash-gguf[train]" in capsys.readouterr().err


def test_data_under_a_hidden_directory_is_read_and_hidden_names_below_it_are_not(tmp_path):
    """--data ~/.cache/... or a .venv's standard library: a hidden part above the directory
    given does not hide its files; a hidden name below it does."""
    from dflash_gguf.train.data import _files

    root = tmp_path / ".cache" / "corpus"
    (root / ".git").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / ".git" / "config").write_text("[core]\n")
    (root / ".hidden.py").write_text("y = 2\n")
    assert _files([root]) == [root / "a.py"]
