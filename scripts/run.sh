#!/usr/bin/env bash
# The main job: sets up .venv (see setup.sh) and runs dflash-run. With no arguments it
# runs the bundled demo; any arguments go to dflash-run (see dflash-run --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" run
exec "$root/.venv/bin/dflash-run" "$@"
