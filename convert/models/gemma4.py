"""Gemma 4 text models -> GGUF architecture `gemma4` (llama.cpp's layout), dense and MoE,
from Gemma4ForCausalLM or the text tower of Gemma4ForConditionalGeneration.

Sliding and full-attention layers differ in head size (head_dim / global_head_dim), KV
head count (num_key_value_heads / num_global_key_value_heads) and RoPE; llama.cpp keeps
the full layers' values in the plain keys and the sliding layers' in the *_swa keys, with
a per-layer head_count_kv array when the two counts differ. Full layers use
"proportional" RoPE: NeoX over the whole head, the pairs past the rotary fraction held
still by a frequency factor of 1e30 (the generated rope_freqs tensor). Gemma 4's norms
are plain weights, stored as they are. With attention_k_eq_v a full layer has no
v_proj (its v is the raw k projection); the last num_kv_shared_layers layers have no
k/v weights at all. MoE layers keep experts fused (ffn_gate_up_exps), the router's
scale as ffn_gate_inp.scale and the per-expert output scale as ffn_down_exps.scale.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from ..base import KV, ModelConverter, array, decoder_kv, f32, head_size_kv, u32
from ..errors import ConversionError
from ..hf import Checkpoint, check_hparams, refuse_hparams, require_hparams, text_hparams
from ..tensors import TensorSpec, checked_spec

ARCH = "gemma4"
_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "layer_types", "sliding_window"]
# Options of Gemma4TextConfig this converter (and the runtime) do not implement.
_REFUSED = {
    "hidden_size_per_layer_input": "per-layer input embeddings",
    "use_double_wide_mlp": "double-wide MLPs on the KV-shared layers",
    "attention_bias": "attention biases",
}
_PREFIXES = ("model.language_model.", "model.")


def embedding_scale(dtype: str, hidden_size: int) -> float | None:
    """transformers multiplies Gemma's embeddings by sqrt(hidden_size) cast to the weights'
    dtype: 16-bit checkpoints run with a rounded scale (sqrt(3072) = 55.43 becomes 55.5 in
    bf16). llama.cpp always scales by sqrtf(n_embd) and ignores the `embedding_scale` key;
    the runtime reads it. f32 checkpoints need no key (None: the runtime's default is exact)."""
    exact = np.float32(float(hidden_size) ** 0.5)
    if dtype == "BF16":
        bits = exact.view(np.uint32)
        return float((((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32))
    if dtype == "F16":
        return float(np.float32(np.float16(exact)))
    return None


class Gemma4Converter(ModelConverter):
    gguf_arch = ARCH

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, **kwargs):
        super().__init__(model_dir, config, checkpoint, **kwargs)
        hp = self.hp = text_hparams(config)
        require_hparams(hp, _REQUIRED, "a Gemma 4 model")
        check_hparams(hp, [k for k in _REQUIRED if k not in ("rms_norm_eps", "layer_types")], ["rms_norm_eps"])
        refuse_hparams(hp, _REFUSED, "which is not supported")
        if hp.get("use_bidirectional_attention") == "all":
            raise ConversionError("use_bidirectional_attention='all' (a non-causal encoder) is not supported")
        self.n_layer = int(hp["num_hidden_layers"])
        self.layer_types = list(hp["layer_types"])
        if len(self.layer_types) != self.n_layer or set(self.layer_types) - {"sliding_attention", "full_attention"}:
            raise ConversionError(f"config.json: layer_types must list {self.n_layer} entries of 'sliding_attention' "
                                  "or 'full_attention'")
        self.swa = [t == "sliding_attention" for t in self.layer_types]
        self.n_shared = int(hp.get("num_kv_shared_layers") or 0)
        if not 0 <= self.n_shared < self.n_layer:
            raise ConversionError(f"num_kv_shared_layers {self.n_shared} is not within 0..{self.n_layer - 1}")
        self.k_eq_v = bool(hp.get("attention_k_eq_v"))
        self.head_dim_swa = int(hp["head_dim"])
        self.head_dim_full, self.kv_heads_full = self._full_attention_shape()
        self.rope_full, self.rope_swa = self._rope()
        self.moe = bool(hp.get("enable_moe_block"))
        if self.moe:
            check_hparams(hp, ["num_experts", "top_k_experts", "moe_intermediate_size"])
            if not 0 < int(hp["top_k_experts"]) <= int(hp["num_experts"]):
                raise ConversionError(f"top_k_experts {hp['top_k_experts']} is not within 1..num_experts")
        self.prefix = next((p for p in _PREFIXES if f"{p}embed_tokens.weight" in checkpoint), None)
        if self.prefix is None:
            raise ConversionError("checkpoint has no model.embed_tokens.weight (or model.language_model.*)")
        self.vocab_rows = self._vocab_rows()
        self._specs = self._build_specs()
        used = {s.source for s in self._specs if s.name != "rope_freqs.weight"}
        text = [n for n in checkpoint.names() if n.startswith(self.prefix) and not n.startswith(
            tuple(f"{self.prefix}{tower}" for tower in ("vision", "audio", "embed_vision", "embed_audio")))]
        unexpected = [n for n in text if n not in used]
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            raise ConversionError(f"{len(unexpected)} checkpoint tensors have no gemma4 mapping: {shown}")

    # ---- configuration ---------------------------------------------------------------

    def _full_attention_shape(self) -> tuple[int, int | None]:
        """Head size of the full layers, and their KV head count when it differs from the
        sliding layers' (None: same), from the flat keys or per_layer_config."""
        hp = self.hp
        head_dim, kv_heads = hp.get("global_head_dim"), hp.get("num_global_key_value_heads")
        per_layer = hp.get("per_layer_config") or {}
        for idx, layer in sorted(per_layer.items(), key=lambda kv: int(kv[0])):
            if int(idx) < self.n_layer and not self.swa[int(idx)] and isinstance(layer, dict):
                head_dim = head_dim if head_dim is not None else layer.get("head_dim")
                kv_heads = kv_heads if kv_heads is not None else layer.get("num_key_value_heads")
        if head_dim is None:
            head_dim = 512  # Gemma4TextConfig's default global_head_dim
        if kv_heads is not None and not self.k_eq_v and hp.get("num_global_key_value_heads") is not None:
            kv_heads = None  # transformers applies num_global_key_value_heads only with attention_k_eq_v
        check_hparams({"global_head_dim": head_dim, "num_global_key_value_heads": kv_heads or 1},
                      ["global_head_dim", "num_global_key_value_heads"])
        return int(head_dim), (int(kv_heads) if kv_heads is not None else None)

    def _rope(self) -> tuple[dict, dict]:
        rope = self.hp.get("rope_parameters") or {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
        full, swa = rope.get("full_attention"), rope.get("sliding_attention")
        if not isinstance(full, dict) or not isinstance(swa, dict):
            raise ConversionError("config.json: rope_parameters needs 'full_attention' and 'sliding_attention' entries")
        if full.get("rope_type") != "proportional":
            raise ConversionError(f"full-attention rope type {full.get('rope_type')!r} is not supported "
                                  "(Gemma 4 uses 'proportional')")
        if swa.get("rope_type", "default") != "default" or swa.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConversionError("sliding-attention RoPE must be the default (whole head)")
        if full.get("factor", 1.0) != 1.0:
            raise ConversionError(f"proportional RoPE with factor {full['factor']} is not supported")
        return full, swa

    def _vocab_rows(self) -> int:
        """llama.cpp's converter keeps the embedding rows the tokenizer has (tokens plus
        added tokens, as it counts them); the runtime needs the same count."""
        import json
        tok = json.loads((self.model_dir / "tokenizer.json").read_text(encoding="utf-8"))
        n = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
        return min(n, int(self.hp["vocab_size"]))

    @property
    def vocab_size(self) -> int:
        return self.vocab_rows

    def metadata(self) -> list[KV]:
        hp, a = self.hp, ARCH
        n_rot_swa = self.head_dim_swa
        kv = [
            *decoder_kv(a, hp, self.n_layer, hp.get("max_position_embeddings", 131072), head_count_kv=False),
            f32(f"{a}.rope.freq_base", self.rope_full.get("rope_theta", 1_000_000.0)),
            f32(f"{a}.rope.freq_base_swa", self.rope_swa.get("rope_theta", 10_000.0)),
            f32(f"{a}.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"]),
            *head_size_kv(a, self.head_dim_full),
            u32(f"{a}.attention.sliding_window", hp["sliding_window"]),
            u32(f"{a}.attention.shared_kv_layers", self.n_shared),
            u32(f"{a}.embedding_length_per_layer_input", 0),
            array(f"{a}.attention.sliding_window_pattern", self.swa, GGUFValueType.BOOL),
            *head_size_kv(a, self.head_dim_swa, "_swa"),
            u32(f"{a}.rope.dimension_count", self.head_dim_full),
            u32(f"{a}.rope.dimension_count_swa", n_rot_swa),
        ]
        if self.kv_heads_full is None:
            kv.append(u32(f"{a}.attention.head_count_kv", hp["num_key_value_heads"]))
        else:
            heads = [int(hp["num_key_value_heads"]) if s else self.kv_heads_full for s in self.swa]
            kv.append(array(f"{a}.attention.head_count_kv", heads, GGUFValueType.INT32))
        scale = self._embedding_scale()
        if scale is not None:
            kv.append(f32(f"{a}.embedding_scale", scale))
        if hp.get("final_logit_softcapping"):
            kv.append(f32(f"{a}.final_logit_softcapping", hp["final_logit_softcapping"]))
        if self.moe:
            kv += [u32(f"{a}.expert_count", hp["num_experts"]),
                   u32(f"{a}.expert_used_count", hp["top_k_experts"]),
                   u32(f"{a}.expert_feed_forward_length", hp["moe_intermediate_size"])]
        return kv

    def _embedding_scale(self) -> float | None:
        return embedding_scale(self.checkpoint.tensors[f"{self.prefix}embed_tokens.weight"].dtype,
                               int(self.hp["hidden_size"]))

    def tensors(self) -> list[TensorSpec]:
        return self._specs

    def skipped(self) -> dict[str, int]:
        towers = [n for n in self.checkpoint.names() if not n.startswith(self.prefix) or n.startswith(
            tuple(f"{self.prefix}{t}" for t in ("vision", "audio", "embed_vision", "embed_audio")))]
        out = {"vision/audio towers (text model only)": len(towers)} if towers else {}
        if "lm_head.weight" in self.checkpoint:
            out["lm_head.weight (tied: output uses token_embd)"] = 1
        return out

    # ---- tensors -----------------------------------------------------------------------

    def _spec(self, name: str, source: str, shape: tuple[int, ...], **kw) -> TensorSpec:
        return checked_spec(self.checkpoint, name, source, shape, **kw)

    def _rope_factors(self) -> TensorSpec:
        """rope_freqs: 1 for the rotated pairs of a full layer's head, 1e30 for the rest.
        Generated, not read: the recipe reads a full layer's q_norm (as long as the head)
        only for its row machinery and replaces every value."""
        hd = self.head_dim_full
        n_rot = int(hd * self.rope_full.get("partial_rotary_factor", 1.0) / 2)
        values = np.array([1.0] * n_rot + [1e30] * (hd // 2 - n_rot), dtype=np.float32)
        full = self.swa.index(False)
        src = f"{self.prefix}layers.{full}.self_attn.q_norm.weight"
        return TensorSpec("rope_freqs.weight", src, (hd // 2,), cols=np.arange(hd // 2),
                          transform=lambda x: np.broadcast_to(values, x.shape).copy())

    def _build_specs(self) -> list[TensorSpec]:
        hp, p = self.hp, self.prefix
        E, F, V = int(hp["hidden_size"]), int(hp["intermediate_size"]), self.vocab_rows
        H, Hkv = int(hp["num_attention_heads"]), int(hp["num_key_value_heads"])
        first_shared = self.n_layer - self.n_shared
        embd = self.checkpoint.tensors.get(f"{p}embed_tokens.weight")
        if embd is not None and (len(embd.shape) != 2 or embd.shape[1] != E or embd.shape[0] < V):
            raise ConversionError(f"embed_tokens has shape {list(embd.shape)}; [{V}+, {E}] expected")
        specs = [TensorSpec("token_embd.weight", f"{p}embed_tokens.weight", (V, E), rows=np.arange(V))]
        if not all(self.swa):
            specs.insert(0, self._rope_factors())
        for i in range(self.n_layer):
            lp, b = f"{p}layers.{i}.", f"blk.{i}."
            sa, mlp = lp + "self_attn.", lp + "mlp."
            hd = self.head_dim_swa if self.swa[i] else self.head_dim_full
            kvh = Hkv if self.swa[i] or self.kv_heads_full is None else self.kv_heads_full
            specs += [
                self._spec(b + "attn_norm.weight", lp + "input_layernorm.weight", (E,)),
                self._spec(b + "attn_q.weight", sa + "q_proj.weight", (H * hd, E)),
                self._spec(b + "attn_q_norm.weight", sa + "q_norm.weight", (hd,)),
                self._spec(b + "attn_output.weight", sa + "o_proj.weight", (E, H * hd)),
                self._spec(b + "post_attention_norm.weight", lp + "post_attention_layernorm.weight", (E,)),
                self._spec(b + "ffn_norm.weight", lp + "pre_feedforward_layernorm.weight", (E,)),
                self._spec(b + "ffn_gate.weight", mlp + "gate_proj.weight", (F, E)),
                self._spec(b + "ffn_up.weight", mlp + "up_proj.weight", (F, E)),
                self._spec(b + "ffn_down.weight", mlp + "down_proj.weight", (E, F)),
                self._spec(b + "post_ffw_norm.weight", lp + "post_feedforward_layernorm.weight", (E,)),
            ]
            if lp + "layer_scalar" in self.checkpoint:
                specs.append(self._spec(b + "layer_output_scale.weight", lp + "layer_scalar", (1,)))
            if i < first_shared:
                specs += [self._spec(b + "attn_k.weight", sa + "k_proj.weight", (kvh * hd, E)),
                          self._spec(b + "attn_k_norm.weight", sa + "k_norm.weight", (hd,))]
                if not (self.k_eq_v and not self.swa[i]):
                    specs.append(self._spec(b + "attn_v.weight", sa + "v_proj.weight", (kvh * hd, E)))
            if self.moe:
                X, Fx = int(hp["num_experts"]), int(hp["moe_intermediate_size"])
                specs += [
                    self._spec(b + "ffn_gate_inp.weight", lp + "router.proj.weight", (X, E)),
                    self._spec(b + "ffn_gate_inp.scale", lp + "router.scale", (E,)),
                    self._spec(b + "ffn_down_exps.scale", lp + "router.per_expert_scale", (X,)),
                    self._spec(b + "pre_ffw_norm_2.weight", lp + "pre_feedforward_layernorm_2.weight", (E,)),
                    self._spec(b + "post_ffw_norm_1.weight", lp + "post_feedforward_layernorm_1.weight", (E,)),
                    self._spec(b + "post_ffw_norm_2.weight", lp + "post_feedforward_layernorm_2.weight", (E,)),
                    self._spec(b + "ffn_gate_up_exps.weight", lp + "experts.gate_up_proj", (X, 2 * Fx, E)),
                    self._spec(b + "ffn_down_exps.weight", lp + "experts.down_proj", (X, E, Fx)),
                ]
        specs.append(self._spec("output_norm.weight", f"{p}norm.weight", (E,)))
        return specs

