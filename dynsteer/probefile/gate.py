"""The logistic-probe ↔ dynamic-gate identity (architecture §4).

A linear probe ``σ(x·w + b)`` and the in-graph gate ``σ(sharpness · (x·probe − threshold))`` are the same function
when ``probe = w/‖w‖``, ``sharpness = ‖w‖`` and ``threshold = −b/‖w‖``:
``sharpness · (x·probe − threshold) = ‖w‖ · x·w/‖w‖ + ‖w‖ · b/‖w‖ = x·w + b``. The gate's ``threshold`` is therefore
a distance along the unit probe direction, in the residual stream's own units, and ``sharpness`` says how quickly the
gate goes from 0 to 1 around it. Input standardisation must already be folded into ``(w, b)``
(see :meth:`dynsteer.probes.estimators.LinearProbe.linear_form`).

Example:
    >>> import numpy as np
    >>> w, b = np.array([3.0, 4.0]), -10.0
    >>> p = gate_params(w, b)
    >>> p.sharpness, p.threshold
    (5.0, 2.0)
    >>> x = np.array([1.0, 2.0])
    >>> bool(np.isclose(gate(x, p), 1 / (1 + np.exp(-(x @ w + b)))))
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import expit


@dataclass(frozen=True)
class GateParams:
    """Parameters of a sigmoid gate on the residual stream.

    Attributes:
        probe: unit-norm direction ``[hidden]`` (float64).
        sharpness: ``‖w‖``, the slope of the gate's logit per unit of projection.
        threshold: projection on ``probe`` at which the gate is 0.5.
    """

    probe: np.ndarray
    sharpness: float
    threshold: float


def gate_params(w: np.ndarray, b: float, *, at: float = 0.0) -> GateParams:
    """Gate parameters reproducing ``σ(x·w + b − at)``.

    Args:
        w: probe weights in the residual's own (un-standardised) space, ``[hidden]``.
        b: probe bias.
        at: decision value at which the gate should be 0.5. The default 0 gives the exact identity with
            ``σ(x·w + b)``; pass a calibrated decision threshold (e.g. ``Probe.meta.calibration.threshold``) to centre
            the gate there instead (``threshold = (at − b)/‖w‖``, same ``probe`` and ``sharpness``).

    Raises:
        ValueError: ``w`` is not a finite, non-zero 1-D vector.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"w must be a 1-D vector, got shape {w.shape}")
    if not np.all(np.isfinite(w)) or not np.isfinite(b) or not np.isfinite(at):
        raise ValueError("w, b and at must be finite")
    norm = float(np.linalg.norm(w))
    if norm == 0.0:
        raise ValueError("w is all zeros: a zero probe has no direction to gate on")
    return GateParams(probe=w / norm, sharpness=norm, threshold=(float(at) - float(b)) / norm)


def gate_logit(x: np.ndarray, params: GateParams) -> np.ndarray:
    """``sharpness · (x·probe − threshold)`` for ``x`` of shape ``[..., hidden]``."""
    return params.sharpness * (np.asarray(x, dtype=np.float64) @ params.probe - params.threshold)


def gate(x: np.ndarray, params: GateParams) -> np.ndarray:
    """Gate value in (0, 1) for ``x`` of shape ``[..., hidden]`` (numerically stable sigmoid)."""
    return expit(gate_logit(x, params))
