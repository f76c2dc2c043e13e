"""Tiny seeded EAGLE3 drafters in the speculators checkpoint format (config.json with a
`transformer_layer_config`, `speculators_config` and `eagle_aux_hidden_state_layer_ids`;
model.safetensors with the Eagle3DraftModel state dict: embed_tokens, fc, layers.0.* with
hidden_norm and 2 x hidden q/k/v inputs, norm, lm_head over the draft vocabulary, d2t,
t2d), as vllm-project/speculators saves them; or in the original EAGLE-3 layout (a flat
Llama config naming LlamaForCausalLMEagle3, the layer as `midlayer.*`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def make_eagle3(directory: str | os.PathLike, target_dir: str | os.PathLike, *, layer_ids=(1, 2, 3),
                draft_vocab: int | None = 512, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                ffn: int = 256, seed: int = 0, own_embedding: bool = True, norm_before_fc: bool = False,
                norm_before_residual: bool = False, rope_theta: float = 10000.0, original: bool = False) -> Path:
    """An EAGLE3 drafter for the target in `target_dir`, random weights under `seed`.

    `draft_vocab=None` drafts over the target's whole vocabulary (no d2t/t2d);
    `layer_ids=None` leaves the feature layers to the reader's default (null in config.json)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    V, E = tcfg["vocab_size"], tcfg["hidden_size"]
    Vd = draft_vocab or V
    layer = LlamaConfig(vocab_size=V, hidden_size=E, intermediate_size=ffn, num_hidden_layers=1,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=rope_theta,
                        tie_word_embeddings=False)
    config = {
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": Vd,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids) if layer_ids else None,
        "embed_requires_grad": False,
        "fc_norm": False,
        "has_no_defaults_at_init": False,
        "norm_before_fc": norm_before_fc,
        "norm_before_residual": norm_before_residual,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": tcfg.get("architectures", []), "name_or_path": str(target_dir)},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "transformer_layer_config": layer.to_diff_dict(),
        "dtype": "float32",
    }
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows, cols):
        return torch.randn(rows, cols, generator=gen) / cols ** 0.5

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=gen)

    q, kv = heads * head_dim, kv_heads * head_dim
    if original:
        config = {**layer.to_diff_dict(), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": Vd}
    p = "midlayer." if original else "layers.0."
    tensors = {
        "fc.weight": matrix(E, 3 * E),
        p + "input_layernorm.weight": norm(E), p + "hidden_norm.weight": norm(E),
        p + "self_attn.q_proj.weight": matrix(q, 2 * E), p + "self_attn.k_proj.weight": matrix(kv, 2 * E),
        p + "self_attn.v_proj.weight": matrix(kv, 2 * E), p + "self_attn.o_proj.weight": matrix(E, q),
        p + "post_attention_layernorm.weight": norm(E),
        p + "mlp.gate_proj.weight": matrix(ffn, E), p + "mlp.up_proj.weight": matrix(ffn, E),
        p + "mlp.down_proj.weight": matrix(E, ffn),
        "norm.weight": norm(E),
        "lm_head.weight": matrix(Vd, E),
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(V, E, generator=gen)
    if norm_before_fc:
        tensors["input_norm.weight"] = norm(3 * E)
    if Vd != V:
        # the draft vocabulary: a seeded choice of target ids, in increasing order; d2t holds
        # each one's offset from its draft id, t2d marks them
        chosen = torch.randperm(V, generator=gen)[:Vd].sort().values
        tensors["d2t"] = chosen - torch.arange(Vd)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[chosen] = True
        tensors["t2d"] = t2d
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory
