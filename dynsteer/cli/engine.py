"""Engines started by CLI commands: shut down explicitly before the command returns, and the process ended without
interpreter teardown once one has run.

Left to interpreter exit, vLLM's engine core client is torn down while module globals are being cleared; on CPU this
occasionally aborts the process (``terminate called without an active exception``, exit -6) after the command's work
is done. Shutting the engine core down while the interpreter is whole makes that rarer but not impossible: native
threads of the libraries vLLM loads (ZeroMQ's, torch's) outlive the shutdown and race the teardown. So a command
that ran an engine ends its process with :func:`end_process` (exit handlers and flushed output, then ``os._exit``):
its result and exit code are out, and nothing is left to tear down.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

__all__ = ["closing_engine", "end_process", "engine_ran", "shutdown_engine"]

_ran = False  # this process started (and stopped) an engine


def engine_ran() -> bool:
    """Whether a CLI command of this process stopped an engine (the process then ends with :func:`end_process`)."""
    return _ran


def shutdown_engine(llm: Any) -> None:
    """Stop ``llm``'s engine core (its processes and sockets); best effort, never raises."""
    global _ran
    _ran = True
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


def exit_code(code: Any) -> int:
    """``SystemExit.code`` as a process exit status (``None``: 0; a message: printed to stderr, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def end_process(code: Any) -> NoReturn:
    """End the process with ``code`` (as :class:`SystemExit` takes it): exit handlers run (child processes joined,
    logs flushed), stdout and stderr are flushed, then ``os._exit`` skips the interpreter's teardown."""
    status = exit_code(code)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)
