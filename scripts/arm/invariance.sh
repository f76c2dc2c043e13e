#!/usr/bin/env bash
# Batch invariance of ggml's aarch64 CPU kernels, proven under qemu-user on any Linux host:
# cross-compiles ggml (CPU backend, static, GGML_NATIVE=OFF) from llama-cpp-python's sdist
# with Debian's aarch64 cross-compiler, links scripts/arm/invariance.c against it and runs it
# under qemu-aarch64; writes what every type x layout x column count gave as JSON.
#
#   scripts/arm/invariance.sh [OUT.json]     (default results/arm-invariance-DATE.json)
#
# Two trees: "stock" (the project's patches without 0002-arm-*, i.e. the x86 fixes only)
# and "patched" (every patch in dflash_gguf/data/ggml-patches). Three builds of each:
#   i8mm:    -march=armv8.6-a+fp16+dotprod+i8mm+sve (Graviton3/M2-like), run on qemu's `max` CPU
#            at SVE widths of 128, 256 and 512 bits
#   dotprod: -march=armv8.2-a+dotprod           (a portable dotprod build, no fp16 arithmetic), on `neoverse-n1`
#   fp16:    -march=armv8.2-a+fp16+dotprod      (M1/Graviton2 native-like: f16 through tinyBLAS's
#            f16 kernel), on `neoverse-n1`
# (i8mm and SVE builds leave llamafile's tinyBLAS out: ggml-cpu.c undefines it there.)
# Needs: gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user cmake python3 (host only).
# Env: ARM_WORK (build folder, default build/arm), SDIST (the sdist tarball; else pip
# downloads it), JOBS (default 2), TREES ("stock patched"), VARIANTS ("i8mm dotprod fp16").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version=0.3.36
work="${ARM_WORK:-$root/build/arm}"
jobs="${JOBS:-2}"
trees="${TREES:-stock patched}"
out="${1:-$root/results/arm-invariance-$(date -u +%Y-%m-%d).json}"
mkdir -p "$work"

sdist="${SDIST:-}"
if [ -z "$sdist" ]; then
    sdist="$work/llama_cpp_python-$version.tar.gz"
    if [ ! -f "$sdist" ]; then
        python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
            --dest "$work" "llama-cpp-python==$version"
    fi
fi

patches_all=$(find "$root/dflash_gguf/data/ggml-patches" -name '*.patch' | LC_ALL=C sort)
unpack() {  # unpack TREE: the sdist with its patches applied, fresh each run
    local name=$1 dest="$work/src-$1"
    rm -rf "$dest" && mkdir -p "$dest"
    tar xzf "$sdist" -C "$dest" --strip-components=1
    for p in $patches_all; do
        if [ "$name" = stock ] && [[ "$(basename "$p")" == 0002-arm-* ]]; then continue; fi
        patch -s -p1 --fuzz=0 -d "$dest" < "$p"
    done
    # the sdist leaves out ggml's pkg-config template, which a standalone configure needs
    touch "$dest/vendor/llama.cpp/ggml/ggml.pc.in"
}

declare -A MARCH=(
    [i8mm]="armv8.6-a+fp16+dotprod+i8mm+sve"
    [dotprod]="armv8.2-a+dotprod"
    [fp16]="armv8.2-a+fp16+dotprod"
)
# qemu CPU models per build: NAME=qemu -cpu argument
declare -A CPUS=(
    [i8mm]="max-sve128=max,sve-default-vector-length=16 max-sve256=max,sve-default-vector-length=32 max-sve512=max,sve-default-vector-length=64"
    [dotprod]="neoverse-n1=neoverse-n1"
    [fp16]="neoverse-n1=neoverse-n1"
)

