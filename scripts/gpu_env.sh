#!/usr/bin/env bash
# Source on the offline GPU host (device machine): unpack the vLLM bundle once, install dynsteer (editable, so
# vLLM finds its plugin entry point) and export the environment GPU tests and benchmarks run under.
#   . scripts/gpu_env.sh [PARTS_DIR]
PARTS=${1:-/root/parts}
if [ ! -d /opt/vllm-site/vllm ]; then
  sh "$PARTS/unpack.sh" "$PARTS" /opt/vllm-site >/tmp/unpack.log 2>&1 || { tail /tmp/unpack.log; return 1; }
fi
export PYTHONPATH=/opt/vllm-site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 DYNSTEER_TEST_DEVICE=cuda
export DYNSTEER_CACHE=${DYNSTEER_CACHE:-$PWD/.gpu-carry}
python3 -c "from importlib.metadata import distribution as d; d('dynsteer')" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  >/tmp/pip.log 2>&1 || { tail /tmp/pip.log; return 1; }
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/dynsteer-vllm-cache}
