"""Every target architecture through the one generic runtime: Qwen3 and Qwen2 dense
(attention only) and Qwen3.5 MoE (hybrid, routed experts), next to the Qwen3.5 dense model the
other modules test in depth. For each: f32 logits against transformers, GGUF interop
with llama.cpp both ways, chain and tree speculative decoding equal to plain greedy,
and chain acceptance lengths equal to z-lab's reference loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.arch_checks import (assert_chain_and_tree_lossless, assert_greedy_equals_llama_cpp, assert_same_gguf,
                                 assert_tree_verify_matches_each_path, our_logits, rel_err)
from helpers.draft_fixtures import make_dflash
from helpers.fixtures import (QWEN2_SHAPES, QWEN3_SHAPES, QWEN35MOE_SHAPES, hf_model, llama_cpp_quantize, make_qwen2,
                              make_qwen3, make_qwen35moe, read_gguf)
from helpers.loops import speculative_generate
from helpers.reference_loop import RecomputingTarget, exact_reference
from helpers.target_workers import run_isolated

from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.convert.quant import OUTTYPES
from dflash_gguf.runtime.target import Target, TargetConfig

BLOCK = 8
ARCHS = {
    "qwen3": (make_qwen3, QWEN3_SHAPES),
    "qwen2": (make_qwen2, QWEN2_SHAPES),
    "qwen35moe": (make_qwen35moe, QWEN35MOE_SHAPES),
}
PRE = {"qwen3": "qwen2", "qwen2": "qwen2", "qwen35moe": "qwen35"}  # the fixtures' pre-tokenizers



def prompts(n, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(5, 30))).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory, convert_model):
    arch = request.param
    make, shapes = ARCHS[arch]
    root = tmp_path_factory.mktemp(arch)
    target_dir = make(root / "target", **shapes["base"])
    draft_dir = make_dflash(root / "draft", target_dir, target_layer_ids=(0, 2), block_size=BLOCK, seed=4)
    return {
        "arch": arch,
        "root": root,
        "target_dir": target_dir,
        "draft_dir": draft_dir,
        "target": convert_model(target_dir, "f32"),
        "draft": convert_model(draft_dir, "f32", "--target-model-dir", str(target_dir)),
    }


def load(pair, n_ctx=512, n_verify=BLOCK, **kw):
    meta = read_draft_metadata(pair["draft"])
    target = Target(pair["target"], TargetConfig(n_ctx=n_ctx, n_ubatch=16, n_verify=n_verify, kv_type="f32",
                                                 feature_layers=meta["target_layers"], **kw))
    return target, Draft(pair["draft"], target, DraftConfig(kv_type="f32", top_k=4))



def test_logits_match_transformers(pair):
    tokens = prompts(1, seed=1)[0] + list(range(100, 140))
    with torch.no_grad():
        ref = hf_model(pair["target_dir"])(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    assert rel_err(our_logits(pair["target"], tokens), ref) < 1e-3


def test_llama_cpp_converted_file_loads_and_agrees(pair, llama_cpp_convert):
    tokens = prompts(1, seed=2)[0]
    theirs = llama_cpp_convert(pair["target_dir"], "f32", PRE[pair["arch"]])
    assert rel_err(our_logits(theirs, tokens), our_logits(pair["target"], tokens)) < 1e-5


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_our_gguf_matches_llama_cpp_converter(pair, outtype, convert_model, llama_cpp_convert):
    """Same keys, types, tensor names, shapes and bytes as llama.cpp's own converter."""
    # ssm_a is -exp(A_log): numpy's and torch's exp may differ in the last bit
    assert_same_gguf(convert_model(pair["target_dir"], outtype),
                     llama_cpp_convert(pair["target_dir"], outtype, PRE[pair["arch"]]), approx=("ssm_a",))


@pytest.mark.parametrize("outtype", ["q4_k_m", "q5_k_m"])
def test_k_quant_mix_matches_llama_quantize(pair, outtype, convert_model, tmp_path):
    """Rows that are whole K-quant blocks, so every choice of llama-quantize's mix shows
    (with experts: ffn_down by layer name, the 8-expert rules, f32 routers)."""
    make, shapes = ARCHS[pair["arch"]]
    d = pair["root"] / "k256"
    if not d.exists():
        make(d, **shapes["k256"])
    ours_kv, ours_t = read_gguf(convert_model(d, outtype))
    ref = llama_cpp_quantize(convert_model(d, "f32"), tmp_path / "ref.gguf", int(OUTTYPES[outtype][0]))
    ref_kv, ref_t = read_gguf(ref)
    assert {n: v[0] for n, v in ours_t.items()} == {n: v[0] for n, v in ref_t.items()}
    for name, (_, _, data) in ref_t.items():
        # llama-quantize drops the trailing unit dimension of ffn_gate_inp_shexp [n_embd, 1]
        assert np.array_equal(ours_t[name][2].ravel(), data.ravel()), name


