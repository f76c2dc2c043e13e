"""llama.cpp's own C++ tools, built once from the pinned llama-cpp-python sdist, for the
benchmarks (scripts/bench.py: llama-speculative-simple; scripts/bench_ar.py: llama-bench).

One CMake build directory, .cache/llama-cpp-build/<version>-<flags hash>/, holds every
target; each is built (nice 10, `jobs` parallel compiles) the first time it is asked for.
The flags follow scripts/setup.sh's build of the library (no AMX, native CPU), static
libraries so the binaries do not pick up another libllama.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_BUILD_ROOT = ROOT / ".cache" / "llama-cpp-build"
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # ggml's AMX kernels crash on small matrices here
# tools on (llama-bench lives in tools/), examples on (llama-speculative-simple); only the
# targets asked for are compiled
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
]


def log(msg: str) -> None:
    print(f"[llama.cpp build] {msg}", file=sys.stderr, flush=True)


def llama_build_dir() -> Path:
    key = hashlib.sha256(" ".join([LLAMA_CPP_PYTHON_VERSION, *LLAMA_CMAKE_FLAGS]).encode()).hexdigest()[:12]
    return LLAMA_BUILD_ROOT / f"{LLAMA_CPP_PYTHON_VERSION}-{key}"


def llama_binary(target: str) -> Path | None:
    """The cached binary of a llama.cpp target, or None when not built yet."""
    exe = llama_build_dir() / "bin" / target
    return exe if exe.is_file() and os.access(exe, os.X_OK) else None


def llama_cpp_source() -> Path | None:
    """llama.cpp as vendored in the llama-cpp-python sdist (tests/fixtures.py finds it in
    known places or downloads the sdist from PyPI with pip)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from fixtures import llama_cpp_source as find
    except ImportError as e:  # torch/transformers missing: look in the usual place only
        log(f"tests/fixtures.py unavailable ({e}); looking in /tmp/src only")
        cand = Path(f"/tmp/src/llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp")
        return cand if (cand / "CMakeLists.txt").is_file() else None
    finally:
        sys.path.remove(str(ROOT / "tests"))
    return find()


def build_llama(target: str, jobs: int = 2) -> tuple[Path | None, str]:
    """The binary of `target`, built into the shared build directory when missing.
    Returns (binary or None, note: "cached", "built" or why not)."""
    exe = llama_binary(target)
    if exe:
        return exe, "cached"
    build = llama_build_dir()
    build.mkdir(parents=True, exist_ok=True)
    with open(build / ".lock", "w") as lock:  # one build at a time in the directory
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(target, jobs, build)


def _build(target: str, jobs: int, build: Path) -> tuple[Path | None, str]:
    exe = llama_binary(target)
    if exe:  # built by another process while this one waited for the lock
        return exe, "cached"
    src = llama_cpp_source()
    if src is None:
        return None, f"llama.cpp sources (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist) not found or downloadable"
    logfile = build / f"build-{target}.log"
    log(f"building {target} from {src} into {build} (nice 10, -j{jobs}; ~10+ minutes on 2 cores for the first "
        f"target; log: {logfile})")
    t0 = time.perf_counter()
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    gen = ["-G", "Ninja"] if shutil.which("ninja") and not (build / "CMakeCache.txt").exists() else []
    cmds = []
    if not (build / "CMakeCache.txt").exists() or not any((build / f).exists() for f in ("build.ninja", "Makefile")):
        cmds.append([*nice, "cmake", "-S", str(src), "-B", str(build), *gen, *LLAMA_CMAKE_FLAGS])
    cmds.append([*nice, "cmake", "--build", str(build), "--target", target, "-j", str(jobs)])
    with open(logfile, "w") as fh:
        for cmd in cmds:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                tail = logfile.read_text(errors="replace").strip().splitlines()[-3:]
                return None, f"build failed (exit {rc}, see {logfile}): " + " | ".join(tail)
    exe = llama_binary(target)
    if exe is None:
        return None, f"build finished but {target} is missing (see {logfile})"
    log(f"built {exe} in {time.perf_counter() - t0:.0f} s")
    return exe, "built"


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="build llama.cpp targets for the benchmarks")
    p.add_argument("targets", nargs="*", default=["llama-bench", "llama-speculative-simple"])
    p.add_argument("-j", "--jobs", type=int, default=2)
    a = p.parse_args()
    ok = True
    for tgt in a.targets:
        exe, note = build_llama(tgt, a.jobs)
        print(exe or f"{tgt}: {note}")
        ok &= exe is not None
    sys.exit(0 if ok else 1)
