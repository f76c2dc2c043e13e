#!/usr/bin/env bash
# The ARM patch (dflash_gguf/data/ggml-patches/0002-arm-*) leaves x86 as it was: every file
# it touches that an x86 build compiles preprocesses, for x86 (AVX2 and AVX-512 flags), to
# the same tokens with and without it (file paths and __LINE__ numbers aside), and the x86
# CPU backend still configures and builds (host compiler, no AMX).
#
#   scripts/arm/x86_unchanged.sh [--no-build]
# Env: ARM_WORK (default build/arm), SDIST (else pip downloads it), JOBS (default 2).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version=0.3.36
work="${ARM_WORK:-$root/build/arm}/x86"
jobs="${JOBS:-2}"
mkdir -p "$work"
sdist="${SDIST:-}"
if [ -z "$sdist" ]; then
    sdist="$work/llama_cpp_python-$version.tar.gz"
    [ -f "$sdist" ] || python3 -m pip download -q --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python --dest "$work" "llama-cpp-python==$version"
fi
patches=$(find "$root/dflash_gguf/data/ggml-patches" -name '*.patch' | LC_ALL=C sort)
for t in before after; do
    rm -rf "$work/$t" && mkdir -p "$work/$t"
    tar xzf "$sdist" -C "$work/$t" --strip-components=1
    for p in $patches; do
        if [ "$t" = before ] && [[ "$(basename "$p")" == 0002-arm-* ]]; then continue; fi
        patch -s -p1 --fuzz=0 -d "$work/$t" < "$p"
    done
    touch "$work/$t/vendor/llama.cpp/ggml/ggml.pc.in"  # left out of the sdist; a standalone configure needs it
done
arm_patch=$(ls "$root"/dflash_gguf/data/ggml-patches/0002-arm-*.patch)
files=$(grep '^+++ b/' "$arm_patch" | sed 's#^+++ b/##' | grep -v '/arch/arm/')
status=0
for flags in "-march=x86-64-v3" "-march=x86-64-v4 -mavx512vnni -mavx512bf16"; do
    for f in $files; do
        for t in before after; do
            g="$work/$t/vendor/llama.cpp/ggml"
            cc=g++; [[ "$f" == *.c ]] && cc=gcc
            # shellcheck disable=SC2086
            nice -n 10 $cc -E -P $flags -D_GNU_SOURCE -DGGML_USE_LLAMAFILE -DGGML_USE_CPU_REPACK \
                -I "$g/include" -I "$g/src" -I "$g/src/ggml-cpu" "$work/$t/$f" |
                sed -E "s#$work/$t/##g; s/(\\.(c|cpp|h)\", )[0-9]+/\\1N/g" | grep -v '^[[:space:]]*$' > "$work/$t.i"
        done
        if cmp -s "$work/before.i" "$work/after.i"; then
            echo "[x86] same tokens ($flags): $f"
        else
            echo "[x86] DIFFERENT ($flags): $f"; status=1
        fi
    done
done
if [ "${1:-}" != --no-build ]; then
    b="$work/build"
    cmake -S "$work/after/vendor/llama.cpp/ggml" -B "$b" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DGGML_LLAMAFILE=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
        -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
        -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" > "$b.configure.log" 2>&1
    nice -n 10 cmake --build "$b" -j "$jobs" --target ggml-cpu > "$b.build.log" 2>&1 && echo "[x86] ggml-cpu builds for this host"
fi
exit $status
