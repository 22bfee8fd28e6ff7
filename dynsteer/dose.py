"""Relative dose: how hard an additive steering entry pushes, measured against the residual it is added to.

The **relative dose** of an additive action (a policy's ``Action(kind="add")`` or a spec's ``AddVector``) at
``(layer, site)`` is::

    dose = |scale| · ‖v‖ / mean‖h‖

where ``v`` is the action's vector and ``mean‖h‖`` is the mean L2 norm of the model's (unsteered) residual stream at
that layer and site, measured once per model on :data:`REFERENCE_TEXTS` (every prompt position but the first, whose
norm is an attention-sink outlier in most models) and cached under ``$DYNSTEER_CACHE/residual_norms/``. A dose of 0.1
adds a vector a tenth as long as a typical residual. For a policy the **peak dose** multiplies the dose by the
largest ``dyn_scale`` its sync controller can output (:meth:`DynamicSteeringPolicy.max_output`; 1 without a
controller; custom controllers, unbounded, count as 1 here and are bounded by the engine's ``max_dyn_scale``).

A policy's optional guardrail ``max_relative_dose`` (:class:`dynsteer.policy.RelativeDoseLimit`) is enforced by
:func:`enforce_dose_limit` where the caller admits the policy: :class:`dynsteer.Steerer` does it before sending a
policy (``generate``, ``chat``, ``set_policy``), and ``dynsteer sweep`` for every variant. ``reject`` raises a
:class:`~dynsteer.spec.SteeringValidationError` naming the action and its dose; ``clip`` reduces the action's scale so
that its peak dose equals the limit and reports it (:attr:`DoseEntry.clipped_from`).

Example:
    >>> import numpy as np
    >>> from dynsteer.policy import Action, DynamicSteeringPolicy, ProbeGate, Rule
    >>> mon = ProbeGate(name="m", layer=1, direction=[1.0, 0.0], sharpness=1.0, threshold=0.0)
    >>> act = Action(kind="add", layer=2, vector=[3.0, 4.0], scale=2.0)
    >>> pol = DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act])],
    ...                             max_relative_dose={"limit": 0.5, "mode": "clip"})
    >>> clipped, report = enforce_dose_limit(pol, {(2, "post_block"): 40.0})
    >>> report[0].dose, report[0].clipped_from, clipped.rules[0].actions[0].scale
    (0.25, None, 2.0)
    >>> tight = DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act])],
    ...                               max_relative_dose={"limit": 0.1, "mode": "clip"})
    >>> clipped, report = enforce_dose_limit(tight, {(2, "post_block"): 40.0})
    >>> round(clipped.rules[0].actions[0].scale, 6), report[0].clipped_from, round(report[0].dose, 6)
    (0.8, 2.0, 0.1)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from dynsteer.cache import default_cache_root
from dynsteer.policy import DynamicSteeringPolicy, RelativeDoseLimit
from dynsteer.spec import SteeringSpec, SteeringValidationError
from dynsteer.vectors import as_vector

Place = tuple[int, str]

__all__ = ["DoseEntry", "REFERENCE_TEXTS", "admit_dose", "applied_dose", "dose_places", "enforce_dose_limit",
           "measure_residual_norms", "norm_cache_path", "relative_doses", "residual_norms"]

REFERENCE_TEXTS: tuple[str, ...] = (
    "The committee met on Tuesday to discuss the budget for the coming year.",
    "She walked to the market, bought some apples and a loaf of bread, and went home.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Can you explain how a binary search works and why it is fast?",
    "The train was late again this morning, so I missed the first meeting.",
    "In 1969, astronauts landed on the Moon for the first time.",
    "Please write a short poem about the sea at night.",
    "Our team fixed the bug, wrote a test for it, and shipped the release.",
)
"""Neutral sentences whose prompt residuals define ``mean‖h‖`` (fixed: changing them changes every cached norm)."""
_NORMS_VERSION = 1


class DoseEntry(BaseModel):
    """One additive action's dose.

    Attributes:
        where: the action's field path (``rules[0].actions[1]`` or ``vectors[0]``).
        layer, site: where it adds.
        scale: its scale (after clipping, if clipped).
        vector_norm: ``‖v‖``.
        mean_norm: ``mean‖h‖`` at ``(layer, site)``.
        dose: ``|scale|·‖v‖ / mean‖h‖``.
        peak_dose: ``dose`` times the controller's largest output (equal to ``dose`` for static specs).
        clipped_from: the scale before a ``clip`` guardrail reduced it (``None``: not clipped).
    """

    model_config = ConfigDict(frozen=True)

    where: str
    layer: int
    site: str
    scale: float
    vector_norm: float
    mean_norm: float
    dose: float
    peak_dose: float
    clipped_from: Optional[float] = None


def norm_cache_path(model_id: str, root: Path | None = None) -> Path:
    """Where the residual norms of ``model_id`` are cached (one JSON file per model)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id.strip("/"))[-60:] or "model"
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:12]
    return (root or default_cache_root()) / "residual_norms" / f"{slug}-{digest}.json"


