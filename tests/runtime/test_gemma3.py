"""Gemma 3 targets through the generic runtime, on tiny seeded checkpoints.

The checkpoints have local layers with a window of 8 that every test prompt (20+ tokens)
exceeds, a global layer with another RoPE base, GQA, random norm weights (stored +1) and
a logit softcap; a variant has linear RoPE scaling on the global layers, a layer pattern
that is not llama.cpp's default and a query_pre_attn_scalar other than the head size.
Oracles: transformers' Gemma3ForCausalLM (logits), llama.cpp's converter (the GGUF, byte
for byte) and libllama (logits and greedy output on our file)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.arch_checks import (assert_greedy_equals_llama_cpp, assert_same_gguf, assert_tree_verify_matches_each_path,
                                 our_logits, rel_err)
from helpers.fixtures import hf_model, llama_logits, read_gguf
from helpers.gemma3_fixtures import WINDOW, make_gemma3

VARIANT = dict(
    layers=5, seed=3, softcap=None, query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 2_000.0}},
)


def prompts(n, seed=0, lo=20, hi=40):
    """Random prompts longer than the sliding window (ids past the special and byte tokens)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(300, 1000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def hf_logits(model_dir, tokens):
    with torch.no_grad():
        return hf_model(model_dir)(input_ids=torch.tensor([tokens])).logits[0].float().numpy()


# Our GELU is ggml's (ggml_geglu_split, as llama.cpp's build_ffn: its CPU kernel reads an
# f16-indexed table), which keeps us equal to llama.cpp to its printing on the published
# 270M (docs/parity.md) and parts us from transformers' f32 tanh-GELU by 4.4e-4 to 5.5e-4
# on these checkpoints (measured; llama.cpp's own bound against transformers below: 5e-3)
HF_TOL = 2e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory, convert_model):
    d = make_gemma3(tmp_path_factory.mktemp("gemma3") / "model")
    return {"dir": d, "gguf": convert_model(d, "f32")}


def test_logits_match_transformers(model):
    tokens = prompts(1, seed=1)[0]
    assert len(tokens) > 2 * WINDOW
    ref = hf_logits(model["dir"], tokens)
    assert np.abs(ref).max() > 0.5 * 5.0  # the softcap (5) bends the largest logits
    assert rel_err(our_logits(model["gguf"], tokens), ref) < HF_TOL


def test_norms_are_stored_plus_one(model):
    """Gemma3RMSNorm scales by 1 + w: the file holds the sum, as llama.cpp's converter writes it."""
    from safetensors import safe_open

    _, tensors = read_gguf(model["gguf"])
    with safe_open(str(model["dir"] / "model.safetensors"), "np") as f:
        for ours, theirs in (("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
                             ("output_norm.weight", "model.norm.weight"),
                             ("blk.5.post_ffw_norm.weight", "model.layers.5.post_feedforward_layernorm.weight")):
            assert np.allclose(tensors[ours][2], f.get_tensor(theirs) + 1.0)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_our_gguf_matches_llama_cpp_converter(model, outtype, convert_model, llama_cpp_convert):
    """Same keys, types, tensor names, shapes and bytes as llama.cpp's own converter."""
    theirs = llama_cpp_convert(model["dir"], outtype, None)
    assert read_gguf(theirs)[0]["tokenizer.ggml.model"][1] == "llama"
    assert_same_gguf(convert_model(model["dir"], outtype), theirs)


def test_llama_cpp_converted_file_loads_and_agrees(model, llama_cpp_convert):
    tokens = prompts(1, seed=2)[0]
    theirs = llama_cpp_convert(model["dir"], "f32", None)
    assert rel_err(our_logits(theirs, tokens), our_logits(model["gguf"], tokens)) < 1e-5


def test_our_file_runs_in_llama_cpp(model):
    """libllama's logits on our file are transformers' (within its f16 GELU table and KV
    cache), and its greedy output is ours."""
    tokens = prompts(1, seed=3)[0]
    assert rel_err(llama_logits(model["gguf"], tokens), hf_logits(model["dir"], tokens)) < 5e-3
    assert_greedy_equals_llama_cpp(model["gguf"], prompts(2, seed=4))


def test_tree_verify_matches_decoding_each_path(model):
    """Tree nodes see only their ancestors, local layers only the window behind each
    node's position; committing a path leaves the caches (rings included) as if decoded."""
    from dflash_gguf.runtime.target import Target, TargetConfig

    target = Target(str(model["gguf"]), TargetConfig(n_ctx=256, n_ubatch=16, n_verify=8, kv_type="f32"))
    assert_tree_verify_matches_each_path(target, model["gguf"], prompts(1, seed=7)[0],
                                         [311, 312, 313, 314, 315, 316, 317], [321, 322])


def test_scaled_rope_custom_pattern_and_attention_scale(tmp_path, convert_model):
    """Linear scaling on the global layers only, a layer pattern written as a per-layer
    array, and query_pre_attn_scalar != head_dim recorded as attention.scale."""
    d = make_gemma3(tmp_path / "variant", **VARIANT)
    path = convert_model(d, "f32")
    kv, _ = read_gguf(path)
    assert kv["gemma3.rope.scaling.type"][1] == "linear" and kv["gemma3.rope.scaling.factor"][1] == 4.0
    assert kv["gemma3.attention.sliding_window_pattern"][1] == [True, False, True, True, False]
    assert kv["gemma3.attention.scale"][1] == pytest.approx(24 ** -0.5)
    tokens = prompts(1, seed=5)[0]
    assert rel_err(our_logits(path, tokens), hf_logits(d, tokens)) < HF_TOL


def test_a_model_of_local_layers_only(tmp_path, convert_model):
    """Four layers, every one sliding-window (the pattern's first global layer would be the
    sixth): no layer reads the full-attention cache rows, which the step then leaves out
    (setting their input aborted in ggml before). Logits as transformers', greedy as
    plain decoding's."""
    d = make_gemma3(tmp_path / "local", layers=4, seed=6)
    path = convert_model(d, "f32")
    kv, _ = read_gguf(path)
    assert kv["gemma3.block_count"][1] == 4 and "gemma3.attention.sliding_window_pattern" not in kv or \
        all(kv["gemma3.attention.sliding_window_pattern"][1])
    tokens = prompts(1, seed=5)[0]
    assert rel_err(our_logits(path, tokens), hf_logits(d, tokens)) < HF_TOL


def test_text_tower_of_the_multimodal_checkpoint(tmp_path, convert_model, llama_cpp_convert):
    """Gemma3ForConditionalGeneration: the text tower converts to the file llama.cpp's
    converter writes, and runs with transformers' text logits. No softcap: transformers'
    multimodal class never applies final_logit_softcapping (its CausalLM does, and so do
    llama.cpp and we when the key is there; the published multimodal configs set none)."""
    d = make_gemma3(tmp_path / "mm", multimodal=True, seed=2, softcap=None)
    assert_same_gguf(convert_model(d, "f32"), llama_cpp_convert(d, "f32", None))
    tokens = prompts(1, seed=6)[0]
    assert rel_err(our_logits(convert_model(d, "f32"), tokens), hf_logits(d, tokens)) < HF_TOL


def test_unsupported_options_are_refused_by_name(tmp_path, capfd):
    import json

    from dflash_gguf.convert.cli import main

    d = make_gemma3(tmp_path / "capped", layers=2)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attn_logit_softcapping"] = 50.0
    (d / "config.json").write_text(json.dumps(cfg))
    assert main([str(d), "--outfile", str(tmp_path / "x.gguf")]) == 2
    assert "attn_logit_softcapping" in capfd.readouterr().err
