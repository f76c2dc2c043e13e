"""The demo pair `dflash-run` runs with no -m: a small Qwen3.5-architecture target and
its DFlash drafter, trained by training/train_demo.py and shipped in dflash_gguf/data."""
from __future__ import annotations

import os
from pathlib import Path

DEMO_PROMPT = "def read_lines(path):\n    "
DATA = Path(__file__).resolve().parent.parent / "data"


def demo_paths():
    """(target, drafter) of the bundled demo pair."""
    target, draft = DATA / "demo-target.gguf", DATA / "demo-draft.gguf"
    if not (target.exists() and draft.exists()):
        raise FileNotFoundError(f"the demo pair is missing from {DATA}; regenerate it with training/train_demo.py "
                                "or give a model with -m")
    return str(target), str(draft)


def cache_dir() -> Path:
    """Where measured machine facts (the verify cost curve) are kept."""
    root = os.environ.get("DFLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash-gguf")
    return Path(root)
