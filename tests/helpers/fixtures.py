"""Tiny seeded checkpoints and helpers shared by the test suite.

Everything here is built offline and deterministically: a byte-level BPE tokenizer
trained on local text, tiny Qwen3.5 checkpoints saved with transformers, and access to
llama.cpp's own converter (from the llama-cpp-python sdist) as an oracle.

Import from tests as ``from helpers.fixtures import ...`` (tests/ is on sys.path under pytest).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

# Pre-tokenizer regexes exactly as they appear in the models' tokenizer.json files.
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES = {"qwen2": QWEN2_REGEX, "qwen35": QWEN35_REGEX}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3.5 ships <think>/</think> as added tokens that are not special: they exercise the
# USER_DEFINED token type.
PLAIN_ADDED_TOKENS = ["<think>", "</think>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Multilingual, code and whitespace-heavy text: used as training text (so merges exist for
# it) and by the tokenizer tests.
SAMPLE_TEXT = (
    "def quicksort(xs):\n"
    "    if len(xs) <= 1:\n"
    "        return xs\n"
    "    pivot, *rest = xs\n"
    "    return quicksort([x for x in rest if x < pivot]) + [pivot] + \\\n"
    "        quicksort([x for x in rest if x >= pivot])\n"
    "\n\n\t\tindented\twith tabs   and    runs of spaces  \n"
    "English: The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? "
    "We'll see, they'd say; I'M SURE you've heard.\n"
    "Deutsch: Größere Äpfel schmecken süß. Français: garçon, où êtes-vous?\n"
    "Русский: Съешь же ещё этих мягких французских булок.\n"
    "中文：我想在苹果工作，今天天气很好。日本語：こんにちは、世界！\n"
    "한국어: 안녕하세요 세계. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก\n"
    "Emoji: 🚀 🦙🦙 ✅ 😶‍🌫️ numbers 1 22 333 4444 55555 and 3..3 3...3\n"
    "Symbols: <tag attr=\"v\">&amp;</tag> {\"json\": [1, 2, null]} a->b || c && !d\n"
)

_CORPUS_MODULES = [
    "json/decoder.py", "json/encoder.py", "textwrap.py", "functools.py", "string.py",
    "heapq.py", "bisect.py", "fractions.py", "shlex.py", "difflib.py",
]


# Python source the demo pair (trained on code) continues well: a prompt for the
# checkpoint and server tests
CODE_PROMPT = '''import os


def read_lines(path):
    """Return the lines of a file without their line endings."""
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def peek(self):
        """The item on top, left on the stack."""
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]

    def __len__(self):
        return len(self.items)


def count_words(text):
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts

'''


def _training_corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in _CORPUS_MODULES]
    return texts + [SAMPLE_TEXT] * 8


def make_tokenizer(directory: str | os.PathLike, *, vocab_size: int = 1024,
                   regex: str = "qwen35") -> Path:
    """Train a byte-level BPE tokenizer shaped like Qwen's and save it in `directory`.

    `vocab_size` counts the trained tokens (bytes + merges); the special and plain added
    tokens are appended after them, as in Qwen's own vocabulary. `regex` picks the Split
    pattern: "qwen35" (Qwen3.5, the default) or "qwen2".
    """
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            trainers)
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEXES[regex]), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        add_bos_token=False,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    save_qwen_style(fast, directory)
    return directory


def save_qwen_style(fast, directory: Path) -> None:
    """save_pretrained, then the post-processor Qwen's own tokenizer.json carries: a
    ByteLevel one (transformers 5 saves TemplateProcessing; same ids), which is what
    converters see in the wild."""
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    path = directory / "tokenizer.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                               "use_regex": False}
    path.write_text(json.dumps(saved, ensure_ascii=False, indent=2), encoding="utf-8")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter so that all conversion paths matter numerically.

    transformers' init leaves norm weights at 0 (stored as w, applied as 1+w) and dt_bias
    at 1: a converter that forgot the +1 or the V-head reorder could still pass. Here
    every tensor is random and activations stay O(1) so logits differ meaningfully.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "visual" in name:
                p.copy_(normal(p.shape, 0.05))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen).mul(3.0).sub(2.0))
            elif name.endswith("dt_bias"):
                p.copy_(normal(p.shape, 0.5))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(normal(p.shape, 0.2, mean=1.0))
            elif "norm" in name:
                p.copy_(normal(p.shape, 0.2))
            elif name.endswith("conv1d.weight"):
                p.copy_(normal(p.shape, 0.5))
            elif "embed_tokens" in name:
                p.copy_(normal(p.shape, 1.0))
            elif name.endswith("lm_head.weight"):
                p.copy_(normal(p.shape, 2.0 / p.shape[1] ** 0.5))
            elif p.ndim == 2:
                p.copy_(normal(p.shape, 1.0 / p.shape[1] ** 0.5))
            else:
                p.copy_(normal(p.shape, 0.1))


def _tiny_vision_config(out_hidden: int) -> dict:
    return {
        "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "out_hidden_size": out_hidden, "num_position_embeddings": 16,
    }


def make_qwen35(directory: str | os.PathLike, *, vocab_size: int | None = None, hidden: int = 128,
                layers: int = 4, layer_types: list[str] | None = None, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 32, lin_k_heads: int = 2, lin_v_heads: int = 4,
                lin_k_dim: int = 16, lin_v_dim: int = 16, ffn: int = 256, tie: bool = False,
                seed: int = 0, dtype: torch.dtype = torch.float32, multimodal: bool = False,
                shards: int = 1, mtp_layers: int = 0, full_attention_interval: int | None = None,
                tokenizer_regex: str = "qwen35") -> Path:
    """Build and save a tiny seeded Qwen3.5 checkpoint (with tokenizer) in `directory`.

    `layer_types=None` uses transformers' default pattern (every 4th layer is full
    attention), saved as an explicit `layer_types` list. `full_attention_interval=N`
    (with `layer_types=None`) instead saves only the interval, as older configs do. `multimodal=True`
    saves the `Qwen3_5ForConditionalGeneration` layout (text tower under
    `model.language_model`, a one-block vision tower under `model.visual`). `shards > 1`
    forces a sharded checkpoint with an index. `mtp_layers > 0` adds `mtp.*` tensors the
    way the released checkpoints carry them (transformers never loads them).
    `vocab_size=None` uses the tokenizer's size; a larger value pads the embedding.
    """
    from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5TextConfig)

    directory = Path(directory)
    make_tokenizer(directory, regex=tokenizer_regex)
    n_tokens = len(json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]) \
        + len(SPECIAL_TOKENS) + len(PLAIN_ADDED_TOKENS)
    vocab_size = vocab_size or n_tokens
    if vocab_size < n_tokens:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({n_tokens})")
    eos_id = n_tokens - len(PLAIN_ADDED_TOKENS) - 1
    pad_id = eos_id - 2

    text_kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=lin_k_heads, linear_num_value_heads=lin_v_heads,
        linear_key_head_dim=lin_k_dim, linear_value_head_dim=lin_v_dim,
        max_position_embeddings=4096, tie_word_embeddings=tie, layer_types=layer_types,
        eos_token_id=eos_id, pad_token_id=pad_id, dtype=dtype,
    )
    if full_attention_interval is not None and layer_types is None:
        text_kwargs["full_attention_interval"] = full_attention_interval
    if mtp_layers:
        text_kwargs["mtp_num_hidden_layers"] = mtp_layers

    torch.manual_seed(seed)
    if multimodal:
        text_cfg = Qwen3_5TextConfig(**text_kwargs)
        cfg = Qwen3_5Config(
            text_config=text_cfg.to_dict(), vision_config=_tiny_vision_config(hidden),
            tie_word_embeddings=tie, image_token_id=vocab_size - 1, video_token_id=vocab_size - 2,
            vision_start_token_id=vocab_size - 3, vision_end_token_id=vocab_size - 4,
        )
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        cfg = Qwen3_5TextConfig(**text_kwargs)
        model = Qwen3_5ForCausalLM(cfg)
    _randomize(model, seed)
    if tie:
        model.tie_weights()
    model = model.to(dtype).eval()

    save_kwargs = {}
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        save_kwargs["max_shard_size"] = max(1, total // shards + 1)
    model.save_pretrained(str(directory), **save_kwargs)
    if full_attention_interval is not None and layer_types is None:
        _config_with_interval_only(directory, full_attention_interval, multimodal)
    if mtp_layers:
        _add_mtp_tensors(directory, cfg.text_config if multimodal else cfg, mtp_layers, seed, dtype)
    return directory


def _tiny_model_dir(directory, tokenizer_regex: str, vocab_size: int | None):
    """Directory with a fresh tokenizer; (path, vocabulary size, eos id, pad id)."""
    directory = Path(directory)
    make_tokenizer(directory, regex=tokenizer_regex)
    n_tokens = len(json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]) \
        + len(SPECIAL_TOKENS) + len(PLAIN_ADDED_TOKENS)
    eos_id = n_tokens - len(PLAIN_ADDED_TOKENS) - 1
    return directory, vocab_size or n_tokens, eos_id, eos_id - 2


def make_qwen3(directory: str | os.PathLike, *, vocab_size: int | None = None, hidden: int = 128, layers: int = 3,
               heads: int = 4, kv_heads: int = 2, head_dim: int = 32, ffn: int = 256, tie: bool = False,
               seed: int = 0, dtype: torch.dtype = torch.float32, tokenizer_regex: str = "qwen2",
               rope_scaling: dict | None = None, max_positions: int = 4096) -> Path:
    """A tiny seeded Qwen3ForCausalLM (with tokenizer) saved in `directory`. Qwen3's norms
    are plain weights: they are randomised around 1. `rope_scaling`: extra rope_parameters
    fields (rope_type, factor, ...)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory, vocab_size, eos_id, pad_id = _tiny_model_dir(directory, tokenizer_regex, vocab_size)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_positions, tie_word_embeddings=tie, eos_token_id=eos_id,
                      pad_token_id=pad_id, rope_theta=1_000_000.0, dtype=dtype)
    if rope_scaling:
        cfg.rope_parameters = {"rope_theta": 1_000_000.0, **rope_scaling}
    return _save_dense(Qwen3ForCausalLM, cfg, directory, seed=seed, dtype=dtype, tie=tie)


