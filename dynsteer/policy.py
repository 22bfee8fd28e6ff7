"""Dynamic steering policies: monitors (in-graph probe gates), rules (what a gate switches on) and a sync controller.

A :class:`DynamicSteeringPolicy` is the schema of the dynamic tiers of DESIGN §4. Like :mod:`dynsteer.spec` it is
pydantic, immutable, versioned and free of vLLM and torch imports, so it can be written in a notebook, saved as
YAML/JSON, shipped with a request and validated against a model's shape (:meth:`DynamicSteeringPolicy.check`) before
anything reaches the engine.

Semantics:
    * A :class:`Monitor` reads the residual at ``(layer, site)`` of each generated token and computes
      ``score = x·direction`` and ``gate = σ(sharpness · (score − threshold))`` inside the forward (the in-graph
      monitor, :func:`dynsteer.kernels.dynamic_reference.steer_site_dyn_reference`). Prompt (prefill) tokens are
      never gated: their gate is 0. The monitor reads the residual *before* any dynamic action at the same site.
    * A :class:`Rule` ties a monitor to actions. ``gate`` values below ``gate_floor`` count as 0. Each action is the
      dynamic term ``g · dyn_scale · action`` of DESIGN §3: an ``add`` adds ``g · dyn_scale · scale · vector``; a
      ``clamp``/``ablate`` uses ``g · dyn_scale · strength`` as its strength. ``dyn_scale`` is the sync controller's
      output (1 without a controller).
    * ``scope`` says when the gate acts: ``this_token`` — in the same forward pass, on the same token (the gate is
      carried forward from the monitor site, so actions can only steer the monitor's layer or later ones);
      ``next_step`` — the gate of token ``t`` steers token ``t + 1``; ``rest_of_request`` — once the gate fires
      (``g ≥ gate_floor`` and ``g > 0``) the actions stay on, at full gate, until the request finishes.
    * The optional :class:`SyncControllerSpec` is the sync actuator tier: after every step it sees the monitor's
      score/gate for the token just computed and sets ``dyn_scale`` for the next step
      (:mod:`dynsteer.controllers.sync`).

Example:
    >>> import numpy as np
    >>> from dynsteer.policy import Action, DynamicSteeringPolicy, Monitor, Rule, SyncControllerSpec
    >>> from dynsteer.spec import ModelShape
    >>> mon = Monitor(name="tox", layer=2, direction=np.eye(8)[0], sharpness=4.0, threshold=1.5)
    >>> rule = Rule(monitor="tox", actions=[Action(kind="add", layer=3, vector=-np.eye(8)[0], scale=2.0)])
    >>> policy = DynamicSteeringPolicy(monitors=[mon], rules=[rule],
    ...                                controller=SyncControllerSpec(kind="latch", on=2.0, off=1.0, scale=1.0))
    >>> DynamicSteeringPolicy.from_yaml(policy.to_yaml()) == policy
    True
    >>> policy.check(ModelShape(num_layers=4, hidden_size=8))
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from dynsteer.spec import (SITES, Layer, ModelShape, Real, Site, SteeringValidationError, VectorSource,
                           check_clamp_bounds, check_name, check_site, resolve_vector)
from dynsteer.vectors import Vector

POLICY_VERSION = 1

Scope = Literal["this_token", "next_step", "rest_of_request"]
MonitorReads = Literal["token", "prompt_last", "prompt_mean"]
"""When a rule's gate acts: the same token (in-graph), the next step, or from the first trigger to the end."""
ControllerKind = Literal["latch", "ema_latch", "pid", "budget", "custom"]

__all__ = ["Action", "ControllerKind", "DynamicSteeringPolicy", "MAX_ABS_THRESHOLD", "MAX_SHARPNESS", "MIN_SHARPNESS",
           "Monitor", "POLICY_VERSION", "RelativeDoseLimit", "MonitorReads", "Rule", "Scope", "SyncControllerSpec",
           "gate_param_problem"]

# A gate's sharpness and threshold reach the kernels as float32 (``σ(sharpness·(score − threshold))``); float64
# values such as 1e300 would become inf there, and a slope that rounds to 0 reads as "no monitor". The bounds lie far
# outside any real gate: a logistic probe's sharpness is its weight norm (tens to hundreds, thousands for an
# unregularised probe on separable data), and at 1e8 the gate is already a step at float32's resolution of any
# score; a slope under 1e-6 per unit of projection cannot tell real residuals apart. A threshold is a projection
# of the residual (real ones stay below ~1e5; "always"/"never" gates are written as ±1e9). Within the bounds
# ``|sharpness·(score − threshold)|`` stays below ~1e21 for any real score, far inside float32's 3.4e38.
MIN_SHARPNESS = 1e-6
MAX_SHARPNESS = 1e8
MAX_ABS_THRESHOLD = 1e12


