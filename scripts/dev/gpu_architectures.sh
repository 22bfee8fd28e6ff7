#!/usr/bin/env bash
# The whole architecture test file in one device call: TestFamily split over SHARDS processes (families
# interleaved, alternating GPUs), the file's other tests in one more. Run after `. scripts/gpu_env.sh`; logs go
# to $1.
#   bash scripts/dev/gpu_architectures.sh "$OUT" [SHARDS] [TIMEOUT_S]
OUTDIR=${1:?log directory}; SHARDS=${2:-7}; LIMIT=${3:-520}
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())"); [ "${GPUS:-0}" -gt 0 ] || GPUS=1
export DYNSTEER_TEST_GPU_UTIL=${DYNSTEER_TEST_GPU_UTIL:-0.08}
export DYNSTEER_TEST_KV_BYTES=${DYNSTEER_TEST_KV_BYTES:-268435456}
FAMILIES='from dynsteer.testing.tiny_models import CPU_LOADABLE as c, FAMILY_ARCHS as f; A = (*c, *f)'
python3 -c "$FAMILIES
from dynsteer.testing.tiny_models import tiny_model
[tiny_model(a) for a in A]" > "$OUTDIR/arch-build.log" 2>&1
for i in $(seq 0 $((SHARDS - 1))); do
  archs=$(python3 -c "$FAMILIES
print(','.join(A[$i::$SHARDS]))")
  (CUDA_VISIBLE_DEVICES=$((i % GPUS)) VLLM_CACHE_ROOT=/tmp/arch-cache-$i DYNSTEER_TEST_ARCHS=$archs \
     timeout "$LIMIT" python3 -m pytest -q -rs tests/test_architectures.py -k TestFamily \
     > "$OUTDIR/arch-$i.log" 2>&1
   echo "rc=$? archs=$archs" >> "$OUTDIR/arch-$i.log") &
done
(CUDA_VISIBLE_DEVICES=$((SHARDS % GPUS)) VLLM_CACHE_ROOT=/tmp/arch-cache-rest \
   timeout "$LIMIT" python3 -m pytest -q -rs tests/test_architectures.py -k "not TestFamily" \
   > "$OUTDIR/arch-rest.log" 2>&1
 echo "rc=$?" >> "$OUTDIR/arch-rest.log") &
wait
for f in "$OUTDIR"/arch-[0-9r]*.log; do
  echo "== $(basename "$f"): $(grep -E '(passed|failed|error)' "$f" | tail -n 1) $(tail -n 1 "$f")"
done
