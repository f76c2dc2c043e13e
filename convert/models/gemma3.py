"""Gemma 3 text models -> GGUF architecture `gemma3` (llama.cpp's layout), from
Gemma3ForCausalLM or the text tower of Gemma3ForConditionalGeneration.

Written as llama.cpp's converter writes them: the global layers' rope_theta as
rope.freq_base, the local layers' as rope.freq_base_swa, the global layers' linear
scaling (Gemma 3 4B and up) as rope.scaling.*, the sliding window, and every norm
(Gemma3RMSNorm multiplies by 1 + w) stored with the 1 added. The tokenizer is the
SentencePiece model (vocab_spm.py). Two keys llama.cpp does not write, only where the
checkpoint needs them: attention.sliding_window_pattern (a bool per layer) when the
layer types are not llama.cpp's rule (every sixth layer global), and attention.scale
when query_pre_attn_scalar is not the value llama.cpp assumes (the head size; the
27B's hidden / heads). llama.cpp reads the first, not the second.
"""
from __future__ import annotations

import logging
from pathlib import Path

from gguf import GGUFValueType

from ..base import KV, ModelConverter, array, decoder_kv, f32, head_size_kv, rope_scaling_kv, u32
from ..errors import ConversionError
from ..hf import Checkpoint, check_hparams, refuse_hparams, require_hparams, text_hparams
from ..tensors import TensorSpec, add_one, attention_specs, checked_spec
from .gemma4 import embedding_scale

log = logging.getLogger("dflash_gguf.convert")

ARCH = "gemma3"
_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "rms_norm_eps"]
# Options of Gemma3TextConfig this converter (and llama.cpp's gemma3) do not implement.
_REFUSED = {
    "attn_logit_softcapping": "attention logit softcapping",
    "attention_bias": "attention biases",
    "use_bidirectional_attention": "bidirectional attention (an encoder)",
}
# text weights: Gemma3ForCausalLM's, transformers 5's multimodal layout, the Hub's older one
_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def llama_cpp_swa_rule(n_layer: int, period: int = 6) -> list[bool]:
    """llama.cpp's sliding-window pattern for a period: every period-th layer is global."""
    return [period == 0 or i % period < period - 1 for i in range(n_layer)]


