"""convert-hf-to-gguf for DFlash drafters: layout against llama.cpp's own converter, type
mixes against llama.cpp's quantizer, loading in libllama and in our runtime (drafter
logits against z-lab's reference model), DFlash2 and mask embeddings, and the errors for
a missing or mismatched target."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import LlamaFileType

from dflash_gguf.convert.cli import main
from dflash_gguf.convert.models.dflash_tensors import interleaved_to_neox
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

from helpers.convert_checks import libllama_model, variant
from helpers.decoding_checks import BLOCK, reference_draft_logits, reference_models, rel_err
from helpers.draft_fixtures import make_dflash
from helpers.fixtures import llama_cpp_quantize, read_gguf

DFLASH2 = dict(conv_kernel_size=3, conv_group_size=32, selector_rank=16, selector_top_k=4)
MASK_ID = 1024  # make_dflash: vocab_size - 5 of the fixture tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, qwen35_dir):
    """ckpt(name) -> checkpoint directory (drafters and target variants), built on first use."""
    root = tmp_path_factory.mktemp("dflash")
    base = qwen35_dir("base")

    def options(cfg):
        cfg["rope_parameters"]["partial_rotary_factor"] = 0.5
        cfg["rope_is_neox_style"] = False
        cfg["is_causal"] = False
        cfg["dflash_config"].update(output_multiplier=0.5, final_logit_softcapping=30.0, input_embedding_scale=2.0,
                                    attention_value_scale=0.75)

    def mask(cfg):
        gen = torch.Generator().manual_seed(7)
        torch.save({"mask_token_id": MASK_ID, "embedding": torch.randn(128, generator=gen)},
                   root / "mask" / "mask_embedding.pt")

    recipes = {
        "target": lambda: base,
        "draft": lambda: make_dflash(root / "draft", base, target_layer_ids=(0, 2), block_size=BLOCK, seed=11),
        "dflash2": lambda: make_dflash(root / "dflash2", base, target_layer_ids=(1, 2), block_size=BLOCK, seed=12,
                                       dflash2=DFLASH2),
        # every matrix row a multiple of 256, so the K-quant mix applies without fallbacks
        "draft_k256": lambda: make_dflash(root / "draft_k256", qwen35_dir("k256"), target_layer_ids=(1, 3), head_dim=64,
                                    ffn=512, block_size=BLOCK, seed=13),
        # optional keys, partial rotary, interleaved rope (q/k rows permuted), non-causal
        "options": lambda: variant(get("draft"), root / "options", options),
        # a Qwen3.5 target with M-RoPE sections, as the released ones have
        "target_mrope": lambda: variant(base, root / "target_mrope",
                                        lambda c: c["rope_parameters"].update(mrope_section=[11, 11, 10])),
        "mask": lambda: variant(get("draft"), root / "mask", mask),
        "bad_ids": lambda: variant(get("draft"), root / "bad_ids",
                                   lambda c: c["dflash_config"].update(target_layer_ids=[0, 4])),
    }
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = Path(recipes[name]()) if name in recipes else qwen35_dir(name)
        return built[name]

    return get


@pytest.fixture(scope="module")
def ours(ckpt, convert_model):
    """ours(drafter, outtype, target="target") -> drafter GGUF from our converter."""
    def convert(draft: str, outtype: str = "f32", target: str = "target") -> Path:
        return convert_model(ckpt(draft), outtype, "--target-model-dir", str(ckpt(target)))

    return convert


def assert_same_gguf(ours_path: Path, ref_path: Path) -> None:
    ours_kv, ours_t = read_gguf(ours_path)
    ref_kv, ref_t = read_gguf(ref_path)
    # ours records the target it was converted for (dflash.target.*); llama.cpp does not
    assert {k for k in ours_kv if not k.startswith("dflash.target.")} == set(ref_kv)
    for key in set(ref_kv) - {"general.name"}:  # llama.cpp title-cases the directory name
        assert ours_kv[key] == ref_kv[key], key
    assert set(ours_t) == set(ref_t)
    for name, (rtype, rshape, rdata) in ref_t.items():
        otype, oshape, odata = ours_t[name]
        assert (otype, oshape) == (rtype, rshape), name
        assert np.array_equal(odata.view(np.uint8), rdata.view(np.uint8)), name


# ---- layout: llama.cpp's converter as the oracle -----------------------------------------

@pytest.mark.parametrize("draft,target,outtype", [
    ("draft", "target", "f32"), ("draft", "target", "f16"), ("draft", "target", "bf16"), ("draft", "target", "q8_0"),
    ("dflash2", "target", "f32"), ("dflash2", "target", "q8_0"),
    ("options", "target_mrope", "f16"),
    ("mask", "target", "f16"), ("mask", "sharded", "f32"),  # sharded: a bf16 target with an index
])
def test_matches_llama_cpp_converter(draft, target, outtype, ckpt, ours, llama_cpp_convert_dflash):
    ref = llama_cpp_convert_dflash(ckpt(draft), ckpt(target), outtype)
    assert_same_gguf(ours(draft, outtype, target), ref)


def test_drafter_keys_and_tensors(ours):
    kv, tensors = read_gguf(ours("draft"))
    assert kv["general.architecture"][1] == "dflash"
    assert kv["dflash.target_layers"][1] == [1, 3]  # HF target_layer_ids (0, 2) + 1
    assert kv["dflash.block_size"][1] == BLOCK
    assert kv["tokenizer.ggml.mask_token_id"][1] == MASK_ID
    assert len(kv["tokenizer.ggml.tokens"][1]) == 1029  # the target's vocabulary
    assert "dflash.rope.dimension_sections" not in kv and "dflash.rope.dimension_count" not in kv
    assert tensors["fc.weight"][1] == (256, 128)  # ggml order: 2 target layers x hidden in, hidden out
    assert {"enc.output_norm.weight", "output_norm.weight", "blk.1.ffn_norm.weight"} <= set(tensors)
    assert "token_embd.weight" not in tensors and "output.weight" not in tensors  # the target's are used

    kv, tensors = read_gguf(ours("options", "f16", "target_mrope"))
    assert kv["dflash.rope.dimension_sections"][1] == [16, 0, 0, 0]  # head_dim / 2 on the temporal section
    assert kv["dflash.rope.dimension_count"][1] == 16  # partial rotary 0.5 of head_dim 32
    assert kv["dflash.attention.causal"][1] is False
    for key, value in [("logit_scale", 0.5), ("final_logit_softcapping", 30.0), ("embedding_scale", 2.0),
                       ("attention.value_scale", 0.75)]:
        assert kv[f"dflash.{key}"][1] == pytest.approx(value), key


def test_interleaved_rope_permutation():
    idx = interleaved_to_neox(8, 4)  # two heads of (x0, y0, x1, y1)
    assert idx.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_dflash2_keys_and_tensors(ours):
    kv, tensors = read_gguf(ours("dflash2", "q8_0"))
    for key, value in DFLASH2.items():
        assert kv[f"dflash.{key}"][1] == value
    assert kv["dflash.target_layers"][1] == [2, 3]
    groups = 128 // DFLASH2["conv_group_size"]
    for i in range(2):
        for part in ("attn", "ffn"):
            assert tensors[f"blk.{i}.{part}_conv_base"][:2] == ("F32", (128, 3, 2))
            assert tensors[f"blk.{i}.{part}_conv_proj.weight"][:2] == ("Q8_0", (128, 2 * 3 * groups))
    # rank 16 rows are not whole Q8_0 blocks: F16, as llama.cpp falls back
    assert tensors["selector_predecessor.weight"][:2] == ("F16", (16, 1029))
    assert tensors["selector_successor.weight"][:2] == ("F16", (16, 1029))
    assert tensors["selector_hidden.weight"][:2] == ("Q8_0", (128, 16))


def test_target_layers_offset(ours):
    assert read_draft_metadata(ours("draft"))["target_layers"] == [1, 3]
    # the last target layer (HF id 3 of 4) is stored as 4 = n_layer
    assert read_draft_metadata(ours("draft_k256", "f32", "k256"))["target_layers"] == [2, 4]


# ---- quantized mixes: llama.cpp's quantizer as the oracle ----------------------------------

def test_q4_k_m_matches_llama_quantize(ours, tmp_path):
    mine = ours("draft_k256", "q4_k_m", "k256")
    ref = llama_cpp_quantize(ours("draft_k256", "f32", "k256"), tmp_path / "ref.gguf", int(LlamaFileType.MOSTLY_Q4_K_M))
    _, mine_t = read_gguf(mine)
    _, ref_t = read_gguf(ref)
    assert {n: v[0] for n, v in mine_t.items()} == {n: v[0] for n, v in ref_t.items()}
    for name, (_, _, data) in ref_t.items():
        assert np.array_equal(mine_t[name][2], data), name
    types = {n: v[0] for n, v in mine_t.items()}
    assert types["fc.weight"] == "Q4_K"
    assert types["enc.output_norm.weight"] == types["blk.0.attn_q_norm.weight"] == "F32"
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"  # use_more_bits
    assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"


# ---- loading: libllama and our runtime ------------------------------------------------------


@pytest.mark.parametrize("draft,target,outtype", [("draft", "target", "f32"), ("dflash2", "target", "q8_0"),
                                                  ("draft_k256", "k256", "q4_k_m"), ("mask", "target", "f16")])
def test_libllama_loads_drafter(draft, target, outtype, ckpt, ours, convert_model):
    path = ours(draft, outtype, target)
    model = libllama_model(path)  # all tensors, with the shapes llama.cpp's dflash loader requires
    target_model = libllama_model(convert_model(ckpt(target), "f32"))
    try:
        assert model.desc().startswith("dflash")
        assert model.n_vocab() == target_model.n_vocab()
        assert model.n_embd() == target_model.n_embd()
        text = "def quicksort(xs):\n    return sorted(xs)  # Größe 🚀"
        assert model.tokenize(text.encode(), False, True) == target_model.tokenize(text.encode(), False, True)
    finally:
        model.close()
        target_model.close()


def run_drafter(target_gguf: Path, draft_gguf: Path, prompt: list[int]):
    """(drafter logits for block positions 1..B-1, bonus token) from our runtime."""
    meta = read_draft_metadata(draft_gguf)
    target = Target(target_gguf, TargetConfig(n_ctx=256, n_ubatch=16, n_verify=BLOCK, kv_type="f32",
                                              feature_layers=meta["target_layers"]))
    draft = Draft(draft_gguf, target, DraftConfig(kv_type="f32"))
    try:
        target.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: draft.append())
        bonus = int(target.choices()[0])
        draft.propose(bonus)
        return draft.logits(0, BLOCK - 1), bonus
    finally:
        draft.close()
        target.close()


PROMPT = [5, 17, 300, 42, 999, 7, 64, 128, 256, 511, 3, 900, 21, 33, 8, 400, 19, 77, 640, 2]


def test_runtime_logits_match_reference(ckpt, ours, convert_model, llama_cpp_convert_dflash):
    target_gguf = convert_model(ckpt("target"), "f32")
    logits, bonus = run_drafter(target_gguf, ours("draft"), PROMPT)
    pair = {"target_dir": ckpt("target"), "draft_dir": ckpt("draft")}
    ref = reference_draft_logits(*reference_models(pair), PROMPT, bonus)
    assert rel_err(logits, ref) < 1e-3
    # and the same numbers as from llama.cpp's conversion of the checkpoint
    theirs, _ = run_drafter(target_gguf, llama_cpp_convert_dflash(ckpt("draft"), ckpt("target"), "f32"), PROMPT)
    np.testing.assert_allclose(logits, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max())


def test_runtime_mask_embedding_matches_reference(ckpt, ours, convert_model):
    """A drafter with mask_embedding.pt embeds its mask token with its own vector."""
    logits, bonus = run_drafter(convert_model(ckpt("target"), "f32"), ours("mask"), PROMPT)
    ref_target, ref_draft = reference_models({"target_dir": ckpt("target"), "draft_dir": ckpt("mask")})
    vector = torch.load(ckpt("mask") / "mask_embedding.pt", weights_only=True)["embedding"]
    with torch.no_grad():
        ref_target.get_input_embeddings().weight[MASK_ID] = vector
    ref = reference_draft_logits(ref_target, ref_draft, PROMPT, bonus)
    assert rel_err(logits, ref) < 1e-3


def test_runtime_runs_q4_k_m_drafter(ckpt, ours, convert_model):
    target_gguf = convert_model(ckpt("k256"), "f32")
    exact, _ = run_drafter(target_gguf, ours("draft_k256", "f32", "k256"), PROMPT)
    quant, _ = run_drafter(target_gguf, ours("draft_k256", "q4_k_m", "k256"), PROMPT)
    assert np.isfinite(quant).all()
    assert np.corrcoef(quant.ravel(), exact.ravel())[0, 1] > 0.95


def test_runtime_runs_converted_dflash2(ours, ckpt, convert_model):
    """The converted DFlash2 file loads and drafts (its arithmetic against z-lab's is
    tests/drafters/test_dflash2.py's)."""
    path = ours("dflash2")
    target = Target(convert_model(ckpt("target"), "f32"),
                    TargetConfig(n_ctx=64, n_ubatch=16, n_verify=BLOCK, kv_type="f32",
                                 feature_layers=read_draft_metadata(path)["target_layers"]))
    try:
        with Draft(path, target, DraftConfig(kv_type="f32")) as draft:
            target.prefill(list(range(5, 25)), LOGITS_LAST, on_chunk=lambda s, n: draft.append())
            drafts = draft.propose(int(target.choices()[0]))
            assert len(drafts) == draft.block_size - 1 and all(0 <= t < target.n_vocab for t in drafts)
    finally:
        target.close()


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("draft,target,message", [
    ("draft", None, "--target-model-dir"),
    ("draft", "missing", "is not a directory"),
    ("draft", "k256", "hidden size 128 does not match"),
    ("draft", "tied", "vocab_size 1029 does not match"),  # same hidden size, padded vocabulary
    ("bad_ids", "target", "reads layer 4, but the target ("),
    ("draft", "dflash2", "is itself a drafter"),
    ("target", "target", "--target-model-dir is for drafters"),
])
def test_bad_target_exits_2(draft, target, message, ckpt, tmp_path, capsys):
    out = tmp_path / "draft.gguf"
    args = [str(ckpt(draft)), "--outfile", str(out)]
    if target == "missing":
        args += ["--target-model-dir", str(tmp_path / "nowhere")]
    elif target is not None:
        args += ["--target-model-dir", str(ckpt(target))]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not out.exists()
