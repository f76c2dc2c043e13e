"""DFlash block-diffusion drafters (z-lab's DFlashDraftModel and DFlash2DraftModel) -> GGUF
architecture `dflash`, with llama.cpp's keys, tensor names and layouts.

- A drafter has no embedding or LM head of its own: it uses its target's. Its tokenizer
  is therefore the target's (`--target-model-dir`), with `tokenizer.ggml.mask_token_id`
  set to the drafter's mask token.
- `dflash.target_layers` stores the HF `target_layer_ids` plus one (llama.cpp's
  convention: layer L means the input of layer L, i.e. the output of HF layer L-1).
- Qwen3 RMSNorm weights are applied as they are (no +1, unlike Qwen3.5's).
- A Qwen3.5 target ropes in sections (M-RoPE); its drafter ropes on the temporal section
  only, written as the degenerate sections [head_dim/2, 0, 0, 0].
- DFlash2 adds per-layer grouped dynamic convolutions around attention and MLP and a
  low-rank candidate selector.
- `dflash.target.*` (ours; llama.cpp ignores unknown keys) records the target the drafter
  is converted for: its directory name, tokenizer fingerprint (sha256 of tokens, merges
  and special ids), embedding shape and layer count (gpt-oss-20b and -120b share the
  first two). The runtime refuses the drafter with any other
  target; drafters without these keys (llama.cpp's converter) are checked by shape and
  by the vocabulary they carry.
- `mask_embedding.pt` (a trained mask-token vector shipped next to some drafters) becomes
  a drafter-owned token embedding: the target's table with the mask row replaced, plus
  the target's output head, as llama.cpp writes it.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from .base import KV, ModelConverter, array, boolean, f32, string, u32
from .errors import ConversionError
from .hf import Checkpoint, check_hparams, load_config, require_hparams, text_hparams
from .tensors import TensorSpec

log = logging.getLogger("dflash_gguf.convert")

ARCH = "dflash"
DEFAULT_BLOCK_SIZE = 16  # z-lab's default when the config has none
MASK_EMBEDDING_FILE = "mask_embedding.pt"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# transformers' Qwen3Config defaults. llama.cpp's converter reads the config through
# transformers, so a config.json that omits these gets them in its output.
QWEN3_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]

# Per-layer checkpoint names (after `layers.N.`) -> GGUF names (after `blk.N.`).
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_DFLASH2_LAYER_TENSORS = {
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
# Checkpoint tensors that are buffers, not weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def build_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """z-lab's default feature layers when a config lists none (dflash.model)."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    start, end = 1, n_target_layers - 3
    return [round(start + i * (end - start) / (n_draft_layers - 1)) for i in range(n_draft_layers)]


