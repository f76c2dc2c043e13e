"""Gemma 4 targets (dense and MoE) and a Gemma drafter through the generic runtime.

The tiny checkpoints have sliding layers with a window of 8 that every test prompt
exceeds, full layers with another head size and KV head count (K = V), two layers
reading earlier layers' KV caches, layer output scales and a logit softcap that bends
the logits. Oracles: transformers' Gemma4ForCausalLM (logits), llama.cpp's converter
(the GGUF, byte for byte) and libllama (greedy output), plain greedy decoding (chain and
tree), and z-lab's dflash package (drafter logits, reference loop acceptance lengths)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.arch_checks import (assert_chain_and_tree_lossless, assert_greedy_equals_llama_cpp,
                                 assert_same_gguf, assert_tree_verify_matches_each_path, our_logits, rel_err)
from helpers.fixtures import hf_model, read_gguf
from helpers.gemma4_fixtures import BLOCK, DRAFT_WINDOW, GEMMA4_SHAPES, MASK_ID, make_gemma4, make_gemma_drafter
from helpers.loops import speculative_generate
from helpers.reference_loop import History, RecomputingTarget

from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

WINDOW = 8


def prompts(n, seed=0, vocab=1000, lo=12, hi=40):
    """Random prompts longer than the sliding window (ids past the special and byte tokens)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(300, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=list(GEMMA4_SHAPES))
def pair(request, tmp_path_factory, convert_model):
    root = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    target_dir = make_gemma4(root / "target", **GEMMA4_SHAPES[request.param])
    draft_dir = make_gemma_drafter(root / "draft", target_dir)
    return {
        "kind": request.param,
        "target_dir": target_dir,
        "draft_dir": draft_dir,
        "target": convert_model(target_dir, "f32"),
        "draft": convert_model(draft_dir, "f32", "--target-model-dir", str(target_dir)),
    }


def load(pair, n_ctx=512, n_verify=BLOCK, n_ubatch=16):
    meta = read_draft_metadata(pair["draft"])
    target = Target(pair["target"], TargetConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=n_verify, kv_type="f32",
                                                 feature_layers=meta["target_layers"]))
    return target, Draft(pair["draft"], target, DraftConfig(kv_type="f32", top_k=4))


def test_logits_match_transformers(pair):
    tokens = prompts(1, seed=1)[0] + list(range(400, 440))
    with torch.no_grad():
        ref = hf_model(pair["target_dir"])(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    assert np.abs(ref).max() > 0.5 * 5.0  # the softcap (5) bends the largest logits
    assert rel_err(our_logits(pair["target"], tokens), ref) < 1e-3


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_our_gguf_matches_llama_cpp_converter(pair, outtype, convert_model, llama_cpp_convert):
    """Same keys, types, tensor names, shapes and bytes as llama.cpp's own converter."""
    assert_same_gguf(convert_model(pair["target_dir"], outtype), llama_cpp_convert(pair["target_dir"], outtype, None))


def test_llama_cpp_converted_file_loads_and_agrees(pair, llama_cpp_convert):
    tokens = prompts(1, seed=2)[0]
    theirs = llama_cpp_convert(pair["target_dir"], "f32", None)
    assert rel_err(our_logits(theirs, tokens), our_logits(pair["target"], tokens)) < 1e-5


def test_our_file_runs_in_llama_cpp_with_the_same_greedy_output(pair):
    assert_greedy_equals_llama_cpp(pair["target"], prompts(2, seed=3))


def test_tree_verify_matches_decoding_each_path(pair):
    """Tree nodes see only their ancestors, sliding layers only the window behind each
    node's position p + depth; committing a path leaves the caches as if decoded."""
    target, _ = load(pair)
    assert_tree_verify_matches_each_path(target, pair["target"], prompts(1, seed=4)[0],
                                         [311, 312, 313, 314, 315, 316, 317], [321, 322])


def test_chain_and_tree_are_lossless(pair):
    target, draft = load(pair, n_verify=9)
    assert_chain_and_tree_lossless(target, draft, prompts(3, seed=5))


def reference_pair(pair):
    from dflash.model import DFlashDraftModel

    ref_draft = DFlashDraftModel.from_pretrained(str(pair["draft_dir"]), dtype=torch.float32).eval()
    return hf_model(pair["target_dir"]), ref_draft


def test_drafter_applies_embedding_scale_once_softcap_and_sliding_layers(pair):
    """The drafter's logits equal the reference drafter's, fed as z-lab's loop feeds it:
    the target's raw embedding times input_embedding_scale (once), softcapped logits."""
    from dflash.model import extract_context_feature

    ref_target, ref_draft = reference_pair(pair)
    assert ref_draft.layers[0].self_attn.sliding_window == DRAFT_WINDOW
    target, draft = load(pair, n_ubatch=8)
    prompt = prompts(1, seed=1)[0]
    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: draft.append())
    bonus = int(target.choices()[0])
    block = [bonus] + draft.propose(bonus)
    with torch.no_grad():
        out = ref_target(torch.tensor([prompt]), output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, ref_draft.target_layer_ids)
        scale = ref_draft.config.dflash_config["input_embedding_scale"]
        ids = torch.tensor([[bonus] + [MASK_ID] * (BLOCK - 1)])
        noise = F.embedding(ids, ref_target.get_input_embeddings().weight) * scale
        hidden = ref_draft(target_hidden=feats, noise_embedding=noise,
                           position_ids=torch.arange(len(prompt) + BLOCK)[None], use_cache=False)
        ref = ref_draft.compute_logits(hidden[:, 1:], ref_target.lm_head)[0].numpy()
    assert np.abs(ref).max() < ref_draft.config.dflash_config["final_logit_softcapping"]
    assert rel_err(draft.logits(0, BLOCK - 1), ref) < 1e-3
    assert block[1:] == ref.argmax(1).tolist()


