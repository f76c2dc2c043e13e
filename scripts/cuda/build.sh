#!/usr/bin/env bash
# Builds everything the GPU runs need from .cuda-pack/ (scripts/cuda/pack.py), with no
# network: ONE build of ggml, which llama-cpp-python (Python), our libdflash and llama.cpp's
# llama-bench / llama-completion / llama-speculative-simple all load.
#
#   bash scripts/cuda/build.sh [--cpu] [-j N] [STEP ...]      (default steps: env llama tools project)
#
# Steps, each skipped when its result is already there (a warm machine keeps the ignored
# .cuda-build/; a cold one can restore `save`'s archive from .cuda-pack/built/):
#   env      .cuda-build/<mode>/venv: a virtualenv over $PYTHON's packages (the image's
#            numpy, scikit-build-core, cmake, ninja, pytest, ...) plus the packed wheels
#   llama    llama-cpp-python from the packed sources (pip, scikit-build-core; its CMake build
#            directory is .cuda-build/<mode>/llama-build), -DGGML_CUDA=ON with the H100/H200's
#            machine code only (sm_90, "90-real": no PTX for other GPUs, which would double
#            the archive `save` makes) and -DGGML_RPC=ON; or restored from
#            .cuda-pack/built/llama-<mode>.tar.*
#   tools    the three llama.cpp tools, compiled in that same CMake build directory (tools and
#            examples switched on there; ggml is not compiled again), copied to
#            .cuda-build/<mode>/tools/ with their own libraries; they run against the ggml and
#            libllama in the venv's llama_cpp/lib (scripts/cuda/bench.py sets LD_LIBRARY_PATH)
#   project  dflash-gguf against that ggml (find_package(ggml) in the venv), installed in the venv
#   save     the built llama-cpp-python and tools as llama-<mode>.tar.{zst,xz}.NN parts of
#            at most 15 MiB in $OUT (the run tool's return folder; else .cuda-build/<mode>/save):
#            copied to .cuda-pack/built/ here, a later cold machine restores them in seconds
#   flags    only print the CMake flags (with the cuBLAS and driver libraries found)
# The flags and each step's time go to .cuda-build/<mode>/build-info.txt (bench.py's header).
# --cpu builds the same with -DGGML_CUDA=OFF (mode "cpu"): the proof of the steps on a
# machine without CUDA. $PYTHON (default python3) is the interpreter whose packages the venv
# sees. Each step prints its wall time.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
pack="${DFLASH_CUDA_PACK:-$root/.cuda-pack}"
mode=cuda
jobs=$(nproc)
steps=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) mode=cpu ;;
    -j) jobs="$2"; shift ;;
    -j*) jobs="${1#-j}" ;;
    env|llama|tools|project|save|flags) steps+=("$1") ;;
    -h|--help) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#steps[@]} -gt 0 ] || steps=(env llama tools project)

build="${DFLASH_CUDA_BUILD:-$root/.cuda-build}/$mode"
venv="$build/venv"
vpy="$venv/bin/python"
tools="$build/tools"
TOOLS="llama-bench llama-completion llama-speculative-simple"
say() { echo "[cuda-build $(date +%H:%M:%S)] $*" >&2; }

