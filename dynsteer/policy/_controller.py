"""The sync controller's spec: which built-in (or registered) controller sets ``dyn_scale`` after every step, and the
largest output it can give."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import Field, StrictInt, field_validator, model_validator

from dynsteer.policy._base import FrozenModel, finite_fields
from dynsteer.spec import ModelShape, Real, SteeringValidationError, check_name

if TYPE_CHECKING:
    from dynsteer.policy._gates import ProbeGate

ControllerKind = Literal["latch", "ema_latch", "pid", "budget", "custom"]

_CONTROLLER_REQUIRED = {"latch": ("on", "off", "scale"), "ema_latch": ("alpha", "on", "off", "scale"),
                        "pid": ("target", "kp", "ki", "kd"), "budget": ("inner", "max_steered_tokens"),
                        "custom": ("name",)}
_CONTROLLER_OPTIONAL = {"pid": ("min_scale", "max_scale"), "custom": ("options",)}
_CONTROLLER_PARAMS = ("on", "off", "scale", "alpha", "target", "kp", "ki", "kd", "min_scale", "max_scale", "inner",
                      "max_steered_tokens", "name", "options")


class SyncControllerSpec(FrozenModel):
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

    def in_score_units(self, monitor: "ProbeGate", where: str = "controller") -> "SyncControllerSpec":
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

    _finite_fields = finite_fields("on", "off", "scale", "target", "kp", "ki", "kd", "min_scale", "max_scale")

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

