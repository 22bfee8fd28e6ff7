"""``dynsteer sweep``: run a policy or steering spec over a grid of its fields and a labelled prompt set."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer

__all__ = ["engine_config", "make_engine", "sweep"]


def engine_config(cfg: Any) -> Any:
    """The :class:`~dynsteer.DynsteerConfig` a sweep needs: capture buffers at the probe's place (concept score) and
    at the additive actions' places (to measure their residual norms once), and a gate slot per rule (+1 for a
    controller-only monitor)."""
    from dynsteer import DynsteerConfig
    from dynsteer.dose import dose_places
    from dynsteer.probefile.fileformat import load_probe

    target = cfg.target()
    places = set(dose_places(target))
    if cfg.probe_file is not None:
        probe = load_probe(cfg.probe_file)
        places.add((probe.layer, probe.site))
    gates = max(2, len(getattr(target, "rules", ())) + 1)
    return DynsteerConfig(capture_sites=tuple(sorted({s for _, s in places})),
                          capture_layers=tuple(sorted({layer for layer, _ in places})) or None, max_gates=gates)


def make_engine(model: str, cfg: Any, *, dtype: str = "auto", max_model_len: int = 1024, eager: bool = True) -> Any:
    """A ``vllm.LLM`` with :func:`engine_config` (a separate function so tests can hand in a running engine)."""
    from vllm import LLM

    return LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=0, enforce_eager=eager,
               **engine_config(cfg).engine_kwargs())


def sweep(
    target: Path = typer.Argument(..., help="policy or steering-spec file (YAML or JSON)"),
    prompts: Path = typer.Option(..., "--prompts", help="JSONL: {\"prompt\": ..., \"label\": ...} per line"),
    grid: list[str] = typer.Option([], "--grid", help="PATH=V1,V2,... e.g. rules[0].actions[0].scale=0,2,4 "
                                                      "(repeat for more axes)"),
    out: Path = typer.Option(Path("sweep-out"), "--out", help="output directory (re-running resumes)"),
    model: Optional[str] = typer.Option(None, help="model directory (default: SmolLM2-135M-Instruct)"),
    samples: int = typer.Option(1, help="samples per prompt and variant"),
    seed: int = typer.Option(0, help="seed of the first sample (sample s uses seed + s)"),
    max_tokens: int = typer.Option(32, help="tokens to generate per sample"),
    temperature: float = typer.Option(0.0, help="0: greedy"),
    target_class: Optional[str] = typer.Option(None, help="the class the policy should steer (selectivity)"),
    leave_alone: list[str] = typer.Option([], "--leave-alone", help="classes to leave alone (default: all others)"),
    probe: Optional[Path] = typer.Option(None, help="probe file for the concept score"),
    concept_class: int = typer.Option(1, help="probe class that is the concept (1: positive)"),
    words: Optional[Path] = typer.Option(None, help="word list file (one word per line) for a word concept score"),
    raw: bool = typer.Option(False, "--raw", help="send prompts as raw text (no chat template)"),
    batch_size: int = typer.Option(64, help="requests per batch (and per resume checkpoint)"),
    dtype: str = typer.Option("auto", help="model dtype"),
    max_model_len: int = typer.Option(1024, help="engine context length"),
    overwrite: bool = typer.Option(False, help="replace a different sweep found in --out"),
) -> None:
    """Sweep a policy or spec over a grid; write samples.jsonl, summary.csv and report.html (resumable)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rich.console import Console

    import dynsteer
    from dynsteer.sweep import SweepConfig, SweepMismatchError, load_target, run_sweep

    console = Console()
    try:
        cfg = SweepConfig.build(
            load_target(target), grid=grid, prompts=prompts, samples=samples, seed=seed, max_tokens=max_tokens,
            temperature=temperature, target_class=target_class, leave_alone=tuple(leave_alone) or None,
            probe_file=str(probe) if probe else None, concept_class=concept_class, chat=not raw,
            words=tuple(w.strip() for w in words.read_text().splitlines() if w.strip()) if words else (),
            batch_size=batch_size)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if model is None:
        from dynsteer.zoo import smollm2

        model = str(smollm2())
    with console.status("starting vLLM"):
        llm = make_engine(model, cfg, dtype=dtype, max_model_len=max_model_len)
    steerer = dynsteer.attach(llm)
    try:
        result = run_sweep(cfg, steerer, out, overwrite=overwrite)
    except SweepMismatchError as exc:
        console.print(f"[red]{exc}[/red] (use --overwrite)")
        raise typer.Exit(2) from None
    console.print(f"{result.generated} samples generated, {result.skipped} already done; "
                  f"{result.samples_jsonl}, {result.summary_csv}, {result.report_html}")