def _finite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def gate_param_problem(name: str, value: float) -> str | None:
    """What is wrong with a gate's ``sharpness`` or ``threshold`` for the engine's float32 tables (None: fine)."""
    if name == "sharpness" and not MIN_SHARPNESS <= value <= MAX_SHARPNESS:
        return (f"{value:g} is outside [{MIN_SHARPNESS:g}, {MAX_SHARPNESS:g}] (gate parameters must stay finite "
                f"and non-zero in the engine's float32 tables)")
    if name == "threshold" and not abs(value) <= MAX_ABS_THRESHOLD:
        return (f"{value:g} is outside [-{MAX_ABS_THRESHOLD:g}, {MAX_ABS_THRESHOLD:g}] (gate parameters must stay "
                f"finite in the engine's float32 tables)")
    return None


def _check_gate(m: "Monitor", where: str, source: "Monitor") -> None:
    """Raise naming the field when inline monitor ``m``'s gate parameters do not fit the float32 tables; ``source``
    is the monitor as written (a probe's values are reported on its ``probe``/``probe_file`` field)."""
    for name in ("sharpness", "threshold"):
        problem = gate_param_problem(name, float(getattr(m, name)))
        if problem is None:
            continue
        if source.is_inline:
            raise SteeringValidationError(f"{where}.{name}: {problem}")
        field = "probe" if source.probe is not None else "probe_file"
        what = source.probe if source.probe is not None else source.probe_file
        raise SteeringValidationError(f"{where}.{field}: {what!r} gives an out-of-range {name}: {problem}")


def _site_order(site: str) -> int:
    return SITES.index(site)  # type: ignore[arg-type]