# ggml and llama.cpp flags. AMX off as in scripts/setup.sh (ggml's AMX kernels crash on
# small matrices on some CPUs); CUDA graphs on as llama.cpp's own build has them.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
flags=(-DGGML_RPC=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
       -DLLAMA_OPENSSL=OFF "-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
# What ggml-cuda links besides the runtime: cuBLAS and the driver library. A CUDA toolkit
# put together from NVIDIA's pip wheels (this workplace's images: nvcc, the runtime and
# CCCL, no cuBLAS) leaves CMake to find cuBLAS in the Python packages (PyTorch's
# nvidia-cublas: site-packages/nvidia/cu13) and the driver's libcuda.so.1 where the driver
# is mounted. The cuBLAS headers come in through a folder of links to them alone, so that
# the other NVIDIA headers beside them cannot shadow the toolkit's own; the libraries'
# folders end up in the RPATH (llama-cpp-python installs with its link path).
cuda_flags() {
  local root sp lib hdr drv
  root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  if ! find "$root"/ -name 'libcublas.so*' 2>/dev/null | grep -q .; then
    sp=$("${PYTHON:-python3}" -c "import site; print(' '.join(site.getsitepackages()))")
    # shellcheck disable=SC2086
    lib=$( (find $sp -path '*nvidia*' -name 'libcublas.so*' 2>/dev/null || true) | sort | head -n 1)
    # shellcheck disable=SC2086
    hdr=$( (find $sp -path '*nvidia*' -name cublas_v2.h 2>/dev/null || true) | head -n 1)
    if [ -n "$lib" ] && [ -n "$hdr" ]; then
      mkdir -p "$build/cublas-include"
      ln -sf "$(dirname "$hdr")"/cublas*.h "$build/cublas-include/"
      echo "-DCUDA_cublas_LIBRARY=$lib"
      echo "-DCUDA_cublasLt_LIBRARY=$(dirname "$lib")/$(basename "$lib" | sed 's/libcublas/libcublasLt/')"
      echo "-DCMAKE_CUDA_FLAGS=-I$build/cublas-include"
    fi
  fi
  if ! find "$root"/ -name 'libcuda.so' 2>/dev/null | grep -q .; then
    drv=$( (ldconfig -p 2>/dev/null || true) | awk '/libcuda\.so(\.1)? /{print $NF; exit}')
    [ -n "$drv" ] || drv=$( (find /usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/lib64 -name 'libcuda.so*' 2>/dev/null \
                             || true) | head -n 1)
    # without the driver library at link time, ggml's memory pool goes without virtual memory
    if [ -n "$drv" ]; then echo "-DCUDA_cuda_driver_LIBRARY=$drv"; else echo "-DGGML_CUDA_NO_VMM=ON"; fi
  fi
}

if [ "$mode" = cuda ]; then
  command -v nvcc >/dev/null || { echo "build.sh: no nvcc on PATH" >&2; exit 1; }
  mkdir -p "$build"
  mapfile -t found < <(cuda_flags)
  # ggml-cpu for an x86-64 baseline every GPU host has (AVX2, FMA, F16C), not -march=native:
  # a build made on one machine runs on another whose CPU may lack this one's AVX-512
  flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_GRAPHS=ON -DGGML_NATIVE=OFF
          -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "${found[@]}")
else
  flags+=(-DGGML_CUDA=OFF)
fi

