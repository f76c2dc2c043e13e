#!/usr/bin/env python3
"""Packs into .cuda-pack/ (git-ignored) what the lent GPU machine needs and cannot
download: it has no network, and it receives only the working tree plus the paths a
`run` call names in `carry`, 64 MiB in all.

    .venv/bin/python scripts/cuda/pack.py                      # sdist from .cache/sdist (or PyPI)
    .venv/bin/python scripts/cuda/pack.py --sdist /path/to/llama_cpp_python-X.tar.gz
    .venv/bin/python scripts/cuda/pack.py --check                  # only the sizes (after adding built/)

What goes in:
  llama-cpp-python-src.tar.gz   the pinned llama-cpp-python sdist (77 MB) without what a
                                CUDA build never reads: llama.cpp's models/ (test
                                vocabularies), docs/, media/, the web UI, the converter, the
                                CI files, and ggml's other backends' sources
  wheels/                       cp312 manylinux x86-64 wheels of the runtime dependencies
                                the GPU machine's Python lacks (see WHEELS), at the versions
                                installed in the virtualenv running this script, so that the
                                GPU run uses what the tests here used
  built/                        left as it is: a build saved by `build.sh save` and copied
                                back here (scripts/cuda/README.md), counted in the total
Prints each part's size and the total that would travel with the tracked tree (tracked and
untracked-not-ignored files); exits 1 when that is over the 64 MiB a call may carry.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / ".cuda-pack"
LIMIT = 64 << 20
MIB = 1 << 20

# Runtime needs that are not in the GPU machine's image (its package list:
# /work/.library/device/KINDS.md). numpy, tokenizers, safetensors, tqdm, jinja2, pyyaml,
# requests, typing-extensions, anyio, click, h11, pytest, scikit-build-core, cmake and
# ninja are there. llama-cpp-python itself is built there from the sources.
WHEELS = ("cffi", "pycparser", "gguf", "diskcache", "starlette", "uvicorn")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# Paths (relative to the sdist's top directory) a build with -DGGML_CUDA=ON, RPC, the
# tools and the examples never reads. Every other file is kept: CMake configures all
# tools and examples when they are on, so their sources must be there.
_LLAMA = "vendor/llama.cpp/"
PRUNE = [
    ".git", ".github", "docker", "docs", "examples", "tests", "mkdocs.yml",  # llama-cpp-python's own
    *(_LLAMA + p for p in (
        ".git", ".github", ".devops", "models", "docs", "media", "benches", "tests", "gguf-py", "conversion",
        "convert_hf_to_gguf.py", "convert_hf_to_gguf_update.py", "convert_llama_ggml_to_gguf.py",
        "convert_lora_to_gguf.py", "requirements", "requirements.txt", "ci", "skills", "app",
        "tools/ui", "tools/server", "tools/mtmd/test-3.mp4", "tools/mtmd/tests")),  # the last two: media tests
    # ggml backends other than the CPU, CUDA and RPC ones (each added only when its option is on)
    *(_LLAMA + "ggml/src/ggml-" + b for b in (
        "cann", "et", "hexagon", "hip", "metal", "musa", "opencl", "openvino", "sycl", "virtgpu", "vulkan",
        "webgpu", "zdnn", "zendnn")),
]


def pinned_version() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(r"llama-cpp-python==([\w.]+)", dep.replace(" ", ""))
        if m:
            return m.group(1)
    raise SystemExit("error: pyproject.toml pins no llama-cpp-python version")


def find_sdist(version: str, given: Path | None) -> Path:
    if given:
        if not given.is_file():
            raise SystemExit(f"error: {given} does not exist")
        return given
    # where tests/helpers/fixtures.py keeps it
    sdist = ROOT / ".cache" / "sdist" / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        sdist.parent.mkdir(parents=True, exist_ok=True)
        print(f"[pack] downloading the llama-cpp-python {version} sdist", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                        "--dest", str(sdist.parent), f"llama-cpp-python=={version}"], check=True)
    return sdist


def pruned(name: str, top: str) -> bool:
    rel = name[len(top) + 1:] if name.startswith(top + "/") else ""
    return any(rel == p or rel.startswith(p + "/") for p in PRUNE)


def pack_sources(sdist: Path, out: Path) -> tuple[int, int]:
    """The sdist without PRUNE, as one .tar.gz whose top directory is the sdist's.
    Returns (files kept, files dropped)."""
    kept = dropped = 0
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz", compresslevel=9) as dst:
        top = src.getnames()[0].split("/")[0]
        for member in src:
            if pruned(member.name, top):
                dropped += 1
                continue
            data = src.extractfile(member) if member.isfile() else None
            dst.addfile(member, io.BytesIO(data.read()) if data else None)
            kept += 1
    return kept, dropped


def download_wheels(dest: Path, python_version: str) -> list[str]:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    plat = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--only-binary=:all:", "--implementation", "cp", "--python-version", python_version, *plat,
                    "-d", str(dest), *pins], check=True)
    return pins


def travelling_bytes() -> int:
    """Tracked and untracked-not-ignored files of the checkout: what every call sends."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def report(out: Path) -> int:
    """Prints what travels; 1 when it is over the limit."""
    tree, pack, built = travelling_bytes(), tree_bytes(out), tree_bytes(out / "built")
    if built:
        print(f"saved build (built/): {built / MIB:.1f} MiB")
    print(f"working tree {tree / MIB:.1f} MiB + pack {pack / MIB:.1f} MiB = {(tree + pack) / MIB:.1f} MiB "
          f"of {LIMIT / MIB:.0f} MiB a call carries")
    if tree + pack > LIMIT:
        print(f"error: {(tree + pack) / MIB:.1f} MiB is over the {LIMIT / MIB:.0f} MiB limit: drop built/ (the GPU "
              "machine then builds again) or untracked files", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", type=Path, help="the llama-cpp-python sdist (default: .cache/sdist/, else PyPI)")
    p.add_argument("--out", type=Path, default=PACK, help="pack directory (default: .cuda-pack/)")
    p.add_argument("--python-version", default="3.12", help="wheels for this Python (the GPU machine's: 3.12)")
    p.add_argument("--check", action="store_true", help="only print the sizes and check the limit")
    a = p.parse_args(argv)
    if a.check:
        return report(a.out)
    version = pinned_version()
    sdist = find_sdist(version, a.sdist)
    a.out.mkdir(parents=True, exist_ok=True)
    src = a.out / "llama-cpp-python-src.tar.gz"
    kept, dropped = pack_sources(sdist, src)
    wheels = a.out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    pins = download_wheels(wheels, a.python_version)
    (a.out / "pack.txt").write_text(f"llama-cpp-python {version} from {sdist.name}\nwheels (Python "
                                    f"{a.python_version}): {' '.join(pins)}\n")

    print(f"sdist {sdist.name}: {sdist.stat().st_size / MIB:.1f} MiB; pruned sources {src.stat().st_size / MIB:.1f} "
          f"MiB ({kept} entries kept, {dropped} dropped)")
    print(f"wheels ({a.python_version}): {tree_bytes(wheels) / MIB:.2f} MiB: {', '.join(pins)}")
    return report(a.out)


if __name__ == "__main__":
    sys.exit(main())
