#!/usr/bin/env bash
# The test command: sets up .venv (see setup.sh) and runs the test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k converter -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" test
cd "$root"
exec "$root/.venv/bin/pytest" "$@"
