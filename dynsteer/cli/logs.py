"""Keep vLLM's logs out of a CLI report unless asked for (``--verbose``)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def quiet_vllm(verbose: bool, name: str = "dynsteer") -> Iterator[tuple[Path | None, TextIO]]:
    """Send what is written to stdout and stderr while the block runs to a log file: vLLM's logs (it logs to
    stdout) and progress bars, torch's warnings, in this process and in the engine-core and worker processes it
    starts (they inherit the descriptors, so their shutdown messages land there too).

    Yields ``(log path, terminal)``: ``terminal`` writes to the real stdout (give it to ``rich.console.Console``).
    With ``verbose`` nothing is redirected: ``(None, sys.stdout)``. On an error the log's path is printed once
    the descriptors are back.
    """
    if verbose:
        yield None, sys.stdout
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(1), "w", buffering=1, encoding=getattr(sys.stdout, "encoding", None) or "utf-8")
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    failed = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield Path(path), terminal
    except BaseException:
        failed = True
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        terminal.close()
        for target, src in zip((1, 2), saved):
            os.dup2(src, target)
            os.close(src)
        if failed:
            print(f"{name}: vLLM's log is in {path}", file=sys.stderr)