def test_acceptance_lengths_match_reference_loop(pair, monkeypatch):
    import time

    import dflash.model as ref

    # transformers' sliding caches cannot be cropped back past their window: the oracle
    # recomputes the target from the committed tokens instead (the loop is untouched)
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    make_cache = ref._make_cache
    monkeypatch.setattr(ref, "_make_cache", lambda cfg: History() if getattr(cfg, "model_type", "") == "gemma4_text"
                        else make_cache(cfg))
    hf_target, ref_draft = reference_pair(pair)
    ref_target = RecomputingTarget(hf_target)
    target, draft = load(pair)
    for prompt in prompts(3, seed=7):
        res = ref.dflash_generate(ref_draft, ref_target, torch.tensor([prompt]), 40, None, temperature=0.0,
                                  return_stats=True)
        ours, stats = speculative_generate(target, draft, prompt, 40)
        assert ours == res.output_ids[0, len(prompt):].tolist()
        assert stats.accepted_lengths == list(res.acceptance_lengths)


@pytest.mark.parametrize("pair", ["moe"], indirect=True)
def test_moe_routing_uses_several_experts(pair):
    model = hf_model(pair["target_dir"])
    chosen = set()

    def record(module, args, output):
        chosen.update(output[2].flatten().tolist())

    hooks = [layer.router.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.tensor([prompts(1, seed=8)[0]]))
    for h in hooks:
        h.remove()
    assert len(chosen) == model.config.num_experts


def test_unsupported_options_are_refused_by_name(tmp_path, capfd):
    from dflash_gguf.convert.cli import main

    d = make_gemma4(tmp_path / "ple", layers=3, shared_kv_layers=0, hidden_size_per_layer_input=16)
    assert main([str(d), "--outfile", str(tmp_path / "x.gguf")]) != 0
    assert "hidden_size_per_layer_input" in capfd.readouterr().err