build() {  # build TREE VARIANT -> $work/inv-TREE-VARIANT
    local tree=$1 var=$2 b="$work/build-$1-$2"
    cmake -S "$work/src-$tree/vendor/llama.cpp/ggml" -B "$b" -G "Unix Makefiles" \
        -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
        -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_STATIC=ON \
        -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="${MARCH[$var]}" -DGGML_OPENMP=OFF \
        -DGGML_LLAMAFILE=ON -DGGML_CPU_REPACK=ON -DGGML_CPU_KLEIDIAI=OFF \
        -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF \
        $(command -v ccache >/dev/null && echo -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache) \
        > "$b.configure.log"
    nice -n 10 cmake --build "$b" -j "$jobs" --target ggml-cpu ggml-base ggml > "$b.build.log"
    local libs
    libs=$(find "$b" -name 'libggml*.a' | sort)
    nice -n 10 aarch64-linux-gnu-g++ -O2 -static -march="${MARCH[$var]}" \
        -I "$work/src-$tree/vendor/llama.cpp/ggml/include" -x c "$root/scripts/arm/invariance.c" -x none \
        -Wl,--start-group $libs -Wl,--end-group -lm -lpthread -o "$work/inv-$tree-$var"
}

rm -f "$work"/run-*.txt
for tree in $trees; do
    unpack "$tree"
    for var in ${VARIANTS:-i8mm dotprod fp16}; do
        echo "[arm] building $tree ($var: -march=${MARCH[$var]})" >&2
        build "$tree" "$var"
        for spec in ${CPUS[$var]}; do
            name=${spec%%=*}
            cpu=${spec#*=}
            echo "[arm] running $tree/$var on qemu-aarch64 -cpu $cpu" >&2
            {
                echo "TREE $tree"
                echo "BUILD $var -march=${MARCH[$var]}"
                echo "CPU $name $cpu"
                # ggml's "repack: repack tensor ... with LAYOUT" lines (stderr) name the layouts
                qemu-aarch64 -cpu "$cpu" "$work/inv-$tree-$var" 2 2>&1
            } > "$work/run-$tree-$var-$name.txt"
        done
    done
done

python3 - "$out" "$root" "$work" <<'EOF'
import glob, hashlib, json, os, subprocess, sys
out, root, work = sys.argv[1:4]
def git(*a):
    return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True).stdout.strip()
runs = []
for path in sorted(glob.glob(os.path.join(work, "run-*.txt"))):
    run = {"results": [], "layouts": {}}
    layout = None
    for line in open(path):
        f = line.split()
        if not f:
            continue
        if line.startswith("repack: repack tensor"):
            layout = f[-1]
            continue
        if f[0] == "TREE":
            run["tree"] = f[1]
        elif f[0] == "BUILD":
            run["build"], run["march"] = f[1], f[2]
        elif f[0] == "CPU":
            run["cpu_model"], run["qemu_cpu"] = f[1], f[2]
        elif f[0] == "FEATURES":
            run["features"] = dict(kv.split("=") for kv in f[1:])
        elif f[0] == "RESULT":
            t, kind, k, d, m = f[1:6]
            if kind == "repacked" and layout:
                run["layouts"][t] = layout
                layout = None
            if k == "-":
                run["results"].append({"type": t, "layout": kind})
            else:
                run["results"].append({"type": t, "layout": kind, "columns": int(k),
                                       "columns_differing": int(d), "max_abs_diff": float(m)})
    bad = sorted({f"{r['type']} {r['layout']}" for r in run["results"] if r.get("columns_differing")})
    run["invariant"] = not bad
    run["differing"] = bad
    runs.append(run)
doc = {
    "what": "batch invariance of ggml's aarch64 CPU matrix product under qemu-user: every column of a "
            "k-column ggml_mul_mat against the same column alone, bit for bit (scripts/arm/invariance.sh)",
    "commit": git("rev-parse", "HEAD"),
    "dirty": bool(git("status", "--porcelain")),
    "patches": {os.path.basename(p): hashlib.sha256(open(p, "rb").read()).hexdigest()
                for p in sorted(glob.glob(os.path.join(root, "dflash_gguf/data/ggml-patches/*.patch")))},
    "stock": "the project's patches without 0002-arm-* (x86 fixes only)",
    "shape": {"inputs": 1536, "outputs": 64, "outliers": "every 97th input x30", "threads": 2},
    "compiler": subprocess.run(["aarch64-linux-gnu-gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
    "qemu": subprocess.run(["qemu-aarch64", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
    "runs": runs,
}
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
json.dump(doc, open(out, "w"), indent=1)
for r in runs:
    print(f"{r['tree']:8s} {r['build']:8s} {r['cpu_model']:12s} invariant={r['invariant']} " + "; ".join(r["differing"]))
print(out)
EOF
