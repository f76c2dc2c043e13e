#!/usr/bin/env python3
"""llama.cpp's own sources and C++ tools, from the sdist of the installed llama-cpp-python
(the same patched ggml our runtime runs on), where dflash_gguf.tools.llama_cpp_tree finds them:

    .venv/bin/python scripts/llama_cpp_build.py            # build llama-bench, llama-completion and
                                                            # llama-speculative-simple for dflash-bench,
                                                            # llama-server for dflash-bench concurrency
    .venv/bin/python scripts/llama_cpp_build.py --sources  # only fetch and unpack the sdist (what
                                                            # `scripts/setup.sh test` runs for the test oracles)
    .venv/bin/python scripts/llama_cpp_build.py dflash-draft-eval  # our drafter printer (dflash_gguf.tools.parity_draft)

The sdist comes from PyPI through pip. The tools are built once into one CMake build
directory (nice 10, `--jobs` parallel compiles; the first takes about ten minutes on two
cores) with scripts/setup.sh's choices for the library: native CPU, no AMX (ggml's AMX
kernels crash on small matrices on some CPUs), static libraries so that the binaries do not
load another libllama. llama-server is built without its web UI (no npm, no download of
prebuilt assets): the benchmark speaks to its HTTP API only.

`dflash-draft-eval` is not llama.cpp's: a small program of ours over llama.cpp's common
library (scripts/llama-cpp-tools/), which prints a drafter's named tensors as
llama-eval-callback prints a target's. It is compiled as llama-speculative-simple is (its
compile command, read from the build directory) and linked with the same libraries, after it.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_gguf.tools import llama_cpp_tree

TOOLS = ("llama-bench", "llama-completion", "llama-speculative-simple", "llama-server")
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
]


def log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def fetch_sources() -> Path:
    """llama.cpp's tree from the sdist, downloaded, unpacked and patched when missing
    (scripts/llama_cpp_sources.sh, which setup.sh runs too)."""
    src = llama_cpp_tree.source_dir()
    if src is not None:
        return src
    script = Path(__file__).with_name("llama_cpp_sources.sh")
    subprocess.run(["bash", str(script), llama_cpp_tree.llama_cpp_python_version(), sys.executable], check=True,
                   stdout=subprocess.DEVNULL)
    src = llama_cpp_tree.source_dir()
    if src is None:
        raise SystemExit(f"{llama_cpp_tree.sdist_dir()} holds no llama.cpp tree after {script.name}")
    return src


# programs of ours built over llama.cpp's libraries, each as the llama.cpp tool named here is
OURS = {"dflash-draft-eval": "llama-speculative-simple"}
OUR_SOURCES = Path(__file__).resolve().parent / "llama-cpp-tools"


def build_ours(name: str, build_dir: Path) -> None:
    """One of OURS: compiled with its model tool's compile command (compile_commands.json,
    which CMake writes for any generator) and linked with the build's static libraries in
    one group (their order then does not matter), OpenMP as ggml's CPU backend uses it."""
    model = OURS[name]
    stem = model.removeprefix("llama-")
    commands = json.loads((build_dir / "compile_commands.json").read_text())
    command = shlex.split(next(c["command"] for c in commands if c["file"].endswith(f"/{stem}/{stem}.cpp")))
    flags = [a for a in command[1:] if not a.endswith((".o", ".cpp")) and a not in ("-o", "-c")]
    libs = [build_dir / lib for lib in ("common/libllama-common.a", "common/libllama-common-base.a", "src/libllama.a",
                                        "vendor/cpp-httplib/libcpp-httplib.a")]
    libs += sorted((build_dir / "ggml" / "src").rglob("libggml*.a"))
    missing = [str(lib) for lib in libs if not lib.is_file()]
    if missing:
        raise SystemExit(f"building {name}: {', '.join(missing)} not built")
    cmd = [command[0], *flags, str(OUR_SOURCES / f"{name}.cpp"), "-o", str(build_dir / "bin" / name),
           "-Wl,--start-group", *map(str, libs), "-Wl,--end-group", "-fopenmp", "-lpthread", "-ldl", "-lm"]
    if subprocess.run(cmd, cwd=build_dir, stdout=subprocess.DEVNULL).returncode != 0:
        raise SystemExit(f"compiling {name} failed: {shlex.join(cmd)}")


def build(targets, jobs: int) -> None:
    build_dir = llama_cpp_tree.build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:  # one build at a time in the directory
        fcntl.flock(lock, fcntl.LOCK_EX)
        ours = [t for t in targets if t in OURS and llama_cpp_tree.tool(t) is None]
        # llama.cpp's targets, with the tools ours are built as (their objects and libraries)
        todo = [t for t in dict.fromkeys([*targets, *(OURS[t] for t in ours)])
                if t not in OURS and llama_cpp_tree.tool(t) is None]
        if not todo and not ours:
            return
        src = fetch_sources()
        logfile = build_dir / "build.log"
        log(f"building {', '.join(todo + ours)} from {src} into {build_dir} (nice 10, -j{jobs}; log: {logfile})")
        t0 = time.perf_counter()
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        generator = ["-G", "Ninja"] if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists() else []
        steps = [[*nice, "cmake", "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_FLAGS],
                 [*nice, "cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *todo]]
        with open(logfile, "w") as fh:
            for cmd in steps if todo else []:
                fh.write("$ " + " ".join(cmd) + "\n")
                fh.flush()
                if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode != 0:
                    tail = logfile.read_text(errors="replace").strip().splitlines()[-3:]
                    raise SystemExit(f"the build failed (see {logfile}): " + " | ".join(tail))
        for name in ours:
            build_ours(name, build_dir)
        log(f"built in {time.perf_counter() - t0:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="*", default=list(TOOLS), help=f"targets to build (default: {' '.join(TOOLS)})")
    p.add_argument("--sources", action="store_true", help="only fetch and unpack the sources")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compiles (default 2)")
    args = p.parse_args(argv)
    if args.sources:
        print(fetch_sources())
        return 0
    build(args.targets, args.jobs)
    missing = [t for t in args.targets if llama_cpp_tree.tool(t) is None]
    for t in args.targets:
        print(llama_cpp_tree.tool(t) or f"{t}: not built")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
