#!/usr/bin/env python3
"""The cost of the project's ggml patches counted, not timed: instructions that llama-bench's
decodes take (valgrind's callgrind, inside llama_decode), llama.cpp over stock ggml against
the same tool over the patched ggml, on one GGUF, one thread.

On a machine of two shared cores the timed A/B (experiments/ggml_patch_ab.py) spreads by
+-10% from run to run, wider than the bounds asked of the patches (plain decoding within 2%
of stock, a verify's 2-16 rows within 5%). An instruction count is the same on every run.
It weighs arithmetic, not memory traffic; the patches change the order in which a kernel
sums (and 0007 which attention kernel a pass of up to 256 rows takes), not what a product
reads, so at equal traffic the count is the cost.

valgrind 3.19 runs no AVX-512, so both llama-bench are built here for AVX2 (FMA, F16C),
the x86 path the patches change for AVX2 and AVX-512 builds alike:

    .venv/bin/python experiments/ggml_patch_count.py -m MODEL.gguf --work /tmp/count \\
        --out results/ggml-patch-count-<model>-<date>.json

Tests: tgN (N one-row decodes from an empty cache; instructions per token), ppK (one pass of
K rows into an empty cache: a verify's rows).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_gguf.tools import llama_cpp_tree
from dflash_gguf.bench.provenance import machine, results_doc, versions, write_results

TESTS = ("tg16", "pp2", "pp4", "pp8", "pp16")
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
AVX2 = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]


def log(msg: str) -> None:
    print(f"[count] {msg}", file=sys.stderr, flush=True)


def stock_sources(work: Path) -> Path:
    """llama.cpp's tree from the same llama-cpp-python sdist, without the patches."""
    version = llama_cpp_tree.llama_cpp_python_version()
    dest = work / f"llama_cpp_python-{version}"
    if not (dest / "vendor/llama.cpp/CMakeLists.txt").is_file():
        log(f"fetching the llama-cpp-python {version} sdist (stock)")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                        "--dest", str(work), f"llama-cpp-python=={version}"], check=True)
        shutil.unpack_archive(str(work / f"llama_cpp_python-{version}.tar.gz"), str(work))
    return dest / "vendor/llama.cpp"


def build(src: Path, out: Path) -> Path:
    """llama-bench for AVX2, static, as scripts/llama_cpp_build.py builds it otherwise."""
    bench = out / "bin" / "llama-bench"
    if not bench.is_file():
        log(f"building llama-bench (AVX2) from {src} into {out}")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *generator, "-DCMAKE_BUILD_TYPE=Release", *AVX2,
                        f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(out), "-j", "2", "--target", "llama-bench"], check=True,
                       stdout=subprocess.DEVNULL)
    return bench


def parse(test: str) -> tuple:
    """('pp' or 'tg', rows or tokens)."""
    m = re.fullmatch(r"(pp|tg)(\d+)", test)
    if not m:
        raise SystemExit(f"unknown test {test!r} (tgN or ppK)")
    return m.group(1), int(m.group(2))


def count(bench: Path, model: str, test: str) -> int:
    """Instructions inside the test's decodes (llama_context::decode, which llama_decode
    enters; load and warm-up left out): per token for tg, per pass for pp."""
    kind, n = parse(test)
    args = ["-p", str(n), "-n", "0"] if kind == "pp" else ["-p", "0", "-n", str(n)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        res = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                              "--toggle-collect=llama_context::decode*", str(bench), "-m", model, "-t", "1", "-r", "1",
                              "--no-warmup", *args], capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"{bench} {test} under callgrind failed:\n{res.stderr[-2000:]}")
        total = int(re.search(r"^summary:\s+(\d+)", out.read_text(), re.M).group(1))
    return total // (n if kind == "tg" else 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--work", type=Path, required=True, help="where the stock sources and both builds go")
    p.add_argument("--stock-src", type=Path, help="llama.cpp's stock tree (default: the sdist, fetched into --work)")
    p.add_argument("--patched-src", type=Path, help="the patched tree (default: scripts/llama_cpp_sources.sh's)")
    p.add_argument("--tests", default=",".join(TESTS), help=f"comma-separated (default {','.join(TESTS)})")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    tests = args.tests.split(",")
    for t in tests:
        parse(t)
    args.work.mkdir(parents=True, exist_ok=True)
    patched_src = args.patched_src or llama_cpp_tree.source_dir()
    if patched_src is None:
        p.error("no patched llama.cpp tree: run scripts/llama_cpp_build.py --sources, or pass --patched-src")
    benches = {"stock": build(args.stock_src or stock_sources(args.work), args.work / "stock"),
               "patched": build(patched_src, args.work / "patched")}
    table = []
    for test in tests:
        row = {"test": test, **{side: count(bench, args.model, test) for side, bench in benches.items()}}
        row["ratio"] = round(row["patched"] / row["stock"], 4)
        table.append(row)
        log(f"{test:>9}: stock {row['stock']:,}  patched {row['patched']:,}  ratio {row['ratio']:.4f}")
    doc = results_doc("ggml_patch_count", sys.argv, machine=machine(1, "CPU"), versions=versions(),
                      model=args.model, unit="instructions inside llama_decode (per token for tg, per pass for pp)",
                      builds={side: str(b) for side, b in benches.items()},
                      patches=[q.name for q in llama_cpp_tree.ggml_patches()], patch_key=llama_cpp_tree.patch_key(),
                      table=table)
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
