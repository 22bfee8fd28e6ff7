#!/usr/bin/env bash
# Set up .venv (first run only) and run the CPU demo: SmolLM2 steered by a contrastive vector, before/after table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv/bin/dynsteer demo "$@"
