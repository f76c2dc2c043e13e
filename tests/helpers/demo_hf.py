"""The demo pair's HF checkpoints (tests/data/demo-hf/{target,draft}: the bf16 weights the
transformers and z-lab oracles read, and the device tests convert) are kept in git
xz-compressed, a third smaller, which keeps the checkout small enough for a lent GPU
machine's call. `unpack()` writes each model.safetensors beside its .xz (git ignores it),
again whenever git brought a newer .xz; tests/conftest.py calls it before any test, and
scripts/setup.sh test for the training scripts that read the checkpoints.

    python tests/helpers/demo_hf.py      # the same, by hand
"""
from __future__ import annotations

import lzma
import os
from pathlib import Path

# no import of helpers.paths: scripts/setup.sh runs this file on its own
DEMO_HF = Path(__file__).resolve().parents[1] / "data" / "demo-hf"  # tests/data/demo-hf


def unpack() -> list[Path]:
    """The checkpoints' weights unpacked where they were missing or older than their .xz."""
    done = []
    for packed in sorted(DEMO_HF.glob("*/model.safetensors.xz")):
        out = packed.with_suffix("")
        if out.exists() and out.stat().st_mtime >= packed.stat().st_mtime:
            continue
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.write_bytes(lzma.decompress(packed.read_bytes()))
        tmp.replace(out)  # whole or not at all, if two runs unpack at once
        done.append(out)
    return done


if __name__ == "__main__":
    for path in unpack():
        print(f"unpacked {path}")
