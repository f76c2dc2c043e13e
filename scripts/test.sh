#!/usr/bin/env bash
# The test command (README; .ci/run calls it): sets up .venv (see setup.sh) and runs the
# test suite on the CPU, then the device tests on ggml's Vulkan backend over Mesa's
# software driver (scripts/test-vulkan.sh, its set-up cached as setup.sh's is), so that no
# device regression lands unseen. DFLASH_SKIP_VULKAN=1 runs the CPU suite alone.
# Extra arguments go to pytest, e.g. scripts/test.sh -k converter -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" test
cd "$root"
"$root/.venv/bin/pytest" "$@"
if [ "${DFLASH_SKIP_VULKAN:-0}" != "1" ]; then
    bash "$root/scripts/test-vulkan.sh" "$@"
fi
