"""YaRN RoPE scaling: a tiny Qwen3 whose rope_parameters ask for YaRN (factor 4 over an
original context of 64 positions) converts to llama.cpp's rope.scaling.* keys, and decodes
past the original context as transformers and llama.cpp do."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.arch_checks import (assert_chain_and_tree_lossless, assert_greedy_equals_llama_cpp, our_logits,
                                 rel_err)
from helpers.draft_fixtures import make_dflash
from helpers.fixtures import hf_model, make_qwen3, read_gguf
from helpers.loops import greedy_generate

from dflash_gguf.convert.cli import main as convert_main
from dflash_gguf.runtime.native import DflashError
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.runtime.target import LOGITS_ALL, LOGITS_LAST, RopeScaling, Target, TargetConfig
from dflash_gguf.engine.options import EngineOptions

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory, convert_model):
    target_dir = make_qwen3(tmp_path_factory.mktemp("yarn") / "target", rope_scaling=YARN, max_positions=256, seed=7)
    return target_dir, convert_model(target_dir, "f32")


@pytest.fixture(scope="module")
def yarn_pair(yarn_model, tmp_path_factory, convert_model):
    """The YaRN target with a DFlash drafter that uses YaRN as well."""
    target_dir, target = yarn_model
    draft_dir = make_dflash(tmp_path_factory.mktemp("yarn-draft") / "draft", target_dir, block_size=4, seed=3,
                            rope_scaling=YARN, max_positions=256)
    return target_dir, target, draft_dir, convert_model(draft_dir, "f32", "--target-model-dir", str(target_dir))


def load_pair(target, draft):
    meta = read_draft_metadata(draft)
    t = Target(str(target), TargetConfig(n_ctx=256, n_ubatch=16, n_verify=9, kv_type="f32",
                                         feature_layers=meta["target_layers"]))
    return t, Draft(str(draft), t, DraftConfig(kv_type="f32", top_k=4))


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


def test_rope_scaling_none_override_is_plain_rope(yarn_model):
    """--rope-scaling none runs the file with unscaled RoPE: transformers' default rotation."""
    target_dir, ours = yarn_model
    seq = tokens(100, seed=4)
    plain = hf_model(target_dir)
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
    plain.model.rotary_emb.__init__(plain.config)
    with torch.no_grad():
        ref = plain(input_ids=torch.tensor([seq])).logits[0].float().numpy()
    target = Target(str(ours), TargetConfig(n_ctx=256, n_ubatch=128, kv_type="f32", rope=RopeScaling("none")))
    target.decode(seq, LOGITS_ALL)
    assert rel_err(target.logits(0, len(seq)), ref) < 1e-3


def test_context_past_yarn_reach_is_one_clear_error(yarn_model):
    _, ours = yarn_model
    with pytest.raises(DflashError, match="past what YaRN covers: factor 4 over the original context 64"):
        Target(str(ours), TargetConfig(n_ctx=512, kv_type="f32"))
    # --yarn-orig-ctx widens it as llama.cpp's does
    Target(str(ours), TargetConfig(n_ctx=512, kv_type="f32", rope=RopeScaling(yarn_orig_ctx=128)))


@pytest.mark.parametrize("options, flag", [
    ({"rope_scaling": "longrope"}, "--rope-scaling"),
    ({"rope_scale": -2.0}, "--rope-scale"),
    ({"yarn_orig_ctx": -1}, "--yarn-orig-ctx"),
])
def test_rope_flags_are_validated(yarn_model, options, flag):
    from dflash_gguf.engine.args import FLAGS
    from dflash_gguf.engine.setup import EngineSetup
    from dflash_gguf.runtime.errors import ConfigError

    _, ours = yarn_model
    with pytest.raises(ConfigError) as e:
        EngineSetup.of(str(ours), None, EngineOptions.of(**options))
    assert FLAGS[e.value.option] == flag


def test_chain_and_tree_lossless_past_the_original_context(yarn_pair):
    _, target, _, draft = yarn_pair
    t, d = load_pair(target, draft)
    assert_chain_and_tree_lossless(t, d, [tokens(50, seed=5), tokens(30, seed=6)], n_new=60)


def test_drafter_logits_match_reference_past_the_original_context(yarn_pair):
    """The drafter's block logits at positions 70..73 equal z-lab's reference DFlash model
    run with the same YaRN config (and differ from an unscaled drafter's)."""
    from dflash.model import DFlashDraftModel, extract_context_feature

    target_dir, target, draft_dir, draft = yarn_pair
    ref_target = hf_model(target_dir)
    ref_draft = DFlashDraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    t, d = load_pair(target, draft)
    prompt = tokens(70, seed=8)
    t.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: d.append())
    bonus = int(t.choices()[0])
    d.propose(bonus)
    ours = d.logits(0, 3)

    def reference(model):
        with torch.no_grad():
            out = ref_target(torch.tensor([prompt]), output_hidden_states=True)
            feats = extract_context_feature(out.hidden_states, model.target_layer_ids)
            noise = ref_target.get_input_embeddings()(torch.tensor([[bonus] + [model.mask_token_id] * 3]))
            pos = torch.arange(len(prompt) + 4)[None]
            hidden = model(target_hidden=feats, noise_embedding=noise, position_ids=pos, use_cache=False)
            return model.compute_logits(hidden[:, 1:], ref_target.lm_head)[0].numpy()

    assert rel_err(ours, reference(ref_draft)) < 1e-3
    ref_draft.config.rope_parameters = {"rope_type": "default", "rope_theta": 10_000_000.0}
    ref_draft.rotary_emb.__init__(ref_draft.config)
    assert rel_err(ours, reference(ref_draft)) > 1e-3


