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


class HostRing:
    """Pinned host buffers for per-step device-to-host copies: ``depth`` flat float32 buffers allocated once (each
    holding the largest copy) with an event each, so a step's copy allocates nothing and creates no event. Slots are
    taken in order; the caller frees one (consumes its copy) before the ring wraps onto it."""

    def __init__(self, numel: int, depth: int = 8) -> None:
        # device="cpu" explicitly: this runs during model construction, under vLLM's default-device context.
        self.slots = [torch.empty(numel, dtype=torch.float32, device="cpu", pin_memory=True) for _ in range(depth)]
        self.views = [slot.numpy() for slot in self.slots]
        self.events = [torch.cuda.Event() for _ in range(depth)]
        self.depth = depth
        self.i = -1

    def copy(self, src: torch.Tensor, stream: Any) -> tuple[Any, np.ndarray]:
        """Copy the contiguous ``src`` into the next slot on ``stream`` (non-blocking) and record its event there;
        returns ``(event, host view shaped like src)``, valid until the ring comes back to this slot."""
        self.i = (self.i + 1) % self.depth
        n = src.numel()
        self.slots[self.i][:n].copy_(src.reshape(-1), non_blocking=True)
        ev = self.events[self.i]
        ev.record(stream)
        return ev, self.views[self.i][:n].reshape(src.shape)
