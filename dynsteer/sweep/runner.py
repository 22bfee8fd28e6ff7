"""Run a sweep: every variant of a policy (or steering spec) over a labelled prompt set, in one engine.

All variants go through one engine as per-request policies/specs, mixed in the same batches, next to an unsteered
baseline (variant ``v000``) and, unless ``cfg.random_control`` is off, each steered variant's random-direction control
(``r001`` for ``v001``: every added vector replaced by a seeded random direction of its norm,
:mod:`dynsteer.sweep.control`). Samples are appended to ``samples.jsonl`` after every batch, so an interrupted sweep
resumes where it stopped (finished samples are skipped; the output directory remembers the sweep's fingerprint and
refuses a different sweep). At the end ``samples.jsonl`` is rewritten in sample order, ``summary.csv`` written (one
row per variant and class) and ``report.html`` rendered (:mod:`dynsteer.sweep.report`). Nothing written depends on
time or on where the sweep was interrupted, so a greedy sweep run twice gives byte-identical files.

Example:
    >>> cfg = SweepConfig.build(policy, grid=["rules[0].actions[0].scale=0,2,4"], prompts="prompts.jsonl",
    ...                         target_class="complaint", probe_file="sentiment.safetensors")  # doctest: +SKIP
    >>> result = run_sweep(cfg, steerer, "sweep-out")                                           # doctest: +SKIP
    >>> result.summary_csv, result.report_html                                                  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dynsteer.dose import applied_dose, dose_places, enforce_dose_limit, relative_doses, residual_norms
from dynsteer.policy import DynamicSteeringPolicy
from dynsteer.sweep import metrics as M
from dynsteer.sweep.config import BASELINE, SweepConfig
from dynsteer.sweep.control import adds_anything, random_control
from dynsteer.sweep.grid import GridPathError, apply_point, grid_points, point_label
from dynsteer.sweep.quality import perplexities
from dynsteer.sweep.report import write_report
from dynsteer.sweep.summary import summarize, summary_csv_text
from dynsteer.sweep.types import SweepResult, Variant

__all__ = ["BASELINE", "SweepInterrupted", "SweepMismatchError", "SweepResult", "Variant", "make_variants",
           "run_sweep", "summarize"]


class SweepMismatchError(RuntimeError):
    """The output directory holds a different sweep (its fingerprint differs)."""


class SweepInterrupted(RuntimeError):
    """Raised by an ``on_batch`` callback to stop a sweep after a batch (what is done stays done)."""


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def make_variants(cfg: SweepConfig, norms: dict[tuple[int, str], float] | None,
                  named: dict[str, np.ndarray] | None = None) -> list[Variant]:
    """The baseline, one variant per grid point (a point that fails validation or the dose guardrail keeps its
    error and runs no samples), then, with ``cfg.random_control``, the random-direction control of every valid
    variant that adds a vector (id ``r`` + its variant's number, label ``random: `` + its label;
    :mod:`dynsteer.sweep.control`)."""
    base = cfg.target()
    variants = [Variant(id=BASELINE, point={}, label="unsteered")]
    for i, point in enumerate(grid_points(list(cfg.grid)), 1):
        v = Variant(id=f"v{i:03d}", point=point, label=point_label(point, cfg.grid))
        try:
            obj = apply_point(base, point)
            if isinstance(obj, DynamicSteeringPolicy):
                if norms is not None:
                    obj, v.doses = enforce_dose_limit(obj, norms, named)
                v.policy = obj
            else:
                if norms is not None:
                    v.doses = relative_doses(obj, norms, named)
                v.spec = obj
        except GridPathError:
            raise
        except ValueError as exc:
            v.error = " ".join(str(exc).split())
        variants.append(v)
    if cfg.random_control:
        variants += [_control(cfg, v, norms, named) for v in variants[1:] if v.error is None
                     and adds_anything(v.policy or v.spec)]  # type: ignore[arg-type]
    return variants


def _control(cfg: SweepConfig, v: Variant, norms: dict[tuple[int, str], float] | None,
             named: dict[str, np.ndarray] | None) -> Variant:
    """``v``'s random-direction control: the policy as sent (after the guardrail), so the same scales and doses (a
    vector name ``named`` lacks leaves the control with its error)."""
    c = Variant(id="r" + v.id[1:], point=v.point, label=f"random: {v.label}", control_of=v.id)
    try:
        obj = random_control(v.policy or v.spec, cfg.control_seed, named)  # type: ignore[type-var]
        c.doses = relative_doses(obj, norms) if norms is not None else []
    except ValueError as exc:
        c.error = " ".join(str(exc).split())
        return c
    if isinstance(obj, DynamicSteeringPolicy):
        c.policy = obj
    else:
        c.spec = obj
    return c


def _units(cfg: SweepConfig, variants: list[Variant]) -> list[tuple[str, Variant, int, int]]:
    """(key, variant, prompt index, sample): the baseline first, then prompt by prompt so batches mix variants."""
    live = [v for v in variants if v.error is None]
    order = [(v, p, s) for v in live[:1] for p in range(len(cfg.prompts)) for s in range(cfg.samples)]
    order += [(v, p, s) for p in range(len(cfg.prompts)) for s in range(cfg.samples) for v in live[1:]]
    return [(f"{v.id}/p{p:04d}/s{s:03d}", v, p, s) for v, p, s in order]


def _read_records(path: Path) -> list[dict[str, Any]]:
    """Valid records of a (possibly interrupted) JSONL file; a torn last line is dropped and the file repaired."""
    if not path.is_file():
        return []
    records, good = [], []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            break
        if isinstance(rec, dict) and "id" in rec:
            records.append(rec)
            good.append(line)
    text = "".join(g + "\n" for g in good)
    if text != path.read_text():
        _atomic_write(path, text)
    return records


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check_out_dir(out: Path, cfg: SweepConfig, overwrite: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = out / "sweep.json"
    fp = cfg.fingerprint()
    if meta.is_file():
        held = json.loads(meta.read_text())
        old = held.get("fingerprint")
        if old != fp:
            if not overwrite:
                was = held.get("config", {})
                hint = (" (it has no random controls: --no-random-control, random_control=False, resumes it)"
                        if cfg.random_control and not was.get("random_control", False) else "")
                raise SweepMismatchError(f"{out} holds a different sweep (fingerprint {str(old)[:12]}…, this one "
                                         f"{fp[:12]}…){hint}; choose another directory or overwrite it")
            for name in ("samples.jsonl", "summary.csv", "report.html"):
                (out / name).unlink(missing_ok=True)
    _atomic_write(meta, json.dumps({"fingerprint": fp, "config": cfg.model_dump(mode="json")}, indent=1,
                                   sort_keys=True) + "\n")


def _trace_fields(trace: Any, v: Variant) -> dict[str, Any]:
    if trace is None or v.policy is None:
        return {"steered_tokens": None, "fired": None, "gate_rate": None, "gate_trace": None, "score_trace": None,
                "dose_trace": None, "applied_dose": None}
    n = len(trace.position)
    applied = np.asarray(trace.applied, np.float64).reshape(n, -1)[:, :len(v.policy.rules)]
    steered = int(np.count_nonzero(np.any(applied != 0, axis=1))) if n else 0
    gates = trace.gates(0) if n else np.zeros(0)
    dose = applied_dose(trace, v.policy, v.doses) if v.doses else None
    return {"steered_tokens": steered, "fired": steered > 0,
            "gate_rate": float(np.mean(gates >= 0.5)) if n else None,
            "gate_trace": [_r(float(g)) for g in gates],
            "score_trace": [_r(float(x)) for x in (trace.scores(0) if n else [])],
            "dose_trace": None if dose is None else [_r(float(d)) for d in dose],
            "applied_dose": None if dose is None or not n else float(np.mean(dose))}


def run_sweep(cfg: SweepConfig, steerer: Any, out_dir: str | Path, *, progress: bool = True,
              overwrite: bool = False, on_batch: Callable[[int, int], None] | None = None,
              report: bool = True) -> SweepResult:
    """Run (or resume) ``cfg`` on ``steerer``'s engine, writing ``samples.jsonl``, ``summary.csv``, ``report.html``.

    Args:
        cfg: the sweep.
        steerer: a :class:`dynsteer.Steerer` without global steering; its engine needs capture buffers at the probe's
            place (concept score) and at the additive actions' places unless their residual norms are cached
            (:mod:`dynsteer.dose`), and ``max_gates`` ≥ the policy's rules.
        out_dir: where to write; samples already there (same sweep) are skipped.
        progress: show a rich progress bar with ETA.
        overwrite: replace a different sweep found in ``out_dir`` instead of refusing.
        on_batch: called as ``on_batch(done, total)`` after each batch is saved; raising
            :class:`SweepInterrupted` (or anything) stops the sweep there.
        report: render ``report.html``.

    Raises:
        SweepMismatchError: ``out_dir`` holds another sweep.
        ValueError: global steering is set on the engine, or a probe file that does not fit it.
    """
    from vllm import SamplingParams

    from dynsteer.capture.spec import CaptureSpec

    out = Path(out_dir)
    if not steerer.export_steering_spec().is_empty() or steerer.export_policy() is not None:
        raise ValueError("sweep: the engine has global steering set; the baseline would not be unsteered "
                         "(clear it with steerer.clear_all() and steerer.clear_policy())")
    _check_out_dir(out, cfg, overwrite)
    probe = None
    if cfg.probe_file is not None:
        from dynsteer.probefile.fileformat import load_probe

        probe = load_probe(cfg.probe_file)
        probe.check_compatible(steerer.shape)
    base = cfg.target()
    places: set[tuple[int, str]] = set(dose_places(base))
    for point in grid_points(list(cfg.grid)):  # a grid may move an action to another layer or site
        try:
            places |= set(dose_places(apply_point(base, point)))
        except ValueError:
            pass
    norms = residual_norms(steerer, places) if places else {}
    variants = make_variants(cfg, norms, steerer.named_vectors)

    samples_path = out / "samples.jsonl"
    done = {r["id"]: r for r in _read_records(samples_path)}
    units = _units(cfg, variants)
    valid = {u[0] for u in units}
    done = {k: r for k, r in done.items() if k in valid}
    pending = [u for u in units if u[0] not in done]
    skipped = len(units) - len(pending)
    baseline = {(r["prompt_index"], r["sample"]): r["token_ids"] for r in done.values() if r["variant"] == BASELINE}
    capture = (CaptureSpec(layers=[probe.layer], sites=[probe.site], positions="all_generated")
               if probe is not None else None)

    bar = _progress(progress, len(pending), skipped)
    generated = 0
    try:
        for start in range(0, len(pending), cfg.batch_size):
            chunk = pending[start:start + cfg.batch_size]
            records = _run_chunk(cfg, steerer, chunk, capture, probe, baseline, SamplingParams,
                                 _RequestProgress(bar) if bar is not None else False)
            with open(samples_path, "a") as f:
                for rec in records:
                    f.write(json.dumps(rec, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            for rec in records:
                done[rec["id"]] = rec
            generated += len(records)
            if on_batch is not None:
                on_batch(skipped + generated, len(units))
    finally:
        if bar is not None:
            bar[0].stop()

    ordered = [done[u[0]] for u in units]
    _atomic_write(samples_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in ordered))
    summary = summarize(cfg, variants, ordered)
    _atomic_write(out / "summary.csv", summary_csv_text(cfg, summary))
    result = SweepResult(out_dir=out, variants=variants, generated=generated, skipped=skipped, records=ordered,
                         summary=summary)
    if report:
        write_report(result, cfg)
    return result


def _progress(enabled: bool, total: int, skipped: int) -> Any:
    if not enabled:
        return None
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    prog = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("samples"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    TextColumn(f"({skipped} done before)" if skipped else ""))
    prog.start()
    return prog, prog.add_task("sweep", total=total)


class _RequestProgress:
    """What vLLM's ``use_tqdm`` accepts (a tqdm factory): advances the sweep's rich bar as each request finishes."""

    def __init__(self, bar: tuple[Any, Any]) -> None:
        self.progress, self.task = bar

    def __call__(self, iterable: Any = None, **_: Any) -> Any:
        return iterable if iterable is not None else _Bar(self.progress, self.task)


class _Bar:
    def __init__(self, progress: Any, task: Any) -> None:
        self.progress, self.task, self.n, self.postfix = progress, task, 0, ""
        self._t0 = time.perf_counter()

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.perf_counter() - self._t0, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        self.progress.update(self.task, advance=n)

    def refresh(self) -> None:
        self.progress.refresh()

    def close(self) -> None:
        pass


def _run_chunk(cfg: SweepConfig, steerer: Any, chunk: list[tuple[str, Variant, int, int]], capture: Any,
               probe: Any, baseline: dict[tuple[int, int], list[int]], SamplingParams: Any,
               use_tqdm: Any = False) -> list[dict[str, Any]]:
    params = [SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                             seed=cfg.seed + s) for _, _, _, s in chunk]
    steering = [v.spec for _, v, _, _ in chunk]
    policies = [v.policy for _, v, _, _ in chunk]
    kwargs: dict[str, Any] = {"steering": steering, "capture": capture, "use_tqdm": use_tqdm}
    if any(p is not None for p in policies):
        kwargs["policy"] = policies
    if cfg.chat:
        convs = [list(cfg.prompts[p].messages) if cfg.prompts[p].messages is not None
                 else [{"role": "user", "content": cfg.prompts[p].prompt}] for _, _, p, _ in chunk]
        outs = steerer.chat(convs, params, **kwargs)
    else:
        texts = [cfg.prompts[p].prompt or cfg.prompts[p].text() for _, _, p, _ in chunk]
        outs = steerer.generate(texts, params, **kwargs)
    ppl = perplexities(steerer, [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs],
                        SamplingParams)
    records = []
    for (key, v, p, s), out, perp in zip(chunk, outs, ppl):
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        if v.id == BASELINE:
            baseline[(p, s)] = tokens
        identical = tokens == baseline.get((p, s))
        probe_trace = None
        if probe is not None and getattr(out, "capture", None) is not None:
            x = np.asarray(out.capture[(probe.layer, probe.site)], np.float64)
            probe_trace = [_r(float(q)) for q in probe.predict_proba(x)[:, cfg.concept_class]] if len(x) else []
        rec: dict[str, Any] = {
            "id": key, "variant": v.id, "params": v.point, "prompt_index": p, "label": cfg.prompts[p].cls,
            "sample": s, "seed": cfg.seed + s, "text": comp.text, "token_ids": tokens,
            "finish_reason": comp.finish_reason, "identical": identical, "changed": not identical,
            "probe_trace": probe_trace,
            "concept_probe": M.mean_or_none(probe_trace) if probe_trace else None,
            "concept_words": M.concept_words(comp.text, cfg.words),
            "perplexity": perp, "repeat_4gram": M.repeated_ngram_rate(tokens, 4),
            "relevance": M.prompt_overlap(cfg.prompts[p].text(), comp.text),
            "distinct_1": M.distinct_n(tokens, 1), "distinct_2": M.distinct_n(tokens, 2),
            **_trace_fields(getattr(out, "trace", None), v)}
        records.append(rec)
    return records
