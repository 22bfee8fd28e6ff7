"""An in-process subscriber of a ``resid`` stream, for tests whose engine runs in the test's process (generate blocks
the main thread, so frames are received on a thread of their own)."""

from __future__ import annotations

import threading
import time

from dynsteer.config import DynsteerConfig


class StreamCollector(threading.Thread):
    """Receives the ``resid`` stream's frames (or those of ``streams``) until :meth:`finish`."""

    def __init__(self, cfg: DynsteerConfig, name: str = "collector", streams: tuple[str, ...] = ("resid",)) -> None:
        super().__init__(daemon=True)
        from dynsteer.monitor.client import MonitorClient

        self.mon = MonitorClient(cfg.monitor.endpoint, cfg.monitor.command_endpoint, name=name, streams=list(streams),
                                 policy="drop", max_pending=100000)
        self.frames: list = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            frame = self.mon.recv(timeout_s=0.1)
            if frame is not None:
                self.frames.append(frame)

    def finish(self, expect: int, timeout_s: float = 10.0) -> list:
        """Wait until ``expect`` positions arrived (or ``timeout_s``), stop and close; the frames received."""
        deadline = time.monotonic() + timeout_s
        while sum(len(f.positions) for f in self.frames) < expect and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop.set()
        self.join()
        self.mon.close()
        return self.frames
