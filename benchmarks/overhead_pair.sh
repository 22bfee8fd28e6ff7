#!/usr/bin/env bash
# Two overhead.py runs at once on a two-GPU host (32 cores), each on its own GPU and half of the cores (run S):
#   A (GPU 0, cores 0-15): idle against absent - three engines a side (H200) or two (H100: four 8B engines fit)
#   B (GPU 1, cores 16-31): the reduced set (H200) or gate / dynamic / sync / capture (H100)
# On the offline GPU host, after `. scripts/gpu_env.sh`:
#   DYNSTEER_GIT_SHA=<commit> OUT=<folder> [MIN=8.3] [MB_OVERRIDE="--modes ..."] bash benchmarks/overhead_pair.sh
# (MB_OVERRIDE: B's own mode arguments instead of the defaults below)
set -u
W=.gpu-carry/hotwire_vllm-0.1.2-py3-none-any.whl
MIN=${MIN:-8.4}
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
if [ "$mem" -gt 100000 ]; then
  MA="absent aa aa3 idle idle2 idle3"; MB="--reduced"
else
  MA="absent aa idle idle2"; MB="--modes absent aa idle gate prdyn sync capidle capture stream"
fi
MB=${MB_OVERRIDE:-$MB}
echo "gpu mem $mem MiB; A: $MA; B: $MB"
nproc; lscpu | grep -i "model name"
CUDA_VISIBLE_DEVICES=0 VLLM_CACHE_ROOT=/tmp/vc-a taskset -c 0-15 python3 benchmarks/overhead.py --modes $MA \
  --timing-split --burn-in 2 --repeats 40 --max-minutes $MIN --start-timeout 300 --out $OUT/a > $OUT/a.log 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 VLLM_CACHE_ROOT=/tmp/vc-b taskset -c 16-31 python3 benchmarks/overhead.py $MB \
  --hotwire-wheel $W --timing-split --burn-in 2 --repeats 40 --max-minutes $MIN --start-timeout 300 \
  --out $OUT/b > $OUT/b.log 2>&1 &
B=$!
wait $A; echo "A rc=$?"; wait $B; echo "B rc=$?"
tail -n 40 $OUT/a.log; tail -n 60 $OUT/b.log
