#!/usr/bin/env bash
# One call on a lent GPU machine, every step time-boxed so that the call returns what it
# measured before the run tool's limit: the build (restored from .cuda-pack/built/ when a
# saved build travels with the call, else compiled), a look at how the CUDA libraries
# resolve, the verify checks (the batch-invariance probe and the lossless test, first),
# `save` of the build, the other device tests, the CUDA-graph fault's matrix
# (plain_check.py), then benchmark parts into $OUT.
#
#   bash scripts/cuda/device.sh [--budget SECONDS] [--parts 1,2|none] [--skip-tests]
#                               [--verify-first SECONDS] [--save] [--plain-check SECONDS]
#                               [-- BENCH ARGS]
#
# --budget is the time the whole call may take (default 560, under the tool's 600);
# --verify-first caps the verify checks (default 150; 0 leaves them to the other tests):
# test_a_patched_device_rounds_each_verify_column_as_one_column (ggml-patches/0004: every column of 2-64
# rounds as alone, each weight type), the device's invariance report, the attention probe's
# chain and tree rows (test_a_tree_row_attends_as_its_path_decoded_alone_on_the_device), and
# test_chain_and_tree_equal_plain_on_the_device_at_the_engines_defaults (lossless at the
# Engine's defaults); if the probe fails it runs again with GGML_CUDA_VERIFY_CHUNK=1 (each
# column through the one-column kernel) to tell the multi-column kernel from the dispatch.
# --save archives the build into $OUT after the verify checks (for a later cold machine);
# --plain-check caps the matrix (default 0: left out).
# Logs and results go to $OUT (the run tool's return folder), else .cuda-build/results.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
budget=560
parts=1
tests=1
plain_check=0
verify_first=150
save=0
bench_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) budget="$2"; shift ;;
    --parts) parts="$2"; shift ;;
    --skip-tests) tests=0 ;;
    --plain-check) plain_check="$2"; shift ;;
    --verify-first) verify_first="$2"; shift ;;
    --save) save=1 ;;
    --) shift; bench_args=("$@"); break ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "device.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
out="${OUT:-$root/.cuda-build/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
left() { echo $((budget - SECONDS)); }
say() { echo "[device $(date +%H:%M:%S) +${SECONDS}s] $*" >&2; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
say "build (restore or compile)"
if ! timeout "$(left)" bash "$root/scripts/cuda/build.sh" > "$out/build.log" 2>&1; then
  tail -n 30 "$out/build.log"
  say "the build failed or outran the call"
  exit 1
fi
grep -E 'restoring|: [0-9]+ s$|done in' "$out/build.log" >&2
# shellcheck disable=SC1091
source "$root/.cuda-build/cuda/env.sh"
lib="$(dirname "$(find "$root/.cuda-build/cuda/venv" -name 'libggml-cuda.so*' | head -n 1)")"
{ echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; ldd "$lib"/libggml-cuda.so; } > "$out/ldd.txt" 2>&1
if grep -q "not found" "$out/ldd.txt"; then cat "$out/ldd.txt"; say "unresolved libraries"; exit 1; fi

verify_k="patched_device_rounds_each_verify_column or reports_its_invariance or path_decoded_alone_on_the_device or engines_defaults"
if [ "$tests" = 1 ] && [ "$verify_first" -gt 0 ]; then
  # the batch-invariance verify kernels (ggml-patches/0004), before anything else: the probe
  # (seconds) and the lossless test at the Engine's defaults (a minute or two)
  t=$(( $(left) - 30 )); [ "$t" -le "$verify_first" ] || t=$verify_first
  say "verify checks: invariance probe, lossless at the Engine's defaults (at most $t s)"
  DFLASH_TEST_REPORT=verify-tests-cuda timeout "$t" bash "$root/scripts/cuda/test.sh" --full -k "$verify_k" > "$out/verify.log" 2>&1
  echo "verify checks exit $?" >> "$out/verify.log"
  grep -E '(PASSED|FAILED|ERROR|XFAIL|SKIPPED)( |$)|^\[|^  [A-Z0-9_]+: |passed|failed|exit [0-9]+' "$out/verify.log" | tail -n 40
  if grep -qE "patched_device_rounds_each_verify_column.*FAILED|FAILED.*patched_device_rounds_each_verify_column" "$out/verify.log" && [ "$(left)" -gt 90 ]; then
    say "the probe failed: again with GGML_CUDA_VERIFY_CHUNK=1 (one column per launch)"
    GGML_CUDA_VERIFY_CHUNK=1 DFLASH_TEST_REPORT=verify-chunk1-cuda timeout 60 bash "$root/scripts/cuda/test.sh" \
      -k patched_device_rounds_each_verify_column > "$out/verify-chunk1.log" 2>&1
    echo "verify checks (chunk 1) exit $?" >> "$out/verify-chunk1.log"
    grep -E '^\[|^  [A-Z0-9_]+: |passed|failed|exit [0-9]+' "$out/verify-chunk1.log" | tail -n 25
  fi
fi

if [ "$save" = 1 ] && [ "$(left)" -gt 100 ]; then
  say "save: the build's archive into $out (at most 90 s)"
  OUT="$out" timeout 90 bash "$root/scripts/cuda/build.sh" save > "$out/save.log" 2>&1
  echo "save exit $?" >> "$out/save.log"
  tail -n 3 "$out/save.log"
fi

if [ "$tests" = 1 ] && [ "$(left)" -gt 40 ]; then
  # the tests take at most half of what is left, and at most 180 s: the bench parts write
  # their results section by section, the tests only at the end
  t=$(( $(left) / 2 )); [ "$t" -le 180 ] || t=180
  [ "$parts" != none ] || [ "$plain_check" -gt 0 ] || t=$(( $(left) - 15 ))
  skip=(); [ "$verify_first" -gt 0 ] && skip=(-k "not ($verify_k)")
  say "device tests (at most $t s)"
  timeout "$t" bash "$root/scripts/cuda/test.sh" "${skip[@]}" > "$out/test.log" 2>&1
  echo "device tests exit $?" >> "$out/test.log"
  grep -E '(PASSED|FAILED|ERROR|XFAIL|SKIPPED)( |$)|passed|failed|exit [0-9]+' "$out/test.log" | tail -n 30
fi

if [ "$plain_check" -gt 0 ]; then
  t=$(( $(left) - 10 )); [ "$t" -le "$plain_check" ] || t=$plain_check
  say "plain check: CUDA graphs x PDL x fusion x caches (at most $t s)"
  timeout "$t" "$root/.cuda-build/cuda/venv/bin/python" "$root/scripts/cuda/plain_check.py" \
    --out "$out/plain-check.json" > "$out/plain-check.log" 2>&1
  echo "plain check exit $?" >> "$out/plain-check.log"
  tail -n 40 "$out/plain-check.log"
fi
[ "$parts" = none ] && { say "done"; exit 0; }

commit=$(cat "$root/.cuda-pack/commit" 2>/dev/null || echo unknown)
say "bench parts $parts (at most $(( $(left) - 10 )) s), commit $commit"
timeout "$(( $(left) - 10 ))" "$root/.cuda-build/cuda/venv/bin/python" "$root/scripts/cuda/bench.py" \
  --part "$parts" --commit "$commit" --out "$out" "${bench_args[@]}" > "$out/bench.log" 2>&1
echo "bench exit $?" >> "$out/bench.log"
tail -n 40 "$out/bench.log"
say "done"
