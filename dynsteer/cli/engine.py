"""Engines started by CLI commands: shut down explicitly before the command returns.

Left to interpreter exit, vLLM's engine core client is torn down while module globals are being cleared; on CPU this
occasionally aborts the process (``terminate called without an active exception``, exit -6) after the command's work
is done. Shutting the engine core down while the interpreter is whole avoids that race.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

__all__ = ["closing_engine", "shutdown_engine"]


def shutdown_engine(llm: Any) -> None:
    """Stop ``llm``'s engine core (its processes and sockets); best effort, never raises."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - the command's result is already out; a failed stop must not hide it
        pass
    gc.collect()


@contextlib.contextmanager
def closing_engine(llm: Any) -> Iterator[Any]:
    """``with closing_engine(LLM(...)) as llm:`` — the engine core stops when the block ends, whatever happened."""
    try:
        yield llm
    finally:
        shutdown_engine(llm)