def measure_residual_norms(steerer: Any, places: Iterable[Place],
                           texts: Iterable[str] = REFERENCE_TEXTS) -> dict[Place, float]:
    """Measure ``mean‖h‖`` at ``places`` by capturing the unsteered residual of ``texts`` (one unsteered batch).

    Args:
        steerer: a :class:`dynsteer.Steerer` whose engine has capture buffers at every place
            (``DynsteerConfig(capture_sites=..., capture_layers=...)``).
        places: ``(layer, site)`` pairs.
        texts: prompts (plain text, no chat template); every position but the first counts.

    Raises:
        SteeringValidationError: a place without capture buffers.
    """
    from vllm import SamplingParams

    from dynsteer.capture.spec import CaptureSpec

    places = sorted(set((int(layer), str(site)) for layer, site in places))
    missing = [p for p in places if p not in steerer.capture_places]
    if missing:
        raise SteeringValidationError(
            f"relative dose: no residual norm is cached for layer {missing[0][0]} site {missing[0][1]!r} and this "
            f"engine cannot measure it (no capture buffers there); start an engine once with "
            f"DynsteerConfig(capture_sites=({missing[0][1]!r},), capture_layers=({missing[0][0]},)) and call "
            f"dynsteer.dose.residual_norms(steerer, places)")
    sums = {p: 0.0 for p in places}
    for layer, site in places:
        spec = CaptureSpec(layers=[layer], sites=[site], positions="all_prompt")
        outs = steerer.generate(list(texts), SamplingParams(max_tokens=1, temperature=0.0), capture=spec,
                                use_tqdm=False)
        n = 0
        for out in outs:
            rows = np.asarray(out.capture[(layer, site)], dtype=np.float64)[1:]
            sums[(layer, site)] += float(np.linalg.norm(rows, axis=1).sum())
            n += rows.shape[0]
        sums[(layer, site)] /= max(n, 1)
    return sums


def residual_norms(steerer: Any, places: Iterable[Place], *, cache: bool = True,
                   cache_root: Path | None = None) -> dict[Place, float]:
    """``mean‖h‖`` at ``places``: read from the per-model cache, measuring (and caching) only what is missing.

    Args:
        steerer: the engine's :class:`dynsteer.Steerer` (its ``shape.model_id`` keys the cache).
        places: ``(layer, site)`` pairs.
        cache: read and write the cache (``False``: always measure).
        cache_root: the cache directory (default ``$DYNSTEER_CACHE`` or ``~/.cache/dynsteer``).
    """
    places = sorted(set((int(layer), str(site)) for layer, site in places))
    path = norm_cache_path(steerer.shape.model_id or "unknown", cache_root)
    known: dict[str, float] = {}
    if cache and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("version") == _NORMS_VERSION and data.get("hidden_size") == steerer.shape.hidden_size:
                known = {k: float(v) for k, v in data["norms"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            known = {}
    todo = [p for p in places if f"{p[0]}.{p[1]}" not in known]
    if todo:
        for (layer, site), value in measure_residual_norms(steerer, todo).items():
            known[f"{layer}.{site}"] = value
        if cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"version": _NORMS_VERSION, "model_id": steerer.shape.model_id,
                                       "hidden_size": steerer.shape.hidden_size, "texts": list(REFERENCE_TEXTS),
                                       "norms": dict(sorted(known.items()))}, indent=1))
            os.replace(tmp, path)
    return {p: known[f"{p[0]}.{p[1]}"] for p in places}


def _additive(obj: DynamicSteeringPolicy | SteeringSpec) -> list[tuple[str, Any]]:
    if isinstance(obj, SteeringSpec):
        return [(f"vectors[{i}]", v) for i, v in enumerate(obj.vectors)]
    return [(f"rules[{i}].actions[{j}]", a) for i, r in enumerate(obj.rules) for j, a in enumerate(r.actions)
            if a.kind == "add"]


def dose_places(obj: DynamicSteeringPolicy | SteeringSpec) -> list[Place]:
    """The ``(layer, site)`` places of ``obj``'s additive entries."""
    return sorted({(e.layer, e.site) for _, e in _additive(obj)})


def _norm(vector: Any, named: Mapping[str, np.ndarray] | None, where: str) -> float:
    if isinstance(vector, str):
        if not named or vector not in named:
            raise SteeringValidationError(f"{where}.vector: unknown vector name {vector!r}")
        vector = named[vector]
    return float(np.linalg.norm(as_vector(vector).astype(np.float64)))


def _bound(obj: DynamicSteeringPolicy | SteeringSpec) -> float:
    if isinstance(obj, SteeringSpec):
        return 1.0
    bound = obj.max_output()
    return bound if math.isfinite(bound) else 1.0


