"""Host mirror of each steering site's summary for the custom op's eager calls.

``SteeringTables`` keeps every site's summary (the OR of the ``row_live`` flags of the rows a step reads; 0: nothing
at this site this step) on the device, in ``row_live[0]``, and on the host. Inside a CUDA graph the kernel reads the
device copy. In a step that runs eagerly (prefill and mixed batches larger than vLLM's captured sizes, or
``enforce_eager``), ``steer_add_rms_norm`` is called from Python once per fused site pair, and the launch of the
50-argument kernel costs far more host time than the norm costs the device. There the op asks :func:`idle`: when
both sites are idle and nothing is captured, it launches the 9-argument add-norm kernel instead (the same bits).

The host summary is written before the step's forward is issued (``SteeringTables.summarize`` / ``write_row``), and
the forward's eager op calls run in host order after it, so the host copy is the one the step's kernels would read.
Lookups are keyed by the ``row_live`` tensor's address and hold only while that tensor is alive: an unknown or dead
tensor is never idle (the full kernel runs, correct and slower).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from dynsteer.kernels.site_tables import ROW_LIVE

__all__ = ["idle", "watch"]


_watched: dict[int, tuple[weakref.ref[torch.Tensor], np.ndarray, int]] = {}


def watch(row_live: torch.Tensor, summaries: np.ndarray, index: int) -> None:
    """Let :func:`idle` answer for the site whose ``row_live`` this is, from ``summaries[index]`` (host int32)."""
    key = row_live.data_ptr()

    def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
        entry = _watched.get(key)
        if entry is not None and entry[0] is ref:
            del _watched[key]

    _watched[key] = (weakref.ref(row_live, forget), summaries, index)


def idle(tabs: Sequence[torch.Tensor]) -> bool:
    """Whether the site with these tables does nothing this step: no tables (no site), or a watched site whose
    summary is 0. ``False`` for any table set this module was not told about."""
    if not tabs:
        return True
    live = tabs[ROW_LIVE]
    entry = _watched.get(live.data_ptr())
    if entry is None:
        return False
    ref, summaries, index = entry
    # the watched tensor alive: this address is its memory (a view at offset 0 reads the same flags)
    return ref() is not None and summaries[index] == 0
