#!/usr/bin/env bash
# Another version's dynsteer package in base-REV/ at the repository root, for `overhead.py --base-checkout` (an A/B
# of code in one run; `gpu_runs.sh ab`). Untracked and not ignored, so it travels with a device call's copy of the
# checkout (about 2 MB); remove it before committing.
#   bash scripts/dev/base_checkout.sh 4a5b2e9   # then, on the device: BASE=base-4a5b2e9 bash scripts/dev/gpu_runs.sh ab
set -euo pipefail
rev=${1:?"which revision"}
cd "$(git rev-parse --show-toplevel)"
dir="base-$(git rev-parse --short "$rev")"
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" dynsteer | tar x -C "$dir"
echo "$dir"