def relative_doses(obj: DynamicSteeringPolicy | SteeringSpec, norms: Mapping[Place, float],
                   named: Mapping[str, np.ndarray] | None = None) -> list[DoseEntry]:
    """The :class:`DoseEntry` of every additive action of a policy (or ``AddVector`` of a spec), in field order.

    Args:
        obj: a policy or a static spec.
        norms: ``mean‖h‖`` per ``(layer, site)`` (:func:`residual_norms`).
        named: registered vectors, for actions naming one.

    Raises:
        SteeringValidationError: a place missing from ``norms``, an unknown vector name.
    """
    bound = _bound(obj)
    out = []
    for where, e in _additive(obj):
        mean = norms.get((e.layer, e.site))
        if mean is None or not mean > 0:
            raise SteeringValidationError(f"{where}: no residual norm for layer {e.layer} site {e.site!r}")
        vnorm = _norm(e.vector, named, where)
        dose = abs(float(e.scale)) * vnorm / mean
        out.append(DoseEntry(where=where, layer=e.layer, site=e.site, scale=float(e.scale), vector_norm=vnorm,
                             mean_norm=float(mean), dose=dose, peak_dose=dose * bound))
    return out


def enforce_dose_limit(policy: DynamicSteeringPolicy, norms: Mapping[Place, float],
                       named: Mapping[str, np.ndarray] | None = None
                       ) -> tuple[DynamicSteeringPolicy, list[DoseEntry]]:
    """Apply ``policy.max_relative_dose``: the policy to send (clipped if so asked; without the guardrail field, which
    engines refuse) and every action's dose.

    Without a guardrail the policy is returned unchanged (with its doses).

    Raises:
        SteeringValidationError: mode ``reject`` and an action whose peak dose exceeds the limit, e.g.
            ``rules[0].actions[0].scale: relative dose 0.62 (|scale| 2 · ‖v‖ 40 / mean‖h‖ 129 at layer 20
            post_block) exceeds max_relative_dose 0.5``.
    """
    entries = relative_doses(policy, norms, named)
    guard: RelativeDoseLimit | None = policy.max_relative_dose
    if guard is None:
        return policy, entries
    bound = _bound(policy)
    rules = [list(r.actions) for r in policy.rules]
    report = []
    changed = False
    for e in entries:
        if e.peak_dose <= guard.limit * (1 + 1e-9):
            report.append(e)
            continue
        ctrl = f" × controller bound {bound:g}" if bound != 1.0 else ""
        msg = (f"{e.where}.scale: relative dose {e.peak_dose:.4g} (|scale| {abs(e.scale):g} · ‖v‖ "
               f"{e.vector_norm:.4g} / mean‖h‖ {e.mean_norm:.4g} at layer {e.layer} {e.site}{ctrl}) exceeds "
               f"max_relative_dose {guard.limit:g}")
        if guard.mode == "reject":
            raise SteeringValidationError(msg)
        new_scale = math.copysign(guard.limit * e.mean_norm / (e.vector_norm * bound), e.scale)
        i, j = (int(x) for x in re.findall(r"\d+", e.where))
        rules[i][j] = rules[i][j].model_copy(update={"scale": new_scale})
        changed = True
        report.append(e.model_copy(update={"scale": new_scale, "dose": abs(new_scale) * e.vector_norm / e.mean_norm,
                                           "peak_dose": guard.limit, "clipped_from": e.scale}))
    if changed:
        new_rules = tuple(r.model_copy(update={"actions": tuple(acts)}) for r, acts in zip(policy.rules, rules))
        policy = policy.model_copy(update={"rules": new_rules})
    # enforced here: the policy sent on no longer carries the guardrail (an engine refuses one that does, since it
    # cannot measure residual norms and would otherwise run the policy unguarded)
    return policy.model_copy(update={"max_relative_dose": None}), report


def applied_dose(trace: Any, policy: DynamicSteeringPolicy, entries: list[DoseEntry]) -> np.ndarray:
    """The relative dose a request actually received at each traced token: the largest over additive actions of
    ``|applied gate| · dose`` (the applied gate includes the controller's ``dyn_scale``).

    Args:
        trace: the request's :class:`dynsteer.DynamicTrace` (its first slots are the policy's rules, in order).
        policy: the policy it ran.
        entries: :func:`relative_doses` of that policy.

    Returns:
        ``[tokens]`` float64 (zeros where nothing was applied).
    """
    n_rules = len(policy.rules)
    per_rule = np.array([max((e.dose for e in entries if e.where.startswith(f"rules[{i}].")), default=0.0)
                         for i in range(n_rules)], np.float64)
    if not len(trace.position) or not n_rules:
        return np.zeros(len(trace.position))
    applied = np.abs(np.asarray(trace.applied, np.float64).reshape(len(trace.position), -1)[:, :n_rules])
    return (applied * per_rule).max(axis=1)


def admit_dose(steerer: Any, policy: DynamicSteeringPolicy) -> tuple[DynamicSteeringPolicy, list[DoseEntry]]:
    """:func:`enforce_dose_limit` against ``steerer``'s model (norms from the cache, measured once if missing)."""
    norms = residual_norms(steerer, dose_places(policy)) if dose_places(policy) else {}
    return enforce_dose_limit(policy, norms, getattr(steerer, "named_vectors", None))
