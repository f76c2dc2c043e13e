"""YaRN RoPE scaling: a tiny Qwen3 whose rope_parameters ask for YaRN (factor 4 over an
original context of 64 positions) converts to llama.cpp's rope.scaling.* keys, and decodes
past the original context as transformers and llama.cpp do."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from arch_checks import assert_greedy_equals_llama_cpp, our_logits, rel_err
from fixtures import hf_model, make_qwen3, read_gguf

from dflash_gguf.convert.cli import main as convert_main
from dflash_gguf.generate import greedy_generate
from dflash_gguf.target import Target, TargetConfig

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory, convert_model):
    target_dir = make_qwen3(tmp_path_factory.mktemp("yarn") / "target", rope_scaling=YARN, max_positions=256, seed=7)
    return target_dir, convert_model(target_dir, "f32")


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, size=n).tolist()


def test_keys_are_llama_cpps(yarn_model, llama_cpp_convert):
    target_dir, ours = yarn_model
    theirs = llama_cpp_convert(target_dir, "f32", "qwen2")
    kv_ours, _ = read_gguf(ours)
    kv_theirs, _ = read_gguf(theirs)
    rope = {k: v for k, v in kv_theirs.items() if ".rope." in k}
    assert rope["qwen3.rope.scaling.type"][1] == "yarn"
    assert {k: v for k, v in kv_ours.items() if ".rope." in k} == rope


def test_logits_match_transformers_past_the_original_context(yarn_model):
    target_dir, ours = yarn_model
    seq = tokens(120, seed=1)  # almost twice the original 64 positions
    with torch.no_grad():
        ref = hf_model(target_dir)(input_ids=torch.tensor([seq])).logits[0].float().numpy()
    got = our_logits(ours, seq)
    assert rel_err(got, ref) < 1e-3
    # the scaling matters: the same weights with plain RoPE are far off past 64 positions
    plain = hf_model(target_dir)
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
    plain.model.rotary_emb.__init__(plain.config)
    with torch.no_grad():
        unscaled = plain(input_ids=torch.tensor([seq])).logits[0].float().numpy()
    assert rel_err(unscaled, ref) > 1e-2


def test_greedy_equals_transformers_and_llama_cpp(yarn_model):
    target_dir, ours = yarn_model
    prompt = tokens(40, seed=2)
    target = Target(str(ours), TargetConfig(n_ctx=256, kv_type="f32"))
    got, _ = greedy_generate(target, prompt, 60)  # ends at position 100 > 64
    with torch.no_grad():
        ref = hf_model(target_dir).generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False,
                                            min_new_tokens=60)[0, len(prompt):].tolist()
    assert got == ref
    assert_greedy_equals_llama_cpp(ours, [prompt], n_new=60)


def test_llama_cpp_converted_file_agrees(yarn_model, llama_cpp_convert):
    target_dir, ours = yarn_model
    theirs = llama_cpp_convert(target_dir, "f32", "qwen2")
    seq = tokens(120, seed=3)
    assert rel_err(our_logits(theirs, seq), our_logits(ours, seq)) < 1e-5


def test_unimplemented_rope_type_is_refused_by_name(tmp_path, capsys):
    target_dir = make_qwen3(tmp_path / "longrope", rope_scaling=YARN, max_positions=256)
    import json
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0,
                              "short_factor": [1.0] * 16, "long_factor": [1.0] * 16}
    (target_dir / "config.json").write_text(json.dumps(cfg))
    assert convert_main([str(target_dir), "--outfile", str(tmp_path / "x.gguf"), "--outtype", "f32"]) == 2
    assert "'longrope'" in capsys.readouterr().err
