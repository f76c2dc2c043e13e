#!/usr/bin/env bash
# The test command (README; .ci/run calls it): sets up .venv (see setup.sh), then runs in
# stages, the quick before the slow, each timed: the CPU suite less the published models'
# tests, then those (pytest -m real: minutes of real-model decoding), then the device
# tests on ggml's Vulkan backend over Mesa's software driver (scripts/test-vulkan.sh, its
# set-up cached as setup.sh's is), so that no device regression lands unseen.
# DFLASH_SKIP_VULKAN=1 leaves the Vulkan stage out.
# Extra arguments go to each stage's pytest, e.g. scripts/test.sh -k converter -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# stage NAME COMMAND...: run it and say how long it took; pytest's 5 ("no tests
# collected": arguments that select nothing in this stage) is not a failure
stage() {
    local name=$1 t0=$SECONDS rc=0
    shift
    "$@" || rc=$?
    echo "[test] $name: $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || exit "$rc"
}

stage "set-up" bash "$root/scripts/setup.sh" test
cd "$root"
stage "CPU suite, less the published models" "$root/.venv/bin/pytest" -m "not real" "$@"
stage "CPU suite, the published models (-m real)" "$root/.venv/bin/pytest" -m real "$@"
if [ "${DFLASH_SKIP_VULKAN:-0}" != "1" ]; then
    # lavapipe runs a graph in software: eight of its slowest device tests are left to
    # scripts/test-vulkan.sh, which runs them all (on a slow two-core machine the stage ran
    # 17 minutes with five left out, 13 with seven). Every one of them runs in the CPU stage
    # on the RPC device, and each has a twin kept here: the f16 file's greedy run for the
    # f32 file's; the shipped pair's chain and tree at the engine's defaults (equal to the
    # device's plain decoding) and the f16 file's (cut chain included, equal to the CPU's)
    # for the bundled pairs' lossless runs (their q8_0 logits' bound against the CPU's is
    # checked by test-vulkan.sh alone); the chain and tree at the engine's defaults for the
    # sampled runs, which on Vulkan check only their lengths (its logits differ from the
    # CPU's in the last bits); the placement test (every node on the device) and the CLI's
    # -ngl 2 for the -ngl splits.
    stage "Vulkan device tests (set-up included)" bash "$root/scripts/test-vulkan.sh" \
        --deselect "tests/runtime/test_devices.py::test_demo_pair_greedy_equals_the_cpu[f32]" \
        --deselect "tests/runtime/test_devices.py::test_demo_pair_sampling_on_the_device[mtp]" \
        --deselect "tests/runtime/test_devices.py::test_demo_pair_sampling_on_the_device[f32]" \
        --deselect "tests/runtime/test_devices.py::test_bundled_pairs_are_lossless_on_the_device[demo]" \
        --deselect "tests/runtime/test_devices.py::test_bundled_pairs_are_lossless_on_the_device[weak]" \
        --deselect "tests/runtime/test_devices.py::test_bundled_pairs_are_lossless_on_the_device[mtp]" \
        --deselect "tests/runtime/test_devices.py::test_bundled_pairs_are_lossless_on_the_device[eagle3]" \
        --deselect "tests/runtime/test_devices.py::test_partial_offload_matches_the_cpu" "$@"
fi
