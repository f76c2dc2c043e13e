"""Re-typing a GGUF (`convert-hf-to-gguf in.gguf --outtype T --outfile out.gguf`) on a tiny
Gemma 3 file: an f32 file re-typed to q8_0 is the q8_0 file converted from the checkpoint,
byte for byte, and llama.cpp runs it with the f32 file's logits (within q8_0's error);
re-typing quantized tensors is refused unless --allow-requantize."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from helpers.arch_checks import assert_same_gguf, rel_err
from helpers.fixtures import llama_logits, read_gguf
from helpers.gemma3_fixtures import make_gemma3

TOKENS = list(range(300, 330))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_gemma3(tmp_path_factory.mktemp("retype") / "model", layers=3)


def retype(src, dst, outtype, *extra):
    from dflash_gguf.convert.cli import main

    return main([str(src), "--outtype", outtype, "--outfile", str(dst), *extra])


def test_f32_to_q8_0_is_the_direct_conversion_and_runs_in_llama_cpp(model, tmp_path, convert_model):
    f32 = convert_model(model, "f32")
    assert retype(f32, tmp_path / "q8.gguf", "q8_0") == 0
    assert_same_gguf(tmp_path / "q8.gguf", convert_model(model, "q8_0"))
    # q8_0 weights, and llama.cpp's q8_0 products quantize the activations too
    assert rel_err(llama_logits(tmp_path / "q8.gguf", TOKENS), llama_logits(f32, TOKENS)) < 0.1


def test_requantizing_is_refused_unless_allowed(model, tmp_path, convert_model, capfd):
    q8 = convert_model(model, "q8_0")
    assert retype(q8, tmp_path / "f16.gguf", "f16") == 2
    assert "--allow-requantize" in capfd.readouterr().err and not (tmp_path / "f16.gguf").exists()
    assert retype(q8, tmp_path / "f16.gguf", "f16", "--allow-requantize") == 0
    assert retype(q8, tmp_path / "f32.gguf", "f32") == 0  # dequantizing to f32 loses nothing: no flag needed
    _, quantized = read_gguf(q8)
    _, dequantized = read_gguf(tmp_path / "f32.gguf")
    for name, (qtype, shape, data) in quantized.items():  # the f32 file holds the q8_0 values exactly
        assert dequantized[name][0] == "F32" and dequantized[name][1] == shape
        assert np.array_equal(dequantized[name][2].reshape(-1),
                              quants.dequantize(data, GGMLQuantizationType[qtype]).reshape(-1)), name
    ref = llama_logits(tmp_path / "f32.gguf", TOKENS)
    assert rel_err(llama_logits(tmp_path / "f16.gguf", TOKENS), ref) < 1e-2
