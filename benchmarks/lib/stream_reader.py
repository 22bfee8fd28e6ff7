"""A monitor that never fires, for the benchmarks that measure stream delivery: it reads every value of every frame
its :class:`~dynsteer.monitor.client.MonitorClient` receives, on a thread of its own, and counts rows and bytes."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class FrameReader:
    """Reads ``client``'s frames until closed; ``on_bytes`` (optional) is told each value array's size as it is
    read."""

    def __init__(self, client: Any, on_bytes: Callable[[int], None] | None = None, name: str = "bench-monitor") -> None:
        self.client, self.on_bytes = client, on_bytes
        self.rows = self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            frame = self.client.recv(timeout_s=0.05)
            if frame is not None:
                for values in frame.values.values():
                    values.sum()  # a monitor reads every value
                    self.bytes += values.nbytes
                    if self.on_bytes is not None:
                        self.on_bytes(values.nbytes)
                self.rows += len(frame.positions)

    def settle(self, want: int, quiet_s: float = 2.0, timeout_s: float = 30.0, poll_s: float = 0.001) -> None:
        """Wait until ``rows`` reaches ``want``, or none arrives for ``quiet_s`` seconds (frames still in flight after
        the traffic's last response), or ``timeout_s`` passes."""
        deadline, seen, quiet = time.monotonic() + timeout_s, -1, time.monotonic()
        while self.rows < want and time.monotonic() < deadline:
            if self.rows != seen:
                seen, quiet = self.rows, time.monotonic()
            elif time.monotonic() - quiet > quiet_s:
                break
            time.sleep(poll_s)

    def close(self) -> None:
        """Stop reading and close the client."""
        self._stop.set()
        self._thread.join(10)
        self.client.close()