def test_text_tower_of_the_multimodal_checkpoint(tmp_path, convert_model, llama_cpp_convert):
    """Gemma4ForConditionalGeneration (model.language_model.*): the text tower converts to
    the same gemma4 file as llama.cpp's converter writes, and runs with transformers' logits."""
    d = make_gemma4(tmp_path / "mm", multimodal=True, seed=2)
    ours_kv, ours_t = read_gguf(convert_model(d, "f32"))
    ref_kv, ref_t = read_gguf(llama_cpp_convert(d, "f32", None))
    assert set(ours_kv) == set(ref_kv) and set(ours_t) == set(ref_t)
    for key in set(ref_kv) - {"general.name", "general.size_label"}:
        assert ours_kv[key] == ref_kv[key], key
    tokens = prompts(1, seed=12)[0]
    with torch.no_grad():
        ref = hf_model(d)(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    assert rel_err(our_logits(convert_model(d, "f32"), tokens), ref) < 1e-3


def test_bf16_checkpoint_records_the_rounded_embedding_scale(tmp_path, convert_model):
    """transformers scales bf16 embeddings by sqrt(hidden) cast to bf16; the file says so."""
    from transformers import Gemma4ForCausalLM

    d = make_gemma4(tmp_path / "f32", layers=3, shared_kv_layers=0)
    Gemma4ForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "bf16" / name).write_bytes((d / name).read_bytes())
    kv, _ = read_gguf(convert_model(tmp_path / "bf16", "f32"))
    assert kv["gemma4.embedding_scale"][1] == torch.tensor(128 ** 0.5).to(torch.bfloat16).item()
    assert "gemma4.embedding_scale" not in read_gguf(convert_model(d, "f32"))[0]


def test_sliding_layers_keep_only_their_window(pair):
    """Own caches: three sliding layers (32-wide heads, 2 KV heads) in rings of window +
    ubatch rows, one full layer (64-wide, 1 KV head) over the whole context; the two
    shared layers have none; each cache has a verify's rows spare after it (a tree's rows
    past a ring's end)."""
    from dflash_gguf.engine.memory import plan_memory

    n_ctx, n_ubatch = 4096, 64
    plan = plan_memory(pair["target"], None, TargetConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=16, kv_type="f32"))
    row = 2 * 64 * 4  # K and V rows of 64 f32 values, in either kind of layer
    spare = 16
    assert sum(d.parts["kv_cache"] for d in plan.devices) == row * (3 * (WINDOW + n_ubatch + spare) + n_ctx + spare)


def test_drafter_sliding_layers_without_a_window_are_refused(tmp_path, capfd):
    """The reference drafter runs layers marked sliding causally even without
    use_sliding_window; llama.cpp's keys cannot say that, so the converter says no."""
    from dflash_gguf.convert.cli import main

    target = make_gemma4(tmp_path / "target", layers=4, shared_kv_layers=0)
    d = make_gemma_drafter(tmp_path / "draft", target)
    cfg = json.loads((d / "config.json").read_text())
    cfg["use_sliding_window"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    assert main([str(d), "--target-model-dir", str(target), "--outfile", str(tmp_path / "d.gguf")]) != 0
    assert "use_sliding_window" in capfd.readouterr().err


def test_checkpoint_chain_restores_sliding_and_shared_caches(pair):
    """Checkpoints every 16 tokens of a prompt several windows long, each on top of the
    previous one: sliding layers keep only the positions still inside their window (in
    ring rows), layers sharing another's cache keep nothing of their own. Restored from
    the middle and the end of the chain after another prompt, the continuation (chain
    decoding, drafter window included) and its acceptance are a cold run's."""
    from dflash_gguf.runtime.checkpoints import PrefillSaver, PrefixCheckpoints
    from dflash_gguf.decoding.requests import GenerationStats, Placement, Request, collect
    from helpers.loops import prefill_prompt, speculative_steps

    prompt, other = prompts(1, seed=21, lo=60, hi=61)[0], prompts(1, seed=22, lo=40, hi=41)[0]
    target, draft = load(pair)

    def run(reused=0):
        stats = GenerationStats()
        return collect(speculative_steps(target, draft, Request(prompt, 24), stats, where=Placement(reused=reused))), stats

    cold, cold_stats = run()
    target.reset()
    draft.reset()
    store = PrefixCheckpoints(1 << 30, every=16)
    marks = store.positions(len(prompt), 0)
    prefill_prompt(target, prompt, 0, draft, PrefillSaver(marks, lambda n: store.save(prompt[:n], target, draft)))
    assert marks == [16, 32, 48, 59]
    assert [c.parent_n_past for c in store.checkpoints()] == [0, 16, 32, 48]
    for n in (32, 59):
        target.reset()
        draft.reset()
        speculative_generate(target, draft, other, 16)
        found = store.lookup(prompt, n, True)
        assert found.n_past == n
        found.restore(target, draft)
        warm, warm_stats = run(reused=n)
        assert warm == cold, f"restored at {n}"
        assert warm_stats.accepted_lengths == cold_stats.accepted_lengths, f"restored at {n}"
