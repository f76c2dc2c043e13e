"""Where llama.cpp's own sources and C++ tools live on this machine.

The sources are those vendored in the llama-cpp-python sdist of the installed version
(the ggml this package runs on), which `scripts/setup.sh test` downloads from PyPI and
unpacks; `scripts/llama_cpp_build.py` builds llama.cpp's tools (llama-bench,
llama-completion, llama-speculative-simple, llama-server) from them. Both go under the machine-wide
cache (`DFLASH_CACHE`, default ~/.cache/dflash-gguf), next to the llama-cpp-python wheel
that setup builds, so every checkout and virtualenv on the machine shares them.
"""
from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path
from typing import Optional

from ..runtime.demo import cache_dir


def llama_cpp_python_version() -> str:
    """The installed llama-cpp-python's version (the project pins it)."""
    return metadata.version("llama_cpp_python")


def ggml_patches() -> list[Path]:
    """The project's patches over the sdist's ggml (batch-invariant CPU kernels), in the
    order they apply."""
    return sorted((Path(__file__).parent.parent / "data" / "ggml-patches").glob("*.patch"), key=lambda p: p.name)


def patch_key() -> str:
    """The patch set's hash, as scripts/llama_cpp_sources.sh computes it."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in ggml_patches())).hexdigest()[:12]


def sdist_dir() -> Path:
    """Where the sdist is unpacked, patched (scripts/llama_cpp_sources.sh): its
    vendor/llama.cpp holds llama.cpp's tree."""
    return cache_dir() / "src" / f"llama_cpp_python-{llama_cpp_python_version()}-{patch_key()}"


def source_dir() -> Optional[Path]:
    """llama.cpp's tree from the sdist, or None when setup has not fetched it."""
    src = sdist_dir() / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file() and (src / "gguf-py" / "gguf").is_dir():
        return src
    return None


def build_dir() -> Path:
    """The CMake build directory of llama.cpp's tools (over the same patched ggml as our
    runtime); binaries land in its bin/."""
    return cache_dir() / "llama-cpp-build" / f"{llama_cpp_python_version()}-{patch_key()}"


def tool(name: str, directory: Optional[Path] = None) -> Optional[Path]:
    """The binary of a llama.cpp tool: in `directory` when given, else in build_dir()'s
    bin/. None when it is not there (not built)."""
    exe = Path(directory or build_dir() / "bin") / name
    return exe if exe.is_file() and os.access(exe, os.X_OK) else None
