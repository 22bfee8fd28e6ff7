#!/usr/bin/env bash
# The performance issue's device runs, by name, each fitting one 10-minute device call; results under $OUT.
# On the device, after the vLLM bundle's parts are in place:
#   . scripts/gpu_env.sh /root/parts >/dev/null 2>&1; OUT=$OUT bash scripts/dev/gpu_runs.sh RUN
# Runs:
#   host         benchmarks/host_step.py at batch 128 / 256, 4096 wide, steps at a 10 ms device pace (~1 min)
#   capture      overhead.py capture-enabled idle and capture at batch 128 / 256, decode step split, with py-spy
#                summaries at batch 256 when .gpu-carry/py-spy exists (SPY_MODE idle: where threads wait; gil; busy)
#   large-batch  overhead.py idle, per-request dynamic and sync at batch 128 / 256 (decode step split)
#   serve        serve.py at concurrency 16 / 64 (add CONC="256" on an H200), mixes none dynamic reports monitor;
#                needs a tokenizer folder in .gpu-carry/tok (SmolLM2's tokenizer files)
#   tp4          overhead.py at TP=4, 32 of Llama-3-70B's layers (four GPUs)
#   ab           overhead.py idle, per-request dynamic and sync at batch 256, this checkout against BASE (a folder
#                holding another version's dynsteer package: scripts/dev/base_checkout.sh REV makes base-REV where
#                the checkout lives, and it travels untracked); four engines: an H200, or LAYERS=24 on an H100
#   spy          scripts/dev/engine_spy.py: py-spy of one engine's processes, idle against per-request dynamic at
#                batch 256 (needs .gpu-carry/py-spy)
#   synccheck    scripts/dev/engine_spy.py --sync-check: torch calls that synchronise the host with the device, by
#                the line that made them, idle / per-request static / global gate / per-request dynamic / sync (~2 min)
#   diag         synccheck, then spy (two engine start-ups; ~6 min)
# Knobs: REPEATS, MINUTES, CONC, MIXES, ROUNDS, RAMP, LABEL; DYNSTEER_GIT_SHA names the code (a device copy's .git
# may be stale: pass `git rev-parse --short HEAD` taken where the checkout lives).
set -euo pipefail
run=${1:?"which run: host | capture | large-batch | serve | tp4 | ab | spy | synccheck | diag"}
OUT=${OUT:?"set OUT (the device call's \$OUT)"}
export DYNSTEER_GIT_SHA=${DYNSTEER_GIT_SHA:-$(cat .gpu-carry/SHA 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
spy=()
[ -x .gpu-carry/py-spy ] && spy=(--py-spy .gpu-carry/py-spy --py-spy-mode "${SPY_MODE:-idle}" --profile-batch 256)
case "$run" in
  host)
    python3 benchmarks/host_step.py --batches 128 256 --hidden 4096 --steps 300 --pace-ms 10 \
      --modes idle "per-request dynamic cached" sync capture --json "$OUT/host_step.json"
    python3 benchmarks/host_step.py --batches 128 256 --hidden 4096 --steps 300 --pace-ms 10 --churn 2 \
      --modes capture --json "$OUT/host_step-churn.json" ;;
  capture)
    python3 benchmarks/overhead.py --modes capidle capture --batches 128 256 --tokens 64 --prompt-len 32 \
      --timing-split --repeats "${REPEATS:-10}" --max-minutes "${MINUTES:-6.8}" "${spy[@]}" --out "$OUT" ;;
  large-batch)
    python3 benchmarks/overhead.py --modes idle prdyn sync --batches 128 256 --tokens 64 --prompt-len 32 \
      --timing-split --repeats "${REPEATS:-10}" --max-minutes "${MINUTES:-6.8}" --out "$OUT" ;;
  serve)
    python3 benchmarks/serve.py --shape llama3-8b --tokenizer .gpu-carry/tok --concurrency ${CONC:-16 64} \
      --mixes ${MIXES:-none dynamic reports monitor} --rounds "${ROUNDS:-4}" --ramp-s "${RAMP:-0}" \
      --budget-min "${MINUTES:-8.5}" --label "${LABEL:-serve}" --out "$OUT" ;;
  ab)
    python3 benchmarks/overhead.py --modes idle prdyn sync o_idle o_prdyn o_sync --batches 256 --tokens 64 \
      --prompt-len 32 --base-checkout "${BASE:?"set BASE (a folder holding the other version's dynsteer)"}" \
      ${LAYERS:+--layers "$LAYERS"} --timing-split --repeats "${REPEATS:-10}" --max-minutes "${MINUTES:-6.8}" \
      --out "$OUT" ;;
  spy)
    python3 scripts/dev/engine_spy.py --py-spy .gpu-carry/py-spy --modes idle prdyn --batch 256 --out "$OUT" ;;
  synccheck)
    python3 scripts/dev/engine_spy.py --sync-check --modes idle pr64 gate prdyn sync --batch "${BATCH:-64}" \
      --tokens 32 --out "$OUT" ;;
  diag)
    bash "$0" synccheck
    bash "$0" spy ;;
  tp4)
    python3 benchmarks/overhead.py --tp 4 --shape llama3-70b --layers 32 --modes idle pr64 prdyn capidle stream \
      --batches 1 16 64 --timing-split --repeats "${REPEATS:-8}" --max-minutes "${MINUTES:-7}" --out "$OUT" ;;
  *) echo "unknown run: $run" >&2; exit 2 ;;
esac
