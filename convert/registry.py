"""Hugging Face `architectures` names -> converter classes."""
from __future__ import annotations

from .base import ModelConverter
from .errors import ConversionError
from .models.dflash import DFlashConverter
from .models.dflash_config import DSPARK_ARCHITECTURES
from .models.eagle3 import ARCHITECTURES as EAGLE3_ARCHITECTURES, Eagle3Converter
from .models.gemma3 import Gemma3Converter
from .models.gemma4 import Gemma4Converter
from .models.gptoss import GptOssConverter
from .models.qwen2 import Qwen2Converter
from .models.qwen3 import Qwen3Converter
from .models.qwen35 import Qwen35Converter
from .models.qwen35moe import Qwen35MoeConverter

CONVERTERS: dict[str, type[ModelConverter]] = {
    "Qwen3_5ForCausalLM": Qwen35Converter,
    "Qwen3_5ForConditionalGeneration": Qwen35Converter,
    "Qwen3_5MoeForCausalLM": Qwen35MoeConverter,
    "Qwen3_5MoeForConditionalGeneration": Qwen35MoeConverter,
    "Qwen3ForCausalLM": Qwen3Converter,
    "Qwen2ForCausalLM": Qwen2Converter,
    "Gemma3ForCausalLM": Gemma3Converter,
    "Gemma3ForConditionalGeneration": Gemma3Converter,
    "Gemma4ForCausalLM": Gemma4Converter,
    "Gemma4ForConditionalGeneration": Gemma4Converter,
    "GptOssForCausalLM": GptOssConverter,
    "DFlashDraftModel": DFlashConverter,
    "DFlash2DraftModel": DFlashConverter,
    **{name: DFlashConverter for name in DSPARK_ARCHITECTURES},
    **{name: Eagle3Converter for name in EAGLE3_ARCHITECTURES},
}


def converter_for(config: dict) -> type[ModelConverter]:
    names = config.get("architectures") or []
    for name in names:
        if name in CONVERTERS:
            return CONVERTERS[name]
    got = ", ".join(names) if names else "none listed in config.json"
    raise ConversionError(f"unsupported architecture ({got}); supported: {', '.join(sorted(CONVERTERS))}")
