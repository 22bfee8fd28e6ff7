"""``dynsteer doctor [MODEL]``: a self-check of dynsteer inside vLLM on this machine, printed as a report.

Every check compares greedy token ids, so each one can fail:

* **hooked**: the plugin loaded in the engine's workers and hooked the model's decoder layers;
* **steering fires**: a per-request vector changes the continuation (the vector grows ×10 until it does);
* **batchmates untouched**: unsteered requests batched with steered ones equal the same batch run unsteered;
* **clear restores**: a global vector changes the output and clearing it gives the baseline back exactly;
* **prefix cache**: an unsteered repeat hits the cache; prefill steering forks the cache key (no hit, and the
  unsteered prompt's KV is never served to it, nor its KV to unsteered requests); decode-only steering keeps the
  prompt's hits;
* **decode cost**: wall time of the same decode batch unsteered and with every request steered (interleaved
  repeats, medians); fails above ``max_overhead``.

Below the checks it lists what dynsteer overrides in vLLM (:mod:`dynsteer.engine.patching`), and in which
processes: this one (the frontend), the engine core's and rank 0's worker's (one process with the engine core's
where vLLM runs the worker in it, as on one GPU).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynsteer.cli.progress import Steps

PROMPTS = ["The weather today is", "My favourite food is", "In the morning I usually", "The best way to learn is"]
LONG = ("Here is a long shared preamble that many requests start with, so that its blocks can be cached and reused. "
        * 6) + "Now answer briefly: what is the capital of France?"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Patched:
    """One vLLM attribute dynsteer overrides, and in which processes (``frontend``, ``engine core``, ``worker``)."""

    owner: str  # the class or module
    name: str
    kind: str
    function: str
    why: str
    where: list[str]


def resolve_model(model: str | None) -> Path:
    """``tiny`` (default: a tiny random Llama built locally), ``smollm2`` (converted once) or a model directory."""
    if model in (None, "tiny"):
        from dynsteer.testing.tiny_models import tiny_model

        return tiny_model("llama")
    if model == "smollm2":
        from dynsteer.zoo import smollm2

        return smollm2()
    return Path(model)


def run_doctor(model: str | None, max_overhead: float = 2.0, verbose: bool = False,
               gpu_memory_utilization: float = 0.3) -> bool:
    """Run every check, print the report, return whether all passed."""
    from rich.console import Console

    from dynsteer.cli.logs import quiet_vllm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with quiet_vllm(verbose, "dynsteer-doctor") as (log, terminal):
        checks, patched, device, path = _run(Console(file=terminal), model, max_overhead, gpu_memory_utilization)
    return _report(Console(), checks, patched, device, path, log)


def _run(console: Any, model: str | None, max_overhead: float,
         gpu_memory_utilization: float) -> tuple[list[Check], list[Patched], str, Path]:
    import torch

    path = resolve_model(model)

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(max_model_len=512, max_num_seqs=8, seed=0, enable_prefix_caching=True,
                                  block_size=16)
    kwargs.update(dict(gpu_memory_utilization=gpu_memory_utilization) if cuda else
                  dict(dtype="float32", enforce_eager=True))
    from vllm import LLM

    import dynsteer

    steps = Steps(console)
    expect = "about 1 min" if cuda else "1-2 min on CPU, longer for a larger model"
    with steps.step(f"starting vLLM on {path.name}", expect):
        llm = LLM(model=str(path), **kwargs)
    checks: list[Check] = []
    try:
        checks = _checks(llm, dynsteer.attach(llm), max_overhead, steps)
        patched = patches(llm)
    finally:
        from dynsteer.cli.engine import shutdown_engine

        shutdown_engine(llm)  # vLLM's shutdown messages land in the log, not under the report
        del llm
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)"
    return checks, patched, device, path


def patches(llm: Any) -> list[Patched]:
    """What dynsteer overrides in vLLM in this process and in ``llm``'s engine core and rank-0 worker, merged."""
    from dynsteer.engine import keys, patching

    merged: dict[tuple[str, str, str, str], Patched] = {}
    for where, rows in (("frontend", patching.applied_json()), *llm.collective_rpc(keys.RPC_PATCHES)[0].items()):
        for row in rows:
            key = (row["owner"], row["name"], row["kind"], row["function"])
            entry = merged.setdefault(key, Patched(*key[:2], row["kind"], row["function"], row["why"], []))
            entry.where.append(where)
    return sorted(merged.values(), key=lambda p: (p.owner, p.name))