site() { "$vpy" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
src_dir() { ls -d "$build"/src/llama_cpp_python-* 2>/dev/null | head -n 1; }
timed() {  # timed LABEL CMD...: runs CMD, prints its wall time
  local label="$1" t0=$SECONDS; shift
  "$@"
  say "$label: $((SECONDS - t0)) s"
}
built() {  # built LABEL CMD...: a build command, timed, its time noted in build-info.txt
  local label="$1" t0=$SECONDS; shift
  "$@"
  say "$label: $((SECONDS - t0)) s"
  echo "$label: $((SECONDS - t0)) s on $(nproc) cores" >> "$build/build-info.txt"
}

step_env() {
  local want; want=$(ls "$pack"/wheels/*.whl | xargs -n1 basename | sha256sum | cut -c1-16)
  if [ "$(cat "$venv/.dflash-env" 2>/dev/null)" = "$want" ]; then return; fi
  local base="${PYTHON:-python3}"
  say "virtualenv $venv over $("$base" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  rm -rf "$venv"
  "$base" -m venv --without-pip "$venv"
  # the base interpreter's packages (which may sit in a virtualenv of its own, so
  # --system-site-packages would not reach them) after the venv's own
  "$base" -c "import site; print('\n'.join(site.getsitepackages()))" > "$(site)/_dflash_base.pth"
  "$vpy" -m pip install -q --disable-pip-version-check --no-index --no-deps "$pack"/wheels/*.whl
  echo "$want" > "$venv/.dflash-env"
}

# The key of a build: what it is built from and with, not where this machine keeps its
# libraries. cuda_flags' paths (cuBLAS, the driver library, the header links) and the pool
# choice they imply differ between this machine and the GPU machine, yet a build made here
# (no driver: GGML_CUDA_NO_VMM) runs there, so a saved build restores on either.
portable_flags() { printf '%s\n' "${flags[@]}" | grep -v -e '^-DCUDA_.*_LIBRARY=' -e '^-DCMAKE_CUDA_FLAGS=-I' \
                     -e '^-DGGML_CUDA_NO_VMM=' || true; }
llama_key() { { portable_flags; basename "$pack"/llama-cpp-python-src.tar.gz
                stat -c %s "$pack"/llama-cpp-python-src.tar.gz
                find "$root/dflash_gguf/data/ggml-patches" -name '*.patch' | LC_ALL=C sort | xargs cat; } \
              | sha256sum | cut -c1-16; }

restore() {  # restore NAME: unpack a saved build from .cuda-pack/built/
  local parts=("$pack"/built/"$1".tar.*)
  [ -e "${parts[0]}" ] || return 1
  # Python's own decompressors: the GPU image has no zstd command (seen on the H100,
  # 2026-11-25: the archive was not unpacked and the call compiled for 316 s instead)
  local dec=(cat)
  case "${parts[0]}" in
    *.zst.*) dec=(zstd -dc) ;;
    *.xz.*) dec=("${PYTHON:-python3}" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)') ;;
    *.gz.*) dec=(gzip -dc) ;;
  esac
  say "restoring $1 from ${#parts[@]} part(s) in $pack/built"
  mkdir -p "$build/restore"
  if ! cat "${parts[@]}" | "${dec[@]}" | tar -x -C "$build/restore"; then
    say "could not unpack $1 (${dec[0]}): building instead"
    return 1
  fi
}

step_llama() {
  local key; key=$(llama_key)
  if [ "$(cat "$venv/.dflash-llama" 2>/dev/null)" = "$key" ]; then return; fi
  local sp; sp=$(site)
  if restore "llama-$mode" && { [ "$(cat "$build/restore/key" 2>/dev/null)" = "$key" ] ||
                                 { say "the saved build's key $(cat "$build/restore/key" 2>/dev/null) is not this build's $key"; false; }; }; then
    cp -a "$build/restore/site/." "$sp/"
    rm -rf "$tools"; cp -a "$build/restore/tools" "$tools"
    cp "$build/restore/build-info.txt" "$build/"
    rm -rf "$build/restore"
    echo "$key" > "$venv/.dflash-llama"
    return
  fi
  rm -rf "$build/restore"
  # the sources unpacked and patched again when the patches changed (a warm machine keeps
  # .cuda-build/ between calls)
  local patch_key; patch_key=$(find "$root/dflash_gguf/data/ggml-patches" -name '*.patch' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)
  if [ -z "$(src_dir)" ] || [ "$(cat "$build/src/.patches" 2>/dev/null)" != "$patch_key" ]; then
    rm -rf "$build/src"
    mkdir -p "$build/src"
    tar -xzf "$pack/llama-cpp-python-src.tar.gz" -C "$build/src"
    # the project's ggml patches (batch-invariant CPU kernels, 0001; CUDA's verify kernels, 0004),
    # in name order as scripts/setup.sh applies them; sections for backends the pack prunes
    # (Vulkan, ...) are skipped
    "${PYTHON:-python3}" "$root/scripts/cuda/apply_patches.py" "$(src_dir)"
    echo "$patch_key" > "$build/src/.patches"
  fi
  say "building llama-cpp-python ($mode, -j$jobs): ${flags[*]}"
  mkdir -p "$build"
  { echo "llama-cpp-python $(basename "$(src_dir)"), flags: ${flags[*]}"
    if [ "$mode" = cuda ]; then nvcc --version | tail -n 2 | head -n 1; fi; } > "$build/build-info.txt"
  # -v: CMake's and ninja's progress in the log, to tell how far a build cut off at the
  # call's time limit had come
  CMAKE_ARGS="${flags[*]@Q} -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
    built "llama-cpp-python build" "$vpy" -m pip install -v --disable-pip-version-check --no-index --no-deps \
    --no-build-isolation --config-settings=build-dir="$build/llama-build" "$(src_dir)"
  rm -rf "$tools"  # built against an older library
  echo "$key" > "$venv/.dflash-llama"
}

step_tools() {
  local t missing=0
  for t in $TOOLS; do [ -x "$tools/$t" ] || missing=1; done
  [ "$missing" = 1 ] || return 0
  [ -f "$build/llama-build/CMakeCache.txt" ] || { echo "build.sh: no llama build directory; run the llama step" >&2; exit 1; }
  local cmake_bin; cmake_bin=$(sed -n 's/^CMAKE_COMMAND:INTERNAL=//p' "$build/llama-build/CMakeCache.txt")
  say "building $TOOLS in the same build directory (-j$jobs)"
  built "tools configure" "$cmake_bin" -S "$(src_dir)" -B "$build/llama-build" "${flags[@]}" \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -Wno-dev >/dev/null
  # shellcheck disable=SC2086
  built "tools build" "$cmake_bin" --build "$build/llama-build" --target $TOOLS -j "$jobs"
  # the tools and their own shared libraries (llama.cpp's common code, each tool's
  # implementation); ggml and libllama are the venv's, whose copies here are left out
  mkdir -p "$tools"
  local bin="$build/llama-build/bin"
  for t in $TOOLS; do cp "$bin/$t" "$tools/"; done
  find "$bin" -maxdepth 1 -name 'lib*.so*' ! -name 'libggml*' ! -name 'libllama.so*' -exec cp -P {} "$tools/" \;
}

step_project() {
  local want; want=$( (cd "$root" && find pyproject.toml CMakeLists.txt csrc dflash_gguf convert -type f \
    -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum; cat "$venv/.dflash-llama") | sha256sum | cut -c1-16)
  if [ "$(cat "$venv/.dflash-project" 2>/dev/null)" = "$want" ]; then return; fi
  say "building dflash-gguf against the venv's ggml"
  # find_package(ggml) of a CUDA build asks FindCUDAToolkit for CUDA::cublas: where the
  # toolkit has no cuBLAS, the same hints as ggml's own build (cuda_flags) say where it is
  local hints=(); [ "$mode" = cpu ] || hints=("${found[@]}")
  (cd "$root" && CMAKE_ARGS="${hints[*]@Q}" built "dflash-gguf build" "$vpy" -m pip install -q \
    --disable-pip-version-check --no-index --no-deps --no-build-isolation \
    --config-settings=build-dir="$build/project-build" .)
  echo "$want" > "$venv/.dflash-project"
}

step_save() {
  local out="${OUT:-$build/save}" sp name="llama-$mode" stage="$build/stage"
  sp=$(site)
  mkdir -p "$out"
  rm -rf "$stage"; mkdir -p "$stage/site"
  # what llama-cpp-python installed (the package, its metadata, ggml's headers, libraries
  # and CMake files). pip installs each library's soname links as copies (libggml-cuda.so,
  # .so.0, .so.0.25.3: 40 MB each for sm_90) and site/lib repeats llama_cpp/lib: identical
  # files become hard links, which tar stores once
  cp -a "$sp"/llama_cpp "$sp"/llama_cpp_python-*.dist-info "$sp"/include "$sp"/lib "$stage/site/"
  # Python's bytecode is made again where it runs (it is 0.16 MiB of the parts, which a
  # call's 64 MiB counts)
  find "$stage/site" -name __pycache__ -prune -exec rm -rf {} +
  local sum prev_sum="" first="" f
  while read -r sum f; do
    if [ "$sum" = "$prev_sum" ]; then ln -f "$first" "$f"; else prev_sum=$sum; first=$f; fi
  done < <(find "$stage/site" -type f -name 'lib*.so*' -exec sha256sum {} + | sort)
  cp -a "$tools" "$stage/tools"
  cp "$build/build-info.txt" "$stage/"
  cat "$venv/.dflash-llama" > "$stage/key"
  # xz, which restore unpacks with Python's lzma wherever the build runs
  local comp=(gzip -9) ext=gz
  if command -v xz >/dev/null; then comp=(xz -9e -T0); ext=xz; fi
  rm -f "$out/$name".tar.*
  tar -C "$stage" -c . | "${comp[@]}" | split -b 15M -d - "$out/$name.tar.$ext."
  rm -rf "$stage"
  say "saved $(du -cb "$out/$name".tar.* | tail -n 1 | cut -f1) bytes in $(ls "$out/$name".tar.* | wc -l) part(s) to $out"
  ls -l "$out/$name".tar.* >&2
}

t_all=$SECONDS
for s in "${steps[@]}"; do
  case "$s" in
    env) timed "env" step_env ;;
    llama) step_env; timed "llama" step_llama ;;
    tools) timed "tools" step_tools ;;
    project) timed "project" step_project ;;
    save) step_save ;;
    flags) printf '%s\n' "${flags[@]}" ;;
  esac
done
say "done in $((SECONDS - t_all)) s; use: source $build/env.sh"
# A build restored from another machine carries that machine's library paths in its
# RUNPATH; the loader then needs this machine's cuBLAS and CUDA runtime folders.
cuda_lib_dirs() {
  [ "$mode" = cuda ] || return 0
  local sp; sp=$("${PYTHON:-python3}" -c "import site; print(' '.join(site.getsitepackages()))")
  # shellcheck disable=SC2086
  { find $sp -path '*nvidia*' \( -name 'libcublas.so.*' -o -name 'libcudart.so.*' \) 2>/dev/null
    find "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"/ \
      \( -name 'libcublas.so.*' -o -name 'libcudart.so.*' \) 2>/dev/null; } | xargs -r -n1 dirname | sort -u | paste -sd:
}
cat > "$build/env.sh" <<EOF
# written by scripts/cuda/build.sh: the venv and the tools of this build
export PATH="$venv/bin:$tools:\$PATH"
export DFLASH_CUDA_TOOLS="$tools"
export LD_LIBRARY_PATH="$(cuda_lib_dirs)\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
