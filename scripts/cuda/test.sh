#!/usr/bin/env bash
# The device tests (pytest -m device: tests/runtime/test_devices.py) on the GPU, with the build of
# scripts/cuda/build.sh: plain, chain and tree greedy decoding of both bundled pairs equal
# the device's own plain decoding; converted demo pairs equal the CPU's tokens; every node
# of the prefill, propose, verify and commit graphs runs on the device (each graph's nodes
# and scheduler splits are printed); every -ngl split between the CPU and the device gives
# the CPU's logits and lossless speculation; a Qwen3.5-0.8B-shape model loads and runs.
#
#   bash scripts/cuda/test.sh [--cpu] [PYTEST ARGS]
#
# The device is $DFLASH_TEST_DEVICE, CUDA0 by default; with --cpu (the CPU build, mode
# "cpu") the RPC stand-in, as CI runs them. With $OUT set (the lent machine's return
# folder) a JUnit report goes there ($DFLASH_TEST_REPORT.xml, default device-tests-MODE.xml).
# The tests need neither torch nor transformers.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mode=cuda
if [ "${1:-}" = --cpu ]; then mode=cpu; shift; fi
venv="${DFLASH_CUDA_BUILD:-$root/.cuda-build}/$mode/venv"
if [ ! -x "$venv/bin/dflash-run" ]; then
  echo "test.sh: no build in $venv; run scripts/cuda/build.sh$([ $mode = cpu ] && echo ' --cpu') first" >&2
  exit 1
fi
if [ "$mode" = cuda ]; then export DFLASH_TEST_DEVICE="${DFLASH_TEST_DEVICE:-CUDA0}"; fi
report=()
if [ -n "${OUT:-}" ]; then report=("--junitxml=$OUT/${DFLASH_TEST_REPORT:-device-tests-$mode}.xml"); fi
# from tests/: `python -m` puts the working directory first on sys.path, and the checkout's
# root there would shadow the installed package with its sources (no compiled library)
cd "$root/tests"
# test_batch_invariance: which column counts round apart on the device, type by type;
# test_attention_invariance: tree and chain rows at depths 0-2048 against one-row decodes
exec "$venv/bin/python" -m pytest -m device runtime/test_devices.py runtime/test_batch_invariance.py \
  runtime/test_attention_invariance.py -v -s -p no:cacheprovider "${report[@]}" "$@"
