"""Monitors: in-graph probe gates on the residual, and the bounds their gate parameters must keep."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field, StrictBool, field_validator, model_validator

from dynsteer.policy._base import FrozenModel, finite_fields
from dynsteer.spec import Layer, Real, Site, SteeringValidationError, check_name
from dynsteer.vectors import Vector

MonitorReads = Literal["token", "prompt_last", "prompt_mean"]
"""What a monitor's gate reads: every generated token, the prompt's last token, or the mean over the prompt."""

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


def gate_param_problem(name: str, value: float) -> str | None:
    """What is wrong with a gate's ``sharpness`` or ``threshold`` for the engine's float32 tables (None: fine)."""
    if name == "sharpness" and not MIN_SHARPNESS <= value <= MAX_SHARPNESS:
        return (f"{value:g} is outside [{MIN_SHARPNESS:g}, {MAX_SHARPNESS:g}] (gate parameters must stay finite "
                f"and non-zero in the engine's float32 tables)")
    if name == "threshold" and not abs(value) <= MAX_ABS_THRESHOLD:
        return (f"{value:g} is outside [-{MAX_ABS_THRESHOLD:g}, {MAX_ABS_THRESHOLD:g}] (gate parameters must stay "
                f"finite in the engine's float32 tables)")
    return None


def check_gate(m: "ProbeGate", where: str, source: "ProbeGate") -> None:
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


class ProbeGate(FrozenModel):
    """An in-graph probe gate on the residual at ``(layer, site)``.

    Exactly one of three forms:

    * ``probe``: the name of a probe file the operator registered (``DynsteerConfig(probes={name: path})``); the
      only probe form a request sent to an engine may use;
    * ``probe_file``: a dynsteer probe file (architecture §7) read in the caller's process:
      :func:`dynsteer.encode_payload` and :meth:`dynsteer.Steerer.set_policy` load it and send the inline form (an
      engine rejects file paths);
    * inline ``direction`` + ``sharpness`` + ``threshold``: ``gate = σ(sharpness · (x·direction − threshold))``.

    :meth:`from_probe_file` builds the inline form from a probe file (exact logistic-probe identity, architecture §4).

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
        >>> m = ProbeGate(name="m", layer=1, direction=[0.6, 0.8], sharpness=2.0, threshold=0.5)
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

    _finite_params = finite_fields("sharpness", "threshold")

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
    def _one_form(self) -> "ProbeGate":
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
                        target_class: int = 1, reads: str = "token") -> "ProbeGate":
        """An inline monitor equal to the probe in ``path``: its layer, site and gate parameters.

        Args:
            path: a file written by :func:`dynsteer.probes.save_probe`.
            name: the monitor's name.
            calibrated: centre the gate on the probe's calibration threshold instead of decision 0.
            target_class: the class whose probability is the gate: 1 (the probe's positive class, the gate is
                ``predict_proba[:, 1]``) or 0 (the gate is ``predict_proba[:, 0]``: direction and threshold negated).
        """
        from dynsteer.probefile.fileformat import load_probe

        if target_class not in (0, 1):
            raise ValueError(f"target_class must be 0 or 1, got {target_class!r}")
        return cls.from_probe(load_probe(path), name=name, calibrated=calibrated, target_class=target_class,
                              reads=reads)

    @classmethod
    def from_probe(cls, probe: Any, *, name: str, calibrated: bool = False, target_class: int = 1,
                   reads: str = "token") -> "ProbeGate":
        """An inline monitor equal to a loaded :class:`dynsteer.probefile.fileformat.Probe` (see :meth:`from_probe_file`)."""
        p = probe.gate_params(calibrated=calibrated)
        sign = 1.0 if target_class == 1 else -1.0  # σ(−z) = 1 − σ(z)
        return cls(name=name, layer=probe.layer, site=probe.site, direction=sign * p.probe, sharpness=p.sharpness,
                   threshold=sign * p.threshold, reads=reads)

    def resolve(self, probes: Mapping[str, Any] | None = None, *, allow_files: bool = True) -> "ProbeGate":
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
            m = ProbeGate.from_probe(probes[self.probe], name=self.name, calibrated=self.calibrated,
                                   target_class=self.target_class, reads=self.reads)
            source = f"probe {self.probe!r}"
        else:
            if not allow_files:
                raise ValueError("file paths are not accepted in requests; register the probe file with "
                                 "DynsteerConfig(probes={name: path}) and reference it as probe=name")
            m = ProbeGate.from_probe_file(self.probe_file, name=self.name, calibrated=self.calibrated,  # type: ignore
                                        target_class=self.target_class, reads=self.reads)
            source = f"probe file {self.probe_file!r}"
        if (m.layer, m.site) != (self.layer, self.site):
            raise ValueError(f"monitor {self.name!r}: {source} reads layer {m.layer} site {m.site!r}, but the "
                             f"monitor says layer {self.layer} site {self.site!r}")
        return m

    def gate_params(self) -> Any:
        """The :class:`dynsteer.probefile.gate.GateParams` of this monitor (loads ``probe_file`` if needed)."""
        from dynsteer.probefile.gate import GateParams

        m = self.resolve()
        assert m.direction is not None and m.sharpness is not None and m.threshold is not None
        return GateParams(probe=np.asarray(m.direction, dtype=np.float64), sharpness=float(m.sharpness),
                          threshold=float(m.threshold))

    def score(self, x: Any) -> np.ndarray:
        """``x·direction`` in float64 for ``x`` of shape ``[..., hidden]`` (host-side reference)."""
        return np.asarray(x, dtype=np.float64) @ self.gate_params().probe

    def gate(self, x: Any) -> np.ndarray:
        """``σ(sharpness · (x·direction − threshold))`` in float64 (host-side reference; no prefill masking)."""
        from dynsteer.probefile.gate import gate

        return gate(np.asarray(x, dtype=np.float64), self.gate_params())

