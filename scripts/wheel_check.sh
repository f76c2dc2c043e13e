#!/usr/bin/env bash
# The patch travels with the package: builds dflash-gguf as a user's `pip wheel .` of a clone
# does (pip's isolated build, which sees no installed ggml, so CMakeLists.txt builds ggml here
# from llama-cpp-python's sdist with the project's patches, cmake/bundled_ggml.cmake),
# installs that wheel into a new virtualenv beside a llama-cpp-python whose ggml is NOT this
# patch set's (the tokenizer's; default: the newest other wheel in the set-up's wheelhouse),
# and asks the installed engine what it runs on: the bundled ggml must be the one loaded,
# name this patch set, say `exact: yes`, and decode the demo pair as plain decoding does.
# Writes a JSON record (OUT, default results/wheel-check-DATE.json).
#   scripts/wheel_check.sh                 (about 10 minutes on 2 cores: ggml is compiled)
#   LLAMA_WHEEL=path/to/llama_cpp_python-*.whl scripts/wheel_check.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/results/wheel-check-$(date +%F).json}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { echo "[wheel-check] $*" >&2; }

key=$(find "$root/dflash_gguf/data/ggml-patches" -name '*.patch' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12)
if [ -z "${LLAMA_WHEEL:-}" ]; then
  LLAMA_WHEEL=$(ls -t "${DFLASH_WHEELHOUSE:-$HOME/.cache/dflash-gguf/wheels}"/*/llama_cpp_python-*.whl 2>/dev/null \
    | while read -r w; do unzip -p "$w" 'llama_cpp/lib/libggml-cpu.so' 2>/dev/null \
        | grep -qa "patches $key" || { echo "$w"; break; }; done)
fi
[ -n "$LLAMA_WHEEL" ] || { say "no llama-cpp-python wheel of another ggml: name one in LLAMA_WHEEL"; exit 2; }

say "cloning $(git -C "$root" rev-parse --short HEAD) and building its wheel in pip's isolation"
git clone -q "$root" "$work/clone"
commit=$(git -C "$work/clone" rev-parse HEAD)
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
t0=$SECONDS
"$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/wheels" "$work/clone"
build_s=$((SECONDS - t0))
wheel=$(ls "$work"/wheels/dflash_gguf-*.whl)
say "built $(basename "$wheel") in ${build_s} s; installing it beside $(basename "$(dirname "$LLAMA_WHEEL")")'s llama-cpp-python"
"$py" -m pip install -q --disable-pip-version-check --no-deps "$LLAMA_WHEEL"
"$py" -m pip install -q --disable-pip-version-check "$wheel"

# from outside the clone: the installed package, not the source tree
(cd "$work" && "$py" - "$root" "$commit" "$wheel" "$LLAMA_WHEEL" "$build_s" "$key" "$out") <<'EOF'
import json, os, platform, subprocess, sys, zipfile
from pathlib import Path

root, commit, wheel, llama_wheel, build_s, key, out = sys.argv[1:]
from dflash_gguf import Engine
from dflash_gguf.runtime import exactness

data = Path(root) / "dflash_gguf" / "data"
target, draft = str(data / "demo-target.gguf"), str(data / "demo-draft.gguf")
prompt = "def fibonacci(n):"
with Engine(target, draft, n_threads=2) as engine:
    want = engine.generate(prompt, 48, speculative=False).tokens
    got = engine.generate(prompt, 48).tokens
    exact = str(engine.exact)
maps = Path("/proc/self/maps").read_text().splitlines()
loaded = sorted({line.split()[-1] for line in maps if "ggml" in line and line.split()[-1].startswith("/")})
bundled = [p for p in loaded if "/dflash_gguf/ggml/libdflash-ggml" in p]
in_wheel = sorted(n for n in zipfile.ZipFile(wheel).namelist() if "/ggml/" in n)
record = {
    "what": "a `pip wheel .` of a clean clone (pip's isolated build) installed into a new virtualenv beside "
            "a llama-cpp-python of another ggml; the engine asked what it loaded and decoding the demo pair",
    "commit": commit, "machine": platform.machine(), "load_average": os.getloadavg(),
    "wheel": Path(wheel).name, "wheel_mb": round(Path(wheel).stat().st_size / 2**20, 1), "ggml_in_wheel": in_wheel,
    "build_seconds": int(build_s), "llama_cpp_python_wheel": llama_wheel,
    "patch_key": key, "built_for": exactness.built_for(), "cpu_backend_names": exactness.backend_patch("CPU"),
    "exact": exact, "ggml_loaded": loaded, "speculative_equals_plain": got == want, "tokens": len(got),
}
Path(out).write_text(json.dumps(record, indent=1) + "\n")
print(json.dumps(record, indent=1))
ok = (exact == "yes" and record["built_for"] == key and bundled and in_wheel
      and record["cpu_backend_names"].endswith(f"patches {key}") and got == want)
sys.exit(0 if ok else 1)
EOF
say "record in $out"
