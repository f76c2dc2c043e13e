"""EAGLE3 drafters (vllm-project/speculators' Eagle3Speculator / Eagle3DraftModel
checkpoints, and the original EAGLE-3 layout whose decoder layer is `midlayer.*`) -> GGUF
architecture `eagle3`, with llama.cpp's keys, tensor names and layouts.

The drafter: g = fc(concat of three target layers' hidden states) (after an RMSNorm over
the concatenation when `norm_before_fc`); one Llama decoder layer whose attention reads
concat(input_layernorm(embedding of the token), hidden_norm(g)) (q/k/v take 2 x hidden
inputs) and whose residual is g (hidden_norm(g) with `norm_before_residual`); norm, then
lm_head over the draft vocabulary, mapped to target ids by d2t.

- `eagle3.target_layers` is the config's `eagle_aux_hidden_state_layer_ids` as they are
  (llama.cpp's default [2, n/2, n-3] without them): id L is the input of target layer L,
  i.e. HF hidden_states[L], the output of layer L-1 (the convention DFlash's GGUF key uses,
  but not DFlash's HF config, which is one lower); id n_layer is the target's last hidden
  state after its final norm.
- Llama RoPE: q_proj and k_proj rows go from each head's halves to interleaved pairs
  (llama.cpp runs eagle3 with ggml's normal RoPE); RMSNorm weights are stored as they are.
- d2t is written as absolute target ids (I64); t2d, the inverse mask, is left out.
- The tokenizer is the target's (`--target-model-dir`); `eagle3.target.*` (ours; llama.cpp
  ignores unknown keys) records the target the drafter is converted for, as `dflash.target.*`
  does for DFlash drafters (csrc/dfl_pair.c).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from ..base import KV, ModelConverter, array, boolean, f32, rope_scaling_kv, string, u32
from ..errors import ConversionError
from ..hf import Checkpoint, check_hparams, load_config, require_hparams, text_hparams
from ..tensors import TensorSpec

log = logging.getLogger("dflash_gguf.convert")

ARCH = "eagle3"
ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
# Unsupported drafter options: llama.cpp's eagle3 graph has no place for them.
_UNSUPPORTED_FLAGS = {"fc_norm": "per-layer norms of the target features (fc_norm)",
                      "norm_output": "post-norm hidden states fed back across steps (norm_output)"}

# Decoder-layer checkpoint names (after `layers.0.` or `midlayer.`) -> GGUF names (after `blk.0.`).
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "hidden_norm.weight": "attn_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_PREFIXES = ("layers.0.", "midlayer.")


def neox_to_interleaved(n: int, head_dim: int) -> np.ndarray:
    """Gather index taking each head's rotary halves (x0, x1, ..., y0, y1, ...) to
    interleaved pairs (x0, y0, x1, y1, ...) over `n` rows: ggml's normal RoPE order."""
    return np.arange(n).reshape(-1, 2, head_dim // 2).transpose(0, 2, 1).reshape(-1)


def default_target_layers(n_target_layers: int) -> list[int]:
    """llama.cpp's (and speculators') feature layers when a config lists none."""
    return [2, n_target_layers // 2, n_target_layers - 3]


class Eagle3Converter(ModelConverter):
    gguf_arch = ARCH
    needs_target = True

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, *, target_dir: Path | None = None):
        super().__init__(model_dir, config, checkpoint, target_dir=target_dir)
        if target_dir is None:
            raise ConversionError("an EAGLE3 drafter reads its target's hidden states and uses its tokenizer: pass "
                                  "--target-model-dir with the target model's checkpoint directory")
        layer_cfg = config.get("transformer_layer_config")
        if layer_cfg is not None and not isinstance(layer_cfg, dict):
            raise ConversionError("config.json: transformer_layer_config must be an object")
        # speculators nests the decoder layer's config; its keys win, as in llama.cpp (null
        # values, e.g. target_hidden_size, mean "not given")
        hp = self.hp = {k: v for k, v in {**config, **(layer_cfg or {})}.items() if v is not None}
        require_hparams(hp, _REQUIRED, "an EAGLE3 drafter")
        check_hparams(hp, _REQUIRED + ["num_key_value_heads", "head_dim", "max_position_embeddings",
                                       "draft_vocab_size", "target_hidden_size"], ["rms_norm_eps", "rope_theta"])
        kind = (layer_cfg or {}).get("model_type", "llama")
        if kind != "llama":
            raise ConversionError(f"transformer_layer_config.model_type is {kind!r}: llama.cpp's eagle3 layout is a "
                                  "Llama decoder layer (no q/k norms)")
        if hp["num_hidden_layers"] != 1:
            raise ConversionError(f"num_hidden_layers is {hp['num_hidden_layers']}: an EAGLE3 drafter has one "
                                  "decoder layer")
        for flag, what in _UNSUPPORTED_FLAGS.items():
            if hp.get(flag):
                raise ConversionError(f"{what} is not in llama.cpp's eagle3 layout")
        for flag in ("attention_bias", "mlp_bias"):
            if hp.get(flag):
                raise ConversionError(f"{flag}=true: the eagle3 GGUF layout has no biases")
        if hp.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"hidden_act {hp['hidden_act']!r}: only SiLU (SwiGLU) drafters are supported")

        self.n_embd = int(hp["hidden_size"])
        self.n_ff = int(hp["intermediate_size"])
        self.n_head = int(hp["num_attention_heads"])
        self.n_head_kv = int(hp.get("num_key_value_heads") or self.n_head)
        self.head_dim = int(hp.get("head_dim") or self.n_embd // self.n_head)
        self.draft_vocab = int(hp.get("draft_vocab_size") or hp["vocab_size"])

        self.target_config = load_config(target_dir)
        if set(ARCHITECTURES + ("DFlashDraftModel", "DFlash2DraftModel")) & \
                set(self.target_config.get("architectures") or []):
            raise ConversionError(f"--target-model-dir {target_dir} is itself a drafter; pass the target model's "
                                  "directory")
        self.target_layers = self._check_target(text_hparams(self.target_config))
        self._build_specs()

    @property
    def vocab_size(self) -> int:
        return int(self.hp["vocab_size"])

    def _check_target(self, thp: dict) -> list[int]:
        """Validate the drafter against its target; returns the feature layers."""
        where = f"the target ({self.target_dir})"
        t_embd, t_vocab, t_layers = thp.get("hidden_size"), thp.get("vocab_size"), thp.get("num_hidden_layers")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (t_embd, t_vocab, t_layers)):
            raise ConversionError(f"{where}: config.json lacks hidden_size, vocab_size or num_hidden_layers")
        self.target_shape = (t_vocab, t_embd)
        declared = self.hp.get("target_hidden_size")
        if declared is not None and declared != t_embd:
            raise ConversionError(f"the drafter reads target hidden states of size {declared} (target_hidden_size), "
                                  f"but {where} has hidden size {t_embd}: this drafter was not made for that target")
        if declared is None and t_embd != self.n_embd:
            raise ConversionError(f"the drafter's hidden size {self.n_embd} does not match the target's {t_embd} "
                                  f"({self.target_dir}) and config.json gives no target_hidden_size: this drafter "
                                  "was not made for that target")
        if t_vocab != self.vocab_size:
            raise ConversionError(f"the drafter's vocab_size {self.vocab_size} does not match the target's {t_vocab} "
                                  f"({self.target_dir}): this drafter was not made for that target")
        ids = self.hp.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            ids = default_target_layers(t_layers)
            log.info("no eagle_aux_hidden_state_layer_ids in the config: using llama.cpp's default %s", ids)
        if not isinstance(ids, list) or len(ids) != 3 or \
                not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConversionError(f"eagle_aux_hidden_state_layer_ids must list 3 target layers (low, middle, high), "
                                  f"got {ids!r}")
        bad = [i for i in ids if not 0 <= i <= t_layers]
        if bad:
            raise ConversionError(f"eagle_aux_hidden_state_layer_ids {ids} reads layer "
                                  f"{', '.join(map(str, bad))}, but {where} has {t_layers} layers (valid ids: "
                                  f"0..{t_layers}, the input of that layer; {t_layers}: the last hidden state)")
        return ids

    def vocab_source(self) -> tuple[Path, dict]:
        return self.target_dir, self.target_config

    def adjust_vocab(self, vocab) -> None:
        self._tokenizer_sha256 = vocab.fingerprint()

    # ---- metadata ------------------------------------------------------------------------

    def metadata(self) -> list[KV]:
        hp, a = self.hp, ARCH
        kv = [
            array(f"{a}.target_layers", self.target_layers, GGUFValueType.INT32),
            u32(f"{a}.target_hidden_size", hp.get("target_hidden_size") or self.target_shape[1]),
            boolean(f"{a}.norm_before_residual", bool(hp.get("norm_before_residual", False))),
            boolean(f"{a}.norm_before_fc", bool(hp.get("norm_before_fc", False))),
            u32(f"{a}.block_count", 1),
        ]
        if hp.get("max_position_embeddings") is not None:
            kv.append(u32(f"{a}.context_length", hp["max_position_embeddings"]))
        kv += [
            u32(f"{a}.embedding_length", self.n_embd),
            u32(f"{a}.feed_forward_length", self.n_ff),
            u32(f"{a}.attention.head_count", self.n_head),
        ]
        if hp.get("num_key_value_heads") is not None:
            kv.append(u32(f"{a}.attention.head_count_kv", self.n_head_kv))
        rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConversionError("config.json: rope_parameters must be an object")
        rope = dict(rope)
        if "rope_type" not in rope and "type" in rope:
            rope["rope_type"] = rope["type"]
        kv += rope_scaling_kv(a, rope)
        theta = rope.get("rope_theta", hp.get("rope_theta"))
        if theta is not None:
            kv.append(f32(f"{a}.rope.freq_base", theta))
        if hp.get("rms_norm_eps") is not None:
            kv.append(f32(f"{a}.attention.layer_norm_rms_epsilon", hp["rms_norm_eps"]))
        if hp.get("head_dim") is not None:
            kv += [u32(f"{a}.attention.key_length", self.head_dim), u32(f"{a}.attention.value_length", self.head_dim)]
        kv += [u32(f"{a}.vocab_size", self.vocab_size), u32(f"{a}.rope.dimension_count", self.head_dim)]
        # Ours, not llama.cpp's (which ignores them): the target this drafter is converted
        # for, checked when the pair is loaded.
        sha = getattr(self, "_tokenizer_sha256", None)
        if sha is not None:
            kv += [string(f"{a}.target.name", self.target_dir.resolve().name),
                   string(f"{a}.target.tokenizer_sha256", sha),
                   u32(f"{a}.target.embedding_length", self.target_shape[1]),
                   u32(f"{a}.target.vocab_size", self.target_shape[0])]
        return kv

    # ---- tensors -------------------------------------------------------------------------

    def tensors(self) -> list[TensorSpec]:
        return self._specs

    def skipped(self) -> dict[str, int]:
        return dict(self._skipped)

    def _spec(self, name: str, source: str, shape: tuple[int, ...], **kw) -> TensorSpec:
        t = self.checkpoint.tensors[source]
        if t.shape != tuple(shape):
            raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies "
                                  f"{list(shape)}")
        return TensorSpec(name, source, tuple(shape), **kw)

    def _build_specs(self) -> None:
        E, V, Vd, hd = self.n_embd, self.vocab_size, self.draft_vocab, self.head_dim
        E_tgt = self.target_shape[1]
        q_dim, kv_dim = self.n_head * hd, self.n_head_kv * hd
        shapes = {
            "attn_norm.weight": ((E,), {}), "attn_norm_2.weight": ((E,), {}),
            "attn_q.weight": ((q_dim, 2 * E), {"rows": neox_to_interleaved(q_dim, hd)}),
            "attn_k.weight": ((kv_dim, 2 * E), {"rows": neox_to_interleaved(kv_dim, hd)}),
            "attn_v.weight": ((kv_dim, 2 * E), {}), "attn_output.weight": ((E, q_dim), {}),
            "ffn_norm.weight": ((E,), {}), "ffn_gate.weight": ((self.n_ff, E), {}),
            "ffn_up.weight": ((self.n_ff, E), {}), "ffn_down.weight": ((E, self.n_ff), {}),
        }
        top = {"embed_tokens.weight": ("token_embd.weight", (V, E)),
               "fc.weight": ("fc.weight", (E, 3 * E_tgt)),
               "input_norm.weight": ("enc.output_norm.weight", (3 * E_tgt,)),
               "norm.weight": ("output_norm.weight", (E,)),
               "lm_head.weight": ("output.weight", (Vd, E))}
        specs, self._skipped = [], {}
        for n in sorted(self.checkpoint.names()):
            canon = n[len("model."):] if n.startswith("model.") else n
            layer = next((canon[len(p):] for p in _LAYER_PREFIXES if canon.startswith(p)), None)
            if layer in _LAYER_TENSORS:
                gguf_name = _LAYER_TENSORS[layer]
                shape, kw = shapes[gguf_name]
                specs.append(self._spec(f"blk.0.{gguf_name}", n, shape, **kw))
            elif canon in top:
                specs.append(self._spec(top[canon][0], n, top[canon][1]))
            elif canon == "t2d":
                self._check_t2d(n)
                self._skipped["t2d (the target-to-draft vocabulary mask; d2t is kept)"] = 1
            elif canon != "d2t" and not canon.endswith(".rotary_emb.inv_freq"):
                raise ConversionError(f"checkpoint tensor {n!r} has no eagle3 mapping")
        names = {s.name for s in specs}
        for needed in ["fc.weight", "output_norm.weight"] + [f"blk.0.{g}" for g in _LAYER_TENSORS.values()]:
            if needed not in names:
                raise ConversionError(f"the checkpoint has no tensor for {needed}")
        if self.hp.get("norm_before_fc") and "enc.output_norm.weight" not in names:
            raise ConversionError("norm_before_fc is set but the checkpoint has no input_norm.weight")
        d2t = self._d2t()
        if d2t is not None:
            specs.append(d2t)
        elif Vd != V:
            raise ConversionError(f"draft_vocab_size {Vd} differs from the target's {V} but the checkpoint has no d2t")
        if "output.weight" not in names and Vd != V:
            raise ConversionError("the checkpoint has no lm_head.weight: a drafter over its own vocabulary needs one")
        self._specs = specs

    def _d2t(self) -> TensorSpec | None:
        """d2t as absolute target ids (the checkpoint holds offsets from the draft id)."""
        name = next((n for n in ("d2t", "model.d2t") if n in self.checkpoint), None)
        if name is None:
            return None
        offsets = self.checkpoint.integers(name).reshape(-1)
        if offsets.size != self.draft_vocab:
            raise ConversionError(f"d2t has {offsets.size} entries for draft_vocab_size {self.draft_vocab}")
        ids = offsets + np.arange(offsets.size, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ConversionError(f"d2t maps draft ids to target ids outside 0..{self.vocab_size - 1}")
        if np.unique(ids).size != ids.size:
            raise ConversionError("d2t maps two draft ids to one target id")
        return TensorSpec("d2t", name, (ids.size,), values=ids, fixed_type=GGMLQuantizationType.I64)

    def _check_t2d(self, name: str) -> None:
        mask = self.checkpoint.integers(name).reshape(-1)
        if mask.size != self.vocab_size or int((mask != 0).sum()) != self.draft_vocab:
            raise ConversionError(f"t2d marks {int((mask != 0).sum())} of {mask.size} target ids; expected "
                                  f"{self.draft_vocab} of {self.vocab_size}")
