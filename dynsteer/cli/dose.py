"""``dynsteer dose recommend``: the strongest relative dose of a steering vector that keeps replies fluent, with a
random control of equal norm and held-out figures (:mod:`dynsteer.sweep.dose_search`)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

import typer

dose_app = typer.Typer(help="Relative doses of steering vectors.", no_args_is_help=True)


def split_prompts(prompts: list[str], held_out: float, seed: int) -> tuple[list[str], list[str]]:
    """Distinct prompts, shuffled with ``seed``, split into (tuning, held-out); each split gets at least one.

    Raises:
        ValueError: fewer than two distinct prompts, ``held_out`` outside (0, 1).
    """
    unique = list(dict.fromkeys(prompts))
    if len(unique) < 2:
        raise ValueError("--prompts: need at least two distinct prompts (a tuning and a held-out split)")
    if not 0 < held_out < 1:
        raise ValueError(f"--held-out: a fraction in (0, 1), got {held_out}")
    random.Random(seed).shuffle(unique)
    n_held = min(len(unique) - 1, max(1, round(held_out * len(unique))))
    return unique[n_held:], unique[:n_held]


@dose_app.command("recommend")
def recommend(
    model: str = typer.Argument(..., help="model directory or name"),
    vector: Path = typer.Option(..., help="steering vector: .npy, or a steering-vector .safetensors file"),
    layer: int = typer.Option(..., help="decoder layer to add it at"),
    site: str = typer.Option("post_block", help="residual site"),
    prompts: Path = typer.Option(..., help="JSONL prompt file ({\"prompt\": ...} per line), split into tuning and "
                                           "held-out prompts"),
    probe: Optional[Path] = typer.Option(None, help="concept score: this probe file's P(--target-class) on the reply"),
    target_class: int = typer.Option(1, help="the probe's concept class"),
    words: Optional[str] = typer.Option(None, help="concept score without a probe: comma-separated concept words"),
    opposite_words: str = typer.Option("", help="with --words: comma-separated words that count against"),
    held_out: float = typer.Option(0.5, help="fraction of the prompts held out"),
    doses: Optional[str] = typer.Option(None, help="comma-separated relative doses to try, increasing "
                                                   "(default 0.02,0.05,0.1,0.15,0.2,0.3,0.4,0.6,0.8)"),
    max_perplexity_ratio: float = typer.Option(1.5, help="bound: mean perplexity ≤ this × unsteered"),
    max_repeat_4gram: float = typer.Option(0.05, help="bound: mean fraction of repeated 4-grams"),
    max_tokens: int = typer.Option(32, help="greedy tokens per reply"),
    seed: int = typer.Option(0, help="split shuffle and random-control seed"),
    dtype: str = typer.Option("auto", help="engine dtype"),
    max_model_len: int = typer.Option(1024, help="engine context length"),
    out: Optional[Path] = typer.Option(None, help="write the full result (every step, every reply) as JSON"),
) -> None:
    """Step the dose up on the tuning prompts, keep the strongest with perplexity and repetition within the bounds,
    and report it beside a random direction of equal norm, on the held-out prompts."""
    from dynsteer.sweep.config import load_prompts
    from dynsteer.sweep.dose_search import DEFAULT_DOSES, recommend_dose
    from dynsteer.sweep.quality import probe_concept, word_concept
    from dynsteer.sweep.vectorref import load_vector_file

    try:
        if (probe is None) == (words is None):
            raise ValueError("--probe / --words: give exactly one concept score")
        texts = [p.prompt for p in load_prompts(prompts) if p.prompt]
        tune, held = split_prompts(texts, held_out, seed)
        vec = load_vector_file(vector, layer)
        grid = tuple(float(x) for x in doses.split(",")) if doses else DEFAULT_DOSES
        loaded: Any = None
        if probe is not None:
            from dynsteer.probes import load_probe

            loaded = load_probe(probe)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    from dynsteer import attach
    from dynsteer.cli.vector import make_engine

    places = [layer] + ([loaded.meta.layer] if loaded is not None else [])
    if loaded is not None and loaded.meta.site != site:
        raise typer.BadParameter(f"--probe reads site {loaded.meta.site!r}; this command captures --site {site!r}")
    from dynsteer.cli.engine import closing_engine

    with closing_engine(make_engine(model, site, places, dtype=dtype, max_model_len=max_model_len)) as llm:
        st = attach(llm)
        if loaded is not None:
            concept = probe_concept(st, loaded, layer=loaded.meta.layer, site=site, target_class=target_class)
        else:
            concept = word_concept(words.split(","),  # type: ignore[union-attr]
                                   [w for w in opposite_words.split(",") if w])
        rec = recommend_dose(st, vec, layer=layer, site=site, tune_prompts=tune, held_prompts=held, concept=concept,
                             doses=grid, max_perplexity_ratio=max_perplexity_ratio,
                             max_repeat_4gram=max_repeat_4gram, max_tokens=max_tokens, seed=seed)
    typer.echo(rec.summary())
    if out is not None:
        out.write_text(json.dumps(json.loads(rec.model_dump_json()), indent=1) + "\n")
        typer.echo(f"wrote {out}")
