"""A DFlash drafter's LM head cut to kept tokens (--spec-draft-vocab, or the kept set a
dflash-train file carries in dflash.head_tokens): its logits are the whole head's at the
kept tokens and -inf at the others, so it drafts the argmax over the kept tokens; greedy
output stays plain greedy's under chain and tree; what cannot be cut is refused in one
line. On the bundled demo pair (a trained drafter: its drafts are worth keeping)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.loops import assert_chain_and_tree_keep_greedy, greedy_generate

from dflash_gguf import DflashError
from dflash_gguf.runtime.errors import ConfigError
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.speculation.draft_simple import kept_tokens
from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
from dflash_gguf.train.export import copy_key
from dflash_gguf.runtime.tokenizer import Tokenizer

TARGET, DRAFT = (str(p) for p in demo_paths())
TEXTS = ("def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\nimport sys\n\n\ndef main():")
OPTIONS = dict(n_ctx=256, n_threads=1, kv_type="f32")


def load_target():
    return Target(TARGET, TargetConfig(n_ctx=256, n_verify=16, kv_type="f32", n_threads=1,
                                       feature_layers=read_draft_metadata(DRAFT)["target_layers"]))


def propose(target, draft, prompt):
    """The drafter's block after the prompt: its drafts and their logits."""
    target.reset()
    draft.reset()
    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: draft.append())
    drafts = draft.propose(int(target.choices()[0]))
    return drafts, draft.logits(0, len(drafts))


def test_a_cut_heads_logits_are_the_whole_heads_at_the_kept_tokens():
    target = load_target()
    V = target.n_vocab
    kept = tuple(sorted(int(t) for t in np.random.default_rng(0).permutation(V)[:V // 3]))
    prompt = Tokenizer(TARGET).encode(TEXTS[0])
    whole = Draft(DRAFT, target, DraftConfig(kv_type="f32"))
    cut = Draft(DRAFT, target, DraftConfig(kv_type="f32", head_tokens=kept))
    try:
        assert (whole.n_head_tokens, cut.n_head_tokens) == (V, len(kept))
        want_drafts, full = propose(target, whole, prompt)
        drafts, part = propose(target, cut, prompt)
        np.testing.assert_allclose(part[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
        assert np.isneginf(np.delete(part, kept, axis=1)).all()
        # every draft but the first follows the ones before it: compare the first with the
        # kept argmax of the whole head's logits, and all with the cut's own
        assert drafts[0] == kept[int(np.argmax(full[0, kept]))]
        assert drafts == np.argmax(part, axis=1).tolist() and set(drafts) <= set(kept)
        assert drafts != want_drafts  # the cut changes some draft here: the test can fail
    finally:
        cut.close()
        whole.close()
        target.close()


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_output_is_plain_greedys_with_a_cut_head(tree):
    """--spec-draft-vocab on a DFlash drafter: the Engine's drafter drafts over the kept
    tokens only, and every text is plain greedy's, token for token."""
    target = load_target()
    tok = Tokenizer(TARGET)
    try:
        plain = [greedy_generate(target, tok.encode(t), 40)[0] for t in TEXTS]
    finally:
        target.close()
    n = 1024
    with Engine(TARGET, DRAFT, spec_draft_vocab=n, tree_budget=8 if tree else None, **OPTIONS) as engine:
        assert engine.draft.n_head_tokens == n
        got = [engine.generate(t, 40, stop_tokens=()).tokens for t in TEXTS]
    assert got == plain


def test_a_kept_set_in_the_file_cuts_the_head_and_the_option_overrides_it(tmp_path):
    """A dflash-train file with --draft-vocab carries its kept set (llama.cpp ignores the
    key); our runtime cuts the head by it unless --spec-draft-vocab names another size;
    the output stays plain greedy's under chain and tree."""
    path = tmp_path / "kept.gguf"
    kept = kept_tokens(TARGET, 700)
    copy_with_key(DRAFT, path, "dflash.head_tokens", list(kept))
    target = load_target()
    tok = Tokenizer(TARGET)
    try:
        d = Draft(str(path), target, DraftConfig(kv_type="f32", top_k=4))
        assert d.n_head_tokens == len(kept)
        for text in TEXTS[:2]:
            stats = assert_chain_and_tree_keep_greedy(target, d, tok.encode(text), 40)
            assert max(stats.accepted_lengths) > 1
        d.close()
    finally:
        target.close()
    with Engine(TARGET, str(path), spec_draft_vocab=300, **OPTIONS) as engine:
        assert engine.draft.n_head_tokens == 300


def test_the_memory_plan_counts_the_cut_heads_rows():
    """The kept rows are a copy beside the whole head: the plan's drafter weights grow by
    exactly their bytes and their ids'."""
    import gguf

    n = 1024
    with Engine(TARGET, DRAFT, **OPTIONS) as whole, Engine(TARGET, DRAFT, spec_draft_vocab=n, **OPTIONS) as cut:
        grow = sum(d.parts["draft_weights"] for d in cut.memory_plan.devices) - \
            sum(d.parts["draft_weights"] for d in whole.memory_plan.devices)
    tensors = {t.name: t for t in gguf.GGUFReader(TARGET).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    assert grow == int(head.n_bytes) // int(head.shape[1]) * n + 4 * n


def test_what_cannot_be_cut_is_refused_in_one_line(tmp_path):
    target = load_target()
    V = target.n_vocab
    try:
        for kept, match in (((5, 5), "listed twice"), ((1, V), "outside the vocabulary"),
                            (tuple(range(V + 1)), "keep 1..")):
            with pytest.raises(DflashError, match=match):
                Draft(DRAFT, target, DraftConfig(kv_type="f32", head_tokens=kept))
        bad = tmp_path / "bad.gguf"
        copy_with_key(DRAFT, bad, "dflash.head_tokens", [3, 9, 3])
        with pytest.raises(DflashError, match="listed twice"):
            Draft(str(bad), target, DraftConfig(kv_type="f32"))
    finally:
        target.close()
    with pytest.raises(ConfigError, match="head is cut for draft-simple and DFlash drafters; this run has none"):
        Engine(TARGET, spec_type="ngram-simple", spec_draft_vocab=100, **OPTIONS)


def copy_with_key(src, dst, key, values):
    """The GGUF at src with one more integer array key (its tensors as they are)."""
    import gguf

    from dflash_gguf.runtime.gguf_meta import GGUFMeta

    reader, meta = gguf.GGUFReader(str(src)), GGUFMeta(str(src))
    writer = gguf.GGUFWriter(str(dst), meta.get("general.architecture"))
    for name in meta.keys():
        if name != "general.architecture":
            copy_key(writer, meta, name)
    writer.add_array(key, [int(v) for v in values])
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
