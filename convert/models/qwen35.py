"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) -> GGUF architecture `qwen35`.

Names, keys and layouts are llama.cpp's, so the files also load in llama.cpp:
- RMSNorm weights are applied as (1 + w) by transformers and stored +1; the GDN output
  norm (linear_attn.norm) is a plain weight and is stored as is.
- ssm_a = -exp(A_log); dt_bias becomes ssm_dt.bias; conv1d drops its singleton axis.
- When there are fewer linear-attention key heads than value heads, every V-head axis is
  reordered from grouped-by-key-head to tiled order, so that ggml's broadcasting repeat
  lines value heads up with their key heads.
- Attention q_proj keeps its packed per-head [query, gate] rows.
- The multi-token-prediction head (mtp.*, `mtp_num_hidden_layers` full-attention layers)
  becomes llama.cpp's nextn layers, numbered after the model's own (block_count counts
  them, `nextn_predict_layers` says how many): each a full-attention block, with
  mtp.fc -> nextn.eh_proj, mtp.pre_fc_norm_embedding -> nextn.enorm,
  mtp.pre_fc_norm_hidden -> nextn.hnorm and mtp.norm -> nextn.shared_head_norm on the
  first (norms +1 as every other). `--no-mtp` leaves it out.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from ..base import KV, ModelConverter, array, decoder_kv, f32, head_size_kv, rope_scaling_kv, u32
from ..errors import ConversionError
from ..hf import Checkpoint, check_hparams, require_hparams, text_hparams
from ..tensors import TensorSpec, add_one, neg_exp

ARCH = "qwen35"
# llama.cpp's loader requires rope sections; this is Qwen3.5's default (transformers
# falls back to the same [11, 11, 10]).
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
DEFAULT_FULL_ATTENTION_INTERVAL = 4
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25

_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "rms_norm_eps", "linear_conv_kernel_dim", "linear_key_head_dim",
             "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"]


def v_head_order(n_k_heads: int, n_v_heads: int, head_dim: int) -> np.ndarray:
    """Gather index taking V heads from grouped order (per key head) to tiled order.

    Grouped: [k0v0, k0v1, ..., k1v0, k1v1, ...]; tiled: [k0v0, k1v0, ..., k0v1, k1v1, ...].
    Output element i is source element index[i]; heads are `head_dim` elements wide.
    """
    per_k = n_v_heads // n_k_heads
    return np.arange(n_v_heads * head_dim).reshape(n_k_heads, per_k, head_dim).transpose(1, 0, 2).reshape(-1)


