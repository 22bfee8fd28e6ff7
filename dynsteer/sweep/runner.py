"""Run a sweep: every variant of a policy (or steering spec) over a labelled prompt set, in one engine.

All variants go through one engine as per-request policies/specs, mixed in the same batches, next to an unsteered
baseline (variant ``v000``). Samples are appended to ``samples.jsonl`` after every batch, so an interrupted sweep
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

import csv
import hashlib
import io
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynsteer.dose import DoseEntry, dose_places, enforce_dose_limit, relative_doses, residual_norms
from dynsteer.policy import DynamicSteeringPolicy
from dynsteer.spec import SteeringSpec
from dynsteer.sweep import metrics as M
from dynsteer.sweep.grid import GridAxis, GridPathError, apply_point, grid_points, parse_axis, point_label

__all__ = ["PromptItem", "SweepConfig", "SweepInterrupted", "SweepMismatchError", "SweepResult", "Variant",
           "format_value", "load_prompts", "load_target", "run_sweep"]

BASELINE = "v000"
UNLABELLED = "unlabelled"


class SweepMismatchError(RuntimeError):
    """The output directory holds a different sweep (its fingerprint differs)."""


class SweepInterrupted(RuntimeError):
    """Raised by an ``on_batch`` callback to stop a sweep after a batch (what is done stays done)."""


class PromptItem(BaseModel):
    """One prompt of the set: a user message (``prompt``) or a whole conversation (``messages``), and its class.

    Attributes:
        prompt: the user message (chat) or raw prompt text (``chat=False``).
        messages: a conversation (``[{"role": ..., "content": ...}]``), instead of ``prompt``.
        label: its class (``None``: ``"unlabelled"``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: Optional[str] = None
    messages: Optional[tuple[dict[str, str], ...]] = None
    label: Optional[str] = None

    @model_validator(mode="after")
    def _one(self) -> "PromptItem":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages (exactly one)")
        return self

    @property
    def cls(self) -> str:
        return self.label if self.label is not None else UNLABELLED

    def text(self) -> str:
        """The prompt as shown in reports (the last message of a conversation)."""
        return self.prompt if self.prompt is not None else self.messages[-1].get("content", "")  # type: ignore


def load_prompts(path: str | Path) -> list[PromptItem]:
    """Read a JSONL prompt file: one object per line, ``{"prompt": ..., "label": ...}`` or ``{"messages": [...],
    "label": ...}`` (``label`` optional; ``text``/``class`` are accepted as aliases); a bare JSON string is a prompt.

    Raises:
        ValueError: naming the line that is not a valid prompt.
    """
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, str):
                obj = {"prompt": obj}
            if isinstance(obj, dict):
                obj = {{"text": "prompt", "class": "label"}.get(k, k): v for k, v in obj.items()}
            items.append(PromptItem.model_validate(obj))
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not a prompt: {exc}") from None
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def load_target(path: str | Path) -> DynamicSteeringPolicy | SteeringSpec:
    """A policy or steering-spec file (YAML or JSON): a policy if it has ``monitors``/``rules``/``controller``."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping (a DynamicSteeringPolicy or a SteeringSpec)")
    if {"monitors", "rules", "controller", "max_relative_dose"} & set(data):
        return DynamicSteeringPolicy.model_validate(data)
    return SteeringSpec.model_validate(data)


class SweepConfig(BaseModel):
    """Everything that defines a sweep (and its fingerprint: change any field but ``batch_size`` and it is another
    sweep).

    Attributes:
        kind: ``policy`` or ``spec``.
        base: the base policy or spec (JSON form; probe-file monitors already loaded, so their ``threshold`` and
            ``sharpness`` can be swept).
        grid: the swept fields (:mod:`dynsteer.sweep.grid`); variants are their cartesian product.
        prompts: the labelled prompt set.
        samples: samples per prompt and variant; sample ``s`` uses seed ``seed + s``.
        seed: the first sample's seed.
        max_tokens, temperature, top_p: sampling (``temperature=0``: greedy).
        chat: apply the model's chat template (``prompt`` becomes a user message).
        target_class: the class the policy should steer (selectivity); ``None``: no selectivity figures.
        leave_alone: classes the policy should leave alone (side effects); default: every class but the target.
        probe_file: a probe file whose probability is the concept score (captured in the same run).
        concept_class: which probe class is the concept (1: the probe's positive class).
        words: a word list for the word concept score.
        batch_size: requests per engine batch (and per resume checkpoint).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["policy", "spec"]
    base: dict[str, Any]
    grid: tuple[GridAxis, ...] = ()
    prompts: tuple[PromptItem, ...] = Field(min_length=1)
    samples: int = Field(default=1, ge=1)
    seed: int = 0
    max_tokens: int = Field(default=32, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    chat: bool = True
    target_class: Optional[str] = None
    leave_alone: Optional[tuple[str, ...]] = None
    probe_file: Optional[str] = None
    concept_class: Literal[0, 1] = 1
    words: tuple[str, ...] = ()
    batch_size: int = Field(default=64, ge=1)

    @classmethod
    def build(cls, target: DynamicSteeringPolicy | SteeringSpec, *, grid: Sequence[str | GridAxis] = (),
              prompts: str | Path | Sequence[PromptItem | dict[str, Any] | str], **kwargs: Any) -> "SweepConfig":
        """A config from a policy or spec object, grid strings (``"path=v1,v2"``) and a prompt file or list."""
        if isinstance(target, DynamicSteeringPolicy):
            kind, base = "policy", json.loads(target.resolved().to_json())
        else:
            kind, base = "spec", json.loads(target.model_dump_json())
        if isinstance(prompts, (str, Path)):
            items = load_prompts(prompts)
        else:
            items = [p if isinstance(p, PromptItem) else PromptItem.model_validate(
                {"prompt": p} if isinstance(p, str) else p) for p in prompts]
        axes = [a if isinstance(a, GridAxis) else parse_axis(a) for a in grid]
        if kwargs.get("probe_file") is not None:
            kwargs["probe_file"] = str(Path(kwargs["probe_file"]).resolve())
        cfg = cls(kind=kind, base=base, grid=tuple(axes), prompts=tuple(items), **kwargs)
        cfg.check_paths()
        return cfg

    def check_paths(self) -> None:
        """Fail early on a grid path that addresses no field of the base (values are checked per variant).

        Raises:
            GridPathError: naming the path.
        """
        base = self.target()
        for axis in self.grid:
            try:
                apply_point(base, {axis.path: axis.values[0]})
            except GridPathError:
                raise
            except ValueError as exc:
                if "Extra inputs are not permitted" in str(exc):
                    raise GridPathError(f"grid path {axis.path!r}: no such field") from None

    def target(self) -> DynamicSteeringPolicy | SteeringSpec:
        model = DynamicSteeringPolicy if self.kind == "policy" else SteeringSpec
        return model.model_validate_json(json.dumps(self.base))

    def classes(self) -> list[str]:
        """Prompt classes in order of first appearance."""
        return list(dict.fromkeys(p.cls for p in self.prompts))

    def alone_classes(self) -> list[str]:
        if self.leave_alone is not None:
            return list(self.leave_alone)
        return [c for c in self.classes() if c != self.target_class] if self.target_class is not None else []

    def fingerprint(self) -> str:
        """sha256 of everything that decides the samples (the probe file's bytes included)."""
        data = self.model_dump(mode="json", exclude={"batch_size"})
        if self.probe_file is not None:
            data["probe_sha256"] = hashlib.sha256(Path(self.probe_file).read_bytes()).hexdigest()
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@dataclass
class Variant:
    """One point of the grid, ready to send (``v000``: the unsteered baseline)."""

    id: str
    point: dict[str, Any]
    label: str
    spec: SteeringSpec | None = None
    policy: DynamicSteeringPolicy | None = None
    doses: list[DoseEntry] = field(default_factory=list)
    error: str | None = None

    @property
    def max_dose(self) -> float | None:
        return max((d.dose for d in self.doses), default=None)

    @property
    def max_peak_dose(self) -> float | None:
        return max((d.peak_dose for d in self.doses), default=None)

    @property
    def clipped(self) -> int:
        return sum(d.clipped_from is not None for d in self.doses)


@dataclass
class SweepResult:
    """What a sweep produced.

    Attributes:
        out_dir: the output directory.
        variants: the variants (``v000`` first).
        generated: samples generated by this call; ``skipped``: samples already done (resumed).
        records: every sample record, in sample order.
        summary: the rows of ``summary.csv`` (formatted strings, as written).
    """

    out_dir: Path
    variants: list[Variant]
    generated: int
    skipped: int
    records: list[dict[str, Any]]
    summary: list[dict[str, str]]

    @property
    def samples_jsonl(self) -> Path:
        return self.out_dir / "samples.jsonl"

    @property
    def summary_csv(self) -> Path:
        return self.out_dir / "summary.csv"

    @property
    def report_html(self) -> Path:
        return self.out_dir / "report.html"


def format_value(v: Any) -> str:
    """How a summary value is written (CSV and report alike): ``""`` for none, 6 significant digits for floats."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.6g}"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, sort_keys=True)
    return str(v)


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def make_variants(cfg: SweepConfig, norms: dict[tuple[int, str], float] | None,
                  named: dict[str, np.ndarray] | None = None) -> list[Variant]:
    """The baseline and one variant per grid point (a point that fails validation or the dose guardrail keeps its
    error and runs no samples)."""
    base = cfg.target()
    variants = [Variant(id=BASELINE, point={}, label="unsteered")]
    for i, point in enumerate(grid_points(list(cfg.grid)), 1):
        v = Variant(id=f"v{i:03d}", point=point, label=point_label(point))
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
    return variants


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
        old = json.loads(meta.read_text()).get("fingerprint")
        if old != fp:
            if not overwrite:
                raise SweepMismatchError(f"{out} holds a different sweep (fingerprint {str(old)[:12]}…, this one "
                                         f"{fp[:12]}…); choose another directory or overwrite it")
            for name in ("samples.jsonl", "summary.csv", "report.html"):
                (out / name).unlink(missing_ok=True)
    _atomic_write(meta, json.dumps({"fingerprint": fp, "config": cfg.model_dump(mode="json")}, indent=1,
                                   sort_keys=True) + "\n")


def _trace_fields(trace: Any) -> dict[str, Any]:
    if trace is None:
        return {"steered_tokens": None, "fired": None, "gate_rate": None, "gate_trace": None, "score_trace": None}
    applied = np.asarray(trace.applied, np.float64).reshape(len(trace.position), -1)
    scale = np.asarray(trace.scale, np.float64).reshape(-1, 1)
    steered = int(np.count_nonzero(np.any(applied * scale != 0, axis=1))) if len(trace.position) else 0
    gates = trace.gates(0) if len(trace.position) else np.zeros(0)
    return {"steered_tokens": steered, "fired": steered > 0,
            "gate_rate": float(np.mean(gates >= 0.5)) if len(gates) else None,
            "gate_trace": [_r(float(g)) for g in gates],
            "score_trace": [_r(float(s)) for s in (trace.scores(0) if len(trace.position) else [])]}


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
        from dynsteer.probes.fileformat import load_probe

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
            records = _run_chunk(cfg, steerer, chunk, capture, probe, baseline, SamplingParams)
            with open(samples_path, "a") as f:
                for rec in records:
                    f.write(json.dumps(rec, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            for rec in records:
                done[rec["id"]] = rec
            generated += len(records)
            if bar is not None:
                bar[0].update(bar[1], advance=len(records))
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
        from dynsteer.sweep.report import write_report

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


def _run_chunk(cfg: SweepConfig, steerer: Any, chunk: list[tuple[str, Variant, int, int]], capture: Any,
               probe: Any, baseline: dict[tuple[int, int], list[int]], SamplingParams: Any) -> list[dict[str, Any]]:
    params = [SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                             seed=cfg.seed + s) for _, _, _, s in chunk]
    steering = [v.spec for _, v, _, _ in chunk]
    policies = [v.policy for _, v, _, _ in chunk]
    kwargs: dict[str, Any] = {"steering": steering, "capture": capture, "use_tqdm": False}
    if any(p is not None for p in policies):
        kwargs["policy"] = policies
    if cfg.chat:
        convs = [list(cfg.prompts[p].messages) if cfg.prompts[p].messages is not None
                 else [{"role": "user", "content": cfg.prompts[p].prompt}] for _, _, p, _ in chunk]
        outs = steerer.chat(convs, params, **kwargs)
    else:
        texts = [cfg.prompts[p].prompt or cfg.prompts[p].text() for _, _, p, _ in chunk]
        outs = steerer.generate(texts, params, **kwargs)
    ppl = _perplexities(steerer, [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs],
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
            "distinct_1": M.distinct_n(tokens, 1), "distinct_2": M.distinct_n(tokens, 2),
            **_trace_fields(getattr(out, "trace", None) if v.policy is not None else None)}
        records.append(rec)
    return records


def _perplexities(steerer: Any, pairs: list[tuple[list[int], list[int]]], SamplingParams: Any) -> list[float | None]:
    """Unsteered perplexity of each output given its prompt: one batch of prompt-logprob requests (each distinct
    prompt + output scored once)."""
    todo = sorted({(tuple(p), tuple(o)) for p, o in pairs if o})
    if not todo:
        return [None] * len(pairs)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = steerer.llm.generate([{"prompt_token_ids": list(p + o)} for p, o in todo], params, use_tqdm=False)
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], float | None] = {}
    for (p, o), out in zip(todo, outs):
        lps = []
        for pos, tok in enumerate(o, start=len(p)):
            entry = out.prompt_logprobs[pos]
            lps.append(float(entry[tok].logprob))
        found[(p, o)] = M.perplexity(lps)
    return [found.get((tuple(p), tuple(o))) if o else None for p, o in pairs]


SUMMARY_METRICS = ("concept_probe", "concept_words", "perplexity", "repeat_4gram", "distinct_1", "distinct_2",
                   "changed_rate", "identical_rate", "fire_rate", "gate_rate", "steered_tokens")
VARIANT_COLUMNS = ("side_effect_identical_rate", "target_steered_rate", "other_steered_rate", "selectivity",
                   "max_relative_dose", "max_peak_dose", "clipped_actions", "error")


def summary_columns(cfg: SweepConfig) -> list[str]:
    """The columns of ``summary.csv``, in order."""
    return ["variant", "label", *[a.path for a in cfg.grid], "class", "n", *SUMMARY_METRICS, *VARIANT_COLUMNS]


def summarize(cfg: SweepConfig, variants: list[Variant], records: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per variant and class (then ``all``), formatted with :func:`format_value` (the metrics module's
    definitions: :mod:`dynsteer.sweep.metrics`)."""
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_variant.setdefault(r["variant"], []).append(r)
    alone = set(cfg.alone_classes())
    rows = []
    for v in variants:
        recs = by_variant.get(v.id, [])

        def rate(sel: Callable[[dict[str, Any]], bool], key: str, recs=recs) -> float | None:
            return M.mean_or_none(r[key] for r in recs if sel(r))

        per_variant = {
            "side_effect_identical_rate": rate(lambda r: r["label"] in alone, "identical") if alone else None,
            "target_steered_rate": (rate(lambda r: r["label"] == cfg.target_class, "changed")
                                    if cfg.target_class is not None else None),
            "other_steered_rate": (rate(lambda r: r["label"] != cfg.target_class, "changed")
                                   if cfg.target_class is not None else None),
            "max_relative_dose": v.max_dose, "max_peak_dose": v.max_peak_dose,
            "clipped_actions": v.clipped if v.doses else None, "error": v.error}
        t, o = per_variant["target_steered_rate"], per_variant["other_steered_rate"]
        per_variant["selectivity"] = t - o if t is not None and o is not None else None
        for cls in [*cfg.classes(), "all"]:
            sel = [r for r in recs if cls == "all" or r["label"] == cls]
            row: dict[str, Any] = {"variant": v.id, "label": v.label,
                                   **{a.path: v.point.get(a.path) for a in cfg.grid}, "class": cls, "n": len(sel)}
            for m in ("concept_probe", "concept_words", "perplexity", "repeat_4gram", "distinct_1", "distinct_2",
                      "steered_tokens", "gate_rate"):
                row[m] = M.mean_or_none(r[m] for r in sel)
            row["changed_rate"] = M.mean_or_none(r["changed"] for r in sel)
            row["identical_rate"] = M.mean_or_none(r["identical"] for r in sel)
            row["fire_rate"] = M.mean_or_none(r["fired"] for r in sel)
            row.update(per_variant)
            rows.append({c: format_value(row.get(c)) for c in summary_columns(cfg)})
    return rows


def summary_csv_text(cfg: SweepConfig, rows: list[dict[str, str]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=summary_columns(cfg), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()