def interleaved_to_neox(n: int, head_dim: int) -> np.ndarray:
    """Gather index taking each head's rotary pairs from interleaved order (x0, y0, x1, y1,
    ...) to NeoX halves (x0, x1, ..., y0, y1, ...) over `n` elements."""
    return np.arange(n).reshape(-1, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def _round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to a checkpoint dtype and back (what assigning into a tensor
    of that dtype does)."""
    if dtype == "BF16":
        from .quant import _to_bf16

        return (_to_bf16(values).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return values.astype(np.float16).astype(np.float32)
    return values.astype(np.float32)


class DFlashConverter(ModelConverter):
    gguf_arch = ARCH
    needs_target = True

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, *, target_dir: Path | None = None):
        super().__init__(model_dir, config, checkpoint, target_dir=target_dir)
        if target_dir is None:
            raise ConversionError(
                "a DFlash drafter has no tokenizer or embeddings of its own: pass --target-model-dir with the "
                "target model's checkpoint directory")
        hp = self.hp = text_hparams(config)
        dcfg = hp.get("dflash_config")
        self.dcfg = dict(dcfg) if isinstance(dcfg, dict) else {}
        require_hparams(hp, _REQUIRED, "a DFlash drafter")
        check_hparams(hp, _REQUIRED + ["num_key_value_heads", "head_dim", "max_position_embeddings",
                                       "num_target_layers", "block_size"], ["rms_norm_eps", "rope_theta"])
        check_hparams(self.dcfg, ["block_size", "num_target_layers"], where="config.json dflash_config")
        if hp.get("attention_bias"):
            raise ConversionError("attention_bias=true: the dflash GGUF layout has no attention biases")
        act = hp.get("hidden_act", "silu")
        if act != "silu":
            raise ConversionError(f"hidden_act {act!r}: only SiLU (SwiGLU) drafters are supported")
        experts = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if hp.get(k)]
        if experts:
            raise ConversionError("mixture-of-experts drafters are not supported")
        sliding = "sliding_attention" in (hp.get("layer_types") or [])
        windowed = hp.get("use_sliding_window") or self.dcfg.get("use_swa")
        if sliding and not windowed and hp.get("is_causal") is None and self.dcfg.get("causal") is None:
            # the reference drafter runs such layers causally without a window; the GGUF
            # (llama.cpp's keys) can say causal only for all layers or with a window
            raise ConversionError("layer_types marks sliding_attention layers but use_sliding_window is false: "
                                  "set use_sliding_window (and sliding_window) or is_causal")

        self.n_layer = int(hp["num_hidden_layers"])
        self.n_embd = int(hp["hidden_size"])
        self.n_ff = int(hp["intermediate_size"])
        self.n_head = int(hp["num_attention_heads"])
        self.n_head_kv = int(hp.get("num_key_value_heads") or self.n_head)
        self.head_dim = int(hp.get("head_dim") or self.n_embd // self.n_head)

        mask = self._value("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < self.vocab_size:
            raise ConversionError(f"dflash_config.mask_token_id is {mask!r}; it must be a token id below "
                                  f"vocab_size {self.vocab_size}")
        self.mask_token_id = mask
        self.dflash2 = self._value("conv_kernel_size") is not None
        if self.dflash2:
            missing = [k for k in DFLASH2_KEYS if self._value(k) is None]
            if missing:
                raise ConversionError(f"DFlash2 drafter: dflash_config lacks {', '.join(missing)}")
        elif "DFlash2DraftModel" in (config.get("architectures") or []):
            raise ConversionError(f"DFlash2DraftModel without {', '.join(DFLASH2_KEYS)} in dflash_config")

        self.target_config = load_config(target_dir)
        drafters = {"DFlashDraftModel", "DFlash2DraftModel"} & set(self.target_config.get("architectures") or [])
        if drafters:
            raise ConversionError(f"--target-model-dir {target_dir} is itself a drafter ({', '.join(drafters)}); "
                                  "pass the target model's directory")
        self.target_layer_ids = self._check_target(text_hparams(self.target_config))
        self._build_specs()

    # ---- config --------------------------------------------------------------------------

    def _value(self, name: str, default=None):
        """A drafter setting: dflash_config first, then the config root (z-lab's lookup)."""
        if name in self.dcfg and self.dcfg[name] is not None:
            return self.dcfg[name]
        return self.hp.get(name, default)

    @property
    def vocab_size(self) -> int:
        return int(self.hp["vocab_size"])

    def _check_target(self, thp: dict) -> list[int]:
        """Validate the drafter against its target; returns the HF target_layer_ids."""
        where = f"the target ({self.target_dir})"
        t_embd, t_vocab, t_layers = thp.get("hidden_size"), thp.get("vocab_size"), thp.get("num_hidden_layers")
        if not all(isinstance(v, int) for v in (t_embd, t_vocab, t_layers)):
            raise ConversionError(f"{where}: config.json lacks hidden_size, vocab_size or num_hidden_layers")
        self.target_shape = (t_vocab, t_embd)
        if t_embd != self.n_embd:
            raise ConversionError(
                f"the drafter's hidden size {self.n_embd} does not match the target's {t_embd} "
                f"({self.target_dir}): this drafter was not made for that target")
        if t_vocab != self.vocab_size:
            raise ConversionError(
                f"the drafter's vocab_size {self.vocab_size} does not match the target's {t_vocab} "
                f"({self.target_dir}): this drafter was not made for that target")
        self.target_layers = t_layers
        n_target = self._value("num_target_layers")
        if isinstance(n_target, int) and n_target != t_layers:
            # same tokenizer and width, another depth: gpt-oss-20b and -120b, whose drafters
            # read features of layers that exist in both
            raise ConversionError(
                f"the drafter was made for a {n_target}-layer target, but {where} has {t_layers} layers: this "
                "drafter was not made for that target")

        ids = self._value("target_layer_ids")
        if ids is None:
            ids = build_target_layer_ids(n_target if isinstance(n_target, int) else t_layers, self.n_layer)
            log.info("no target_layer_ids in the config: using z-lab's default %s", ids)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in ids):
            raise ConversionError(f"dflash_config.target_layer_ids must be a non-empty list of layer indices, "
                                  f"got {ids!r}")
        bad = [i for i in ids if not 0 <= i < t_layers]
        if bad:
            raise ConversionError(
                f"dflash_config.target_layer_ids {ids} reads layer{'s' if len(bad) > 1 else ''} "
                f"{', '.join(map(str, bad))}, but {where} has {t_layers} layers (valid ids: 0..{t_layers - 1})")
        return ids

    def vocab_source(self) -> tuple[Path, dict]:
        return self.target_dir, self.target_config

    def adjust_vocab(self, vocab) -> None:
        # the tokenizer is the target's: its fingerprint, taken before the mask id joins it
        self._tokenizer_sha256 = vocab.fingerprint()
        vocab.special_ids["mask"] = self.mask_token_id

    # ---- metadata ------------------------------------------------------------------------

    def _rope(self) -> dict:
        hp = self.hp
        rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
        if "rope_type" not in rope and "type" in rope:
            rope["rope_type"] = rope["type"]
        for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
            if key not in rope and key in hp:
                rope[key] = hp[key]
        rope.setdefault("rope_theta", QWEN3_DEFAULTS["rope_theta"])
        return rope

    def _target_uses_mrope(self) -> bool:
        thp = self.target_config.get("text_config", self.target_config)
        rope = thp.get("rope_parameters") or thp.get("rope_scaling") or {}
        return "mrope_section" in rope

    def metadata(self) -> list[KV]:
        hp, a, rope = self.hp, ARCH, self._rope()
        kv: dict[str, KV] = {}

        def put(item: KV) -> None:  # a later value for a key replaces the earlier one, as in llama.cpp
            kv[item.key] = item

        for item in (
            u32(f"{a}.block_count", self.n_layer),
            u32(f"{a}.context_length", hp.get("max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"])),
            u32(f"{a}.embedding_length", self.n_embd),
            u32(f"{a}.feed_forward_length", self.n_ff),
            u32(f"{a}.attention.head_count", self.n_head),
            u32(f"{a}.attention.head_count_kv", self.n_head_kv),
        ):
            put(item)
        if hp.get("is_causal") is False:
            put(boolean(f"{a}.attention.causal", False))
        for item in self._rope_scaling(rope):
            put(item)
        if "mrope_section" in rope:
            sections = (list(rope["mrope_section"]) + [0] * 4)[:4]
            put(array(f"{a}.rope.dimension_sections", sections, GGUFValueType.INT32))
        put(f32(f"{a}.rope.freq_base", rope["rope_theta"]))
        put(f32(f"{a}.attention.layer_norm_rms_epsilon", hp.get("rms_norm_eps", QWEN3_DEFAULTS["rms_norm_eps"])))
        for name in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"):
            if hp.get(name) is not None:
                put(f32(f"{a}.attention.layer_norm_epsilon", hp[name]))
                break
        put(u32(f"{a}.attention.key_length", self.head_dim))
        put(u32(f"{a}.attention.value_length", self.head_dim))

        if rope.get("partial_rotary_factor") is not None:
            put(u32(f"{a}.rope.dimension_count", int(self.head_dim * rope["partial_rotary_factor"])))
        if self.dcfg.get("attention_value_scale") is not None:
            put(f32(f"{a}.attention.value_scale", self.dcfg["attention_value_scale"]))
        put(u32(f"{a}.block_size", self._value("block_size", DEFAULT_BLOCK_SIZE)))
        if self.dflash2:
            for key in DFLASH2_KEYS:
                put(u32(f"{a}.{key}", int(self._value(key))))
        if self._value("output_multiplier") is not None:
            put(f32(f"{a}.logit_scale", self._value("output_multiplier")))
        softcap = self._value("final_logit_softcapping")
        if softcap is not None and float(softcap) > 0:
            put(f32(f"{a}.final_logit_softcapping", softcap))
        if self._value("input_embedding_scale") is not None:
            put(f32(f"{a}.embedding_scale", self._value("input_embedding_scale")))
        # llama.cpp's convention: +1 (the input of layer id+1 = the output of HF layer id).
        put(array(f"{a}.target_layers", [i + 1 for i in self.target_layer_ids], GGUFValueType.INT32))

        use_swa = bool(self.dcfg.get("use_swa", False))
        window = self.dcfg.get("swa_window_size") or hp.get("sliding_window")
        if (hp.get("use_sliding_window", False) or use_swa) and window:
            pattern = [True] * self.n_layer if use_swa else \
                [t == "sliding_attention" for t in hp.get("layer_types") or []]
            put(u32(f"{a}.attention.sliding_window", window))
            put(array(f"{a}.attention.sliding_window_pattern", pattern, GGUFValueType.BOOL))
        causal = hp.get("is_causal")
        if causal is None:
            causal = self.dcfg.get("causal")
        if causal is not None:
            put(boolean(f"{a}.attention.causal", bool(causal)))
        if self._target_uses_mrope():
            put(array(f"{a}.rope.dimension_sections", [self.head_dim // 2, 0, 0, 0], GGUFValueType.INT32))
        # Ours, not llama.cpp's (which ignores them): the target this drafter is converted
        # for, checked when the pair is loaded (csrc/dfl_pair.c).
        sha = getattr(self, "_tokenizer_sha256", None)
        if sha is not None:
            put(string(f"{a}.target.name", self.target_dir.resolve().name))
            put(string(f"{a}.target.tokenizer_sha256", sha))
            put(u32(f"{a}.target.embedding_length", self.target_shape[1]))
            put(u32(f"{a}.target.vocab_size", self.target_shape[0]))
            put(u32(f"{a}.target.block_count", self.target_layers))
        return list(kv.values())

    def _rope_scaling(self, rope: dict) -> list[KV]:
        a = ARCH
        kind, factor = rope.get("rope_type"), rope.get("factor")
        if kind in (None, "default"):
            return []
        if kind == "linear" and factor is not None:
            return [string(f"{a}.rope.scaling.type", "linear"), f32(f"{a}.rope.scaling.factor", factor)]
        if kind == "yarn" and factor is not None:
            if "original_max_position_embeddings" not in rope:
                raise ConversionError("yarn rope scaling without original_max_position_embeddings")
            kv = [string(f"{a}.rope.scaling.type", "yarn"), f32(f"{a}.rope.scaling.factor", factor),
                  u32(f"{a}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])]
            optional = {"extrapolation_factor": "rope.scaling.yarn_ext_factor",
                        "attention_factor": "rope.scaling.yarn_attn_factor",
                        "beta_fast": "rope.scaling.yarn_beta_fast",
                        "beta_slow": "rope.scaling.yarn_beta_slow"}
            out = []
            for name, key in optional.items():
                value = rope.get(name, rope.get("attn_factor") if name == "attention_factor" else None)
                if value is not None:
                    out.append(f32(f"{a}.{key}", value))
            if not rope.get("truncate", True):  # YaRN's range unrounded (ours; llama.cpp rounds it)
                out.append(boolean(f"{a}.rope.scaling.yarn_truncate", False))
            return kv + out
        raise ConversionError(f"rope type {kind!r} is not supported for DFlash drafters (default, linear and yarn are)")

    # ---- tensors -------------------------------------------------------------------------

    def tensors(self) -> list[TensorSpec]:
        return self._specs

    def skipped(self) -> dict[str, int]:
        return dict(self._skipped)

    def _spec(self, name: str, source: str, shape: tuple[int, ...], ckpt: Checkpoint | None = None,
              **kw) -> TensorSpec:
        t = (ckpt or self.checkpoint).tensors.get(source)
        if t is None:
            raise ConversionError(f"checkpoint tensor {source!r} (for {name}) is missing")
        if t.shape != tuple(shape):
            raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies "
                                  f"{list(shape)}")
        return TensorSpec(name, source, tuple(shape), checkpoint=ckpt, **kw)

    def _build_specs(self) -> None:
        E, V, hd = self.n_embd, self.vocab_size, self.head_dim
        q_dim, kv_dim = self.n_head * hd, self.n_head_kv * hd
        # Canonical name (no `model.` prefix, codebooks with `.weight`) -> checkpoint name.
        names: dict[str, str] = {}
        self._skipped: dict[str, int] = {}
        for n in self.checkpoint.names():
            canon = n[len("model."):] if n.startswith("model.") else n
            if canon in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
                canon += ".weight"  # z-lab stores the codebooks without the suffix
            if canon.endswith(_IGNORED_SUFFIXES):
                self._skipped["rotary embedding buffers"] = self._skipped.get("rotary embedding buffers", 0) + 1
                continue
            names[canon] = n
        used: set[str] = set()

        def spec(gguf_name: str, canon: str, shape: tuple[int, ...], **kw) -> TensorSpec:
            if canon not in names:
                raise ConversionError(f"checkpoint tensor {canon!r} (for {gguf_name}) is missing")
            used.add(canon)
            return self._spec(gguf_name, names[canon], shape, **kw)

        n_feat = len(self.target_layer_ids)
        fc = names.get("fc.weight")
        if fc is not None and self.checkpoint.tensors[fc].shape[1:] != (n_feat * E,):
            raise ConversionError(
                f"fc.weight has shape {list(self.checkpoint.tensors[fc].shape)}: it fuses "
                f"{self.checkpoint.tensors[fc].shape[-1] // E} target layers, but target_layer_ids lists {n_feat}")
        specs = [
            spec("fc.weight", "fc.weight", (E, n_feat * E)),
            spec("enc.output_norm.weight", "hidden_norm.weight", (E,)),
            spec("output_norm.weight", "norm.weight", (E,)),
        ]

        neox = self.hp.get("rope_is_neox_style", True)
        q_rows = None if neox else interleaved_to_neox(q_dim, hd)
        k_rows = None if neox else interleaved_to_neox(kv_dim, hd)
        norm_cols = None if neox else interleaved_to_neox(hd, hd)
        shapes = {
            "attn_norm.weight": ((E,), {}),
            "attn_q.weight": ((q_dim, E), {"rows": q_rows}),
            "attn_k.weight": ((kv_dim, E), {"rows": k_rows}),
            "attn_v.weight": ((kv_dim, E), {}),
            "attn_output.weight": ((E, q_dim), {}),
            "attn_q_norm.weight": ((hd,), {"cols": norm_cols}),
            "attn_k_norm.weight": ((hd,), {"cols": norm_cols}),
            "ffn_norm.weight": ((E,), {}),
            "ffn_gate.weight": ((self.n_ff, E), {}),
            "ffn_up.weight": ((self.n_ff, E), {}),
            "ffn_down.weight": ((E, self.n_ff), {}),
        }
        layer_tensors = dict(_LAYER_TENSORS)
        if self.dflash2:
            kernel, group = int(self._value("conv_kernel_size")), int(self._value("conv_group_size"))
            rank, top_k = int(self._value("selector_rank")), int(self._value("selector_top_k"))
            if group <= 0 or E % group != 0:
                raise ConversionError(f"DFlash2: hidden size {E} is not a multiple of conv_group_size {group}")
            if kernel <= 0 or rank <= 0 or top_k <= 0:
                raise ConversionError("DFlash2: conv_kernel_size, selector_rank and selector_top_k must be positive")
            projected = 2 * kernel * (E // group)
            layer_tensors.update(_DFLASH2_LAYER_TENSORS)
            shapes.update({
                "attn_conv_base": ((2, kernel, E), {}), "attn_conv_proj.weight": ((projected, E), {}),
                "ffn_conv_base": ((2, kernel, E), {}), "ffn_conv_proj.weight": ((projected, E), {}),
            })
            specs += [
                spec("selector_predecessor.weight", "candidate_selector.predecessor_codebook.weight", (V, rank)),
                spec("selector_successor.weight", "candidate_selector.successor_codebook.weight", (V, rank)),
                spec("selector_hidden.weight", "candidate_selector.hidden_projection.weight", (rank, E)),
            ]
        for i in range(self.n_layer):
            for hf, gg in layer_tensors.items():
                shape, kw = shapes[gg]
                specs.append(spec(f"blk.{i}.{gg}", f"layers.{i}.{hf}", shape, **kw))

        # A drafter may carry its own embedding and head (llama.cpp maps them as usual).
        own_embd = "embed_tokens.weight" in names
        if own_embd:
            specs.append(spec("token_embd.weight", "embed_tokens.weight", (V, E)))
        if "lm_head.weight" in names:
            specs.append(spec("output.weight", "lm_head.weight", (V, E)))
        specs = self._mask_embedding_specs(specs, names) + specs

        unexpected = sorted(set(names) - used)
        if unexpected:
            shown = ", ".join(names[n] for n in unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            hint = " (DFlash2 tensors, but dflash_config has no conv_kernel_size)" \
                if any("_conv." in n or "candidate_selector" in n for n in unexpected) and not self.dflash2 else ""
            raise ConversionError(f"{len(unexpected)} checkpoint tensors have no dflash mapping{hint}: {shown}")
        # llama.cpp writes generated tensors first, then the checkpoint's in name order.
        generated = [s for s in specs if s.checkpoint is not None or s.patch]
        rest = sorted((s for s in specs if s not in generated), key=lambda s: s.source)
        self._specs = generated + rest

    def _mask_embedding_specs(self, specs: list[TensorSpec], names: dict[str, str]) -> list[TensorSpec]:
        """token_embd (mask row replaced) and output from the target, for a drafter with a
        mask_embedding.pt; replaces a drafter-owned token_embd spec in `specs` in place."""
        path = self.model_dir / MASK_EMBEDDING_FILE
        if not path.is_file():
            return []
        E, V, mask_id = self.n_embd, self.vocab_size, self.mask_token_id
        vector = self._read_mask_embedding(path)
        log.info("%s: replacing the embedding row of mask token %d", MASK_EMBEDDING_FILE, mask_id)

        target = Checkpoint(self.target_dir)
        tcfg = text_hparams(self.target_config)
        embd_names = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                      "language_model.model.embed_tokens.weight")
        target_embd = next((n for n in embd_names if n in target), None)
        out: list[TensorSpec] = []
        if "lm_head.weight" not in names:
            head = target_embd if tcfg.get("tie_word_embeddings", False) else "lm_head.weight"
            if head is None or head not in target:
                raise ConversionError(f"{MASK_EMBEDDING_FILE}: the target checkpoint has no output head "
                                      f"({head or 'embed_tokens'})")
            out.append(self._spec("output.weight", head, (V, E), ckpt=target))
        for k, s in enumerate(specs):
            if s.name == "token_embd.weight":  # the drafter's own table, patched
                row = _round_to(vector, self.checkpoint.tensors[s.source].dtype)
                specs[k] = TensorSpec(s.name, s.source, s.shape, patch={mask_id: row})
                return out
        if target_embd is None:
            raise ConversionError(f"{MASK_EMBEDDING_FILE}: the target checkpoint has no token embedding "
                                  f"({embd_names[0]})")
        row = _round_to(vector, target.tensors[target_embd].dtype)
        out.append(self._spec("token_embd.weight", target_embd, (V, E), ckpt=target, patch={mask_id: row}))
        return out

    def _read_mask_embedding(self, path: Path) -> np.ndarray:
        try:
            import torch
        except ImportError as e:
            raise ConversionError(f"{path} is a PyTorch file: install torch to convert this drafter") from e
        try:
            data = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:  # pickle and zip errors of every kind
            raise ConversionError(f"cannot read {path}: {e}") from e
        if not isinstance(data, dict) or "mask_token_id" not in data or "embedding" not in data:
            raise ConversionError(f"{path} must hold a dict with mask_token_id and embedding")
        if int(data["mask_token_id"]) != self.mask_token_id:
            raise ConversionError(f"{path} is for mask token {int(data['mask_token_id'])}, but dflash_config's "
                                  f"mask_token_id is {self.mask_token_id}")
        emb = data["embedding"]
        if tuple(emb.shape) != (self.n_embd,):
            raise ConversionError(f"{path}: embedding has shape {list(emb.shape)}, expected [{self.n_embd}]")
        return emb.detach().to(torch.float32).numpy().astype(np.float32)
