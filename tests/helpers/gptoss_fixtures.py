"""Tiny seeded GPT-OSS checkpoints (transformers' GptOssForCausalLM) with a tokenizer shaped
like o200k_harmony, and the MXFP4 form of their experts as OpenAI publishes it.

The tokenizer is a byte-level BPE trained on local text with gpt-oss's Split regex (the
one llama.cpp's `gpt-4o` pre-tokenizer implements), followed by the harmony special
tokens in their published order (a few reserved ones among them) and the published chat
template of the pinned llama.cpp sources (models/templates/openai-gpt-oss-120b.jinja).

The model has YaRN RoPE (transformers' default for gpt-oss: factor 32 over 4096, the
correction range unrounded), learned attention sinks, attention biases, 8 experts of
which 4 run per token (with biases), a sliding window of 8 on even layers that every
test prompt exceeds, and expert pre-activations large enough that the SwiGLU clamp (7)
cuts some of them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from helpers.draft_fixtures import make_dflash
from helpers.fixtures import _training_corpus, llama_cpp_source

# o200k's Split regex as gpt-oss's tokenizer.json carries it
O200K_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# harmony's special tokens in o200k_harmony's order (ids 199998.. there)
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
                    "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
                    "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>"]
MASK_TOKEN = "<|reserved_200000|>"  # a drafter's mask: never generated
GPT_OSS_TEMPLATE = "openai-gpt-oss-120b"

WINDOW = 8
BLOCK = 8  # z-lab's gpt-oss-20b-DFlash drafts blocks of 8
# transformers' GptOssConfig default rope_parameters (those of the published configs)
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}


def make_gptoss_tokenizer(directory: Path, vocab_size: int = 1024) -> dict[str, int]:
    """Train and save the tokenizer and the chat template; returns the special tokens' ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_REGEX), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>", model_max_length=131072,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(directory))
    path = directory / "tokenizer.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved["post_processor"] = None  # as gpt-oss's tokenizer.json: no BOS added
    path.write_text(json.dumps(saved, ensure_ascii=False, indent=2), encoding="utf-8")
    src = llama_cpp_source()
    if src is not None:
        template = (src / "models" / "templates" / f"{GPT_OSS_TEMPLATE}.jinja").read_text(encoding="utf-8")
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    vocab = tok.get_vocab()
    return {t: vocab[t] for t in HARMONY_SPECIALS}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random: norms around 1, sinks and biases O(1), routers spread so that
    tokens pick different experts with clear margins, expert gate/up projections wide
    enough that the SwiGLU clamp at 7 cuts some pre-activations."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(normal(p.shape, 0.2, mean=1.0))
            elif name.endswith("sinks"):
                p.copy_(normal(p.shape, 1.0))
            elif "embed_tokens" in name:
                p.copy_(normal(p.shape, 1.0))
            elif name.endswith("router.weight"):
                p.copy_(normal(p.shape, 2.0 / p.shape[1] ** 0.5))
            elif name.endswith("experts.gate_up_proj"):  # [experts, hidden, 2 ffn]: x @ W
                p.copy_(normal(p.shape, 3.5 / p.shape[1] ** 0.5))
            elif name.endswith("experts.down_proj"):     # [experts, ffn, hidden]
                p.copy_(normal(p.shape, 0.5 / p.shape[1] ** 0.5))
            elif p.ndim >= 2:
                p.copy_(normal(p.shape, 1.0 / p.shape[-1] ** 0.5))
            else:
                p.copy_(normal(p.shape, 0.3))


def gptoss_config(vocab_size: int, specials: dict[str, int], *, layers: int = 4, window: int = WINDOW,
                  rope: dict | None = None, **extra) -> dict:
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=4,
               sliding_window=window, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_parameters={"rope_theta": 150000.0, **(rope or YARN)}, eos_token_id=specials["<|return|>"],
               pad_token_id=specials["<|endoftext|>"], bos_token_id=specials["<|startoftext|>"])
    cfg.update(extra)
    return cfg


def make_gptoss(directory: str | os.PathLike, *, seed: int = 0, pad_vocab: int = 8, dtype=torch.float32,
                **overrides) -> Path:
    """A tiny seeded GptOssForCausalLM with its tokenizer in `directory` (the embedding
    `pad_vocab` rows longer than the tokenizer, as gpt-oss's is)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    directory = Path(directory)
    specials = make_gptoss_tokenizer(directory)
    n_tokens = max(specials.values()) + 1
    cfg = GptOssConfig(**gptoss_config(n_tokens + pad_vocab, specials, **overrides))
    cfg.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg)
    _randomize(model, seed)
    model.to(dtype).eval().save_pretrained(str(directory))
    return directory


# ---- MXFP4 --------------------------------------------------------------------------------

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., n] (n a multiple of 32) -> OpenAI's packed MXFP4: blocks [..., n/32, 16]
    uint8 (value 2j in the low nibble of byte j, 2j+1 in the high one) and scales
    [..., n/32] uint8 (biased exponents: a block's values are FP4 x 2^(scale - 127)).
    Each block's scale puts its largest magnitude at most 6; values round to the nearest
    FP4 value (the fixture's own quantizer: only the format matters)."""
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    exp = np.clip(exp, -127, 127)
    scaled = blocks / np.ldexp(1.0, exp)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp + 127).astype(np.uint8)


def make_gptoss_mxfp4(directory: str | os.PathLike, float_dir: str | os.PathLike) -> Path:
    """The checkpoint in `float_dir` with its experts as OpenAI publishes them: per layer
    experts.gate_up_proj_blocks/_scales [experts, 2 ffn, hidden/32, (16)] (rows interleave
    gate and up, as gate_up_proj's columns do) and down_proj_blocks/_scales [experts,
    hidden, ffn/32, (16)], uint8, and config.json's quantization_config. Everything else,
    expert biases included, as it was."""
    from safetensors.torch import load_file, save_file

    directory, float_dir = Path(directory), Path(float_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(float_dir / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.float().transpose(1, 2).contiguous().numpy()  # [experts, out, in]
            blocks, scales = mxfp4_quantize(rows)
            out[name + "_blocks"] = torch.from_numpy(blocks)
            out[name + "_scales"] = torch.from_numpy(scales)
        else:
            out[name] = t
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for f in float_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (directory / f.name).write_bytes(f.read_bytes())
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def make_drafter(directory, target_dir, seed=4):
    d = make_dflash(directory, target_dir, target_layer_ids=(0, 2), block_size=BLOCK, seed=seed)
    cfg = json.loads((d / "config.json").read_text())
    tok = json.loads((target_dir / "tokenizer.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = next(t["id"] for t in tok["added_tokens"] if t["content"] == MASK_TOKEN)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


