#!/usr/bin/env bash
# Compiles the CUDA translation units our ggml patches touch, for sm_90, with nvcc and the
# include paths and defines ggml's own CMake gives them: a check that a patch builds, on a
# machine without a GPU (and without cuBLAS's libraries), in minutes instead of the 45 that
# all of ggml-cuda takes on 2 cores.
#
#   bash scripts/cuda/compile-check.sh [-j N] [--src DIR] [TU ...]
#
# TU: files under ggml/src/ggml-cuda/ (default: the .cu files the patches touch, plus the
# .cu files that include a touched .cuh). --src: an unpacked llama-cpp-python sdist root
# with the patches applied (default: .cuda-build/compile-check/src, unpacked from
# .cuda-pack/llama-cpp-python-src.tar.gz or the sdist in .cache/ and patched here).
#
# CMake configures llama.cpp (vendor/llama.cpp: ggml's own CMakeLists needs files the sdist
# leaves out; tests, tools and examples off) with the build's CUDA flags
# (scripts/cuda/build.sh: -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real
# -DGGML_CUDA_GRAPHS=ON ...), and ninja builds only the object files named. cuBLAS: only
# its headers are needed to compile; they come from the toolkit, from an nvidia-cublas
# wheel installed in Python, or from the wheel file $CUBLAS_WHEEL (headers unpacked
# alone); the library paths CMake asks for point at an empty stand-in, never linked.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="${DFLASH_CUDA_BUILD:-$root/.cuda-build}/compile-check"
jobs=2
src=""
tus=()
instances=()
while [ $# -gt 0 ]; do
  case "$1" in
    -j) jobs="$2"; shift ;;
    -j*) jobs="${1#-j}" ;;
    --src) src="$2"; shift ;;
    -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) tus+=("$1") ;;
  esac
  shift
done
say() { echo "[compile-check $(date +%H:%M:%S)] $*" >&2; }
command -v nvcc >/dev/null || export PATH="/usr/local/cuda-13.0/bin:$PATH"
command -v nvcc >/dev/null || { echo "compile-check.sh: no nvcc" >&2; exit 1; }
mkdir -p "$work"
patches=$(find "$root/dflash_gguf/data/ggml-patches" -name '*.patch' | LC_ALL=C sort)

if [ -z "$src" ]; then
  key=$(cat $patches | sha256sum | cut -c1-12)
  src="$work/src-$key"
  if [ ! -d "$src/vendor/llama.cpp/ggml" ]; then
    tarball=""
    for t in "$root/.cuda-pack/llama-cpp-python-src.tar.gz" "$root"/.cache/sdist*/llama_cpp_python-*.tar.gz; do
      [ -f "$t" ] && { tarball="$t"; break; }
    done
    [ -n "$tarball" ] || { echo "compile-check.sh: no sdist (run scripts/cuda/pack.py, or give --src)" >&2; exit 1; }
    say "unpacking $tarball and applying $(echo "$patches" | wc -l) patch(es)"
    rm -rf "$work/unpack"; mkdir -p "$work/unpack"
    tar -xzf "$tarball" -C "$work/unpack"
    d=$(ls -d "$work"/unpack/llama_cpp_python-* | head -n 1)
    python3 "$root/scripts/cuda/apply_patches.py" "$d"  # patch -p1 --fuzz=0, each in name order
    rm -rf "$src"; mv "$d" "$src"; rm -rf "$work/unpack"
  fi
fi
ggml="$src/vendor/llama.cpp/ggml"
[ -d "$ggml/src/ggml-cuda" ] || { echo "compile-check.sh: no ggml-cuda in $src" >&2; exit 1; }

