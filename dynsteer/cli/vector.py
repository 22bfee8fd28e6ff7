"""``dynsteer vector make``: a steering-vector file from contrastive pairs (``caa``, ``pca``), a probe file
(``probe``) or an SAE's decoder rows (``sae``); see :mod:`dynsteer.make`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer

vector_app = typer.Typer(help="Make steering vectors.", no_args_is_help=True)

METHODS = ("caa", "pca", "probe", "sae")


def make_engine(model: str, site: str, layers: list[int], *, dtype: str, max_model_len: int) -> Any:
    """A ``vllm.LLM`` with capture buffers at ``(layers, site)`` (a separate function so tests can hand in a running
    engine)."""
    from vllm import LLM

    from dynsteer import DynsteerConfig

    return LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=0, enforce_eager=True,
               **DynsteerConfig(capture_sites=(site,), capture_layers=tuple(sorted(set(layers)))).engine_kwargs())


def model_hidden_size(model: str) -> int:
    """The model's hidden size from its config (a local directory or a cached hub name)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    return int(getattr(cfg, "hidden_size", None) or cfg.get_text_config().hidden_size)


def _positions(text: str) -> Any:
    if text in ("last", "all"):
        return text
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise typer.BadParameter(f"{text!r}: 'last', 'all' or a count k >= 1 (mean over the last k prompt tokens)",
                                 param_hint="--positions")
    return k


def _need(value: Any, option: str, method: str) -> Any:
    if value is None or value == []:
        raise typer.BadParameter(f"required with --method {method}", param_hint=option)
    return value


@vector_app.command()
def make(
    method: str = typer.Option(..., "--method", help="caa | pca (contrastive pairs) | probe | sae"),
    out: Path = typer.Option(..., "--out", "-o", help="vector file to write (.safetensors)"),
    pairs: Optional[Path] = typer.Option(None, help="caa/pca: JSONL, one {\"positive\": ..., \"negative\": ...} "
                                                    "per line (texts or lists of chat messages)"),
    model: Optional[str] = typer.Option(None, help="caa/pca: the model to read residuals from; probe/sae: checks "
                                                   "the vector's length against its hidden size"),
    layer: Optional[list[int]] = typer.Option(None, "--layer", help="caa/pca: layers (repeatable); sae: the layer "
                                                                   "when cfg.json has no hook_name"),
    site: Optional[str] = typer.Option(None, help="residual site: pre_attn | post_attn | post_block (caa/pca "
                                                  "default post_block; sae default from cfg.json)"),
    positions: str = typer.Option("last", help="caa/pca: 'last' prompt token, 'all' prompt tokens (mean) or K: the "
                                               "mean over the last K prompt tokens"),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template",
                                       help="caa/pca: render each side with the model's chat template"),
    probe: Optional[Path] = typer.Option(None, help="probe: the probe file"),
    sae: Optional[Path] = typer.Option(None, help="sae: SAE weights (a .safetensors file or a directory with "
                                                  "cfg.json)"),
    feature: Optional[list[int]] = typer.Option(None, "--feature", help="sae: feature index (repeatable; rows "
                                                                       "are summed)"),
    coefficient: Optional[list[float]] = typer.Option(None, "--coefficient", help="sae: one per --feature "
                                                                                 "(default 1)"),
    norm: Optional[float] = typer.Option(None, help="rescale each layer's vector to this L2 norm"),
    model_id: Optional[str] = typer.Option(None, help="model id recorded in the file (default: the engine's, the "
                                                      "probe's or cfg.json's)"),
    dtype: str = typer.Option("auto", help="caa/pca: model dtype"),
    max_model_len: int = typer.Option(1024, help="caa/pca: engine context length"),
    batch_size: int = typer.Option(32, help="caa/pca: prompts per engine pass"),
) -> None:
    """Make a steering-vector file (loadable with dynsteer.load_vector, DynsteerConfig(vectors=...), the server)."""
    from rich.console import Console
    from rich.table import Table

    from dynsteer.spec import SITES

    if method not in METHODS:
        raise typer.BadParameter(f"{method!r}: choose one of {', '.join(METHODS)}", param_hint="--method")
    if site is not None and site not in SITES:
        raise typer.BadParameter(f"{site!r}: one of {', '.join(SITES)}", param_hint="--site")
    if norm is not None and not norm > 0:
        raise typer.BadParameter(f"{norm}: give a number > 0", param_hint="--norm")
    console = Console()
    if method in ("caa", "pca"):
        made = _from_pairs(method, _need(pairs, "--pairs", method), _need(model, "--model", method),
                           _need(layer, "--layer", method), site or "post_block", _positions(positions),
                           chat_template, norm, dtype, max_model_len, batch_size)
    else:
        made = _from_file(method, probe, sae, feature, coefficient, layer, site, norm)
        if model is not None:
            try:
                made.check_hidden_size(model_hidden_size(model), f"--model {model}")
            except (OSError, ValueError) as exc:
                raise typer.BadParameter(str(exc), param_hint="--model") from None
    if model_id is not None:
        made.model_id = model_id
    made.save(out)
    table = Table(title=f"{out.name}: {made.method} at {made.site}")
    table.add_column("layer", justify="right")
    table.add_column("norm", justify="right")
    for k, v in made.norms.items():
        table.add_row(str(k), f"{v:.4g}")
    console.print(table)
    if "sae_layout" in made.meta:  # which of the two decoder layouts the file held
        typer.echo(f"decoder read from {made.meta['sae']}: {made.meta['sae_layout']}")
    typer.echo(f"wrote {out} ({made.hidden_size} dimensions, model {made.model_id or '?'})")


