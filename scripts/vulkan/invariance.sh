#!/usr/bin/env bash
# Batch invariance of ggml's Vulkan backend, proven on whatever Vulkan0 is (Mesa's lavapipe
# on a machine without a GPU): builds ggml alone (CMake, Vulkan only) from the patched
# llama-cpp-python sdist tree (ggml-patches/0003 applied), compiles invariance_probe.c against it and asks the device,
# for every weight type, whether column j of a k-column product (k = 2..515) equals the
# column alone, and for flash attention whether a query row of an n-row call equals the
# row alone. Run with GGML_VK_BATCH_VARIANT=1 for ggml's stock kernel choices (the
# patch keeps them behind that switch) to see what the patch changes.
#   scripts/vulkan/invariance.sh [BUILD_DIR] [MAX_COLUMNS] [TYPES...]  > out.json
# (MAX_COLUMNS 129 by default; every count to 40, then about each power of two; PROBE_EVERY=1
# for all; PROBE_ROWS=N outputs, 16 by default; PROBE_NO_FA=1 skips flash attention)
# Needs what scripts/setup-vulkan.sh installs (glslc, libvulkan-dev, mesa-vulkan-drivers,
# the trixie Vulkan headers in ~/.cache/dflash-gguf/vulkan-headers). Shaders take about
# 15 minutes to compile on 2 cores, once per build directory.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build/vulkan-ggml}"
shift || true
cache="${DFLASH_CACHE:-$HOME/.cache/dflash-gguf}"
python="${PYTHON:-python3}"
src=$(bash "$root/scripts/llama_cpp_sources.sh" 0.3.36 "$python")
ggml="$src/vendor/llama.cpp/ggml"
headers=$(ls -d "$cache"/vulkan-headers/*/usr/include | sort -V | tail -n 1)
# the sdist leaves out ggml.pc.in, which ggml's own CMakeLists configures: build from a copy
work="$build/ggml-src"
if [ ! -d "$work" ]; then
  mkdir -p "$build"
  cp -a "$ggml" "$work"
  touch "$work/ggml.pc.in"
fi
if [ ! -f "$build/src/ggml-vulkan/libggml-vulkan.so" ]; then
  nice -n 10 cmake -S "$work" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DGGML_CPU=OFF \
    -DVulkan_INCLUDE_DIR="$headers" -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DGGML_BUILD_TESTS=OFF \
    -DGGML_BUILD_EXAMPLES=OFF >&2
  nice -n 10 cmake --build "$build" -j2 >&2
fi
cc -O2 "$root/scripts/vulkan/invariance_probe.c" -I"$work/include" -L"$build/src" \
  -Wl,-rpath,"$build/src:$build/src/ggml-vulkan" -lggml -lggml-base -lm -o "$build/invariance_probe"
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}"
[ $# -gt 0 ] || set -- 129
exec "$build/invariance_probe" Vulkan0 "$@"