def patch_table(patched: list[Patched]) -> Any:
    """The report's table of overrides: ``Class.attribute`` (never folded) under its module."""
    from rich.table import Table

    table = Table(title=f"vLLM attributes dynsteer overrides ({len(patched)})")
    width = max((len(_short(p)) for p in patched), default=10)
    table.add_column("vLLM attribute", no_wrap=True, min_width=width)
    table.add_column("in", overflow="fold")
    table.add_column("kind", no_wrap=True)
    table.add_column("where", no_wrap=True)
    table.add_column("dynsteer", overflow="fold")
    table.add_column("why")
    for p in patched:
        module = p.owner.removesuffix(_short(p).rsplit(".", 1)[0]).rstrip(".") or p.owner
        table.add_row(_short(p), module, p.kind, ", ".join(p.where), p.function.removeprefix("dynsteer."), p.why)
    return table


def _short(p: Patched) -> str:
    """``Class.attribute`` (a module's function: ``function``): the owner's last part, which is a class name when
    it starts with a capital."""
    last = p.owner.rsplit(".", 1)[-1]
    return f"{last}.{p.name}" if last[:1].isupper() else p.name


def _report(console: Any, checks: list[Check], patched: list[Patched], device: str, path: Path,
            log: Path | None) -> bool:
    import torch
    from rich.table import Table

    import dynsteer

    table = Table(title=f"dynsteer doctor: {path.name} on {device}", show_lines=True)
    table.add_column("check", style="bold")
    table.add_column("result")
    table.add_column("detail")
    for c in checks:
        table.add_row(c.name, "[green]PASS[/green]" if c.ok else "[red]FAIL[/red]", c.detail)
    console.print(table)
    console.print(patch_table(patched))
    ok = bool(checks) and all(c.ok for c in checks)
    console.print(f"dynsteer {dynsteer.__version__}, vLLM {_vllm_version()}, torch {torch.__version__}: "
                  + ("[green]all checks passed[/green]" if ok else "[red]some checks failed[/red]")
                  + ("" if log is None else f" (vLLM's log: {log})"))
    return ok


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def _checks(llm: Any, steerer: Any, max_overhead: float, steps: Steps | None = None) -> list[Check]:
    """Every check, in order; ``steps`` prints each one as it starts and ends (PASS/FAIL, seconds)."""
    from vllm import SamplingParams

    from dynsteer import AddVector, SteeringSpec

    steps = steps or Steps(None)
    shape = steerer.shape
    checks: list[Check] = []

    @contextlib.contextmanager
    def check(name: str) -> Iterator[None]:
        with steps.step(f"check: {name}") as step:
            yield
            step.result = "PASS" if checks and checks[-1].name == name and checks[-1].ok else "FAIL"

    with check("hooked"):
        layers = shape.num_layers if shape.layers is None else len(shape.layers)
        rank = steerer.describe()[0]
        checks.append(Check("hooked", layers > 0 and rank["rows_total"] > 0,
                            f"{shape.architecture}: {layers}/{shape.num_layers} layers × {len(shape.sites)} sites, "
                            f"hidden {shape.hidden_size}, {rank['rows_total']} table rows"))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    layer = (shape.num_layers // 2) if shape.layers is None else shape.layers[len(shape.layers) // 2]
    direction = np.random.default_rng(0).standard_normal(shape.hidden_size).astype(np.float32)
    direction /= np.linalg.norm(direction)

    def ids(outputs: list[Any]) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in outputs]

    def spec(scale: float, tier: str = "base") -> SteeringSpec:
        return SteeringSpec(vectors=[AddVector(layer=layer, vector=direction, scale=scale, tier=tier)])

    with check("steering fires"):  # grow the vector until the continuation changes (max_abs_value bounds it)
        base = ids(steerer.generate(PROMPTS, params, use_tqdm=False))
        scale, fired = float(np.sqrt(shape.hidden_size)), None
        while scale * float(np.abs(direction).max()) <= shape.max_abs_value:
            out = ids(steerer.generate(PROMPTS[:1], params, steering=spec(scale), use_tqdm=False))
            if out[0] != base[0]:
                fired = scale
                break
            scale *= 10
        checks.append(Check("steering fires", fired is not None,
                            f"a vector of norm {fired:.3g} at layer {layer} changes the continuation" if fired else
                            f"no vector up to norm {scale / 10:.3g} at layer {layer} changed the output"))
        scale = fired or scale / 10
    with check("batchmates untouched"):  # the same batch shape, steered rows interleaved
        mixed = ids(steerer.generate(PROMPTS, params, steering=[spec(scale), None, spec(scale), None],
                                     use_tqdm=False))
        untouched = mixed[1] == base[1] and mixed[3] == base[3]
        checks.append(Check("batchmates untouched", untouched and mixed[0] != base[0],
                            "unsteered rows of a mixed batch equal the unsteered batch token for token" if untouched
                            else "an unsteered request in a mixed batch differs from the unsteered batch"))
    with check("clear restores baseline"):  # global steering, then clear
        steerer.set_layer_vector(layer, direction, scale=scale)
        steered = ids(steerer.generate(PROMPTS, params, use_tqdm=False))
        steerer.clear_all()
        cleared = ids(steerer.generate(PROMPTS, params, use_tqdm=False))
        changed = sum(a != b for a, b in zip(steered, base))
        checks.append(Check("clear restores baseline", changed > 0 and cleared == base,
                            f"global vector changed {changed}/{len(PROMPTS)} outputs; after clear_all "
                            + ("every token equals the baseline" if cleared == base else
                               "outputs DIFFER from baseline")))
    with check("prefix cache"):
        checks.append(_prefix_cache(steerer, params, [spec(scale * 10**k, "prefill") for k in range(3)],
                                    spec(scale, "decode")))
    with check("decode cost"):
        checks.append(_decode_cost(steerer, spec(scale, "decode"), max_overhead))
    return checks


