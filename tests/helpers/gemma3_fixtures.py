"""Tiny seeded Gemma 3 checkpoints with a SentencePiece tokenizer.

The tokenizer is what llama.cpp's gemma3 converter reads: tokenizer.model, a
SentencePiece BPE model with byte fallback and no dummy prefix, Gemma's special tokens at
Gemma's ids (pad 0, eos 1, bos 2, unk 3), and tokenizer_config.json asking for a BOS.

The model: 7 layers in transformers' default pattern (layer 5 global, the others local)
with a sliding window of 8 that the test prompts exceed, local and global RoPE bases of
their own, GQA (4 heads, 2 KV heads), every norm weight random around 0 (Gemma stores
w for a scale of 1 + w) and a final logit softcap that bends the logits.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from helpers.fixtures import _training_corpus, save_gemma

SPECIALS = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "unk": "<unk>"}
WINDOW = 8


def make_spm_tokenizer(directory: str | os.PathLike, vocab_size: int = 1024) -> int:
    """Train tokenizer.model (and write tokenizer_config.json); returns its vocabulary size."""
    import sentencepiece as spm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = [line for text in _training_corpus() for line in text.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(directory / "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", split_digits=True, allow_whitespace_only_pieces=True,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", minloglevel=2, num_threads=1)
    (directory / "tokenizer.vocab").unlink()
    config = {f"{k}_token": v for k, v in SPECIALS.items()}
    config.update(add_bos_token=True, add_eos_token=False, model_max_length=4096)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return vocab_size


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random, so that each conversion path (the +1 of the norms above all)
    matters numerically, with activations O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                std, mean = 0.2, 0.0  # Gemma's w: the scale is 1 + w
            elif "embed_tokens" in name:
                std, mean = 1.0 / p.shape[1] ** 0.5, 0.0
            else:
                std, mean = 1.0 / p.shape[-1] ** 0.5, 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * std + mean)


def gemma3_text_config(vocab_size: int, *, layers: int = 7, window: int = WINDOW, softcap: float | None = 5.0,
                       **extra) -> dict:
    cfg = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=window, final_logit_softcapping=softcap, max_position_embeddings=4096,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}},
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    cfg.update(extra)
    return cfg


def make_gemma3(directory: str | os.PathLike, *, seed: int = 0, multimodal: bool = False, **overrides) -> Path:
    """A tiny seeded Gemma3ForCausalLM (or the text tower of a
    Gemma3ForConditionalGeneration with multimodal=True, vision tower included) in `directory`."""
    directory = Path(directory)
    vocab = make_spm_tokenizer(directory)
    text = gemma3_text_config(vocab, **overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    mm = dict(vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab - 1, boi_token_index=vocab - 2,
              eoi_token_index=vocab - 3)
    return save_gemma(directory, "Gemma3", text, seed=seed, randomize=_randomize, multimodal=mm if multimodal else None)
