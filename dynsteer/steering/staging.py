"""Pinned host staging for small per-step uploads (row indices, control words): the host never waits on the device."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class StagingRing:
    """Host staging for a device int32 buffer: pinned slots, non-blocking copies, a slot reused only after its
    copy's event completed (long done by then: the ring is deeper than the steps in flight)."""

    def __init__(self, target: torch.Tensor, depth: int = 4) -> None:
        self.target = target
        self.cuda = target.is_cuda
        # device="cpu" explicitly: this runs during model construction, under vLLM's default-device context.
        self.slots = [torch.zeros(target.shape, dtype=target.dtype, device="cpu", pin_memory=self.cuda)
                      for _ in range(depth if self.cuda else 1)]
        self.views = [slot.numpy() for slot in self.slots]  # made once: Tensor.numpy() costs microseconds a call
        self.events: list[Any] = [None] * len(self.slots)
        self.i = 0

    def next(self) -> np.ndarray:
        self.i = (self.i + 1) % len(self.slots)
        if self.events[self.i] is not None:
            self.events[self.i].synchronize()
        return self.views[self.i]

    def copy_to(self, upto: int | None = None, row: int | None = None) -> None:
        """Send the current slot's first ``upto`` entries (``None``: all of it) to the device buffer (non-blocking
        from pinned memory); with ``row``, the first ``upto`` entries of that row of a 2-D buffer (contiguous)."""
        src, dst = self.slots[self.i], self.target
        if row is not None:
            src, dst = src[row], dst[row]
        if upto is None:
            dst.copy_(src, non_blocking=self.cuda)
        else:
            dst[:upto].copy_(src[:upto], non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events[self.i] = ev
