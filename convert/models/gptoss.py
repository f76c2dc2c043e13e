"""gpt-oss (GptOssForCausalLM) -> GGUF architecture `gpt-oss` (llama.cpp's layout).

- Attention: q/k/v/o projections with biases, and the per-head sinks as
  `attn_sinks.weight`. Layers alternate sliding window / full attention; llama.cpp
  assumes the alternation (even layers slide), so another `layer_types` pattern is
  written as `attention.sliding_window_pattern` (a bool per layer, which llama.cpp reads).
- Experts: the router with its bias (`ffn_gate_inp`); `experts.gate_up_proj`
  [experts, hidden, 2 ffn] interleaves gate and up columns (gate even, up odd) and is
  split and transposed into `ffn_gate_exps` and `ffn_up_exps` [experts, ffn, hidden], its
  bias likewise; `experts.down_proj` [experts, ffn, hidden] is transposed into
  `ffn_down_exps`. A checkpoint published in MXFP4 (quantization_config.quant_method
  "mxfp4": `*_blocks` and `*_scales` of uint8) keeps its experts' blocks as GGML's MXFP4
  bit for bit, whatever the outtype: the scale byte (E8M0) is the same, and the 4-bit
  codes only move, from two consecutive values per byte to value j and j + 16 of the
  block in one byte.
- RoPE: YaRN from rope_parameters / rope_scaling. gpt-oss's correction range is not
  rounded (`truncate: false`, the runtime's default for gpt-oss); a config that does
  round it gets `rope.scaling.yarn_truncate = true` (ours; llama.cpp always rounds).
- The experts' SwiGLU clamp is swiglu_limit (7 in every published config, and the value
  transformers and llama.cpp use whatever the config says); another limit is written as
  `swiglu_clamp_exp`, which only our runtime applies. Its alpha, 1.702, is fixed.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from ..base import KV, ModelConverter, array, decoder_kv, f32, head_size_kv, rope_scaling_kv, u32
from ..errors import ConversionError
from ..hf import Checkpoint, check_hparams, quantization_method, require_hparams, text_hparams, to_float32
from ..tensors import TensorSpec

log = logging.getLogger("dflash_gguf.convert")

ARCH = "gpt-oss"
SWIGLU_LIMIT = 7.0
_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window", "num_local_experts",
             "num_experts_per_tok"]
MXFP4_BLOCK = 32


def _alternating(n_layer: int) -> list[str]:
    """transformers' (and llama.cpp's) default pattern: even layers slide."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's packed MXFP4 rows -> GGML block_mxfp4 bytes.

    blocks [n, n_blocks, 16] (value 2j of a block in the low nibble of byte j, 2j + 1 in
    the high one), scales [n, n_blocks] (E8M0) -> [n, n_blocks * 17]: per block the scale
    byte, then 16 bytes holding value j in the low nibble and value j + 16 in the high
    one."""
    codes = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    half = codes.shape[-1] // 2
    qs = codes[..., :half] | (codes[..., half:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1)
    return out.reshape(out.shape[0], -1)


class GptOssConverter(ModelConverter):
    gguf_arch = ARCH
    quantizations = ("mxfp4",)

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, **kwargs):
        super().__init__(model_dir, config, checkpoint, **kwargs)
        hp = self.hp = text_hparams(config)
        require_hparams(hp, _REQUIRED, "a gpt-oss model")
        check_hparams(hp, [k for k in _REQUIRED if k != "rms_norm_eps"], ["rms_norm_eps"])
        if hp.get("attention_bias") is False:
            raise ConversionError("attention_bias=false: llama.cpp's gpt-oss layout has attention biases")
        if hp.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"hidden_act {hp['hidden_act']!r}: gpt-oss's experts are clamped SwiGLU (silu)")
        self.n_layer = int(hp["num_hidden_layers"])
        self.n_expert, self.n_used = int(hp["num_local_experts"]), int(hp["num_experts_per_tok"])
        if self.n_used > self.n_expert:
            raise ConversionError(f"num_experts_per_tok {self.n_used} is not within 1..num_local_experts "
                                  f"({self.n_expert})")
        self.layer_types = list(hp.get("layer_types") or _alternating(self.n_layer))
        if len(self.layer_types) != self.n_layer or set(self.layer_types) - {"sliding_attention", "full_attention"}:
            raise ConversionError(f"config.json: layer_types must list {self.n_layer} entries of 'sliding_attention' "
                                  "or 'full_attention'")
        self.rope = self._rope()
        limit = hp.get("swiglu_limit", SWIGLU_LIMIT)
        check_hparams({"swiglu_limit": limit}, floats=["swiglu_limit"])
        self.swiglu_limit = float(limit)
        self.mxfp4 = quantization_method(config) == "mxfp4"
        self._specs = self._build_specs()
        used = {s.source for s in self._specs} | self._mxfp4_sources
        unexpected = [n for n in checkpoint.names() if n not in used]
        if unexpected:
            shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            raise ConversionError(f"{len(unexpected)} checkpoint tensors have no gpt-oss mapping: {shown}")

    def _rope(self) -> dict:
        hp = self.hp
        rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
        if "rope_type" not in rope and "type" in rope:
            rope["rope_type"] = rope["type"]
        rope.setdefault("rope_theta", hp.get("rope_theta", 150000.0))
        check_hparams(rope, floats=["rope_theta"], where="config.json rope_parameters")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConversionError("partial_rotary_factor: gpt-oss rotates whole heads")
        return rope

    @property
    def vocab_size(self) -> int:
        return int(self.hp["vocab_size"])

    def metadata(self) -> list[KV]:
        hp, a = self.hp, ARCH
        kv = [
            *decoder_kv(a, hp, self.n_layer, hp.get("max_position_embeddings", 131072)),
            *rope_scaling_kv(a, self.rope, truncate_default=False),
            f32(f"{a}.rope.freq_base", self.rope["rope_theta"]),
            f32(f"{a}.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"]),
            u32(f"{a}.expert_count", self.n_expert),
            u32(f"{a}.expert_used_count", self.n_used),
            *head_size_kv(a, hp["head_dim"]),
            u32(f"{a}.attention.sliding_window", hp["sliding_window"]),
            u32(f"{a}.expert_feed_forward_length", hp["intermediate_size"]),
        ]
        if self.layer_types != _alternating(self.n_layer):
            kv.append(array(f"{a}.attention.sliding_window_pattern",
                            [t == "sliding_attention" for t in self.layer_types], GGUFValueType.BOOL))
        if self.swiglu_limit != SWIGLU_LIMIT:
            log.warning("swiglu_limit %g: written as gpt-oss.swiglu_clamp_exp, which this runtime applies; "
                        "llama.cpp and transformers clamp at %g whatever the config says", self.swiglu_limit,
                        SWIGLU_LIMIT)
            kv.append(array(f"{a}.swiglu_clamp_exp", [self.swiglu_limit] * self.n_layer, GGUFValueType.FLOAT32))
        return kv

    def tensors(self) -> list[TensorSpec]:
        return self._specs

    # ---- tensors -------------------------------------------------------------------------

    def _spec(self, name: str, source: str, shape: tuple[int, ...], source_shape: tuple[int, ...] | None = None,
              **kw) -> TensorSpec:
        t = self.checkpoint.tensors.get(source)
        if t is None:
            raise ConversionError(f"checkpoint tensor {source!r} (for {name}) is missing")
        want = tuple(source_shape or shape)
        if t.shape != want:
            raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies {list(want)}")
        return TensorSpec(name, source, shape, **kw)

    def _build_specs(self) -> list[TensorSpec]:
        hp = self.hp
        E, V, F, X = int(hp["hidden_size"]), self.vocab_size, int(hp["intermediate_size"]), self.n_expert
        H, Hkv, hd = int(hp["num_attention_heads"]), int(hp["num_key_value_heads"]), int(hp["head_dim"])
        head = "model.embed_tokens.weight" if hp.get("tie_word_embeddings") else "lm_head.weight"
        specs = [self._spec("token_embd.weight", "model.embed_tokens.weight", (V, E)),
                 self._spec("output.weight", head, (V, E)),
                 self._spec("output_norm.weight", "model.norm.weight", (E,))]
        self._mxfp4_sources: set[str] = set()
        for i in range(self.n_layer):
            lp, b = f"model.layers.{i}.", f"blk.{i}."
            sa, mlp = lp + "self_attn.", lp + "mlp."
            specs += [
                self._spec(b + "attn_norm.weight", lp + "input_layernorm.weight", (E,)),
                self._spec(b + "post_attention_norm.weight", lp + "post_attention_layernorm.weight", (E,)),
                self._spec(b + "attn_q.weight", sa + "q_proj.weight", (H * hd, E)),
                self._spec(b + "attn_q.bias", sa + "q_proj.bias", (H * hd,)),
                self._spec(b + "attn_k.weight", sa + "k_proj.weight", (Hkv * hd, E)),
                self._spec(b + "attn_k.bias", sa + "k_proj.bias", (Hkv * hd,)),
                self._spec(b + "attn_v.weight", sa + "v_proj.weight", (Hkv * hd, E)),
                self._spec(b + "attn_v.bias", sa + "v_proj.bias", (Hkv * hd,)),
                self._spec(b + "attn_output.weight", sa + "o_proj.weight", (E, H * hd)),
                self._spec(b + "attn_output.bias", sa + "o_proj.bias", (E,)),
                self._spec(b + "attn_sinks.weight", sa + "sinks", (H,)),
                self._spec(b + "ffn_gate_inp.weight", mlp + "router.weight", (X, E)),
                self._spec(b + "ffn_gate_inp.bias", mlp + "router.bias", (X,)),
                self._spec(b + "ffn_gate_exps.bias", mlp + "experts.gate_up_proj_bias", (X, F), (X, 2 * F),
                           cols=np.arange(0, 2 * F, 2)),
                self._spec(b + "ffn_up_exps.bias", mlp + "experts.gate_up_proj_bias", (X, F), (X, 2 * F),
                           cols=np.arange(1, 2 * F, 2)),
                self._spec(b + "ffn_down_exps.bias", mlp + "experts.down_proj_bias", (X, E)),
            ]
            experts = mlp + "experts."
            if self.mxfp4:
                specs += [self._mxfp4(b + "ffn_gate_exps.weight", experts + "gate_up_proj", X, F, E, 0, 2),
                          self._mxfp4(b + "ffn_up_exps.weight", experts + "gate_up_proj", X, F, E, 1, 2),
                          self._mxfp4(b + "ffn_down_exps.weight", experts + "down_proj", X, E, F, 0, 1)]
            else:
                specs += [self._transposed(b + "ffn_gate_exps.weight", experts + "gate_up_proj", (X, E, 2 * F), 0, 2),
                          self._transposed(b + "ffn_up_exps.weight", experts + "gate_up_proj", (X, E, 2 * F), 1, 2),
                          self._transposed(b + "ffn_down_exps.weight", experts + "down_proj", (X, F, E), 0, 1)]
        return specs

    def _transposed(self, name: str, source: str, source_shape: tuple[int, int, int], first: int,
                    step: int) -> TensorSpec:
        """[experts, out, in] from a float [experts, in, step * out] (x @ W) source: output
        row (x, o) is column first + step * o of expert x."""
        X, n_in, n_cols = source_shape
        n_out = n_cols // step
        if source not in self.checkpoint and source + "_blocks" in self.checkpoint:
            raise ConversionError(f"{source}_blocks is MXFP4 data, but config.json has no quantization_config "
                                  "with quant_method 'mxfp4'")
        self._check(source, source_shape)

        def read(ckpt: Checkpoint, r0: int, r1: int) -> np.ndarray:
            src = ckpt.rows(source, X * n_in)  # row (x, i) of each expert's [in, cols]
            pieces = []
            for x in range(r0 // n_out, (r1 - 1) // n_out + 1):
                a, b = max(r0, x * n_out) - x * n_out, min(r1, (x + 1) * n_out) - x * n_out
                cols = src[x * n_in:(x + 1) * n_in, first + step * a:first + step * b:step]
                pieces.append(to_float32(np.ascontiguousarray(cols.T), ckpt.is_bf16(source)))
            return np.concatenate(pieces)

        return TensorSpec(name, source, (X, n_out, n_in), read=read)

    def _check(self, source: str, shape: tuple[int, ...]) -> None:
        t = self.checkpoint.tensors.get(source)
        if t is None:
            raise ConversionError(f"checkpoint tensor {source!r} is missing")
        if t.shape != shape:
            raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies {list(shape)}")

    def _mxfp4(self, name: str, source: str, X: int, n_out: int, n_in: int, first: int, step: int) -> TensorSpec:
        """[experts, n_out, n_in] in MXFP4 from OpenAI's `<source>_blocks` [experts, step *
        n_out, n_in / 32, 16] and `<source>_scales` [experts, step * n_out, n_in / 32]:
        output row (x, o) is source row first + step * o of expert x."""
        blocks, scales = source + "_blocks", source + "_scales"
        if n_in % MXFP4_BLOCK:
            raise ConversionError(f"{source}: rows of {n_in} values are not whole MXFP4 blocks of {MXFP4_BLOCK}")
        nb = n_in // MXFP4_BLOCK
        self._check(blocks, (X, step * n_out, nb, 16))
        self._check(scales, (X, step * n_out, nb))
        for t in (blocks, scales):
            if self.checkpoint.tensors[t].dtype != "U8":
                raise ConversionError(f"{t} has dtype {self.checkpoint.tensors[t].dtype}; MXFP4 data is U8")
        self._mxfp4_sources.update((blocks, scales))

        def raw(ckpt: Checkpoint, r0: int, r1: int) -> tuple[np.ndarray, int]:
            rows = np.arange(r0, r1)
            src = (rows // n_out) * (step * n_out) + first + step * (rows % n_out)
            b = ckpt.byte_rows(blocks, X * step * n_out)[src].reshape(-1, nb, 16)
            s = ckpt.byte_rows(scales, X * step * n_out)[src]
            n_nan = int(np.count_nonzero(s == 0xFF)) * MXFP4_BLOCK  # E8M0's NaN scale
            return mxfp4_to_ggml(b, s).reshape(-1), n_nan

        return TensorSpec(name, blocks, (X, n_out, n_in), raw=raw, fixed_type=GGMLQuantizationType.MXFP4)
