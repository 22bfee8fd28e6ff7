"""Steering kernels: torch references, fused Triton twins, and the ``dynsteer::steer_site`` /
``dynsteer::steer_site_dyn`` ops.

Importing this package registers ``torch.ops.dynsteer.steer_site`` and ``steer_site_dyn``; both take a site's tables
as one :class:`SiteTables` (``dynsteer.kernels.site_tables``). The
Triton launchers are exported lazily so that importing the package neither requires triton nor
fixes triton's interpreted-vs-compiled mode.
"""

from __future__ import annotations

from typing import Any

from dynsteer.kernels.dynamic_reference import steer_site_dyn_reference
from dynsteer.kernels.ops import DYN_OP_NAME, ENV_KERNEL, OP_NAME, select_impl, steer_site, steer_site_dyn
from dynsteer.kernels.reference import steer_site_reference
from dynsteer.kernels.site_tables import SiteTables

__all__ = [
    "DYN_OP_NAME",
    "ENV_KERNEL",
    "OP_NAME",
    "SiteTables",
    "select_impl",
    "steer_site",
    "steer_site_dyn",
    "steer_site_dyn_reference",
    "steer_site_dyn_triton",
    "steer_site_reference",
    "steer_site_triton",
]


def __getattr__(name: str) -> Any:
    if name in ("steer_site_triton", "steer_site_dyn_triton"):
        from dynsteer.kernels import triton_steer

        return getattr(triton_steer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
