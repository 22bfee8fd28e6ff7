"""The ``dynsteer`` command line (typer)."""

from dynsteer.cli.app import app, main

__all__ = ["app", "main"]
