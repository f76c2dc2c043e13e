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