def _from_pairs(method: str, pairs: Path, model: str, layers: list[int], site: str, positions: Any,
                chat_template: bool, norm: Optional[float], dtype: str, max_model_len: int, batch_size: int) -> Any:
    import dynsteer
    from dynsteer.make import from_pairs
    from dynsteer.spec import SteeringValidationError
    from dynsteer.vectors.pairs import read_pairs

    try:
        data = read_pairs(pairs)  # before the engine starts: a bad line fails in a second
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--pairs") from None
    if method == "pca" and len(data) < 2:
        raise typer.BadParameter(f"{pairs}: PCA needs at least 2 pairs, the file has {len(data)}",
                                 param_hint="--pairs")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from dynsteer.cli.engine import closing_engine

    with closing_engine(make_engine(model, site, layers, dtype=dtype, max_model_len=max_model_len)) as llm:
        steerer = dynsteer.attach(llm)
        if any(not 0 <= k < steerer.num_layers for k in layers):
            raise typer.BadParameter(f"{layers}: the model has layers 0..{steerer.num_layers - 1}",
                                     param_hint="--layer")
        try:
            return from_pairs(steerer, data, layers=layers, method=method, site=site, positions=positions,
                              chat_template=chat_template, norm=norm, batch_size=batch_size, progress=True)
        except (ValueError, SteeringValidationError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--pairs") from None


def _from_file(method: str, probe: Optional[Path], sae: Optional[Path], feature: Optional[list[int]],
               coefficient: Optional[list[float]], layer: Optional[list[int]], site: Optional[str],
               norm: Optional[float]) -> Any:
    from dynsteer.make import from_probe, from_sae

    if method == "probe":
        try:
            return from_probe(_need(probe, "--probe", method), norm=norm)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--probe") from None
    path = _need(sae, "--sae", method)
    features = _need(feature, "--feature", method)
    if layer and len(layer) > 1:
        raise typer.BadParameter("an SAE reads one layer; give --layer once", param_hint="--layer")
    try:
        return from_sae(path, features, coefficients=coefficient or None, layer=layer[0] if layer else None,
                        site=site, norm=norm)
    except (OSError, ValueError) as exc:
        msg = str(exc)
        hint = ("--feature" if msg.startswith("features") else "--coefficient" if msg.startswith("coefficients")
                else "--layer" if msg.startswith("layer") else "--site" if msg.startswith("site") else "--sae")
        raise typer.BadParameter(msg, param_hint=hint) from None
