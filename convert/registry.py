"""Hugging Face `architectures` names -> converter classes."""
from __future__ import annotations

from .base import ModelConverter
from .dflash import DFlashConverter
from .errors import ConversionError
from .qwen35 import Qwen35Converter

CONVERTERS: dict[str, type[ModelConverter]] = {
    "Qwen3_5ForCausalLM": Qwen35Converter,
    "Qwen3_5ForConditionalGeneration": Qwen35Converter,
    "DFlashDraftModel": DFlashConverter,
    "DFlash2DraftModel": DFlashConverter,
}


def converter_for(config: dict) -> type[ModelConverter]:
    names = config.get("architectures") or []
    for name in names:
        if name in CONVERTERS:
            return CONVERTERS[name]
    got = ", ".join(names) if names else "none listed in config.json"
    raise ConversionError(f"unsupported architecture ({got}); supported: {', '.join(sorted(CONVERTERS))}")