def _prefix_cache(steerer: Any, params: Any, prefills: list[Any], decode: Any) -> Check:
    """``prefills``: prefill-only specs of growing strength (the first that changes the output is used, so that
    the unsteered prompt's KV being served to it, or its KV to unsteered requests, would show in the tokens)."""
    def run(steering: Any = None) -> tuple[list[int], int]:
        out = steerer.generate([LONG], params, steering=steering, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    first, _ = run()
    again, hits = run()
    for prefill in prefills:
        pre1, pre1_hits = run(prefill)
        if pre1 != first or pre1_hits:
            break
    pre2, pre2_hits = run(prefill)
    after, after_hits = run()
    dec, dec_hits = run(decode)
    problems = []
    if again != first or hits == 0:
        problems.append(f"unsteered repeat: {hits} cached tokens, output {'same' if again == first else 'DIFFERS'}")
    if pre1_hits:
        problems.append(f"prefill-steered request reused {pre1_hits} unsteered cached tokens")
    if pre1 == first:
        problems.append("no prefill steering tried changed the output (cannot show which KV it used)")
    if pre2 != pre1 or pre2_hits == 0:
        problems.append(f"prefill-steered repeat: {pre2_hits} cached tokens, output "
                        f"{'same' if pre2 == pre1 else 'DIFFERS'}")
    if after != first or after_hits == 0:
        problems.append(f"unsteered after steered: {after_hits} cached tokens, output "
                        f"{'same' if after == first else 'DIFFERS (steered KV served)'}")
    if dec_hits == 0:
        problems.append("decode-only steering lost the prompt's cache hits")
    detail = "; ".join(problems) or (f"unsteered repeat hits {hits} tokens; prefill steering forks the key (0 hits, "
                                     f"then {pre2_hits} among steered); unsteered output unchanged after it; "
                                     f"decode-only steering keeps {dec_hits} hits")
    return Check("prefix cache", not problems, detail)


def _decode_cost(steerer: Any, decode: Any, max_overhead: float, repeats: int = 3) -> Check:
    from vllm import SamplingParams

    prompts = [f"{p} and" for p in PROMPTS * 2]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    steerer.generate(prompts, params, steering=decode, use_tqdm=False)  # warm both paths
    steerer.generate(prompts, params, use_tqdm=False)
    idle, steered = [], []
    for _ in range(repeats):
        for times, steering in ((idle, None), (steered, decode)):
            t0 = time.perf_counter()
            steerer.generate(prompts, params, steering=steering, use_tqdm=False)
            times.append(time.perf_counter() - t0)
    tokens = len(prompts) * params.max_tokens
    a, b = statistics.median(idle), statistics.median(steered)
    ratio = b / a
    return Check("decode cost", ratio <= max_overhead,
                 f"batch {len(prompts)} × {params.max_tokens} tokens: idle {1e3 * a / params.max_tokens:.1f} ms/step "
                 f"({tokens / a:.0f} tok/s), every request steered {1e3 * b / params.max_tokens:.1f} ms/step "
                 f"({tokens / b:.0f} tok/s): ×{ratio:.2f} (limit ×{max_overhead:g}; medians of {repeats})")
