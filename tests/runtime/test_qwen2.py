"""The `qwen2` target architecture (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen) on tiny
seeded checkpoints, tied and untied: f32 logits and greedy tokens against transformers,
GGUF interop with llama.cpp both ways (its converter's file in our runtime, ours in
libllama, and the two converters' files byte for byte), and clear errors for a qwen2
file that lacks a bias or has one of the wrong shape. The published Qwen2.5-Coder GGUFs
are tested in test_real_qwen2.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.arch_checks import assert_greedy_equals_llama_cpp, assert_same_gguf, our_logits, rel_err
from helpers.fixtures import hf_model, llama_logits, make_qwen2, read_gguf
from helpers.loops import greedy_generate

from dflash_gguf.runtime.native import DflashError
from dflash_gguf.runtime.target import Target, TargetConfig

CASES = {"untied": dict(seed=0), "tied": dict(tie=True, kv_heads=1, seed=1)}


def prompt(seed, n=24, vocab=1000):
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory, convert_model):
    d = make_qwen2(tmp_path_factory.mktemp("qwen2") / request.param, **CASES[request.param])
    return {"dir": d, "gguf": convert_model(d, "f32"), "tied": request.param == "tied"}


def test_converted_layout(model):
    """Biases on q, k and v, no q/k norms; a tied model has no output.weight."""
    kv, tensors = read_gguf(model["gguf"])
    assert kv["general.architecture"][1] == "qwen2"
    assert {f"blk.0.attn_{x}.bias" for x in "qkv"} <= set(tensors)
    assert not any("_norm" in n and "attn_q" in n for n in tensors)
    assert ("output.weight" in tensors) != model["tied"]


def test_logits_match_transformers(model):
    tokens = prompt(1) + list(range(100, 140))
    with torch.no_grad():
        ref = hf_model(model["dir"])(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    assert rel_err(our_logits(model["gguf"], tokens), ref) < 1e-4


def test_greedy_matches_transformers(model):
    p = prompt(2)
    with torch.no_grad():
        out = hf_model(model["dir"]).generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                                              min_new_tokens=32, pad_token_id=0)
    ours, _ = greedy_generate(Target(str(model["gguf"]), TargetConfig(n_ctx=256, kv_type="f32")), p, 32)
    assert ours == out[0, len(p):].tolist()


def test_biases_matter(model, tmp_path):
    """The fixture's biases move the logits far beyond the tolerances above, so a
    runtime that dropped them could not pass."""
    tokens = prompt(3)
    zeroed = rewrite(model["gguf"], tmp_path / "nobias.gguf",
                     lambda name, data: np.zeros_like(data) if name.endswith(".bias") else data)
    assert rel_err(our_logits(zeroed, tokens), our_logits(model["gguf"], tokens)) > 0.05


def test_llama_cpp_converted_file_loads_and_agrees(model, llama_cpp_convert):
    tokens = prompt(4)
    theirs = llama_cpp_convert(model["dir"], "f32", "qwen2")
    assert rel_err(our_logits(theirs, tokens), our_logits(model["gguf"], tokens)) < 1e-5


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_our_gguf_matches_llama_cpp_converter(model, outtype, convert_model, llama_cpp_convert):
    """Same keys, types, tensor names, shapes and bytes as llama.cpp's own converter."""
    assert_same_gguf(convert_model(model["dir"], outtype), llama_cpp_convert(model["dir"], outtype, "qwen2"))


def test_our_file_runs_in_llama_cpp(model):
    """libllama reads our file with the same logits and the same greedy continuation."""
    tokens = prompt(5)
    # libllama's context keeps K/V in f16 (ours here: f32): ~3e-4 apart, measured
    assert rel_err(llama_logits(model["gguf"], tokens), our_logits(model["gguf"], tokens)) < 1e-3
    assert_greedy_equals_llama_cpp(model["gguf"], [prompt(6, n=9), prompt(7, n=17)])


# ---- bad input ---------------------------------------------------------------------------

def rewrite(src, dst, change, extra=None):
    """A copy of GGUF `src` at `dst` with every tensor passed through change(name, data),
    which returns new data, or None to leave the tensor out; `extra` {name: data} added."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = change(t.name, np.array(t.data))
        if data is not None:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("case", ["missing_bias", "bias_shape", "output_bias"])
def test_bad_bias_is_a_clear_error(case, model, tmp_path):
    bad = tmp_path / "bad.gguf"
    if case == "missing_bias":
        rewrite(model["gguf"], bad, lambda n, d: None if n == "blk.1.attn_k.bias" else d)
        expect = "lacks tensor 'blk.1.attn_k.bias'"
    elif case == "bias_shape":
        rewrite(model["gguf"], bad, lambda n, d: np.concatenate([d, d[:1]]) if n == "blk.0.attn_v.bias" else d)
        expect = "tensor 'blk.0.attn_v.bias' has shape"
    else:  # llama.cpp's qwen2 takes a bias on the output head; no Qwen has one and ours refuses it
        n_vocab = read_gguf(model["gguf"])[1]["token_embd.weight"][1][1]
        rewrite(model["gguf"], bad, lambda n, d: d, {"output.bias": np.zeros(n_vocab, np.float32)})
        expect = "output.bias"
    with pytest.raises(DflashError) as e:
        Target(str(bad), TargetConfig(n_ctx=64))
    assert expect in str(e.value) and str(bad) in str(e.value)


@pytest.mark.parametrize("case", ["sliding_window", "missing_bias"])
def test_converter_refuses_what_a_qwen2_gguf_cannot_hold(case, model, tmp_path, capsys):
    """A sliding window (no qwen2 key holds it) and a checkpoint without a q/k/v bias are
    one clear line, not a file that runs differently from the checkpoint."""
    from safetensors.numpy import load_file, save_file
    from helpers.convert_checks import assert_one_clear_line, convert, edit_config, linked_copy

    d = linked_copy(model["dir"], tmp_path / "model")
    if case == "sliding_window":
        edit_config(d, lambda cfg: cfg.update(use_sliding_window=True, sliding_window=64))
        needle = "use_sliding_window"
    else:
        weights = load_file(str(d / "model.safetensors"))
        del weights["model.layers.2.self_attn.v_proj.bias"]
        (d / "model.safetensors").unlink()
        save_file(weights, str(d / "model.safetensors"))
        needle = "model.layers.2.self_attn.v_proj.bias"
    out = tmp_path / "x.gguf"
    assert_one_clear_line(*convert(d, out, capsys), out, needle)
