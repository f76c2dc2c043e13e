#!/usr/bin/env bash
# The device tests (pytest -m device) on ggml's Vulkan backend: sets up .venv-vulkan (see
# setup-vulkan.sh) and runs them on Vulkan0, which on a machine without a GPU is Mesa's
# software driver, lavapipe. Extra arguments go to pytest (scripts/test-vulkan.sh -k tree).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-vulkan.sh"
cd "$root"
# ggml's Vulkan backend skips CPU-type devices such as lavapipe unless they are listed.
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}"
export DFLASH_TEST_DEVICE="${DFLASH_TEST_DEVICE:-Vulkan0}"
exec "$root/.venv-vulkan/bin/pytest" -m device "$@"