class _Model(BaseModel):
    """Frozen, strict base. Equality compares the JSON form, so models holding numpy vectors compare by value."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.model_dump(mode="json") == other.model_dump(mode="json")  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self).__name__, json.dumps(self.model_dump(mode="json"), sort_keys=True)))


class Monitor(_Model):
    """An in-graph probe gate on the residual at ``(layer, site)``.

    Exactly one of three forms:

    * ``probe``: the name of a probe file the operator registered (``DynsteerConfig(probes={name: path})``); the
      only probe form a request sent to an engine may use;
    * ``probe_file``: a dynsteer probe file (DESIGN §7) read in the caller's process: :func:`dynsteer.encode_payload`
      and :meth:`dynsteer.Steerer.set_policy` load it and send the inline form (an engine rejects file paths);
    * inline ``direction`` + ``sharpness`` + ``threshold``: ``gate = σ(sharpness · (x·direction − threshold))``.

    :meth:`from_probe_file` builds the inline form from a probe file (exact logistic-probe identity, DESIGN §4).

    Args:
        name: unique name that rules refer to.
        layer: decoder layer whose residual is read (0-based).
        site: residual site read.
        probe: name of a registered probe file (registered form).
        probe_file: path of a probe file (file form; resolved in the caller's process).
        target_class: with ``probe``/``probe_file``: the class whose probability is the gate (1: the probe's
            positive class, 0: the other one).
        calibrated: with ``probe``/``probe_file``: centre the gate on the probe's calibration threshold.
        direction: probe direction ``[hidden]`` (inline form; usually unit norm, any non-zero norm is accepted).
        sharpness: slope of the gate's logit per unit of projection, in ``[1e-6, 1e8]`` (inline form; an engine
            checks the bound, for probes too: :data:`MAX_SHARPNESS`).
        threshold: projection at which the gate is 0.5, within ``±1e12`` (inline form).
        reads: ``token`` (default): the gate of every generated token, from that token's residual;
            ``prompt_last``: a prompt-level (CAST-style) gate, computed once inside the forward pass from the residual
            of the prompt's last token and held for every generated token of the request (rules it gates, or that
            name it as ``condition``, act on the whole generation or not at all); ``prompt_mean``: the same from
            the mean score over every prompt token (the score is linear, so this is the probe on the mean residual;
            such requests never reuse cached prompt blocks, since the monitor must see every prompt token).

    Example:
        >>> m = Monitor(name="m", layer=1, direction=[0.6, 0.8], sharpness=2.0, threshold=0.5)
        >>> round(float(m.gate([3.0, 4.0])), 6)   # σ(2 · (5 − 0.5))
        0.999877
    """

    name: str = Field(min_length=1, max_length=128)
    layer: Layer
    site: Site = "post_block"
    probe: Optional[str] = None
    probe_file: Optional[str] = None
    target_class: Literal[0, 1] = 1
    calibrated: StrictBool = False
    direction: Optional[Vector] = None
    sharpness: Optional[Real] = Field(default=None, gt=0.0)
    threshold: Optional[Real] = None
    reads: MonitorReads = "token"

    @field_validator("probe")
    @classmethod
    def _probe_name(cls, v: str | None) -> str | None:
        return None if v is None else check_name(v, "probe name")

    @field_validator("sharpness", "threshold")
    @classmethod
    def _finite_params(cls, v: float | None, info: Any) -> float | None:
        _finite(info.field_name, v)
        return v

    @field_validator("direction")
    @classmethod
    def _finite_direction(cls, v: np.ndarray | None) -> np.ndarray | None:
        if v is not None:
            if not np.all(np.isfinite(v)):
                raise ValueError("direction contains NaN or infinite values")
            if not np.linalg.norm(v.astype(np.float64)) > 0:
                raise ValueError("direction has zero norm")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> "Monitor":
        inline = {"direction": self.direction, "sharpness": self.sharpness, "threshold": self.threshold}
        given = [k for k, v in inline.items() if v is not None]
        files = [k for k in ("probe", "probe_file") if getattr(self, k) is not None]
        if len(files) > 1:
            raise ValueError(f"monitor {self.name!r}: give probe or probe_file, not both")
        if files:
            if given:
                raise ValueError(f"monitor {self.name!r}: give either {files[0]} or the inline form "
                                 f"(direction, sharpness, threshold), not both (got {files[0]} and {', '.join(given)})")
        elif len(given) != 3:
            missing = [k for k in inline if inline[k] is None]
            raise ValueError(f"monitor {self.name!r}: needs probe, probe_file or all of direction, sharpness, "
                             f"threshold (missing: {', '.join(missing)})")
        elif self.target_class != 1 or self.calibrated:
            raise ValueError(f"monitor {self.name!r}: target_class and calibrated apply to probe files only")
        return self

    @property
    def is_inline(self) -> bool:
        return self.probe_file is None and self.probe is None

    @classmethod
    def from_probe_file(cls, path: str | Path, *, name: str, calibrated: bool = False,
                        target_class: int = 1, reads: str = "token") -> "Monitor":
        """An inline monitor equal to the probe in ``path``: its layer, site and gate parameters.

        Args:
            path: a file written by :func:`dynsteer.probes.save_probe`.
            name: the monitor's name.
            calibrated: centre the gate on the probe's calibration threshold instead of decision 0.
            target_class: the class whose probability is the gate: 1 (the probe's positive class, the gate is
                ``predict_proba[:, 1]``) or 0 (the gate is ``predict_proba[:, 0]``: direction and threshold negated).
        """
        from dynsteer.probes.fileformat import load_probe

        if target_class not in (0, 1):
            raise ValueError(f"target_class must be 0 or 1, got {target_class!r}")
        return cls.from_probe(load_probe(path), name=name, calibrated=calibrated, target_class=target_class,
                              reads=reads)

    @classmethod
    def from_probe(cls, probe: Any, *, name: str, calibrated: bool = False, target_class: int = 1,
                   reads: str = "token") -> "Monitor":
        """An inline monitor equal to a loaded :class:`dynsteer.probes.fileformat.Probe` (see :meth:`from_probe_file`)."""
        p = probe.gate_params(calibrated=calibrated)
        sign = 1.0 if target_class == 1 else -1.0  # σ(−z) = 1 − σ(z)
        return cls(name=name, layer=probe.layer, site=probe.site, direction=sign * p.probe, sharpness=p.sharpness,
                   threshold=sign * p.threshold, reads=reads)

    def resolve(self, probes: Mapping[str, Any] | None = None, *, allow_files: bool = True) -> "Monitor":
        """The inline form; checks that the probe's layer and site match this monitor.

        Args:
            probes: registered probes (``{name: Probe}``) that ``probe`` may name.
            allow_files: whether ``probe_file`` may be read (the caller's own process; never for a request).

        Raises:
            ValueError: an unknown probe name, a file path where files are not allowed, a mismatching place.
        """
        if self.is_inline:
            return self
        if self.probe is not None:
            if probes is None:
                return self  # the caller's process: the engine resolves registered names against its own registry
            if self.probe not in probes:
                known = ", ".join(sorted(probes or {})) or "none registered"
                raise ValueError(f"unknown probe {self.probe!r} (registered: {known}; the operator registers probe "
                                 f"files with DynsteerConfig(probes={{name: path}}))")
            m = Monitor.from_probe(probes[self.probe], name=self.name, calibrated=self.calibrated,
                                   target_class=self.target_class, reads=self.reads)
            source = f"probe {self.probe!r}"
        else:
            if not allow_files:
                raise ValueError("file paths are not accepted in requests; register the probe file with "
                                 "DynsteerConfig(probes={name: path}) and reference it as probe=name")
            m = Monitor.from_probe_file(self.probe_file, name=self.name, calibrated=self.calibrated,  # type: ignore
                                        target_class=self.target_class, reads=self.reads)
            source = f"probe file {self.probe_file!r}"
        if (m.layer, m.site) != (self.layer, self.site):
            raise ValueError(f"monitor {self.name!r}: {source} reads layer {m.layer} site {m.site!r}, but the "
                             f"monitor says layer {self.layer} site {self.site!r}")
        return m

    def gate_params(self) -> Any:
        """The :class:`dynsteer.probes.gate.GateParams` of this monitor (loads ``probe_file`` if needed)."""
        from dynsteer.probes.gate import GateParams

        m = self.resolve()
        assert m.direction is not None and m.sharpness is not None and m.threshold is not None
        return GateParams(probe=np.asarray(m.direction, dtype=np.float64), sharpness=float(m.sharpness),
                          threshold=float(m.threshold))

    def score(self, x: Any) -> np.ndarray:
        """``x·direction`` in float64 for ``x`` of shape ``[..., hidden]`` (host-side reference)."""
        return np.asarray(x, dtype=np.float64) @ self.gate_params().probe

    def gate(self, x: Any) -> np.ndarray:
        """``σ(sharpness · (x·direction − threshold))`` in float64 (host-side reference; no prefill masking)."""
        from dynsteer.probes.gate import gate

        return gate(np.asarray(x, dtype=np.float64), self.gate_params())


class Action(_Model):
    """One dynamic steering action, scaled by the rule's gate and the controller's ``dyn_scale``.

    Args:
        kind: ``add`` (add ``scale · vector``), ``clamp`` (projection clamp to ``[lo, hi]``) or ``ablate``
            (clamp to ``[0, 0]``).
        layer: decoder layer steered; must not be before the rule's monitor layer.
        site: residual site steered; at the monitor's layer it must not be before the monitor's site.
        vector: registered vector name or inline vector (the direction for clamp/ablate).
        scale: multiplier for ``add`` (must stay 1 for the other kinds).
        lo: clamp lower bound (``clamp`` only; ``None``: open).
        hi: clamp upper bound (``clamp`` only; ``None``: open).
        strength: clamp/ablation strength, ``> 0`` (must stay 1 for ``add``).

    Example:
        >>> Action(kind="clamp", layer=4, vector="refusal", hi=0.5).kind
        'clamp'
    """

    kind: Literal["add", "clamp", "ablate"]
    layer: Layer
    site: Site = "post_block"
    vector: VectorSource
    scale: Real = 1.0
    lo: Optional[Real] = None
    hi: Optional[Real] = None
    strength: Real = Field(default=1.0, gt=0.0)

    @field_validator("scale", "lo", "hi", "strength")
    @classmethod
    def _finite_fields(cls, v: float | None, info: Any) -> float | None:
        _finite(info.field_name, v)
        return v

    @field_validator("vector")
    @classmethod
    def _finite_vector(cls, v: Any) -> Any:
        if isinstance(v, np.ndarray) and not np.all(np.isfinite(v)):
            raise ValueError("vector contains NaN or infinite values")
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> "Action":
        if self.kind == "clamp":
            if self.lo is None and self.hi is None:
                raise ValueError("lo/hi: a clamp action needs lo, hi or both")
            if self.lo is not None and self.hi is not None and self.lo > self.hi:
                raise ValueError(f"lo: lo ({self.lo}) must not exceed hi ({self.hi})")
        elif self.lo is not None or self.hi is not None:
            raise ValueError(f"lo/hi: only clamp actions take bounds, not {self.kind!r}")
        if self.kind != "add" and self.scale != 1.0:
            raise ValueError(f"scale: only add actions take a scale (use strength for {self.kind!r})")
        if self.kind == "add" and self.strength != 1.0:
            raise ValueError("strength: add actions take a scale, not a strength")
        return self


class Rule(_Model):
    """A monitor's gate switching a group of actions.

    Args:
        monitor: name of a monitor of the policy.
        actions: one or more actions.
        scope: ``this_token``, ``next_step`` or ``rest_of_request`` (see the module docstring).
        gate_floor: gate values below it count as 0, in ``[0, 1]``.
        enabled: ``False`` keeps computing the rule's gate (its trace and controller see it) but applies none of
            its actions and never aborts; a monitor's ``rule`` command switches it.
        abort: stop the request, with this reason, once the rule fires: at the first generated position where
            its gate reaches 0.5 (its monitor's score crosses the threshold; or ``gate_floor`` if higher). The
            gate is read back from the device, so the request finishes within two steps of that position, with
            the tokens generated until then and ``stop_reason = "dynsteer policy: rule <i> (monitor <name>):
            <abort>"``; its KV blocks stay shareable. A rule may abort without actions.
        condition: the name of a prompt-level monitor (``reads="prompt_last"``) whose held gate multiplies this
            rule's gate: the rule acts only in requests whose prompt the condition accepts (CAST-style), per token
            as its own monitor says.

    Example:
        >>> Rule(monitor="m", actions=[Action(kind="ablate", layer=5, vector="dir")]).scope
        'this_token'
        >>> Rule(monitor="m", abort="toxic continuation").actions
        ()
    """

    monitor: str = Field(min_length=1, max_length=128)
    actions: tuple[Action, ...] = ()
    scope: Scope = "this_token"
    gate_floor: Real = Field(default=0.0, ge=0.0, le=1.0)
    enabled: StrictBool = True
    abort: Optional[str] = Field(default=None, min_length=1, max_length=200)
    condition: Optional[str] = Field(default=None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _acts_or_aborts(self) -> "Rule":
        if not self.actions and self.abort is None:
            raise ValueError("actions: a rule needs at least one action, or an abort reason")
        if self.abort is not None and not self.abort.isprintable():
            raise ValueError("abort: the reason must be printable text")
        return self


_CONTROLLER_REQUIRED = {"latch": ("on", "off", "scale"), "ema_latch": ("alpha", "on", "off", "scale"),
                        "pid": ("target", "kp", "ki", "kd"), "budget": ("inner", "max_steered_tokens"),
                        "custom": ("name",)}
_CONTROLLER_OPTIONAL = {"pid": ("min_scale", "max_scale"), "custom": ("options",)}
_CONTROLLER_PARAMS = ("on", "off", "scale", "alpha", "target", "kp", "ki", "kd", "min_scale", "max_scale", "inner",
                      "max_steered_tokens", "name", "options")


class SyncControllerSpec(_Model):
    """Parameters of a built-in sync controller (:mod:`dynsteer.controllers.sync`; build with ``make_controller``).

    Required fields per kind (others must be left unset):

    * ``latch``: ``on``, ``off``, ``scale`` — hysteresis on the score (``on ≥ off``).
    * ``ema_latch``: ``alpha`` in ``(0, 1]``, ``on``, ``off``, ``scale`` — the latch on an EMA of the score.
    * ``pid``: ``target``, ``kp``, ``ki``, ``kd`` (``min_scale`` = 0, ``max_scale`` = 1 by default).
    * ``budget``: ``inner`` (another spec), ``max_steered_tokens`` ≥ 0.
    * ``custom``: ``name`` of a controller the operator registered (``DynsteerConfig(controllers={name:
      "package.module:Factory"})`` or the entry-point group ``dynsteer.controllers``); the factory is called with
      ``options`` (a JSON-like dict) as keyword arguments and returns a controller following the
      :class:`dynsteer.controllers.sync.SyncController` contract (pure ``initial_state`` / ``on_step``). Requests
      never carry import paths.

    Args:
        kind: the controller.
        monitor: whose score/gate feeds it; ``None`` is allowed when the policy has exactly one monitor.
        units: ``score`` (default): ``on``/``off``/``target`` are projections (``x·direction``);
            ``probability``: they are the monitor's gate probability in ``(0, 1)`` — for a monitor from a probe
            file, its ``predict_proba`` (calibrated: relative to the calibration threshold) — converted to scores
            when the policy is resolved, so no raw projection values appear in the configuration.

    Example:
        >>> SyncControllerSpec(kind="budget", max_steered_tokens=32,
        ...                    inner=SyncControllerSpec(kind="latch", on=1.0, off=0.5, scale=2.0)).kind
        'budget'
    """

    kind: ControllerKind
    monitor: Optional[str] = Field(default=None, max_length=128)
    on: Optional[Real] = None
    off: Optional[Real] = None
    scale: Optional[Real] = None
    alpha: Optional[Real] = Field(default=None, gt=0.0, le=1.0)
    target: Optional[Real] = None
    kp: Optional[Real] = None
    ki: Optional[Real] = None
    kd: Optional[Real] = None
    min_scale: Optional[Real] = None
    max_scale: Optional[Real] = None
    inner: Optional["SyncControllerSpec"] = None
    max_steered_tokens: Optional[StrictInt] = Field(default=None, ge=0)
    name: Optional[str] = None
    options: Optional[dict[str, Any]] = None
    units: Literal["score", "probability"] = "score"

    def in_score_units(self, monitor: "Monitor", where: str = "controller") -> "SyncControllerSpec":
        """This spec with ``on``/``off``/``target`` (and a budget's inner ones) in score units: probabilities map
        through the monitor's gate, ``score = threshold + logit(p) / sharpness`` (the score at which the monitor's
        probability is ``p``; for a probe file, its ``predict_proba``). ``monitor`` must be inline."""
        upd: dict[str, Any] = {}
        if self.inner is not None:
            upd["inner"] = self.inner.in_score_units(monitor, f"{where}.inner")
        if self.units == "probability":
            sharp, thr = float(monitor.sharpness), float(monitor.threshold)  # type: ignore[arg-type]
            for name in ("on", "off", "target"):
                p = getattr(self, name)
                if p is None:
                    continue
                if not 0.0 < p < 1.0:
                    raise SteeringValidationError(f"{where}.{name}: {p} is not a probability in (0, 1) "
                                                  f"(units='probability')")
                upd[name] = thr + math.log(p / (1.0 - p)) / sharp
            upd["units"] = "score"
        return self.model_copy(update=upd) if upd else self

    @model_validator(mode="before")
    @classmethod
    def _no_import_paths(cls, data: Any) -> Any:
        if isinstance(data, dict) and "factory" in data:
            raise ValueError("factory: import paths are not accepted; register the controller with "
                             "DynsteerConfig(controllers={name: 'package.module:Factory'}) and use kind='custom', "
                             "name=name")
        return data

    @field_validator("name")
    @classmethod
    def _controller_name(cls, v: str | None) -> str | None:
        return None if v is None else check_name(v, "controller name")

    @field_validator("on", "off", "scale", "target", "kp", "ki", "kd", "min_scale", "max_scale")
    @classmethod
    def _finite_fields(cls, v: float | None, info: Any) -> float | None:
        _finite(info.field_name, v)
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> "SyncControllerSpec":
        required = _CONTROLLER_REQUIRED[self.kind]
        allowed = set(required) | set(_CONTROLLER_OPTIONAL.get(self.kind, ()))
        for name in _CONTROLLER_PARAMS:
            value = getattr(self, name)
            if name in required and value is None:
                raise ValueError(f"{name}: a {self.kind!r} controller needs {', '.join(required)}")
            if name not in allowed and value is not None:
                raise ValueError(f"{name}: not a parameter of a {self.kind!r} controller "
                                 f"(it takes {', '.join(sorted(allowed))})")
        if self.on is not None and self.off is not None and self.on < self.off:
            raise ValueError(f"off: hysteresis needs on ≥ off (on={self.on}, off={self.off})")
        lo = 0.0 if self.min_scale is None else self.min_scale
        hi = 1.0 if self.max_scale is None else self.max_scale
        if self.kind == "pid" and lo > hi:
            raise ValueError(f"min_scale: min_scale ({lo}) must not exceed max_scale ({hi})")
        if self.inner is not None and self.inner.monitor is not None:
            raise ValueError("inner.monitor: set the monitor on the outer controller only")
        return self


class RelativeDoseLimit(_Model):
    """A guardrail on each additive action's relative dose ``|scale|·‖v‖ / mean‖h‖`` (:mod:`dynsteer.dose`).

    Checked where the caller admits the policy (:class:`dynsteer.Steerer` before sending it, ``dynsteer sweep``),
    against the residual norms measured once per model. A bare number is accepted as ``limit``.

    Args:
        limit: the largest relative dose, ``> 0``, at the controller's largest output
            (:meth:`DynamicSteeringPolicy.max_output`).
        mode: ``reject`` (a ``SteeringValidationError`` naming the action and its dose) or ``clip`` (the action's
            scale is reduced to the limit, and reported).

    Example:
        >>> RelativeDoseLimit.model_validate(0.5)
        RelativeDoseLimit(limit=0.5, mode='reject')
    """

    limit: Real = Field(gt=0.0)
    mode: Literal["reject", "clip"] = "reject"

    @model_validator(mode="before")
    @classmethod
    def _bare_number(cls, data: Any) -> Any:
        return {"limit": data} if isinstance(data, (int, float)) and not isinstance(data, bool) else data

    @field_validator("limit")
    @classmethod
    def _finite_limit(cls, v: float) -> float:
        _finite("limit", v)
        return v


class DynamicSteeringPolicy(_Model):
    """Monitors, the rules they gate, and an optional sync controller: one request's dynamic steering.

    Args:
        version: schema version (1).
        monitors: in-graph probe gates, unique names.
        rules: each a monitor and the actions its gate scales.
        controller: optional sync controller setting ``dyn_scale`` every step.
        max_relative_dose: optional :class:`RelativeDoseLimit` on additive actions (enforced by the caller's
            process, which knows the model's residual norms, and removed from the policy it sends; an engine
            refuses a policy that still carries it, naming the field, rather than run it unguarded).

    Raises:
        pydantic.ValidationError: (a ``ValueError``) duplicate monitor names, a rule naming an unknown monitor, an
            action steering a layer/site before its monitor's (e.g. ``rules[0].actions[1].layer``), or a controller
            without a well-defined monitor. The message names the field.

    Example:
        >>> p = DynamicSteeringPolicy(
        ...     monitors=[Monitor(name="m", layer=3, direction=[1.0, 0.0], sharpness=1.0, threshold=0.0)],
        ...     rules=[Rule(monitor="m", actions=[Action(kind="ablate", layer=3, vector=[0.0, 1.0])])])
        >>> DynamicSteeringPolicy.from_json(p.to_json()) == p
        True
    """

    version: Literal[1] = POLICY_VERSION
    monitors: tuple[Monitor, ...] = ()
    rules: tuple[Rule, ...] = ()
    controller: Optional[SyncControllerSpec] = None
    max_relative_dose: Optional[RelativeDoseLimit] = None

    @model_validator(mode="after")
    def _references(self) -> "DynamicSteeringPolicy":
        by_name: dict[str, Monitor] = {}
        for i, m in enumerate(self.monitors):
            if m.name in by_name:
                raise ValueError(f"monitors[{i}].name: duplicate monitor name {m.name!r}")
            by_name[m.name] = m
        known = ", ".join(sorted(by_name)) or "none defined"
        for i, rule in enumerate(self.rules):
            mon = by_name.get(rule.monitor)
            if mon is None:
                raise ValueError(f"rules[{i}].monitor: unknown monitor {rule.monitor!r} (known: {known})")
            if rule.condition is not None:
                cond = by_name.get(rule.condition)
                if cond is None:
                    raise ValueError(f"rules[{i}].condition: unknown monitor {rule.condition!r} (known: {known})")
                if cond.reads == "token":
                    raise ValueError(f"rules[{i}].condition: monitor {cond.name!r} reads every token; a condition "
                                     f"is a prompt-level monitor (reads='prompt_last' or 'prompt_mean')")
            if mon.reads != "token":
                if rule.scope != "this_token":
                    raise ValueError(f"rules[{i}].scope: monitor {mon.name!r} reads the prompt, so its gate is "
                                     f"already held for the whole request; use the default scope 'this_token'")
                if rule.abort is not None:
                    raise ValueError(f"rules[{i}].abort: not supported for a prompt-level monitor ({mon.name!r})")
                continue  # the held gate exists before the first generated token reaches any layer
            for j, a in enumerate(rule.actions):
                where = f"rules[{i}].actions[{j}]"
                if a.layer < mon.layer:
                    raise ValueError(
                        f"{where}.layer: layer {a.layer} is before monitor {mon.name!r}'s layer {mon.layer}; the "
                        f"gate is computed at the monitor site and carried forward, so it can only steer layer "
                        f"{mon.layer} (site {mon.site!r} or later) and later layers")
                if a.layer == mon.layer and _site_order(a.site) < _site_order(mon.site):
                    raise ValueError(
                        f"{where}.site: site {a.site!r} at layer {a.layer} comes before monitor {mon.name!r}'s "
                        f"site {mon.site!r}; the gate does not exist yet there")
        prompt_level = [m.name for m in self.monitors if m.reads != "token"]
        if prompt_level and (self.controller is not None or any(r.scope != "this_token" for r in self.rules)):
            where = "controller" if self.controller is not None else next(
                f"rules[{i}].scope" for i, r in enumerate(self.rules) if r.scope != "this_token")
            raise ValueError(f"{where}: prompt-level monitors ({', '.join(prompt_level)}) cannot yet be combined "
                             f"with a sync controller or next_step / rest_of_request rules")
        if self.controller is not None:
            if self.controller.monitor is None:
                if len(self.monitors) != 1:
                    raise ValueError(f"controller.monitor: name the monitor that feeds the controller (the policy "
                                     f"has {len(self.monitors)} monitors: {known})")
            elif self.controller.monitor not in by_name:
                raise ValueError(f"controller.monitor: unknown monitor {self.controller.monitor!r} (known: {known})")
        return self

    def monitor(self, name: str) -> Monitor:
        """The monitor called ``name`` (``KeyError`` if none)."""
        for m in self.monitors:
            if m.name == name:
                return m
        raise KeyError(name)

    def controller_monitor(self) -> Monitor | None:
        """The monitor feeding the controller (``None`` without a controller)."""
        if self.controller is None:
            return None
        return self.monitor(self.controller.monitor) if self.controller.monitor else self.monitors[0]

    def resolved(self, probes: Mapping[str, Any] | None = None, *, allow_files: bool = True,
                 prefix: str = "") -> "DynamicSteeringPolicy":
        """A copy whose monitors are all inline.

        Args:
            probes: registered probes that monitors' ``probe`` may name.
            allow_files: read ``probe_file`` monitors (the caller's own process; engines pass ``False``).
            prefix: prepended to field names in messages.

        Raises:
            SteeringValidationError: naming the monitor field that cannot be resolved.
        """
        monitors = []
        for i, m in enumerate(self.monitors):
            try:
                resolved = m.resolve(probes, allow_files=allow_files)
            except (OSError, ValueError) as exc:
                field = "probe" if m.probe is not None else "probe_file"
                raise SteeringValidationError(f"{prefix}monitors[{i}].{field}: {exc}") from None
            if not m.is_inline and resolved.is_inline:  # a probe's weight norm and bias become the gate's values
                _check_gate(resolved, f"{prefix}monitors[{i}]", m)
            monitors.append(resolved)
        upd: dict[str, Any] = {"monitors": tuple(monitors)}
        if self.controller is not None and all(m.is_inline for m in monitors):
            cm = self.controller.monitor
            mon = next(m for m in monitors if m.name == cm) if cm else monitors[0]
            upd["controller"] = self.controller.in_score_units(mon, f"{prefix}controller")
        return self.model_copy(update=upd)

    def max_output(self) -> float:
        """The largest ``|dyn_scale|`` the controller can output (1 without one; custom: unbounded, clipped by
        the engine's ``max_dyn_scale`` at run time)."""
        return 1.0 if self.controller is None else controller_bound(self.controller)

    def layers(self) -> list[int]:
        """Every layer a monitor reads or an action steers."""
        return sorted({m.layer for m in self.monitors} | {a.layer for r in self.rules for a in r.actions})

    def check(self, shape: ModelShape, named: dict[str, np.ndarray] | None = None, prefix: str = "") -> None:
        """Validate against a model like :func:`dynsteer.spec.check_spec`.

        Checks layer ranges and hooked layers/sites of monitors and actions, vector hidden sizes, finite values and
        non-zero directions, gate parameters within :data:`MIN_SHARPNESS`/:data:`MAX_SHARPNESS` and
        :data:`MAX_ABS_THRESHOLD`, clamp bounds and strengths, the controller's output bound; resolves probe
        monitors and checks them too.

        Args:
            shape: the engine's model shape (and its magnitude limits).
            named: registered vectors for actions that refer to a vector by name.
            prefix: prepended to field names in messages (e.g. ``"policy."``).

        Registered names (probes, custom controllers) are checked where the registry is: :func:`admit_policy`.

        Raises:
            SteeringValidationError: naming the first bad field (e.g. ``monitors[0].direction``).
        """
        def place(where: str, layer: int, site: str) -> None:
            if layer >= shape.num_layers:
                raise SteeringValidationError(
                    f"{where}.layer: layer {layer} out of range; the model has {shape.num_layers} layers "
                    f"(0..{shape.num_layers - 1})")
            if shape.layers is not None and layer not in shape.layers:
                raise SteeringValidationError(f"{where}.layer: layer {layer} is not hooked in this engine "
                                              f"(hooked: {list(shape.layers)})")
            check_site(site, shape, where)

        for i, source in enumerate(self.monitors):
            where = f"{prefix}monitors[{i}]"
            place(where, source.layer, source.site)
            m = source
            if not m.is_inline:
                try:
                    m = m.resolve()
                except (OSError, ValueError) as exc:
                    field = "probe" if m.probe is not None else "probe_file"
                    raise SteeringValidationError(f"{where}.{field}: {exc}") from None
                if not m.is_inline:
                    continue  # a registered name, checked where the registry is (the engine)
            arr = resolve_vector(m.direction, f"{where}.direction", shape, None)
            if not np.linalg.norm(arr.astype(np.float64)) > 0:
                raise SteeringValidationError(f"{where}.direction: direction has zero norm")
            for name in ("sharpness", "threshold"):
                if not math.isfinite(getattr(m, name)):
                    raise SteeringValidationError(f"{where}.{name}: must be finite")
            _check_gate(m, where, source)
        for i, rule in enumerate(self.rules):
            for j, a in enumerate(rule.actions):
                where = f"{prefix}rules[{i}].actions[{j}]"
                place(where, a.layer, a.site)
                arr = resolve_vector(a.vector, f"{where}.vector", shape, named)
                if a.kind != "add":
                    if not np.linalg.norm(arr.astype(np.float64)) > 0:
                        raise SteeringValidationError(f"{where}.vector: direction has zero norm")
                    check_clamp_bounds(a, shape, where)
        if self.controller is not None:
            check_controller(self.controller, shape, f"{prefix}controller")

    def to_json(self) -> str:
        """JSON with vectors in the packed ``{"b64": ...}`` form (bit-exact round trip)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> "DynamicSteeringPolicy":
        return cls.model_validate_json(text)

    def to_yaml(self) -> str:
        """YAML of the JSON form (vectors packed, bit-exact round trip)."""
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "DynamicSteeringPolicy":
        import yaml

        return cls.model_validate(yaml.safe_load(text))


def controller_bound(spec: SyncControllerSpec) -> float:
    """The largest ``|scale|`` a built-in controller can output (``inf`` for custom controllers)."""
    if spec.kind in ("latch", "ema_latch"):
        return abs(float(spec.scale))  # type: ignore[arg-type]
    if spec.kind == "pid":
        lo = 0.0 if spec.min_scale is None else spec.min_scale
        hi = 1.0 if spec.max_scale is None else spec.max_scale
        return max(abs(lo), abs(hi))
    if spec.kind == "budget":
        return controller_bound(spec.inner)  # type: ignore[arg-type]
    return math.inf


def check_controller(spec: SyncControllerSpec, shape: ModelShape, where: str) -> None:
    """Built-in controllers' outputs within the engine's ``max_dyn_scale`` (a custom one is checked at every step)."""
    if spec.kind == "custom":
        return
    if spec.kind == "budget":
        check_controller(spec.inner, shape, f"{where}.inner")  # type: ignore[arg-type]
        return
    bound = controller_bound(spec)
    if bound > shape.max_dyn_scale:
        field = "scale" if spec.kind in ("latch", "ema_latch") else "max_scale"
        if spec.kind == "pid" and abs(spec.min_scale or 0.0) > abs(spec.max_scale if spec.max_scale is not None
                                                                    else 1.0):
            field = "min_scale"
        raise SteeringValidationError(f"{where}.{field}: the controller can output |scale| = {bound:.4g}, over the "
                                      f"engine's limit max_dyn_scale = {shape.max_dyn_scale:g}")


def admit_policy(policy: DynamicSteeringPolicy, probes: Mapping[str, Any], controllers: Any,
                 prefix: str = "policy.") -> DynamicSteeringPolicy:
    """What an engine does with a policy from a request (or set globally): resolve registered probe names against
    ``probes`` (file paths are refused), and check that a custom controller names a registered one.

    Raises:
        SteeringValidationError: naming the field (``policy.monitors[0].probe_file``, ``policy.controller.name``).
    """
    if policy.max_relative_dose is not None:
        raise SteeringValidationError(
            f"{prefix}max_relative_dose: enforced by the caller's process (dynsteer.Steerer, dynsteer sweep), which "
            f"measures the model's residual norms; an engine cannot, so it refuses the policy rather than run it "
            f"without its guardrail (check the dose with dynsteer.dose before sending, or send it through a Steerer)")
    resolved = policy.resolved(probes, allow_files=False, prefix=prefix)
    spec = policy.controller
    where = f"{prefix}controller"
    while spec is not None:
        if spec.kind == "custom" and spec.name not in controllers:
            known = ", ".join(sorted(controllers)) or "none registered"
            raise SteeringValidationError(
                f"{where}.name: unknown controller {spec.name!r} (registered: {known}; the operator registers "
                f"controllers with DynsteerConfig(controllers={{name: 'package.module:Factory'}}))")
        spec, where = spec.inner, f"{where}.inner"
    return resolved