def make_qwen2(directory: str | os.PathLike, *, vocab_size: int | None = None, hidden: int = 128, layers: int = 3,
               heads: int = 4, kv_heads: int = 2, ffn: int = 256, tie: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.float32, tokenizer_regex: str = "qwen2", max_positions: int = 4096,
               bias_std: float = 0.5) -> Path:
    """A tiny seeded Qwen2ForCausalLM (with tokenizer) saved in `directory`: Qwen3's
    layout with q/k/v biases (std `bias_std`, large enough that a dropped bias changes
    every logit) and no q/k norms; head size hidden / heads, as every Qwen2 has."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory, vocab_size, eos_id, pad_id = _tiny_model_dir(directory, tokenizer_regex, vocab_size)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=tie, eos_token_id=eos_id, pad_token_id=pad_id, rope_theta=1_000_000.0,
                      dtype=dtype)
    return _save_dense(Qwen2ForCausalLM, cfg, directory, seed=seed, dtype=dtype, tie=tie, bias_std=bias_std)


def _save_dense(model_cls, cfg, directory: Path, *, seed: int, dtype: torch.dtype, tie: bool,
                bias_std: float | None = None) -> Path:
    """A dense Qwen model of `cfg`, randomised (norms around 1, biases at `bias_std`), saved."""
    torch.manual_seed(seed)
    model = model_cls(cfg)
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
            elif name.endswith(".bias") and bias_std is not None:
                p.copy_(torch.randn(p.shape, generator=gen) * bias_std)
    if tie:
        model.tie_weights()
    model.to(dtype).eval().save_pretrained(str(directory))
    return directory


def save_gemma(directory: Path, family: str, text: dict, *, seed: int, randomize,
               multimodal: dict | None = None) -> Path:
    """A tiny transformers `family` model ("Gemma3", "Gemma4"): <family>ForCausalLM of the
    text config, or with `multimodal` (the <family>Config's other arguments) the
    <family>ForConditionalGeneration around it; `randomize(model, seed)` sets its weights,
    then it is tied and saved in `directory`."""
    import transformers

    torch.manual_seed(seed)
    if multimodal is not None:
        cfg = getattr(transformers, f"{family}Config")(text_config=text, **multimodal)
        arch = f"{family}ForConditionalGeneration"
    else:
        cfg = getattr(transformers, f"{family}TextConfig")(**text)
        arch = f"{family}ForCausalLM"
    cfg.architectures = [arch]
    model = getattr(transformers, arch)(cfg)
    randomize(model, seed)
    model.tie_weights()
    model.eval().save_pretrained(str(directory))
    return directory


def make_qwen35moe(directory: str | os.PathLike, *, vocab_size: int | None = None, hidden: int = 128,
                   layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 32, lin_k_heads: int = 2,
                   lin_v_heads: int = 4, lin_k_dim: int = 16, lin_v_dim: int = 16, experts: int = 8,
                   experts_used: int = 4, expert_ffn: int = 64, shared_ffn: int = 96, tie: bool = False,
                   seed: int = 0, dtype: torch.dtype = torch.float32, tokenizer_regex: str = "qwen35",
                   multimodal: bool = False, mtp_layers: int = 0) -> Path:
    """A tiny seeded Qwen3_5MoeForCausalLM (with tokenizer) saved in `directory`: the
    router's logits spread about 1 apart, so that tokens pick many different experts
    with clear margins and the softmax over them is far from one-hot. `multimodal=True`
    saves the Qwen3_5MoeForConditionalGeneration layout (a one-block vision tower);
    `mtp_layers` adds an MTP head as make_qwen35 does."""
    from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                              Qwen3_5MoeTextConfig)

    directory, vocab_size, eos_id, pad_id = _tiny_model_dir(directory, tokenizer_regex, vocab_size)
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, linear_num_key_heads=lin_k_heads,
        linear_num_value_heads=lin_v_heads, linear_key_head_dim=lin_k_dim, linear_value_head_dim=lin_v_dim,
        moe_intermediate_size=expert_ffn, shared_expert_intermediate_size=shared_ffn, num_experts=experts,
        num_experts_per_tok=experts_used, max_position_embeddings=4096, tie_word_embeddings=tie,
        eos_token_id=eos_id, pad_token_id=pad_id, dtype=dtype,
        **({"mtp_num_hidden_layers": mtp_layers} if mtp_layers else {}))
    text_cfg = cfg
    torch.manual_seed(seed)
    if multimodal:
        cfg = Qwen3_5MoeConfig(
            text_config=cfg.to_dict(), vision_config=_tiny_vision_config(hidden), tie_word_embeddings=tie,
            image_token_id=vocab_size - 1, video_token_id=vocab_size - 2, vision_start_token_id=vocab_size - 3,
            vision_end_token_id=vocab_size - 4)
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        model = Qwen3_5MoeForCausalLM(cfg)
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    if tie:
        model.tie_weights()
    model.to(dtype).eval().save_pretrained(str(directory))
    if mtp_layers:
        _add_mtp_tensors(directory, text_cfg, mtp_layers, seed, dtype)
    return directory


QWEN2_SHAPES: dict[str, dict] = {
    # GQA, untied
    "base": {},
    # tied embeddings, MQA, and rows multiple of 256 for K-quants (head size 64)
    "k256": dict(hidden=256, ffn=512, kv_heads=1, tie=True, seed=1),
}

QWEN3_SHAPES: dict[str, dict] = {
    # GQA, untied, Qwen2-style pre-tokenizer (as Qwen3's tokenizer)
    "base": {},
    # tied embeddings, MQA, and rows multiple of 256 for K-quants
    "k256": dict(hidden=256, ffn=512, head_dim=64, kv_heads=1, tie=True, seed=1),
}

QWEN35MOE_SHAPES: dict[str, dict] = {
    # 8 experts (llama-quantize's 8-expert rules apply), 4 used, a shared expert, V-head reorder
    "base": {},
    # rows multiple of 256 for K-quants, 16 experts of which 2 are used
    "k256": dict(hidden=256, head_dim=64, lin_k_dim=64, lin_v_dim=64, expert_ffn=256, shared_ffn=256,
                 experts=16, experts_used=2, seed=1),
}


def _config_with_interval_only(directory: Path, interval: int, multimodal: bool) -> None:
    """Rewrite config.json with `full_attention_interval` and no `layer_types`, the older
    form of the layer pattern (transformers always saves the expanded list)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    text = config["text_config"] if multimodal else config
    text.pop("layer_types", None)
    text["full_attention_interval"] = interval
    path.write_text(json.dumps(config, indent=2))


def _add_mtp_tensors(directory: Path, cfg, n_layers: int, seed: int, dtype: torch.dtype) -> None:
    """Write `mtp.*` tensors into their own shard and list them in the index."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed + 1)
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * hd * 2, cfg.num_key_value_heads * hd
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for i in range(n_layers):
        p = f"mtp.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h), p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h), p + "self_attn.o_proj.weight": (h, q_out // 2),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
        })
        if getattr(cfg, "num_experts", None):  # Qwen3.5 MoE: the MTP layer's FFN is routed experts too
            E, F, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            shapes.update({p + "mlp.gate.weight": (E, h), p + "mlp.shared_expert_gate.weight": (1, h),
                           p + "mlp.shared_expert.gate_proj.weight": (S, h),
                           p + "mlp.shared_expert.up_proj.weight": (S, h),
                           p + "mlp.shared_expert.down_proj.weight": (h, S)})
            for x in range(E):
                shapes.update({f"{p}mlp.experts.{x}.gate_proj.weight": (F, h),
                               f"{p}mlp.experts.{x}.up_proj.weight": (F, h),
                               f"{p}mlp.experts.{x}.down_proj.weight": (h, F)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                           p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                           p + "mlp.down_proj.weight": (h, cfg.intermediate_size)})
    tensors = {k: (torch.randn(s, generator=gen) * 0.05).to(dtype) for k, s in shapes.items()}
    shard = "model-mtp.safetensors"
    save_file(tensors, str(directory / shard), metadata={"format": "pt"})

    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        single = "model.safetensors"
        renamed = "model-main.safetensors"
        (directory / single).rename(directory / renamed)
        from safetensors import safe_open
        with safe_open(str(directory / renamed), "pt") as f:
            names = list(f.keys())
        index = {"metadata": {}, "weight_map": {n: renamed for n in names}}
    index["weight_map"].update({k: shard for k in tensors})
    index_path.write_text(json.dumps(index, indent=2))


def hf_logits(model_dir: str | os.PathLike, tokens: list[int]) -> torch.Tensor:
    """Float32 logits [n_tokens, vocab] of the transformers model saved in `model_dir`."""
    from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    cfg = AutoConfig.from_pretrained(str(model_dir))
    cls = Qwen3_5ForConditionalGeneration if hasattr(cfg, "text_config") else Qwen3_5ForCausalLM
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]))
    return out.logits[0].float()


# Named tiny shapes (make_qwen35 keyword arguments) shared by the test modules.
QWEN35_SHAPES: dict[str, dict] = {
    # GQA attention, fewer linear key heads than value heads (V-head reorder), untied
    # embeddings, transformers' default layer pattern.
    "base": {},
    # Tied embeddings, a custom layer pattern, equal key/value heads (no reorder), MQA,
    # and an embedding padded past the tokenizer (UNUSED vocab entries).
    "tied": dict(tie=True, layers=5, heads=4, kv_heads=1, lin_k_heads=2, lin_v_heads=2, vocab_size=1056,
                 layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention",
                              "linear_attention"], seed=1),
    # Layer pattern given only as full_attention_interval, 3 value heads per key head.
    "interval": dict(layers=4, full_attention_interval=2, lin_k_heads=1, lin_v_heads=3, seed=2),
    # A bf16 checkpoint in three shards.
    "sharded": dict(dtype=torch.bfloat16, shards=3, seed=3),
    # Qwen3_5ForConditionalGeneration layout with a vision tower and an MTP head.
    "multimodal": dict(multimodal=True, mtp_layers=1, seed=4),
    # Every matrix row a multiple of 256, so K-quant types are used without fallback.
    "k256": dict(hidden=256, ffn=512, head_dim=64, lin_k_dim=64, lin_v_dim=64, seed=5),
}


# ---- llama.cpp's own converter (oracle) ---------------------------------------------

def llama_cpp_source() -> Path | None:
    """The llama.cpp tree vendored in the installed llama-cpp-python's sdist, which
    `scripts/setup.sh test` fetches (None when it has not)."""
    from dflash_gguf.tools.llama_cpp_tree import source_dir

    return source_dir()


def missing_oracle(what: str):
    """Skip a test whose oracle is missing; under CI=true fail it instead, so that a set-up
    that lost an oracle cannot pass by skipping what it checks."""
    message = f"{what} is not available: run `bash scripts/setup.sh test`"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


class LlamaCppConverter:
    """llama.cpp's own convert_hf_to_gguf.py (from the pinned sdist), kept running in a
    subprocess for several conversions.

    llama.cpp refuses tokenizers whose check-string hash it does not know (every tiny test
    tokenizer); `pre` makes its hash lookup return that name instead, in the subprocess
    only.
    """

    def __init__(self):
        src = llama_cpp_source()
        if src is None:
            raise RuntimeError("llama.cpp sources are unavailable: run `bash scripts/setup.sh test`")
        # llama.cpp's converter and its gguf-py are no installed package: the worker finds
        # them through PYTHONPATH
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(src / "gguf-py")])}
        worker = Path(__file__).resolve().parent / "llama_cpp_converter_worker.py"
        self._proc = subprocess.Popen([sys.executable, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, env=env)

    def convert(self, model_dir: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f32", *,
                pre: str | None = None, extra_args: tuple[str, ...] | None = None) -> Path:
        """Convert; raises RuntimeError with the converter's log on failure. By default
        Qwen3.5 checkpoints without MTP layers are converted with --no-mtp (llama.cpp's
        converter needs it there), those with them keep them (as ours does)."""
        if extra_args is None:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            archs = config.get("architectures") or []
            n_mtp = {**config, **config.get("text_config", {})}.get("mtp_num_hidden_layers", 0)
            extra_args = ("--no-mtp",) if any(a.startswith("Qwen3_5") for a in archs) and not n_mtp else ()
        args = [str(model_dir), "--outfile", str(outfile), "--outtype", outtype, *extra_args]
        self._proc.stdin.write(json.dumps({"args": args, "pre": pre}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp converter process exited ({self._proc.wait()})")
        result = json.loads(line)
        if result["status"] != 0:
            raise RuntimeError(f"llama.cpp converter failed ({result['status']}):\n{result['log']}")
        return Path(outfile)

    def close(self) -> None:
        self._proc.communicate(timeout=120)  # closes stdin (the server's end of jobs) and stdout


def run_llama_cpp_converter(model_dir: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f32", *,
                            pre: str | None = None, extra_args: tuple[str, ...] | None = None) -> Path:
    """One conversion with llama.cpp's own converter (see LlamaCppConverter)."""
    oracle = LlamaCppConverter()
    try:
        return oracle.convert(model_dir, outfile, outtype, pre=pre, extra_args=extra_args)
    finally:
        oracle.close()


# ---- reading results ----------------------------------------------------------------

def read_gguf(path: str | os.PathLike) -> tuple[dict, dict]:
    """(metadata {key: (value types, value)}, tensors {name: (type name, ggml shape, data)})."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    kv = {k: (tuple(f.types), f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), np.array(t.data))
               for t in reader.tensors}
    return kv, tensors


def open_llama(path: str | os.PathLike, **kwargs):
    """llama_cpp.Llama for `path`, quiet."""
    from llama_cpp import Llama

    return Llama(str(path), verbose=False, **kwargs)


def llama_logits(path: str | os.PathLike, tokens: list[int]):
    """All-position logits [n_tokens, vocab] from llama-cpp-python (libllama) for `tokens`."""
    import numpy as np

    llm = open_llama(path, logits_all=True, n_ctx=max(64, len(tokens)), n_threads=2)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def llama_cpp_quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: int) -> Path:
    """Quantize a GGUF with libllama's own llama_model_quantize (llama-quantize's engine)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) for {src}")
    return Path(dst)


def hf_model(model_dir: str | os.PathLike):
    """The transformers model saved in `model_dir`, in float32, of the class its
    config.json names."""
    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    return cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def llama_greedy(path: str | os.PathLike, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` from llama-cpp-python (libllama), one eval per token."""
    import numpy as np

    llm = open_llama(path, logits_all=True, n_ctx=max(64, len(prompt) + n), n_threads=2)
    try:
        out = []
        llm.eval(prompt)
        for _ in range(n):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
            llm.eval([tok])
        return out
    finally:
        llm.close()
