#!/usr/bin/env python3
"""Applies the project's ggml patches (dflash_gguf/data/ggml-patches/*.patch, in name order)
to an unpacked llama-cpp-python sdist, with `patch -p1 --fuzz=0`.

    python3 scripts/cuda/apply_patches.py SRC_DIR [PATCH ...]

The sources scripts/cuda/pack.py carries to a GPU machine are pruned: the ggml backends a
CUDA build never compiles (Vulkan, Metal, ...) are left out. A patch's sections for files
the sources lack are skipped (and named), so that a patch for another backend does not stop
the CUDA build; every other section must apply exactly.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "dflash_gguf" / "data" / "ggml-patches"


def sections(text: str) -> list[tuple[str, str]]:
    """(path, section) for each file of a git-style patch."""
    parts = re.split(r"(?m)^(?=diff --git )", text)
    out = []
    for part in parts:
        m = re.match(r"diff --git a/(\S+) b/(\S+)", part)
        if m:
            out.append((m.group(2), part))
        elif part.strip():
            out.append(("", part))  # a preamble (a commit message): kept as is
    return out


def applicable(src: Path, path: str, section: str) -> bool:
    """Whether a section has its file in src: the file it changes, or for a new file the
    directory it goes in. A file missing there was pruned (pack.py's PRUNE)."""
    if not path or (src / path).exists():
        return True
    if re.search(r"(?m)^--- /dev/null$", section):
        return (src / path).parent.is_dir()
    return False


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(argv[0])
    patches = [Path(p) for p in argv[1:]] or sorted(PATCHES.glob("*.patch"))
    for p in patches:
        kept, skipped = [], []
        for path, section in sections(p.read_text()):
            (kept if applicable(src, path, section) else skipped).append((path, section))
        for path, _ in skipped:
            print(f"[patches] {p.name}: {path} is not in the pruned sources, skipped", file=sys.stderr)
        body = "".join(section for _, section in kept)
        if not body.strip():
            continue
        r = subprocess.run(["patch", "-s", "-p1", "--fuzz=0", "-d", str(src)], input=body, text=True)
        if r.returncode != 0:
            print(f"[patches] {p.name} does not apply to {src}", file=sys.stderr)
            return 1
    if not argv[1:]:
        # the whole set: the key its backends name (0006), as scripts/llama_cpp_sources.sh writes it
        key = hashlib.sha256(b"".join(p.read_bytes() for p in patches)).hexdigest()[:12]
        (src / "vendor/llama.cpp/ggml/src/dflash-patch-key.h").write_text(f'#define DFLASH_GGML_PATCH_KEY "{key}"\n')
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
