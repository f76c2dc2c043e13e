"""HF -> GGUF converter: numerics against transformers, layout against llama.cpp's own
converter, type mixes against llama.cpp's quantizer, and the command line's behaviour."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, LlamaFileType

from dflash_gguf.convert.cli import main
from dflash_gguf.convert.models.qwen35 import v_head_order
from dflash_gguf.convert.quant import OUTTYPES, plan_types

from helpers.fixtures import QWEN35_SHAPES, SAMPLE_TEXT, hf_logits, llama_cpp_quantize, llama_logits, read_gguf

N_PROMPT = 24


def prompt_tokens(model_dir) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(SAMPLE_TEXT)
    assert len(ids) >= N_PROMPT
    return ids[:N_PROMPT]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


@pytest.fixture(scope="session")
def reference_logits(qwen35_dir):
    cache = {}

    def get(shape):
        if shape not in cache:
            d = qwen35_dir(shape)
            toks = prompt_tokens(d)
            cache[shape] = (toks, hf_logits(d, toks).numpy())
        return cache[shape]

    return get


# ---- numerics -------------------------------------------------------------------------

@pytest.mark.parametrize("shape", list(QWEN35_SHAPES))
def test_f32_logits_match_transformers(shape, qwen35_dir, convert_model, reference_logits):
    toks, ref = reference_logits(shape)
    got = llama_logits(convert_model(qwen35_dir(shape), "f32"), toks)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < 1e-3
    # The check is only meaningful if the model's predictions vary along the prompt.
    assert len(set(ref.argmax(-1).tolist())) > N_PROMPT // 3


# Minimum correlation of quantized logits with transformers' f32 logits. These random
# tiny models amplify weight noise more than trained ones, so the bounds are loose; the
# exact check of quantized files is test_types_and_bytes_match_llama_quantize.
MIN_CORRELATION = {"f16": 0.9999, "bf16": 0.999, "q8_0": 0.99, "q6_k": 0.99, "q5_k_m": 0.95, "q4_k_m": 0.9,
                   "q4_0": 0.85}


@pytest.mark.parametrize("shape,outtype", [
    ("base", "q8_0"), ("base", "q4_k_m"), ("k256", "q8_0"), ("k256", "q4_k_m"), ("k256", "q5_k_m"),
    ("k256", "q6_k"), ("k256", "q4_0"), ("k256", "f16"), ("k256", "bf16"),
])
def test_quantized_files_decode(shape, outtype, qwen35_dir, convert_model, reference_logits):
    toks, ref = reference_logits(shape)
    got = llama_logits(convert_model(qwen35_dir(shape), outtype), toks)
    assert np.isfinite(got).all()
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > MIN_CORRELATION[outtype]
    assert rel_err(got, ref) < 0.75


# ---- layout: llama.cpp's converter as the oracle -----------------------------------------

@pytest.mark.parametrize("shape,outtype", [("base", "f32"), ("tied", "f32"), ("interval", "f32"), ("sharded", "f32"),
                                           ("multimodal", "f32"), ("k256", "f16"), ("k256", "bf16"),
                                           ("k256", "q8_0")])
def test_matches_llama_cpp_converter(shape, outtype, qwen35_dir, convert_model, llama_cpp_convert):
    ours_kv, ours_t = read_gguf(convert_model(qwen35_dir(shape), outtype))
    ref_kv, ref_t = read_gguf(llama_cpp_convert(qwen35_dir(shape), outtype))

    skip = {"general.name"}  # llama.cpp title-cases the directory name
    if shape == "interval":
        # llama.cpp reads config.json through transformers, which folds the interval into
        # layer_types and drops it, so llama.cpp writes the default 4. Its loader prefers
        # recurrent_layers, which both files agree on.
        skip.add("qwen35.full_attention_interval")
        assert ours_kv["qwen35.full_attention_interval"][1] == 2
    assert set(ours_kv) == set(ref_kv)
    for key in set(ref_kv) - skip:
        assert ours_kv[key] == ref_kv[key], key

    assert set(ours_t) == set(ref_t)
    for name, (rtype, rshape, rdata) in ref_t.items():
        otype, oshape, odata = ours_t[name]
        assert (otype, oshape) == (rtype, rshape), name
        if rtype == "F32":
            # ssm_a = -exp(A_log): numpy's and torch's float32 exp may differ in the last bit.
            np.testing.assert_allclose(odata, rdata, rtol=1e-6, atol=0, err_msg=name)
        else:
            assert np.array_equal(odata.view(np.uint8), rdata.view(np.uint8)), name


# ---- type mixes: llama.cpp's quantizer as the oracle --------------------------------------

@pytest.mark.parametrize("shape", ["k256", "base", "tied"])
@pytest.mark.parametrize("outtype", ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"])
def test_types_and_bytes_match_llama_quantize(shape, outtype, qwen35_dir, convert_model, tmp_path):
    d = qwen35_dir(shape)
    ours = convert_model(d, outtype)
    ref = llama_cpp_quantize(convert_model(d, "f32"), tmp_path / "ref.gguf", int(OUTTYPES[outtype][0]))
    ours_kv, ours_t = read_gguf(ours)
    ref_kv, ref_t = read_gguf(ref)
    assert {n: v[0] for n, v in ours_t.items()} == {n: v[0] for n, v in ref_t.items()}
    for name, (_, _, data) in ref_t.items():
        assert np.array_equal(ours_t[name][2], data), name
    assert ours_kv["general.file_type"] == ref_kv["general.file_type"]


def test_k_quant_mix_on_256_rows(qwen35_dir, convert_model):
    kv, tensors = read_gguf(convert_model(qwen35_dir("k256"), "q4_k_m"))
    types = {n: v[0] for n, v in tensors.items()}
    assert kv["general.file_type"][1] == int(LlamaFileType.MOSTLY_Q4_K_M)
    assert types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q4_K"
    # 4 layers: use_more_bits picks layers 2 and 3 (i >= 7n/8 or (i - n/8) % 3 == 2).
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [types[f"blk.{i}.attn_qkv.weight"] for i in range(3)] == ["Q4_K", "Q4_K", "Q6_K"]
    assert types["blk.3.attn_v.weight"] == "Q6_K"
    assert types["blk.0.ssm_out.weight"] == "Q4_K"
    assert types["blk.0.ssm_alpha.weight"] == "Q4_K"
    for name, t in types.items():
        if name.endswith("norm.weight") or "ssm_conv1d" in name or name.endswith(("ssm_a", ".bias")):
            assert t == "F32", name


def test_k_quant_fallback_on_128_rows():
    tensors = [("token_embd.weight", (1000, 128)), ("output.weight", (1000, 128)),
               ("blk.0.attn_norm.weight", (128,)), ("blk.0.ffn_down.weight", (128, 512)),
               ("blk.0.ffn_up.weight", (512, 128)), ("blk.0.attn_qkv.weight", (256, 128)),
               ("blk.0.ssm_conv1d.weight", (256, 4)), ("blk.0.ssm_a", (4,))]
    plan = plan_types(tensors, "q4_k_m")
    assert plan["token_embd.weight"] == T.Q5_0      # Q4_K -> Q5_0
    assert plan["output.weight"] == T.Q8_0          # Q6_K -> Q8_0
    assert plan["blk.0.ffn_up.weight"] == T.Q5_0
    assert plan["blk.0.ffn_down.weight"] == T.Q6_K  # 512-wide rows: no fallback needed
    assert plan["blk.0.attn_qkv.weight"] == T.Q8_0  # bumped to Q6_K, then Q6_K -> Q8_0
    assert plan["blk.0.attn_norm.weight"] == plan["blk.0.ssm_conv1d.weight"] == plan["blk.0.ssm_a"] == T.F32
    assert plan_types(tensors, "q5_k_m")["blk.0.ffn_up.weight"] == T.Q5_1
    assert plan_types([("blk.0.ffn_up.weight", (8, 48))], "q8_0")["blk.0.ffn_up.weight"] == T.F16
    assert plan_types([("blk.0.ffn_up.weight", (8, 48))], "q4_k_m")["blk.0.ffn_up.weight"] == T.F16


def test_tied_embeddings_take_the_output_type():
    tensors = [("token_embd.weight", (1000, 256)), ("blk.0.ffn_up.weight", (512, 256))]
    assert plan_types(tensors, "q4_k_m")["token_embd.weight"] == T.Q6_K
    assert plan_types(tensors, "q4_0")["token_embd.weight"] == T.Q6_K
    assert plan_types(tensors, "q8_0")["token_embd.weight"] == T.Q8_0
    assert plan_types(tensors + [("output.weight", (1000, 256))], "q4_k_m")["token_embd.weight"] == T.Q4_K


# ---- metadata and transforms -------------------------------------------------------------

def test_metadata_keys(qwen35_dir, convert_model):
    kv, tensors = read_gguf(convert_model(qwen35_dir("base"), "f32"))
    val = {k: v[1] for k, v in kv.items()}
    assert val["general.architecture"] == "qwen35"
    assert val["general.file_type"] == 0 and val["general.quantization_version"] == 2
    assert val["qwen35.attention.recurrent_layers"] == [True, True, True, False]
    assert val["qwen35.full_attention_interval"] == 4
    assert val["qwen35.rope.dimension_count"] == 8          # head_dim 32 * partial factor 0.25
    assert val["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]
    assert (val["qwen35.ssm.conv_kernel"], val["qwen35.ssm.state_size"], val["qwen35.ssm.group_count"],
            val["qwen35.ssm.time_step_rank"], val["qwen35.ssm.inner_size"]) == (4, 16, 2, 4, 64)
    assert "output.weight" in tensors


def test_layer_pattern_from_interval_only(qwen35_dir, convert_model):
    d = qwen35_dir("interval")
    assert "layer_types" not in json.loads((d / "config.json").read_text())
    kv, tensors = read_gguf(convert_model(d, "f32"))
    assert kv["qwen35.attention.recurrent_layers"][1] == [True, False, True, False]
    assert kv["qwen35.full_attention_interval"][1] == 2
    assert "blk.0.ssm_a" in tensors and "blk.1.attn_q.weight" in tensors and "blk.3.attn_q.weight" in tensors


def test_tied_model_has_no_output_tensor(qwen35_dir, convert_model):
    kv, tensors = read_gguf(convert_model(qwen35_dir("tied"), "f32"))
    assert "output.weight" not in tensors
    assert kv["qwen35.attention.recurrent_layers"][1] == [True, False, True, False, True]


def test_weight_transforms(qwen35_dir, convert_model):
    from safetensors.numpy import load_file

    d = qwen35_dir("base")
    src = load_file(str(d / "model.safetensors"))
    _, tensors = read_gguf(convert_model(d, "f32"))
    data = {n: v[2] for n, v in tensors.items()}
    la = "model.layers.0.linear_attn."
    np.testing.assert_allclose(data["blk.0.attn_norm.weight"], src["model.layers.0.input_layernorm.weight"] + 1)
    np.testing.assert_array_equal(data["blk.0.ssm_norm.weight"], src[la + "norm.weight"])
    # 2 key heads, 4 value heads: grouped [k0v0 k0v1 k1v0 k1v1] -> tiled [k0v0 k1v0 k0v1 k1v1].
    order = [0, 2, 1, 3]
    np.testing.assert_allclose(data["blk.0.ssm_a"], -np.exp(src[la + "A_log"][order]), rtol=1e-6)
    np.testing.assert_array_equal(data["blk.0.ssm_dt.bias"], src[la + "dt_bias"][order])
    np.testing.assert_array_equal(data["blk.0.ssm_beta.weight"], src[la + "in_proj_b.weight"][order])
    z = src[la + "in_proj_z.weight"].reshape(4, 16, -1)[order].reshape(64, -1)
    np.testing.assert_array_equal(data["blk.0.attn_gate.weight"], z)
    conv = src[la + "conv1d.weight"][:, 0, :]
    np.testing.assert_array_equal(data["blk.0.ssm_conv1d.weight"][:64], conv[:64])
    np.testing.assert_array_equal(data["blk.0.ssm_conv1d.weight"][64:], conv[64:].reshape(4, 16, 4)[order].reshape(64, 4))
    assert v_head_order(2, 4, 1).tolist() == order


def test_chunked_parallel_conversion_is_identical(qwen35_dir, convert_model, tmp_path, monkeypatch):
    from dflash_gguf.convert import writer

    d = qwen35_dir("base")
    whole = convert_model(d, "q8_0")
    # 2 KiB chunks: every matrix is split across many chunks, including gathered rows.
    monkeypatch.setattr(writer, "row_ranges", lambda spec: [(r, min(spec.n_rows, r + 4))
                                                           for r in range(0, spec.n_rows, 4)])
    chunked = tmp_path / "chunked.gguf"
    assert main([str(d), "--outfile", str(chunked), "--outtype", "q8_0", "--threads", "3"]) == 0
    assert chunked.read_bytes() == whole.read_bytes()


# ---- command line ----------------------------------------------------------------------

def test_multimodal_skips_are_reported(qwen35_dir, tmp_path, capsys):
    assert main([str(qwen35_dir("multimodal")), "--outfile", str(tmp_path / "m.gguf"), "--outtype", "f32"]) == 0
    err = capsys.readouterr().err
    assert "vision tower" in err and "multi-token-prediction" not in err  # kept as nextn layers
    assert main([str(qwen35_dir("multimodal")), "--outfile", str(tmp_path / "n.gguf"), "--outtype", "f32",
                 "--no-mtp"]) == 0
    err = capsys.readouterr().err
    n_mtp = sum(1 for line in err.splitlines() if "multi-token-prediction" in line)
    assert n_mtp == 1 and "skipping 15 tensors: multi-token-prediction" in err


def test_dry_run_writes_nothing(qwen35_dir, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    assert main([str(qwen35_dir("k256")), "--outfile", str(out), "--outtype", "q4_k_m", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert not out.exists() and not list(tmp_path.iterdir())
    assert "token_embd.weight" in printed and "blk.3.attn_v.weight" in printed and "Q6_K" in printed
    assert "{256, 1029}" in printed and "total:" in printed


def test_refuses_to_overwrite_without_force(qwen35_dir, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"precious")
    args = [str(qwen35_dir("base")), "--outfile", str(out), "--outtype", "f32"]
    assert main(args) == 2
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"precious"
    assert main(args + ["--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"
    assert not (tmp_path / "x.gguf.partial").exists()


@pytest.mark.parametrize("case", ["bad_outtype", "missing_dir", "missing_config", "wrong_arch", "missing_tensor",
                                  "unexpected_tensor", "missing_shard"])
def test_clear_errors(case, qwen35_dir, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    model = tmp_path / "model"
    if case not in ("bad_outtype", "missing_dir"):
        shutil.copytree(qwen35_dir("sharded" if case == "missing_shard" else "base"), model)
    outtype = "q3_k_xs" if case == "bad_outtype" else "f32"
    expect = {"bad_outtype": "invalid choice", "missing_dir": "does not exist", "missing_config": "config.json",
              "wrong_arch": "LlamaForCausalLM", "missing_tensor": "blk.1.ffn_up.weight",
              "unexpected_tensor": "model.layers.0.mlp.extra.weight",
              "missing_shard": "missing"}[case]
    if case == "missing_config":
        (model / "config.json").unlink()
    elif case == "wrong_arch":
        cfg = json.loads((model / "config.json").read_text())
        cfg["architectures"] = ["LlamaForCausalLM"]
        (model / "config.json").write_text(json.dumps(cfg))
    elif case in ("missing_tensor", "unexpected_tensor"):
        from safetensors.numpy import load_file, save_file

        weights = load_file(str(model / "model.safetensors"))
        if case == "missing_tensor":
            del weights["model.layers.1.mlp.up_proj.weight"]
        else:
            weights["model.layers.0.mlp.extra.weight"] = np.zeros((4, 4), np.float32)
        save_file(weights, str(model / "model.safetensors"))
    elif case == "missing_shard":
        index = json.loads((model / "model.safetensors.index.json").read_text())
        (model / sorted(set(index["weight_map"].values()))[-1]).unlink()

    rc = main([str(model if case != "bad_outtype" else qwen35_dir("base")), "--outfile", str(out),
               "--outtype", outtype])
    err = capsys.readouterr().err
    assert rc == 2
    assert expect in err
    assert "Traceback" not in err
    if case == "wrong_arch":
        assert "Qwen3_5ForCausalLM" in err  # the supported list
    assert not out.exists()