def test_our_file_runs_in_llama_cpp_with_the_same_greedy_output(pair):
    assert_greedy_equals_llama_cpp(pair["target"], prompts(2, seed=3))


def test_tree_verify_matches_decoding_each_path(pair):
    """Nodes of a tree see only their ancestors; committing a path leaves the cache as
    if the path had been decoded."""
    target, _ = load(pair)
    assert_tree_verify_matches_each_path(target, pair["target"], prompts(1, seed=4)[0],
                                         [11, 12, 13, 14, 15, 16, 17], [21, 22])


def test_chain_and_tree_are_lossless(pair):
    target, draft = load(pair, n_verify=9)
    assert_chain_and_tree_lossless(target, draft, prompts(3, seed=5))


def test_acceptance_lengths_match_reference_loop(pair, monkeypatch):
    import dflash.model as ref
    from dflash.model import DFlashDraftModel

    for name in ("_cuda_time", "_make_cache"):
        monkeypatch.setattr(ref, name, getattr(ref, name))
    exact_reference(ref)
    hf_target = hf_model(pair["target_dir"])
    # an attention-only target rolls back exactly with transformers' own cache
    ref_target = RecomputingTarget(hf_target) if pair["arch"] == "qwen35moe" else hf_target
    ref_draft = DFlashDraftModel.from_pretrained(str(pair["draft_dir"]), dtype=torch.float32).eval()
    target, draft = load(pair)
    compared = 0
    for prompt in prompts(3, seed=7):
        res = ref.dflash_generate(ref_draft, ref_target, torch.tensor([prompt]), 40, None, temperature=0.0,
                                  return_stats=True)
        ours, stats = speculative_generate(target, draft, prompt, 40)
        assert ours == res.output_ids[0, len(prompt):].tolist()
        assert stats.accepted_lengths == list(res.acceptance_lengths)
        compared += 1
    assert compared == 3


@pytest.mark.parametrize("pair", ["qwen35moe"], indirect=True)
def test_moe_routing_uses_several_experts(pair):
    """The fixture's router spreads rows over experts with a clear margin, so the test
    prompts exercise many experts and no routing tie decides a token."""
    model = hf_model(pair["target_dir"])
    tokens = torch.tensor([prompts(1, seed=8)[0] + list(range(200, 230))])
    chosen, margins = set(), []
    k = model.config.num_experts_per_tok

    def record(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        top = torch.topk(logits, k + 1, dim=-1).values
        margins.append(float((top[:, k - 1] - top[:, k]).min()))
        chosen.update(torch.topk(logits, k, dim=-1).indices.flatten().tolist())

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    assert len(chosen) == model.config.num_experts
    assert min(margins) > 1e-4  # no routing decided by float noise


def test_partial_offload_matches_the_cpu(pair, rpc_endpoint):
    placements = [{"device": "CPU", "n_gpu_layers": -1}] + [
        {"device": "RPC0", "n_gpu_layers": n} for n in (1, 2, -1)]
    res = run_isolated("offload_trace", rpc_endpoint, str(pair["target"]), str(pair["draft"]), placements)
    cpu, *offloaded = res["runs"]
    for place, r in zip(placements[1:], offloaded):
        for stage, (a, b) in enumerate(zip(r["logits"], cpu["logits"])):
            err = np.abs(np.asarray(a) - np.asarray(b)).max()
            assert err < 1e-4, f"ngl {place['n_gpu_layers']}, stage {stage}: logits differ by {err}"
        assert r["chain"] == cpu["chain"] and r["tree"] == cpu["tree"], place


def test_moe_text_tower_of_the_multimodal_checkpoint(tmp_path, convert_model, llama_cpp_convert):
    """Qwen3_5MoeForConditionalGeneration: the text tower converts to the same qwen35moe
    file as llama.cpp's converter writes, and runs with transformers' logits."""
    d = make_qwen35moe(tmp_path / "mm", multimodal=True, seed=2)
    ours = convert_model(d, "f32")
    ours_kv, ours_t = read_gguf(ours)
    ref_kv, ref_t = read_gguf(llama_cpp_convert(d, "f32", "qwen35"))
    assert set(ours_t) == set(ref_t) and ours_kv["general.architecture"] == ref_kv["general.architecture"]
    tokens = prompts(1, seed=12)[0]
    with torch.no_grad():
        ref = hf_model(d)(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    assert rel_err(our_logits(ours, tokens), ref) < 1e-3
