"""Qwen3 dense -> GGUF architecture `qwen3` (llama.cpp's layout): attention with per-head
RMSNorm on q and k, SwiGLU FFN. Qwen3's norms are plain weights, stored as they are.

QwenDenseConverter holds what Qwen3 shares with Qwen2 (convert/models/qwen2.py): the two differ
only in how attention conditions q and k (Qwen3's norms, Qwen2's q/k/v biases)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base import KV, ModelConverter, decoder_kv, f32, head_size_kv, rope_scaling_kv
from ..errors import ConversionError
from ..hf import Checkpoint, check_hparams, require_hparams, text_hparams
from ..tensors import TensorSpec, attention_specs

ARCH = "qwen3"
_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "rms_norm_eps"]


class QwenDenseConverter(ModelConverter):
    """A dense Qwen decoder; subclasses say which of q/k/v biases and q/k norms it has."""

    gguf_arch: str
    family: str
    qkv_bias: bool
    qk_norm: bool
    default_context: int | None  # context_length when config.json has no max_position_embeddings

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, **kwargs):
        super().__init__(model_dir, config, checkpoint, **kwargs)
        hp = self.hp = text_hparams(config)
        require_hparams(hp, _REQUIRED, f"a {self.family} model")
        check_hparams(hp, [k for k in _REQUIRED if k != "rms_norm_eps"] + ["head_dim", "max_position_embeddings"],
                      ["rms_norm_eps"])
        self.check_layout(hp)
        rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConversionError(f"config.json: rope_parameters is {rope!r}; an object is expected")
        self.rope_scaling = rope_scaling_kv(self.gguf_arch, rope)
        self.rope_theta = float(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
        self.n_layer = int(hp["num_hidden_layers"])
        self.head_dim = int(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
        self.tied = bool(hp.get("tie_word_embeddings", False))
        self._specs = self._build_specs()
        used = {s.source for s in self._specs}
        unexpected = [n for n in checkpoint.names() if n not in used and not (n == "lm_head.weight" and self.tied)]
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            raise ConversionError(f"{len(unexpected)} checkpoint tensors have no {self.gguf_arch} mapping: {shown}")

    def check_layout(self, hp: dict) -> None:
        """Refuse config options the architecture's llama.cpp layout has no place for."""

    def head_dim_kv(self) -> list[KV]:
        """attention.key_length / value_length (llama.cpp's converter writes them when
        config.json names head_dim)."""
        a = self.gguf_arch
        return head_size_kv(a, self.head_dim)

    @property
    def vocab_size(self) -> int:
        return int(self.hp["vocab_size"])

    def metadata(self) -> list[KV]:
        hp, a = self.hp, self.gguf_arch
        return [
            *decoder_kv(a, hp, self.n_layer, hp.get("max_position_embeddings", self.default_context) or None),
            f32(f"{a}.rope.freq_base", self.rope_theta),
            f32(f"{a}.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"]),
            *self.head_dim_kv(),
            *self.rope_scaling,
        ]

    def tensors(self) -> list[TensorSpec]:
        return self._specs

    def skipped(self) -> dict[str, int]:
        return {"lm_head.weight (tie_word_embeddings: output uses token_embd)": 1} \
            if self.tied and "lm_head.weight" in self.checkpoint else {}

    def _spec(self, name: str, source: str, shape: tuple[int, ...]) -> TensorSpec:
        t = self.checkpoint.tensors.get(source)
        if t is None:
            raise ConversionError(f"checkpoint tensor {source!r} (for {name}) is missing")
        if t.numel != int(np.prod(shape, dtype=np.int64)) or (len(shape) > 1 and t.shape[0] != shape[0]):
            raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies {list(shape)}")
        return TensorSpec(name, source, shape)

    def _build_specs(self) -> list[TensorSpec]:
        hp = self.hp
        E, F, V = int(hp["hidden_size"]), int(hp["intermediate_size"]), self.vocab_size
        H, Hkv, hd = int(hp["num_attention_heads"]), int(hp["num_key_value_heads"]), self.head_dim
        specs = [self._spec("token_embd.weight", "model.embed_tokens.weight", (V, E))]
        for i in range(self.n_layer):
            lp, b = f"model.layers.{i}.", f"blk.{i}."
            sa, mlp = lp + "self_attn.", lp + "mlp."
            specs += attention_specs(self._spec, lp, b, E, H, Hkv, hd)
            if self.qkv_bias:
                specs += [
                    self._spec(b + "attn_q.bias", sa + "q_proj.bias", (H * hd,)),
                    self._spec(b + "attn_k.bias", sa + "k_proj.bias", (Hkv * hd,)),
                    self._spec(b + "attn_v.bias", sa + "v_proj.bias", (Hkv * hd,)),
                ]
            if self.qk_norm:
                specs += [
                    self._spec(b + "attn_q_norm.weight", sa + "q_norm.weight", (hd,)),
                    self._spec(b + "attn_k_norm.weight", sa + "k_norm.weight", (hd,)),
                ]
            specs += [
                self._spec(b + "ffn_norm.weight", lp + "post_attention_layernorm.weight", (E,)),
                self._spec(b + "ffn_gate.weight", mlp + "gate_proj.weight", (F, E)),
                self._spec(b + "ffn_up.weight", mlp + "up_proj.weight", (F, E)),
                self._spec(b + "ffn_down.weight", mlp + "down_proj.weight", (E, F)),
            ]
        specs.append(self._spec("output_norm.weight", "model.norm.weight", (E,)))
        if not self.tied:
            specs.append(self._spec("output.weight", "lm_head.weight", (V, E)))
        return specs


class Qwen3Converter(QwenDenseConverter):
    gguf_arch, family, qkv_bias, qk_norm, default_context = ARCH, "Qwen3", False, True, 40960

    def check_layout(self, hp: dict) -> None:
        if hp.get("attention_bias"):
            raise ConversionError("attention_bias=true is not a Qwen3 layout llama.cpp's qwen3 loads")
