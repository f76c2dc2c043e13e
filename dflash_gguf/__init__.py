"""dflash-gguf: GGUF-native speculative decoding with DFlash drafters on ggml.

    from dflash_gguf import Engine, SamplingParams
    with Engine("target.gguf", "draft.gguf", tree_budget="auto") as engine:
        print(engine.generate("def quicksort(xs):", max_tokens=128).text)
"""
from __future__ import annotations

from ._native import DflashError
from .devices import add_rpc_server, list_devices
from .draft import Draft, DraftConfig, read_draft_metadata
from .engine import Engine, Result
from .generate import GenerationStats
from .sampling import SamplingParams
from .target import Target, TargetConfig

__version__ = "0.1.0"

__all__ = [
    "DflashError", "Draft", "DraftConfig", "Engine", "GenerationStats", "Result", "SamplingParams", "Target",
    "TargetConfig", "add_rpc_server", "list_devices", "read_draft_metadata", "__version__",
]
