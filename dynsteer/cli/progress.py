"""Progress lines for CLI steps that can take a while (starting vLLM, a check, a model conversion).

A spinner alone leaves nothing on the screen once it stops, and nothing in a log or a CI transcript: each step
prints one line as it starts (with what to expect, e.g. how long a first run takes) and one as it ends, with the
seconds it took.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any


class Step:
    """A step being run; set :attr:`result` (e.g. ``"PASS"``) for its end line."""

    def __init__(self, what: str) -> None:
        self.what, self.result, self.started = what, "done", time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


class Steps:
    """Prints steps on ``console`` (a ``rich.console.Console``; ``None``: prints nothing)."""

    def __init__(self, console: Any | None) -> None:
        self.console = console

    @contextlib.contextmanager
    def step(self, what: str, expect: str = "") -> Iterator[Step]:
        """``with steps.step("starting vLLM", "first run ~1 min on CPU") as s: ...``; on an exception no end line
        is printed (the error says what happened)."""
        step = Step(what)
        if self.console is None:
            yield step
            return
        self.console.print(f"[dim]…[/dim] {what}" + (f" [dim]({expect})[/dim]" if expect else ""), highlight=False)
        with self.console.status(what):
            yield step
        self.console.print(f"[dim]✓[/dim] {what}: {step.result} in {step.elapsed:.1f} s", highlight=False)
