"""Tiny seeded Gemma 4 checkpoints (dense and MoE) with a Gemma-style tokenizer.

The tokenizer is what llama.cpp's gemma4 converter reads (gguf-py's LlamaHfVocab): a
BPE model with byte fallback over text whose spaces are normalised to U+2581, byte
tokens <0x00>..<0xFF>, Gemma's special tokens at Gemma's ids (pad 0, eos 1, bos 2,
unk 3) and a <mask> token for drafters.

The models have sliding and full-attention layers with different head sizes, KV head
counts and RoPE, a window the test prompts exceed, K = V on full layers, KV shared by the
last layers, a layer output scale and a final logit softcap that bends the logits.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from helpers.draft_fixtures import make_dflash
from helpers.fixtures import _training_corpus, save_gemma

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
MASK_ID = 4
BLOCK = 8  # the drafters' block
DRAFT_WINDOW = 5  # their sliding layer's window: shorter than context + block

# the last two layers with their own KV are sliding then full: transformers shares the
# last earlier cache of a layer's type, llama.cpp assumes those two (E2B's layout)
LAYER_TYPES = ["sliding_attention", "sliding_attention", "sliding_attention",
               "full_attention", "sliding_attention", "full_attention"]

GEMMA4_SHAPES: dict[str, dict] = {
    "dense": {},
    "moe": {"moe": True, "seed": 1},
}


def make_gemma4_tokenizer(directory: str | os.PathLike, vocab_size: int = 1024) -> int:
    """Train and save the tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIALS + byte_tokens)
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", mask_token="<mask>", model_max_length=4096,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(directory))
    return tok.get_vocab_size()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random (norms around 1, layer scales and expert scales too), so that
    each conversion path matters numerically, with activations O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(normal(p.shape, 0.2, mean=1.0))
            elif "embed_tokens" in name:
                p.copy_(normal(p.shape, 1.0 / p.shape[1] ** 0.5))
            elif name.endswith("router.proj.weight"):
                p.copy_(normal(p.shape, 3.0 / p.shape[1] ** 0.5))
            elif p.ndim >= 2:
                p.copy_(normal(p.shape, 1.0 / p.shape[-1] ** 0.5))
            else:
                p.copy_(normal(p.shape, 0.1))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(normal(b.shape, 0.1, mean=1.0))


def gemma4_text_config(vocab_size: int, *, moe: bool = False, layers: int = 6, window: int = 8,
                       shared_kv_layers: int = 2, softcap: float = 5.0, **extra) -> dict:
    cfg = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=LAYER_TYPES[:layers],
        sliding_window=window, num_kv_shared_layers=shared_kv_layers, hidden_size_per_layer_input=0,
        final_logit_softcapping=softcap, max_position_embeddings=4096, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    cfg.update(extra)
    if moe:
        cfg.update(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=48)
    return cfg


def make_gemma4(directory: str | os.PathLike, *, moe: bool = False, seed: int = 0, multimodal: bool = False,
                **overrides) -> Path:
    """A tiny seeded Gemma4ForCausalLM (or the text tower of a
    Gemma4ForConditionalGeneration with multimodal=True, without vision) in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = make_gemma4_tokenizer(directory)
    text = gemma4_text_config(vocab, moe=moe, **overrides)
    mm = dict(vision_config=None, audio_config=None)
    return save_gemma(directory, "Gemma4", text, seed=seed, randomize=_randomize, multimodal=mm if multimodal else None)


def make_gemma_drafter(directory, target_dir, seed=4):
    """A DFlash drafter for the Gemma target the way z-lab configures one: the target's
    embedding scale and softcap in dflash_config, a sliding first layer with a window
    shorter than context + block."""
    d = make_dflash(directory, target_dir, target_layer_ids=(0, 3), block_size=BLOCK, seed=seed)
    cfg = json.loads((d / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
               sliding_window=DRAFT_WINDOW)
    cfg["dflash_config"].update(mask_token_id=MASK_ID, input_embedding_scale=float(target["hidden_size"]) ** 0.5,
                                final_logit_softcapping=target["final_logit_softcapping"])
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d

