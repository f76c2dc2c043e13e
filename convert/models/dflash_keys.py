"""The `dflash.*` metadata keys of a drafter GGUF: llama.cpp's, in its order, then ours
(`dflash.target.*`) naming the target the drafter was converted for."""
from __future__ import annotations

from gguf import GGUFValueType

from ..base import KV, array, boolean, f32, string, u32
from ..errors import ConversionError
from .dflash_config import DFLASH2_KEYS, DrafterConfig
from .dflash_target import DrafterTarget

ARCH = "dflash"
DEFAULT_BLOCK_SIZE = 16  # z-lab's default when the config has none

# transformers' Qwen3Config defaults. llama.cpp's converter reads the config through
# transformers, so a config.json that omits these gets them in its output.
QWEN3_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def dflash_metadata(cfg: DrafterConfig, target: DrafterTarget, has_confidence: bool,
                    tokenizer_sha256: str | None) -> list[KV]:
    """Every key once; a later value for a key replaces the earlier one in its first place,
    as in llama.cpp."""
    rope = _rope(cfg.hp)
    kv: dict[str, KV] = {}
    for item in (*_decoder_keys(cfg, rope), *_drafter_keys(cfg, target, has_confidence),
                 *_target_keys(target, tokenizer_sha256)):
        kv[item.key] = item
    return list(kv.values())


def _rope(hp: dict) -> dict:
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if key not in rope and key in hp:
            rope[key] = hp[key]
    rope.setdefault("rope_theta", QWEN3_DEFAULTS["rope_theta"])
    return rope


def _decoder_keys(cfg: DrafterConfig, rope: dict) -> list[KV]:
    """The transformer's shape, rope and norms."""
    hp, a = cfg.hp, ARCH
    kv = [
        u32(f"{a}.block_count", cfg.n_layer),
        u32(f"{a}.context_length", hp.get("max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"])),
        u32(f"{a}.embedding_length", cfg.n_embd),
        u32(f"{a}.feed_forward_length", cfg.n_ff),
        u32(f"{a}.attention.head_count", cfg.n_head),
        u32(f"{a}.attention.head_count_kv", cfg.n_head_kv),
    ]
    if hp.get("is_causal") is False:
        kv.append(boolean(f"{a}.attention.causal", False))
    kv += _rope_scaling(rope)
    if "mrope_section" in rope:
        sections = (list(rope["mrope_section"]) + [0] * 4)[:4]
        kv.append(array(f"{a}.rope.dimension_sections", sections, GGUFValueType.INT32))
    kv.append(f32(f"{a}.rope.freq_base", rope["rope_theta"]))
    kv.append(f32(f"{a}.attention.layer_norm_rms_epsilon", hp.get("rms_norm_eps", QWEN3_DEFAULTS["rms_norm_eps"])))
    for name in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"):
        if hp.get(name) is not None:
            kv.append(f32(f"{a}.attention.layer_norm_epsilon", hp[name]))
            break
    kv += [u32(f"{a}.attention.key_length", cfg.head_dim), u32(f"{a}.attention.value_length", cfg.head_dim)]
    if rope.get("partial_rotary_factor") is not None:
        kv.append(u32(f"{a}.rope.dimension_count", int(cfg.head_dim * rope["partial_rotary_factor"])))
    return kv


def _drafter_keys(cfg: DrafterConfig, target: DrafterTarget, has_confidence: bool) -> list[KV]:
    """Block drafting, DFlash2 and DSpark settings, output scaling, the context trained on,
    target layers, attention window and causality."""
    hp, dcfg, a = cfg.hp, cfg.dcfg, ARCH
    kv = []
    if dcfg.get("attention_value_scale") is not None:
        kv.append(f32(f"{a}.attention.value_scale", dcfg["attention_value_scale"]))
    kv.append(u32(f"{a}.block_size", cfg.value("block_size", DEFAULT_BLOCK_SIZE)))
    if cfg.dflash2:
        kv += [u32(f"{a}.{key}", int(cfg.value(key))) for key in DFLASH2_KEYS]
    if cfg.value("output_multiplier") is not None:
        kv.append(f32(f"{a}.logit_scale", cfg.value("output_multiplier")))
    softcap = cfg.value("final_logit_softcapping")
    if softcap is not None and float(softcap) > 0:
        kv.append(f32(f"{a}.final_logit_softcapping", softcap))
    if cfg.value("input_embedding_scale") is not None:
        kv.append(f32(f"{a}.embedding_scale", cfg.value("input_embedding_scale")))
    train_window = cfg.value("train_context_length")  # dflash-train's own key: its -c
    if train_window is not None:
        kv.append(u32(f"{a}.train_context_length", int(train_window)))
    # llama.cpp's convention: +1 (the input of layer id+1 = the output of HF layer id).
    kv.append(array(f"{a}.target_layers", [i + 1 for i in target.layer_ids], GGUFValueType.INT32))

    use_swa = bool(dcfg.get("use_swa", False))
    window = dcfg.get("swa_window_size") or hp.get("sliding_window")
    if (hp.get("use_sliding_window", False) or use_swa) and window:
        pattern = [True] * cfg.n_layer if use_swa else [t == "sliding_attention" for t in hp.get("layer_types") or []]
        kv += [u32(f"{a}.attention.sliding_window", window),
               array(f"{a}.attention.sliding_window_pattern", pattern, GGUFValueType.BOOL)]
    causal = hp.get("is_causal")
    if causal is None:
        causal = dcfg.get("causal")
    if causal is not None:
        kv.append(boolean(f"{a}.attention.causal", bool(causal)))
    if target.uses_mrope:  # the drafter ropes on the temporal section only
        kv.append(array(f"{a}.rope.dimension_sections", [cfg.head_dim // 2, 0, 0, 0], GGUFValueType.INT32))
    if cfg.dspark:
        kv += [boolean(f"{a}.sample_from_anchor", bool(hp.get("sample_from_anchor", True))),
               boolean(f"{a}.has_confidence_head", has_confidence)]
    return kv


def _target_keys(target: DrafterTarget, tokenizer_sha256: str | None) -> list[KV]:
    """Ours, not llama.cpp's (which ignores them): the target this drafter is converted
    for, checked when the pair is loaded (csrc/dfl_pair.c). None without the tokenizer's
    fingerprint."""
    if tokenizer_sha256 is None:
        return []
    a = ARCH
    return [string(f"{a}.target.name", target.dir.resolve().name),
            string(f"{a}.target.tokenizer_sha256", tokenizer_sha256),
            u32(f"{a}.target.embedding_length", target.embedding_length),
            u32(f"{a}.target.vocab_size", target.vocab_size),
            u32(f"{a}.target.block_count", target.block_count)]


def _rope_scaling(rope: dict) -> list[KV]:
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
        for name, key in optional.items():
            value = rope.get(name, rope.get("attn_factor") if name == "attention_factor" else None)
            if value is not None:
                kv.append(f32(f"{a}.{key}", value))
        if not rope.get("truncate", True):  # YaRN's range unrounded (ours; llama.cpp rounds it)
            kv.append(boolean(f"{a}.rope.scaling.yarn_truncate", False))
        return kv
    raise ConversionError(f"rope type {kind!r} is not supported for DFlash drafters (default, linear and yarn are)")
