#!/usr/bin/env bash
# Set up .venv (first run only) and run the CPU test suite (real vLLM engines on tiny local models and SmolLM2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --with-chromium
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 tests "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "no tests collected" >&2; exit 1; }
exit "$rc"
