#!/usr/bin/env bash
# A newcomer's first contact, literally, from a fresh clone (CPU): the README's demo command (set-up, then the
# SmolLM2 demo), the quickstart's doctor, then the quickstart's and the monitor guide's code blocks as written (serve +
# curl steering, Python steering, a monitor service) through tests/test_docs_run.py. Each step's time is printed.
#   bash scripts/newcomer.sh [REPO]      (default: this checkout; minutes, mostly the set-up of a fresh .venv)
set -euo pipefail
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
WORK=$(mktemp -d -t dynsteer-newcomer-XXXX)
step() { local t0=$SECONDS; echo "[newcomer] $1" >&2; shift; "$@"; echo "[newcomer]   done in $((SECONDS - t0)) s" >&2; }
step "fresh clone of $SRC into $WORK" git clone -q "$SRC" "$WORK/dynsteer"
cd "$WORK/dynsteer"
step "README: bash scripts/demo.sh" bash scripts/demo.sh
step "quickstart: .venv/bin/dynsteer doctor" .venv/bin/dynsteer doctor
step "quickstart and monitor guide, every block as written" .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_docs_run.py -k "quickstart or monitors"
echo "[newcomer] all steps passed; the clone stays in $WORK" >&2
