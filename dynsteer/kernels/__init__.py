"""Steering kernels: a torch reference, a fused Triton twin, and the ``dynsteer::steer_site`` op.

Importing this package registers ``torch.ops.dynsteer.steer_site``. The Triton launcher is
exported lazily so that importing the package neither requires triton nor fixes triton's
interpreted-vs-compiled mode.
"""

from __future__ import annotations

from typing import Any

from dynsteer.kernels.ops import ENV_KERNEL, OP_NAME, select_impl, steer_site
from dynsteer.kernels.reference import steer_site_reference

__all__ = [
    "ENV_KERNEL",
    "OP_NAME",
    "select_impl",
    "steer_site",
    "steer_site_reference",
    "steer_site_triton",
]


def __getattr__(name: str) -> Any:
    if name == "steer_site_triton":
        from dynsteer.kernels.triton_steer import steer_site_triton

        return steer_site_triton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