class Gemma3Converter(ModelConverter):
    gguf_arch = ARCH

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, **kwargs):
        super().__init__(model_dir, config, checkpoint, **kwargs)
        hp = self.hp = text_hparams(config)
        require_hparams(hp, _REQUIRED, "a Gemma 3 model")
        check_hparams(hp, [k for k in _REQUIRED if k != "rms_norm_eps"] + ["head_dim", "sliding_window",
                                                                         "query_pre_attn_scalar"],
                      ["rms_norm_eps"])
        refuse_hparams(hp, _REFUSED, "which Gemma 3 in llama.cpp does not implement")
        act = hp.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ConversionError(f"hidden_activation {act!r} is not supported (Gemma 3's is gelu_pytorch_tanh)")
        self.n_layer = int(hp["num_hidden_layers"])
        self.head_dim = int(hp.get("head_dim") or 256)  # llama.cpp's default, as transformers'
        self.swa = self._layer_types()
        self.rope_full, self.rope_swa = self._rope()
        self.prefix = next((p for p in _PREFIXES if f"{p}embed_tokens.weight" in checkpoint), None)
        if self.prefix is None:
            raise ConversionError("checkpoint has no model.embed_tokens.weight (or a multimodal checkpoint's "
                                  "model.language_model.* / language_model.model.*)")
        self.tied = self._lm_head() is None
        self._specs = self._build_specs()
        used = {s.source for s in self._specs}
        unexpected = [n for n in self._text_names() if n not in used]
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            raise ConversionError(f"{len(unexpected)} checkpoint tensors have no gemma3 mapping: {shown}")

    # ---- configuration ---------------------------------------------------------------

    def _layer_types(self) -> list[bool]:
        """Which layers slide: layer_types, else the sliding_window_pattern period (6)."""
        types = self.hp.get("layer_types")
        if types is None:
            period = self.hp.get("sliding_window_pattern", 6)
            if not isinstance(period, int) or isinstance(period, bool) or period < 0:
                raise ConversionError(f"config.json: sliding_window_pattern is {period!r}; a period is expected")
            # transformers: layer i slides unless (i + 1) is a multiple of the period
            return [period == 0 or bool((i + 1) % period) for i in range(self.n_layer)] if period != 1 \
                else [False] * self.n_layer
        if not isinstance(types, list) or len(types) != self.n_layer or \
                set(types) - {"sliding_attention", "full_attention"}:
            raise ConversionError(f"config.json: layer_types must list {self.n_layer} entries of "
                                  "'sliding_attention' or 'full_attention'")
        return [t == "sliding_attention" for t in types]

    def _rope(self) -> tuple[dict, dict]:
        """(global, local) RoPE parameters from rope_parameters (transformers 5) or the older
        rope_theta / rope_local_base_freq / rope_scaling keys."""
        hp = self.hp
        rope = hp.get("rope_parameters")
        if isinstance(rope, dict) and ("full_attention" in rope or "sliding_attention" in rope):
            full, swa = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
        else:
            full = dict(hp.get("rope_scaling") or (rope if isinstance(rope, dict) else {}) or {})
            swa = {}
        full.setdefault("rope_theta", hp.get("rope_theta", 1_000_000.0))
        swa.setdefault("rope_theta", hp.get("rope_local_base_freq", 10_000.0))
        if swa.get("rope_type", swa.get("type", "default")) != "default":
            raise ConversionError(f"sliding-attention rope type {swa.get('rope_type')!r} is not supported "
                                  "(llama.cpp rotates Gemma 3's local layers unscaled)")
        for what, theta in (("global", full["rope_theta"]), ("local", swa["rope_theta"])):
            if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
                raise ConversionError(f"config.json: the {what} rope_theta is {theta!r}; a positive number is expected")
        return full, swa

    def _lm_head(self) -> str | None:
        """An untied output head's tensor, or None when the embedding is the head."""
        if self.hp.get("tie_word_embeddings", True):
            return None
        for name in ("lm_head.weight", "language_model.lm_head.weight"):
            if name in self.checkpoint:
                return name
        return None

    def _text_names(self) -> list[str]:
        return [n for n in self.checkpoint.names() if n.startswith(self.prefix) and "vision" not in n]

    @property
    def vocab_size(self) -> int:
        return int(self.hp["vocab_size"])

    def metadata(self) -> list[KV]:
        hp, a = self.hp, ARCH
        kv = [
            *decoder_kv(a, hp, self.n_layer, hp.get("max_position_embeddings", 131072)),
            f32(f"{a}.rope.freq_base", self.rope_full["rope_theta"]),
            f32(f"{a}.rope.freq_base_swa", self.rope_swa["rope_theta"]),
            f32(f"{a}.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"]),
            *head_size_kv(a, self.head_dim),
            *rope_scaling_kv(a, self.rope_full),
        ]
        if hp.get("final_logit_softcapping"):
            kv.append(f32(f"{a}.final_logit_softcapping", hp["final_logit_softcapping"]))
        if any(self.swa):
            kv.append(u32(f"{a}.attention.sliding_window", hp.get("sliding_window") or 4096))
            if self.swa != llama_cpp_swa_rule(self.n_layer):
                kv.append(array(f"{a}.attention.sliding_window_pattern", self.swa, GGUFValueType.BOOL))
        scale = self._attention_scale()
        if scale is not None:
            kv.append(f32(f"{a}.attention.scale", scale))
        embd = embedding_scale(self.checkpoint.tensors[f"{self.prefix}embed_tokens.weight"].dtype,
                               int(hp["hidden_size"]))
        if embd is not None:
            kv.append(f32(f"{a}.embedding_scale", embd))
        return kv

    def _attention_scale(self) -> float | None:
        """1/sqrt(query_pre_attn_scalar) when llama.cpp's rule would give another scale."""
        hp = self.hp
        pre = hp.get("query_pre_attn_scalar", 256)
        assumed = int(hp["hidden_size"]) // int(hp["num_attention_heads"]) if self.n_layer == 62 else self.head_dim
        if float(pre) == float(assumed):
            return None
        log.warning("query_pre_attn_scalar %s is not what llama.cpp assumes for this size (%s): the file records "
                    "the scale as gemma3.attention.scale, which this runtime reads and llama.cpp ignores", pre, assumed)
        return float(pre) ** -0.5

    def tensors(self) -> list[TensorSpec]:
        return self._specs

    def skipped(self) -> dict[str, int]:
        others = [n for n in self.checkpoint.names() if not n.startswith(self.prefix) or "vision" in n]
        head = [n for n in others if n.endswith("lm_head.weight")]
        out = {}
        if len(others) > len(head):
            out["vision tower and projector (text model only)"] = len(others) - len(head)
        if head and self.tied:
            out["lm_head.weight (tied: output uses token_embd)"] = len(head)
        return out

    # ---- tensors -----------------------------------------------------------------------

    def _spec(self, name: str, source: str, shape: tuple[int, ...]) -> TensorSpec:
        # Gemma3RMSNorm scales by (1 + w): llama.cpp stores the sum
        return checked_spec(self.checkpoint, name, source, shape,
                            transform=add_one if name.endswith("norm.weight") else None)

    def _build_specs(self) -> list[TensorSpec]:
        hp, p = self.hp, self.prefix
        E, F, V = int(hp["hidden_size"]), int(hp["intermediate_size"]), self.vocab_size
        H, Hkv, hd = int(hp["num_attention_heads"]), int(hp["num_key_value_heads"]), self.head_dim
        specs = [self._spec("token_embd.weight", f"{p}embed_tokens.weight", (V, E))]
        for i in range(self.n_layer):
            lp, b = f"{p}layers.{i}.", f"blk.{i}."
            sa, mlp = lp + "self_attn.", lp + "mlp."
            specs += attention_specs(self._spec, lp, b, E, H, Hkv, hd)
            specs += [
                self._spec(b + "attn_q_norm.weight", sa + "q_norm.weight", (hd,)),
                self._spec(b + "attn_k_norm.weight", sa + "k_norm.weight", (hd,)),
                self._spec(b + "post_attention_norm.weight", lp + "post_attention_layernorm.weight", (E,)),
                self._spec(b + "ffn_norm.weight", lp + "pre_feedforward_layernorm.weight", (E,)),
                self._spec(b + "ffn_gate.weight", mlp + "gate_proj.weight", (F, E)),
                self._spec(b + "ffn_up.weight", mlp + "up_proj.weight", (F, E)),
                self._spec(b + "ffn_down.weight", mlp + "down_proj.weight", (E, F)),
                self._spec(b + "post_ffw_norm.weight", lp + "post_feedforward_layernorm.weight", (E,)),
            ]
        specs.append(self._spec("output_norm.weight", f"{p}norm.weight", (E,)))
        head = self._lm_head()
        if head is not None:
            specs.append(self._spec("output.weight", head, (V, E)))
        return specs
