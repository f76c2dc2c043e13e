"""DFlash2 drafters (grouped dynamic convolutions around attention and FFN, a low-rank
candidate selector) on the runtime: logits and the selector's greedy path against
z-lab's DFlash2DraftModel, chain acceptance against its reference generate loop, and
lossless chain and tree decoding."""
from __future__ import annotations

import pytest
import torch

from helpers.decoding_checks import prompts, rel_err
from helpers.draft_fixtures import convert_dflash_llama_cpp, make_dflash
from helpers.fixtures import make_qwen35
from helpers.loops import greedy_generate, speculative_generate, tree_generate
from helpers.parity import Parity
from helpers.reference_loop import RecomputingTarget, exact_reference

from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig

BLOCK = 8
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 32, "selector_rank": 16, "selector_top_k": 6}


@pytest.fixture(scope="module")
def pair2(tmp_path_factory, convert_model):
    root = tmp_path_factory.mktemp("dflash2")
    target_dir = make_qwen35(root / "target", hidden=128, layers=4, seed=3)
    draft_dir = make_dflash(root / "draft", target_dir, target_layer_ids=(0, 2), block_size=BLOCK, seed=5,
                            dflash2=DFLASH2)
    return {
        "target_dir": target_dir,
        "draft_dir": draft_dir,
        "target": convert_model(target_dir, "f32"),
        "draft": convert_model(draft_dir, "f32", "--target-model-dir", str(target_dir)),
        "draft_llama_cpp": convert_dflash_llama_cpp(draft_dir, target_dir, root / "draft-llama-cpp.gguf"),
    }


def load(pair2, draft_key="draft", n_verify=BLOCK, top_k=0):
    meta = read_draft_metadata(pair2[draft_key])
    target = Target(pair2["target"], TargetConfig(n_ctx=512, n_ubatch=16, n_verify=n_verify, kv_type="f32",
                                                  feature_layers=meta["target_layers"]))
    return target, Draft(pair2[draft_key], target, DraftConfig(kv_type="f32", top_k=top_k))


def reference_models(pair2):
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3_5ForCausalLM

    target = Qwen3_5ForCausalLM.from_pretrained(str(pair2["target_dir"]), dtype=torch.float32).eval()
    draft = DFlash2DraftModel.from_pretrained(str(pair2["draft_dir"]), dtype=torch.float32).eval()
    return target, draft


def reference_block(target, draft, context, bonus):
    """z-lab's drafter logits and its selector's greedy path for one block."""
    from dflash.model import extract_context_feature

    with torch.no_grad():
        out = target(torch.tensor([context]), output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, draft.target_layer_ids)
        noise = target.get_input_embeddings()(torch.tensor([[bonus] + [draft.mask_token_id] * (BLOCK - 1)]))
        pos = torch.arange(len(context) + BLOCK)[None]
        hidden = draft(target_hidden=feats, noise_embedding=noise, position_ids=pos, use_cache=False)[:, 1:]
        logits = draft.compute_logits(hidden, target.lm_head)[0].numpy()
        path, _, _ = draft.propose(hidden, torch.tensor([bonus]), target.lm_head, 0.0)
    return logits, path[0].tolist()


@pytest.mark.parametrize("draft_key", ["draft", "draft_llama_cpp"])
def test_logits_and_selector_path_match_reference(pair2, draft_key):
    ref_target, ref_draft = reference_models(pair2)
    target, draft = load(pair2, draft_key)
    context = prompts(1, seed=1)[0] + list(range(40, 60))
    target.prefill(context, LOGITS_LAST, on_chunk=lambda s, n: draft.append())
    bonus = int(target.choices()[0])
    drafts = draft.propose(bonus)
    ref_logits, ref_path = reference_block(ref_target, ref_draft, context, bonus)
    assert rel_err(draft.logits(0, BLOCK - 1), ref_logits) < 1e-3
    assert drafts == ref_path
    assert drafts != ref_logits.argmax(1).tolist(), "the selector should change some choice of this fixture"


def test_a_kept_set_is_refused_in_one_line(pair2):
    """DFlash2's selector scores the whole head: a cut head (--spec-draft-vocab) is refused."""
    from dflash_gguf import DflashError

    target, draft = load(pair2)
    draft.close()
    try:
        with pytest.raises(DflashError, match="DFlash2's selector"):
            Draft(pair2["draft"], target, DraftConfig(kv_type="f32", head_tokens=(1, 2, 3)))
    finally:
        target.close()


def test_chain_acceptance_matches_reference_loop(pair2, monkeypatch):
    import dflash.model as ref

    for name in ("_cuda_time", "_make_cache"):
        monkeypatch.setattr(ref, name, getattr(ref, name))
    exact_reference(ref)
    hf_target, ref_draft = reference_models(pair2)
    target, draft = load(pair2)
    for prompt in prompts(3, seed=7):
        res = ref.dflash_generate(ref_draft, RecomputingTarget(hf_target), torch.tensor([prompt]), 40, None,
                                  temperature=0.0, return_stats=True)
        ours, stats = speculative_generate(target, draft, prompt, 40)
        assert ours == res.output_ids[0, len(prompt):].tolist()
        assert stats.accepted_lengths == list(res.acceptance_lengths)


def test_chain_and_tree_are_lossless(pair2):
    target, draft = load(pair2, n_verify=9, top_k=4)
    with Parity(target) as parity:
        for prompt in prompts(3, seed=9):
            ar, _ = greedy_generate(target, prompt, 64)
            chain, _ = speculative_generate(target, draft, prompt, 64)
            parity.check(prompt, ar, chain)
            tree, _ = tree_generate(target, draft, prompt, 64, 8)
            parity.check(prompt, ar, tree)
