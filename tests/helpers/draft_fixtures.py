"""Tiny seeded DFlash drafters (z-lab's reference model class) and their conversion."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from helpers.fixtures import run_llama_cpp_converter


def make_dflash(directory: str | os.PathLike, target_dir: str | os.PathLike, *, layers: int = 2,
                target_layer_ids=(0, 2), block_size: int = 8, seed: int = 0, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 32, ffn: int = 256, dflash2: dict | None = None,
                rope_scaling: dict | None = None, max_positions: int = 4096) -> Path:
    """A DFlashDraftModel sized for the target in `target_dir`, random weights under `seed`.

    `dflash2` (conv_kernel_size, conv_group_size, selector_rank, selector_top_k) makes a
    DFlash2DraftModel instead, saved the way z-lab publishes them (selector codebooks
    without the `.weight` suffix). `rope_scaling`: extra rope_parameters fields."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config

    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    target_cfg = target_cfg.get("text_config", target_cfg)
    cfg = Qwen3Config(
        vocab_size=target_cfg["vocab_size"], hidden_size=target_cfg["hidden_size"], intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
    )
    if rope_scaling:
        cfg.rope_parameters = {"rope_theta": 10_000_000.0, **rope_scaling}
    mask_id = target_cfg["vocab_size"] - 5  # <|endoftext|> of the fixture tokenizer: never generated
    cfg.dflash_config = {"target_layer_ids": list(target_layer_ids), "block_size": block_size, "mask_token_id": mask_id,
                         **(dflash2 or {})}
    cfg.num_target_layers = target_cfg["num_hidden_layers"]
    cfg.architectures = ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    torch.manual_seed(seed)
    model = (DFlash2DraftModel if dflash2 else DFlashDraftModel)(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    directory = Path(directory)
    model.save_pretrained(str(directory))
    if dflash2:
        from safetensors.torch import load_file, save_file

        path = directory / "model.safetensors"
        tensors = load_file(str(path))
        for name in ("predecessor_codebook", "successor_codebook"):
            tensors[f"candidate_selector.{name}"] = tensors.pop(f"candidate_selector.{name}.weight")
        save_file(tensors, str(path), metadata={"format": "pt"})
    return directory


def convert_dflash_llama_cpp(draft_dir, target_dir, outfile, outtype: str = "f32") -> Path:
    """The drafter converted by llama.cpp's own converter (tokenizer from the target)."""
    return run_llama_cpp_converter(draft_dir, outfile, outtype, pre="qwen35",
                                   extra_args=("--target-model-dir", str(target_dir)))
