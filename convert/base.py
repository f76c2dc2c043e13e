"""What every architecture converter provides to the command line."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFValueType

from .hf import Checkpoint
from .tensors import TensorSpec


@dataclass(frozen=True)
class KV:
    """One GGUF metadata entry with its exact on-disk type."""

    key: str
    value: Any
    type: GGUFValueType
    sub_type: GGUFValueType | None = None


def u32(key: str, value: int) -> KV:
    return KV(key, int(value), GGUFValueType.UINT32)


def f32(key: str, value: float) -> KV:
    return KV(key, float(value), GGUFValueType.FLOAT32)


def string(key: str, value: str) -> KV:
    return KV(key, str(value), GGUFValueType.STRING)


def boolean(key: str, value: bool) -> KV:
    return KV(key, bool(value), GGUFValueType.BOOL)


def array(key: str, values: list, sub_type: GGUFValueType) -> KV:
    return KV(key, list(values), GGUFValueType.ARRAY, sub_type)


# HF YaRN field -> llama.cpp key suffix (llama.cpp's converter writes these when present)
_YARN_OPTIONAL = {"extrapolation_factor": "yarn_ext_factor", "attention_factor": "yarn_attn_factor",
                  "attn_factor": "yarn_attn_factor", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}


def rope_scaling_kv(arch: str, rope: dict, truncate_default: bool = True) -> list[KV]:
    """llama.cpp's `<arch>.rope.scaling.*` keys for an HF rope_parameters / rope_scaling
    object; default RoPE writes none, a type we do not run is refused by name. YaRN's
    `truncate` (transformers' default: true, ggml's rounding of the correction range) is
    written as `yarn_truncate` (ours) when it is not what the runtime assumes for the
    architecture (`truncate_default`)."""
    from .errors import ConversionError
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if kind in (None, "default"):
        return []
    if kind in ("linear", "yarn") and (not isinstance(factor, (int, float)) or isinstance(factor, bool)):
        raise ConversionError(f"config.json: {kind} rope scaling needs a numeric factor (got {factor!r})")
    if kind == "linear":
        return [string(f"{arch}.rope.scaling.type", "linear"), f32(f"{arch}.rope.scaling.factor", factor)]
    if kind == "yarn":
        orig = rope.get("original_max_position_embeddings")
        if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
            raise ConversionError("config.json: yarn rope scaling needs original_max_position_embeddings "
                                  f"(a positive integer, got {orig!r})")
        kv = [string(f"{arch}.rope.scaling.type", "yarn"), f32(f"{arch}.rope.scaling.factor", factor),
              u32(f"{arch}.rope.scaling.original_context_length", orig)]
        written = set()
        for name, key in _YARN_OPTIONAL.items():
            if rope.get(name) is not None and key not in written:
                kv.append(f32(f"{arch}.rope.scaling.{key}", rope[name]))
                written.add(key)
        if bool(rope.get("truncate", True)) != truncate_default:
            kv.append(boolean(f"{arch}.rope.scaling.yarn_truncate", bool(rope.get("truncate", True))))
        return kv
    raise ConversionError(f"rope type {kind!r} is not supported for {arch} (default, linear and yarn are)")


def decoder_kv(arch: str, hp: dict, n_layer: int, n_ctx: int | None, ffn: list[KV] | None = None,
               head_count_kv: bool = True) -> list[KV]:
    """The keys llama.cpp's converter writes first for a decoder, in its order: block_count,
    context_length (None: not written), embedding_length, the FFN's (`ffn`, or
    feed_forward_length from intermediate_size), attention.head_count and head_count_kv
    (head_count_kv False: the caller writes it, e.g. one per layer)."""
    kv = [u32(f"{arch}.block_count", n_layer)]
    if n_ctx is not None:
        kv.append(u32(f"{arch}.context_length", n_ctx))
    kv += [
        u32(f"{arch}.embedding_length", hp["hidden_size"]),
        *(ffn if ffn is not None else [u32(f"{arch}.feed_forward_length", hp["intermediate_size"])]),
        u32(f"{arch}.attention.head_count", hp["num_attention_heads"]),
    ]
    if head_count_kv:
        kv.append(u32(f"{arch}.attention.head_count_kv", hp["num_key_value_heads"]))
    return kv


def head_size_kv(arch: str, head_dim: int, suffix: str = "") -> list[KV]:
    """attention.key_length and value_length (+ suffix, e.g. "_swa"): one head size for both."""
    return [u32(f"{arch}.attention.key_length{suffix}", head_dim),
            u32(f"{arch}.attention.value_length{suffix}", head_dim)]


class ModelConverter(ABC):
    """Maps one Hugging Face architecture to one GGUF architecture.

    Subclasses validate the config in __init__ (raising ConversionError), and describe
    the output: metadata keys for the architecture, tensor recipes, and what was left
    out of the checkpoint on purpose.
    """

    gguf_arch: str
    # Drafters take their tokenizer (and shape checks) from the target checkpoint.
    needs_target: bool = False
    # Keeps a multi-token-prediction head unless constructed with no_mtp=True (--no-mtp).
    has_mtp: bool = False
    # quantization_config.quant_method values whose checkpoints it reads (none: float only).
    quantizations: tuple[str, ...] = ()

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, *, target_dir: Path | None = None):
        self.model_dir = model_dir
        self.config = config
        self.checkpoint = checkpoint
        self.target_dir = target_dir

    def vocab_source(self) -> tuple[Path, dict]:
        """(directory holding tokenizer.json, config.json contents for special token ids)."""
        return self.model_dir, self.config

    def adjust_vocab(self, vocab) -> None:
        """Architecture-specific changes to the tokenizer metadata (e.g. a drafter's mask token)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Rows of the token embedding."""

    @abstractmethod
    def metadata(self) -> list[KV]:
        """Architecture keys (`{arch}.*`); general.* and tokenizer.* are added by the caller."""

    @abstractmethod
    def tensors(self) -> list[TensorSpec]:
        """Every output tensor with the recipe that produces it."""

    def skipped(self) -> dict[str, int]:
        """Checkpoint tensors deliberately not converted: description -> count."""
        return {}