class Qwen35Converter(ModelConverter):
    gguf_arch = ARCH
    family = "Qwen3.5"
    required = _REQUIRED
    has_mtp = True

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, no_mtp: bool = False, **kwargs):
        super().__init__(model_dir, config, checkpoint, **kwargs)
        hp = self.hp = text_hparams(config)
        require_hparams(hp, self.required, f"a {self.family} model")
        check_hparams(hp, [k for k in self.required if k != "rms_norm_eps"]
                      + ["head_dim", "full_attention_interval", "max_position_embeddings"], ["rms_norm_eps"])
        if "layer_types" in hp and not isinstance(hp["layer_types"], list):
            raise ConversionError(f"config.json: layer_types is {hp['layer_types']!r}; a list is expected")
        rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConversionError(f"config.json: rope_parameters is {rope!r}; an object is expected")
        check_hparams(rope, floats=["rope_theta", "partial_rotary_factor", "factor"],
                      where="config.json rope_parameters")
        section = rope.get("mrope_section")
        if section is not None and not (isinstance(section, list) and len(section) <= 4
                                        and all(isinstance(x, int) and x >= 0 for x in section)):
            raise ConversionError(f"config.json: mrope_section is {section!r}; up to 4 section sizes are expected")
        if hp.get("attention_bias"):
            raise ConversionError(f"attention_bias=true is not a {self.family} layout llama.cpp's {self.gguf_arch} loads")
        if hp["linear_key_head_dim"] != hp["linear_value_head_dim"]:
            raise ConversionError(
                "linear_key_head_dim must equal linear_value_head_dim: the qwen35 GGUF layout stores one "
                f"state size (got {hp['linear_key_head_dim']} and {hp['linear_value_head_dim']})")
        if hp["linear_num_value_heads"] % hp["linear_num_key_heads"] != 0:
            raise ConversionError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.n_layer = int(hp["num_hidden_layers"])
        # transformers' Qwen3_5TextConfig default, which applies when config.json omits it.
        self.head_dim = int(hp.get("head_dim", 256))
        self.recurrent = self._recurrent_layers()

        names = checkpoint.names()
        self.prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) \
            else "model."
        self.mtp_prefix = "model.mtp." if any(n.startswith("model.mtp.") for n in names) else "mtp."
        has_mtp = any(n.startswith(self.mtp_prefix) for n in names)
        n_mtp = hp.get("mtp_num_hidden_layers", 0)
        if not isinstance(n_mtp, int) or isinstance(n_mtp, bool) or n_mtp < 0:
            raise ConversionError(f"config.json: mtp_num_hidden_layers is {n_mtp!r}; a count is expected")
        self.n_mtp = n_mtp if has_mtp and not no_mtp else 0
        self.tied = bool(hp.get("tie_word_embeddings", False))
        self._specs = self._build_specs()
        used = {src for s in self._specs for src in (s.stack or (s.source,))}
        self._skipped: dict[str, int] = {}
        unexpected = []
        for n in names:
            if n in used:
                continue
            if n.startswith(("model.visual.", "visual.")):
                self._count_skip("vision tower (model.visual.*)")
            elif n.startswith(("mtp.", "model.mtp.")) and not self.n_mtp:
                self._count_skip("multi-token-prediction head (mtp.*; --no-mtp, or no mtp_num_hidden_layers)")
            elif n == "lm_head.weight" and self.tied:
                self._count_skip("lm_head.weight (tie_word_embeddings: output uses token_embd)")
            else:
                unexpected.append(n)
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            raise ConversionError(f"{len(unexpected)} checkpoint tensors have no {self.gguf_arch} mapping: {shown}")

    def _count_skip(self, what: str) -> None:
        self._skipped[what] = self._skipped.get(what, 0) + 1

    def _recurrent_layers(self) -> list[bool]:
        types = self.hp.get("layer_types")
        if types is None:
            interval = int(self.hp.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
            return [(i + 1) % interval != 0 for i in range(self.n_layer)]
        if len(types) != self.n_layer:
            raise ConversionError(f"layer_types has {len(types)} entries for {self.n_layer} layers")
        bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
        if bad:
            raise ConversionError(f"unknown layer types {bad}; Qwen3.5 has linear_attention and full_attention")
        return [t == "linear_attention" for t in types]

    @property
    def vocab_size(self) -> int:
        return int(self.hp["vocab_size"])

    def _rope(self) -> dict:
        rope = dict(self.hp.get("rope_parameters") or self.hp.get("rope_scaling") or {})
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in rope and key in self.hp:
                rope[key] = self.hp[key]
        return rope

    def metadata(self) -> list[KV]:
        hp, a = self.hp, self.gguf_arch
        rope = self._rope()
        n_v, d_v = int(hp["linear_num_value_heads"]), int(hp["linear_value_head_dim"])
        kv = [
            *decoder_kv(a, hp, self.n_layer + self.n_mtp, hp.get("max_position_embeddings", 32768),
                        ffn=self._ffn_metadata()),
        ]
        kv += rope_scaling_kv(self.gguf_arch, rope)
        sections = list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)
        sections = (sections + [0] * 4)[:4]
        kv.append(array(f"{a}.rope.dimension_sections", sections, GGUFValueType.INT32))
        kv += [
            f32(f"{a}.rope.freq_base", rope.get("rope_theta", 10000.0)),
            f32(f"{a}.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"]),
            *head_size_kv(a, self.head_dim),
            u32(f"{a}.ssm.conv_kernel", hp["linear_conv_kernel_dim"]),
            u32(f"{a}.ssm.state_size", hp["linear_key_head_dim"]),
            u32(f"{a}.ssm.group_count", hp["linear_num_key_heads"]),
            u32(f"{a}.ssm.time_step_rank", n_v),
            u32(f"{a}.ssm.inner_size", n_v * d_v),
        ]
        kv.append(array(f"{a}.attention.recurrent_layers", self.recurrent + [False] * self.n_mtp, GGUFValueType.BOOL))
        if self.n_mtp:
            kv.append(u32(f"{a}.nextn_predict_layers", self.n_mtp))
        kv.append(u32(f"{a}.full_attention_interval",
                      hp.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)))
        partial = float(rope.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
        kv.append(u32(f"{a}.rope.dimension_count", int(self.head_dim * partial)))
        return kv

    def _ffn_metadata(self) -> list[KV]:
        return [u32(f"{self.gguf_arch}.feed_forward_length", self.hp["intermediate_size"])]

    def tensors(self) -> list[TensorSpec]:
        return self._specs

    def skipped(self) -> dict[str, int]:
        return dict(self._skipped)

    def _ffn_specs(self, mlp: str, b: str) -> list[TensorSpec]:
        """The feed-forward block of one layer: `mlp` the checkpoint prefix, `b` the GGUF one."""
        n_embd, n_ff = int(self.hp["hidden_size"]), int(self.hp["intermediate_size"])
        return [
            self._spec(b + "ffn_gate.weight", mlp + "gate_proj.weight", (n_ff, n_embd)),
            self._spec(b + "ffn_up.weight", mlp + "up_proj.weight", (n_ff, n_embd)),
            self._spec(b + "ffn_down.weight", mlp + "down_proj.weight", (n_embd, n_ff)),
        ]

    def _spec(self, name: str, source: str, shape: tuple[int, ...], **kw) -> TensorSpec:
        t = self.checkpoint.tensors.get(source)
        if t is None:
            raise ConversionError(f"checkpoint tensor {source!r} (for {name}) is missing")
        expected = int(np.prod(shape, dtype=np.int64))
        if t.numel != expected or (len(shape) > 1 and t.shape[0] != shape[0]):
            raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies "
                                  f"{list(shape)}")
        return TensorSpec(name, source, shape, **kw)

    def _build_specs(self) -> list[TensorSpec]:
        hp, p = self.hp, self.prefix
        n_embd, n_vocab = int(hp["hidden_size"]), self.vocab_size
        n_head, n_head_kv, hd = int(hp["num_attention_heads"]), int(hp["num_key_value_heads"]), self.head_dim
        n_k, n_v = int(hp["linear_num_key_heads"]), int(hp["linear_num_value_heads"])
        d_k, d_v, k_conv = int(hp["linear_key_head_dim"]), int(hp["linear_value_head_dim"]), \
            int(hp["linear_conv_kernel_dim"])
        key_dim, value_dim = n_k * d_k, n_v * d_v
        conv_dim = 2 * key_dim + value_dim

        reorder = n_k != n_v
        v_rows = v_head_order(n_k, n_v, d_v) if reorder else None
        head_rows = v_head_order(n_k, n_v, 1) if reorder else None
        qkv_rows = np.concatenate([np.arange(2 * key_dim), 2 * key_dim + v_rows]) if reorder else None

        specs = [self._spec("token_embd.weight", p + "embed_tokens.weight", (n_vocab, n_embd))]
        mtp = self.mtp_prefix
        for i in range(self.n_layer + self.n_mtp):
            lp, b = f"{p}layers.{i}.", f"blk.{i}."
            if i >= self.n_layer:  # an MTP layer: full attention, with the nextn tensors on the first
                lp = f"{mtp}layers.{i - self.n_layer}."
                if i == self.n_layer:
                    specs += [
                        self._spec(b + "nextn.eh_proj.weight", mtp + "fc.weight", (n_embd, 2 * n_embd)),
                        self._spec(b + "nextn.enorm.weight", mtp + "pre_fc_norm_embedding.weight", (n_embd,),
                                   transform=add_one),
                        self._spec(b + "nextn.hnorm.weight", mtp + "pre_fc_norm_hidden.weight", (n_embd,),
                                   transform=add_one),
                        self._spec(b + "nextn.shared_head_norm.weight", mtp + "norm.weight", (n_embd,),
                                   transform=add_one),
                    ]
            specs.append(self._spec(b + "attn_norm.weight", lp + "input_layernorm.weight", (n_embd,),
                                    transform=add_one))
            if i < self.n_layer and self.recurrent[i]:
                la = lp + "linear_attn."
                specs += [
                    self._spec(b + "ssm_a", la + "A_log", (n_v,), cols=head_rows, transform=neg_exp),
                    self._spec(b + "ssm_conv1d.weight", la + "conv1d.weight", (conv_dim, k_conv), rows=qkv_rows),
                    self._spec(b + "ssm_dt.bias", la + "dt_bias", (n_v,), cols=head_rows),
                    self._spec(b + "ssm_alpha.weight", la + "in_proj_a.weight", (n_v, n_embd), rows=head_rows),
                    self._spec(b + "ssm_beta.weight", la + "in_proj_b.weight", (n_v, n_embd), rows=head_rows),
                    self._spec(b + "attn_qkv.weight", la + "in_proj_qkv.weight", (conv_dim, n_embd), rows=qkv_rows),
                    self._spec(b + "attn_gate.weight", la + "in_proj_z.weight", (value_dim, n_embd), rows=v_rows),
                    self._spec(b + "ssm_norm.weight", la + "norm.weight", (d_v,)),
                    self._spec(b + "ssm_out.weight", la + "out_proj.weight", (n_embd, value_dim), cols=v_rows),
                ]
            else:
                sa = lp + "self_attn."
                specs += [
                    self._spec(b + "attn_q.weight", sa + "q_proj.weight", (n_head * hd * 2, n_embd)),
                    self._spec(b + "attn_k.weight", sa + "k_proj.weight", (n_head_kv * hd, n_embd)),
                    self._spec(b + "attn_v.weight", sa + "v_proj.weight", (n_head_kv * hd, n_embd)),
                    self._spec(b + "attn_output.weight", sa + "o_proj.weight", (n_embd, n_head * hd)),
                    self._spec(b + "attn_q_norm.weight", sa + "q_norm.weight", (hd,), transform=add_one),
                    self._spec(b + "attn_k_norm.weight", sa + "k_norm.weight", (hd,), transform=add_one),
                ]
            specs.append(self._spec(b + "post_attention_norm.weight", lp + "post_attention_layernorm.weight",
                                    (n_embd,), transform=add_one))
            specs += self._ffn_specs(lp + "mlp.", b)
        specs.append(self._spec("output_norm.weight", p + "norm.weight", (n_embd,), transform=add_one))
        if not self.tied:
            specs.append(self._spec("output.weight", "lm_head.weight", (n_vocab, n_embd)))
        return specs
