"""dflash-gguf: GGUF-native speculative decoding with DFlash drafters on ggml."""
from __future__ import annotations

__version__ = "0.1.0"
