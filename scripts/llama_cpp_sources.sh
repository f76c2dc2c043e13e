#!/usr/bin/env bash
# llama-cpp-python's sdist (llama.cpp's tree, and the ggml that its wheel and our runtime
# build on) unpacked with the project's ggml patches applied; prints the directory:
#   ${DFLASH_CACHE:-~/.cache/dflash-gguf}/src/llama_cpp_python-VERSION-PATCHKEY
# The patches (dflash_gguf/data/ggml-patches/) make ggml's CPU kernels batch-invariant: a row
# of a many-row pass rounds exactly as a one-row pass (docs/exactness.md). PATCHKEY hashes
# them, so a changed patch set unpacks (and setup.sh builds) anew; dflash_gguf.tools.llama_cpp_tree
# computes the same key. scripts/setup.sh builds the llama-cpp-python wheel from this tree,
# scripts/llama_cpp_build.py llama.cpp's tools.
#   scripts/llama_cpp_sources.sh VERSION PYTHON
set -euo pipefail
version=$1
python=$2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
patches=$(find "$root/dflash_gguf/data/ggml-patches" -name '*.patch' | LC_ALL=C sort)
key=$(cat $patches | sha256sum | cut -c1-12)
src="${DFLASH_CACHE:-$HOME/.cache/dflash-gguf}/src"
dest="$src/llama_cpp_python-$version-$key"
if [ ! -f "$dest/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    mkdir -p "$src"
    tmp=$(mktemp -d "$src/.fetch-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    echo "[llama.cpp] fetching the llama-cpp-python $version sdist, patching its ggml into $dest" >&2
    # only this package from source (":all:" would build its build dependencies too)
    "$python" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
        --dest "$tmp" "llama-cpp-python==$version"
    tar xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp"
    # every hunk exactly where it was written (no fuzz): a patch that no longer fits the
    # sources fails here instead of landing beside the code it was meant for
    for p in $patches; do
        if ! patch -s -p1 --fuzz=0 --no-backup-if-mismatch -d "$tmp/llama_cpp_python-$version" < "$p"; then
            echo "[llama.cpp] $(basename "$p") does not apply to llama-cpp-python $version's sources" >&2
            exit 1
        fi
    done
    # the key the patched backends name (0006's dflash-batch-invariance.h): the runtime holds
    # it against the key its own library was built for (CMakeLists.txt)
    printf '#define DFLASH_GGML_PATCH_KEY "%s"\n' "$key" \
        > "$tmp/llama_cpp_python-$version/vendor/llama.cpp/ggml/src/dflash-patch-key.h"
    rm -rf "$dest"
    mv "$tmp/llama_cpp_python-$version" "$dest"  # whole or not at all
fi
echo "$dest"