if [ ${#tus[@]} -eq 0 ]; then
  # what the patches touch in ggml-cuda: the .cu files themselves, the .cu files that include
  # a touched header directly, and of the generated template instances (49 flash-attention
  # vector instances include fattn-vec.cuh) one per header, f16-f16 where there is one
  mapfile -t touched < <(cat $patches | sed -n 's|^+++ [^/]*/vendor/llama.cpp/ggml/src/ggml-cuda/\([^[:space:]]*\).*|\1|p' | sort -u)
  cuda="$ggml/src/ggml-cuda"
  for f in "${touched[@]}"; do
    case "$f" in
      *.cu) tus+=("$f") ;;
      *.cuh)
        inc="#include \"\(\.\./\)\?$(basename "$f")\""
        while read -r u; do tus+=("${u#"$cuda/"}"); done < <(grep -l "$inc" "$cuda"/*.cu || true)
        # resolved after configuring: the first of these that this build compiles
        cands=$( { grep -l "$inc" "$cuda"/template-instances/*-f16-f16.cu; grep -l "$inc" "$cuda"/template-instances/*.cu; } 2>/dev/null || true)
        [ -z "$cands" ] || instances+=("$(echo "$cands" | sed "s|^$cuda/||" | paste -sd' ')") ;;
    esac
  done
  mapfile -t tus < <(printf '%s\n' "${tus[@]}" | sort -u)
fi
[ ${#tus[@]} -gt 0 ] || [ ${#instances[@]} -gt 0 ] || { echo "compile-check.sh: the patches touch no CUDA file" >&2; exit 0; }

# cuBLAS headers (the compile needs cublas_v2.h; nothing here links)
nvcc_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
extra_inc=""
if ! find "$nvcc_root"/ -name cublas_v2.h 2>/dev/null | grep -q .; then
  hdr=$( (find $(python3 -c "import site; print(' '.join(site.getsitepackages()))") -path '*nvidia*' -name cublas_v2.h 2>/dev/null || true) | head -n 1)
  if [ -z "$hdr" ]; then
    wheel="${CUBLAS_WHEEL:-$(ls /opt/pypi*/files/nvidia_cublas-13*.whl 2>/dev/null | head -n 1)}"
    [ -f "$wheel" ] || { echo "compile-check.sh: no cuBLAS headers; set CUBLAS_WHEEL to an nvidia-cublas wheel" >&2; exit 1; }
    mkdir -p "$work/cublas"
    python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if '/include/' in n]" "$wheel" "$work/cublas"
    hdr=$(find "$work/cublas" -name cublas_v2.h | head -n 1)
  fi
  mkdir -p "$work/cublas-include"
  ln -sf "$(dirname "$hdr")"/cublas*.h "$work/cublas-include/"
  extra_inc="-I$work/cublas-include"
  touch "$work/libcublas-standin.so"
fi

bdir="$work/build"
flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real
       -DGGML_CUDA_GRAPHS=ON -DGGML_NATIVE=OFF -DGGML_RPC=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
       -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
       -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -Wno-dev)
if [ -n "$extra_inc" ]; then
  flags+=("-DCMAKE_CUDA_FLAGS=$extra_inc" "-DCUDA_cublas_LIBRARY=$work/libcublas-standin.so"
          "-DCUDA_cublasLt_LIBRARY=$work/libcublas-standin.so")
fi
if [ ! -f "$bdir/build.ninja" ] || [ "$(cat "$bdir/.src" 2>/dev/null)" != "$src" ]; then
  rm -rf "$bdir"
  say "configuring llama.cpp's ggml (CUDA, sm_90) in $bdir"
  t0=$SECONDS
  cmake -S "$src/vendor/llama.cpp" -B "$bdir" "${flags[@]}" > "$work/configure.log" 2>&1 || { tail -n 30 "$work/configure.log"; exit 1; }
  echo "$src" > "$bdir/.src"
  say "configured in $((SECONDS - t0)) s"
fi
obj="ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir"
all_targets=$(ninja -C "$bdir" -t targets all 2>/dev/null | cut -d: -f1)
for c in "${instances[@]}"; do
  for u in $c; do
    if grep -qxF "$obj/$u.o" <<< "$all_targets"; then tus+=("$u"); break; fi
  done
done
mapfile -t tus < <(printf '%s\n' "${tus[@]}" | sort -u)
targets=()
for u in "${tus[@]}"; do targets+=("ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/$u.o"); done
say "compiling ${tus[*]} (-j$jobs)"
t0=$SECONDS
nice -n 10 ninja -C "$bdir" -j "$jobs" "${targets[@]}" 2>&1 | tee "$work/compile.log"
rc=${PIPESTATUS[0]}
warnings=$(grep -c -i 'warning' "$work/compile.log" || true)
say "compiled ${#tus[@]} translation unit(s) in $((SECONDS - t0)) s, exit $rc, $warnings warning line(s) (log: $work/compile.log)"
exit "$rc"
