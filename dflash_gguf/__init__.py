"""dflash-gguf: GGUF-native speculative decoding with DFlash drafters on ggml.

    from dflash_gguf import Engine, SamplingParams
    with Engine("target.gguf", "draft.gguf", tree_budget="auto") as engine:
        print(engine.generate("def quicksort(xs):", max_tokens=128).text)
"""
from __future__ import annotations

import os

# numpy's OpenBLAS threads spin after a call and take a core from ggml's own threads;
# nothing here needs a threaded BLAS. (No effect when numpy was imported before us.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from .runtime.native import DflashError  # noqa: E402
from .runtime.devices import add_rpc_server, list_devices  # noqa: E402
from .runtime.drafter import Draft, DraftConfig, read_draft_metadata  # noqa: E402
from .engine.engine import Engine, Result  # noqa: E402
from .decoding.requests import GenerationStats  # noqa: E402
from .decoding.sampling import SamplingParams  # noqa: E402
from .runtime.target import RopeScaling, Target, TargetConfig  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DflashError", "Draft", "DraftConfig", "Engine", "GenerationStats", "Result", "RopeScaling", "SamplingParams",
    "Target", "TargetConfig", "add_rpc_server", "list_devices", "read_draft_metadata", "__version__",
]
