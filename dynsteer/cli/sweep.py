"""``dynsteer sweep``: run a policy or steering spec over a grid of its fields and a labelled prompt set."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer

__all__ = ["engine_config", "make_engine", "parse_engine_args", "quiet_vllm_logs", "sweep"]


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


ENGINE_OWNED = ("model", "additional_config")
"""Engine arguments the sweep sets itself (the model and dynsteer's own configuration)."""


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` (values as YAML: ``8``, ``0.5``, ``true``, ``bfloat16``, ``{...}``) → engine keyword
    arguments, checked against vLLM's ``EngineArgs`` fields.

    Raises:
        ValueError: naming the malformed item or the unknown key (with the closest valid names).
    """
    import dataclasses
    import difflib

    import vllm
    import yaml

    known = {f.name for f in dataclasses.fields(vllm.EngineArgs)}  # what vllm.LLM(**kwargs) accepts
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE (e.g. max_num_seqs=16)")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            raise ValueError(f"--engine-arg {key}: not a vLLM engine argument"
                             + (f" (did you mean {', '.join(close)}?)" if close else ""))
        if key in ENGINE_OWNED:
            raise ValueError(f"--engine-arg {key}: set by the sweep itself (use --model for the model)")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"--engine-arg {key}: value is not valid YAML: {exc}") from None
    return out


def make_engine(model: str, cfg: Any, *, dtype: str = "auto", max_model_len: int = 1024, eager: bool = True,
                engine_args: dict[str, Any] | None = None) -> Any:
    """A ``vllm.LLM`` with :func:`engine_config` and ``engine_args`` (a separate function so tests can hand in a
    running engine)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {"dtype": dtype, "max_model_len": max_model_len, "seed": 0, "enforce_eager": eager,
                              **(engine_args or {}), **engine_config(cfg).engine_kwargs()}
    return LLM(model=model, **kwargs)


def quiet_vllm_logs(verbose: bool) -> None:
    """vLLM logs errors only unless ``verbose`` (then INFO): in this process and in the engine core it starts (which
    reads the environment); an explicit ``VLLM_LOGGING_LEVEL`` wins."""
    import logging

    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    logging.getLogger("vllm").setLevel(level.upper())  # vLLM may be imported already (its logger is configured)


def sweep(
    target: Path = typer.Argument(..., help="policy or steering-spec file (YAML or JSON; vectors inline, "
                                            "{file: x.npy}, {file: x.safetensors} or {name: registered}; "
                                            "examples in examples/sweeps/)"),
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
    random_control: bool = typer.Option(True, "--random-control/--no-random-control",
                                        help="add each steered variant's random-direction control (same norm, "
                                             "layer, site, scale and gates)"),
    control_seed: int = typer.Option(0, help="seed of the random controls' directions"),
    vector: list[str] = typer.Option([], "--vector", help="NAME=FILE: register a vector (.npy or steering-vector "
                                                          ".safetensors[:LAYER]) that the policy names"),
    dtype: str = typer.Option("auto", help="model dtype (auto, float32, bfloat16, float16)"),
    max_model_len: int = typer.Option(1024, help="engine context length"),
    enforce_eager: bool = typer.Option(True, "--enforce-eager/--no-enforce-eager",
                                       help="eager mode (no torch.compile or CUDA graphs: quick to start)"),
    kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb", min=0.01,
                                                help="KV cache size in GiB (default: 1 on CPU; on GPU, vLLM's "
                                                     "share of --gpu-memory-utilization)"),
    gpu_memory_utilization: Optional[float] = typer.Option(None, min=0.01, max=1.0,
                                                           help="GPU memory share for the engine (vLLM: 0.9)"),
    max_num_seqs: Optional[int] = typer.Option(None, min=1, help="requests the engine runs at once"),
    engine_arg: list[str] = typer.Option([], "--engine-arg", help="KEY=VALUE passed to vllm.LLM (value as YAML; "
                                                                  "repeat), e.g. --engine-arg tensor_parallel_size=2"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show vLLM's INFO logs (default: errors only)"),
    overwrite: bool = typer.Option(False, help="replace a different sweep found in --out"),
) -> None:
    """Sweep a policy or spec over a grid; write samples.jsonl, summary.csv and report.html (resumable)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    quiet_vllm_logs(verbose)
    from rich.console import Console

    import dynsteer
    from dynsteer.sweep import SweepConfig, SweepMismatchError, load_target, run_sweep

    console = Console()
    try:
        named = _named_vectors(vector)
        cfg = SweepConfig.build(
            load_target(target), grid=grid, prompts=prompts, samples=samples, seed=seed, max_tokens=max_tokens,
            temperature=temperature, target_class=target_class, leave_alone=tuple(leave_alone) or None,
            probe_file=str(probe) if probe else None, concept_class=concept_class, chat=not raw,
            words=tuple(w.strip() for w in words.read_text().splitlines() if w.strip()) if words else (),
            batch_size=batch_size, registered_vectors={k: _digest(v) for k, v in named.items()},
            random_control=random_control, control_seed=control_seed)
        extra = parse_engine_args(engine_arg)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    common = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30) if kv_cache_gb else None,
              "gpu_memory_utilization": gpu_memory_utilization, "max_num_seqs": max_num_seqs}
    extra = {**{k: v for k, v in common.items() if v is not None}, **extra}
    if model is None:
        from dynsteer.zoo import smollm2

        model = str(smollm2())
    with console.status("starting vLLM"):
        llm = make_engine(model, cfg, dtype=dtype, max_model_len=max_model_len, eager=enforce_eager,
                          engine_args=extra)
    from dynsteer.cli.engine import closing_engine

    with closing_engine(llm):
        steerer = dynsteer.attach(llm)
        try:
            for name, arr in named.items():
                steerer.register_vector(name, arr)
        except ValueError as exc:
            raise typer.BadParameter(f"--vector {exc}") from None
        try:
            result = run_sweep(cfg, steerer, out, overwrite=overwrite)
        except SweepMismatchError as exc:
            console.print(f"[red]{exc}[/red] (use --overwrite)")
            raise typer.Exit(2) from None
    console.print(f"{result.generated} samples generated, {result.skipped} already done; "
                  f"{result.samples_jsonl}, {result.summary_csv}, {result.report_html}")


def _named_vectors(items: list[str]) -> dict[str, Any]:
    """``--vector NAME=FILE[:LAYER]`` → ``{name: vector}`` (files as in :mod:`dynsteer.sweep.vectorref`)."""
    from dynsteer.sweep.vectorref import load_vector_file

    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--vector {item!r}: expected NAME=FILE (a .npy or steering-vector .safetensors file)")
        layer = None
        head, colon, tail = path.rpartition(":")
        if colon and tail.isdigit():
            path, layer = head, int(tail)
        try:
            out[name] = load_vector_file(path, layer)
        except ValueError as exc:
            raise ValueError(f"--vector {name}: {exc}") from None
    return out


def _digest(arr: Any) -> str:
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(arr, dtype="<f4").tobytes()).hexdigest()