def test_qwen35_yarn_matches_transformers(tmp_path, convert_model):
    """Qwen3.5's partial multi-section RoPE with YaRN over its rotated dimensions."""
    import json

    from helpers.fixtures import make_qwen35

    model_dir = make_qwen35(tmp_path / "qwen35", seed=9)
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["rope_parameters"].update(YARN)
    text["max_position_embeddings"] = 256
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ours = convert_model(model_dir, "f32")
    assert read_gguf(ours)[0]["qwen35.rope.scaling.type"][1] == "yarn"
    seq = tokens(120, seed=10)
    with torch.no_grad():
        ref = hf_model(model_dir)(input_ids=torch.tensor([seq])).logits[0].float().numpy()
    assert rel_err(our_logits(ours, seq), ref) < 1e-3
    unscaled = Target(str(ours), TargetConfig(n_ctx=256, n_ubatch=128, kv_type="f32", rope=RopeScaling("none")))
    unscaled.decode(seq, LOGITS_ALL)
    assert rel_err(unscaled.logits(0, len(seq)), ref) > 1e-3  # the scaling is visible in this model


@pytest.mark.parametrize("flags, code, message", [
    (["-c", "512"], 1, "past what YaRN covers"),
    (["-c", "512", "--yarn-orig-ctx", "128", "--rope-scale", "-1"], 2, "--rope-scale"),
    (["--rope-scaling", "ntk"], 2, "--rope-scaling"),
])
def test_dflash_run_rope_flags(yarn_model, flags, code, message):
    import subprocess
    import sys
    from pathlib import Path

    run = str(Path(sys.executable).with_name("dflash-run"))
    _, ours = yarn_model
    proc = subprocess.run([run, "-m", str(ours), "-p", "hello", "-n", "4", *flags], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == code
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dflash_run_with_yarn_orig_ctx_runs(yarn_model):
    import subprocess
    import sys
    from pathlib import Path

    run = str(Path(sys.executable).with_name("dflash-run"))
    _, ours = yarn_model
    proc = subprocess.run([run, "-m", str(ours), "-p", "hello", "-n", "4", "-c", "512", "--yarn-orig-ctx", "128",
                           "--rope-scaling", "yarn", "--rope-scale", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_unrounded_yarn_range_in_target_and_drafter(tmp_path, convert_model):
    """truncate: false (transformers leaves YaRN's correction range unrounded, where ggml
    rounds it outward to whole dimensions) is recorded as rope.scaling.yarn_truncate and
    honoured by the target and by a drafter: both match transformers / z-lab's reference
    past the original context."""
    from dflash.model import DFlashDraftModel, extract_context_feature

    exact = {**YARN, "truncate": False}
    target_dir = make_qwen3(tmp_path / "target", rope_scaling=exact, max_positions=256, seed=11)
    draft_dir = make_dflash(tmp_path / "draft", target_dir, block_size=4, seed=12, rope_scaling=exact,
                            max_positions=256)
    target = convert_model(target_dir, "f32")
    draft = convert_model(draft_dir, "f32", "--target-model-dir", str(target_dir))
    assert read_gguf(target)[0]["qwen3.rope.scaling.yarn_truncate"][1] is False
    assert read_gguf(draft)[0]["dflash.rope.scaling.yarn_truncate"][1] is False
    prompt = tokens(90, seed=13)
    ref_target = hf_model(target_dir)
    with torch.no_grad():
        out = ref_target(torch.tensor([prompt]), output_hidden_states=True)
    assert rel_err(our_logits(target, prompt), out.logits[0].numpy()) < 1e-4

    ref_draft = DFlashDraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    t, d = load_pair(target, draft)
    t.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: d.append())
    bonus = int(t.choices()[0])
    d.propose(bonus)
    with torch.no_grad():
        feats = extract_context_feature(out.hidden_states, ref_draft.target_layer_ids)
        noise = ref_target.get_input_embeddings()(torch.tensor([[bonus] + [ref_draft.mask_token_id] * 3]))
        hidden = ref_draft(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(len(prompt) + 4)[None],
                           use_cache=False)
        ref = ref_draft.compute_logits(hidden[:, 1:], ref_target.lm_head)[0].numpy()
    assert rel_err(d.logits(0, 3), ref) < 1e-4
