"""The probe file (architecture §7): safetensors with ``weight [hidden]`` (optional ``mean``, ``scale``), JSON metadata.

Layout:
    tensors: ``weight`` float32 ``[hidden]``; optionally ``mean`` and ``scale`` float32 ``[hidden]``. Without them
        ``weight`` acts on the raw residual: ``decision = x·weight + bias``. With them ``weight`` acts on the
        standardised residual: ``decision = ((x − mean)/scale)·weight + bias``
        (:meth:`Probe.linear_form` folds them back into one raw-space ``(w, b)``).
    metadata (safetensors' string map): ``format = "dynsteer.probe/1"`` and ``probe`` = the JSON of
        :class:`ProbeMeta` (model id, hidden size, layer, site, method, bias, calibration).

The bias and the calibration live in the metadata as JSON numbers, which round-trip float64 exactly. The calibration
threshold is on the decision scale (``x·w + b > threshold`` flags positive).

Model ids: :meth:`Probe.check_compatible` only WARNS when the model id differs (the same checkpoint is often reached
through different paths or names), unless ``strict_model_id=True``; the hidden size, layer range and hooked site are
hard errors because the probe cannot run at all there.

Example:
    >>> save_probe("probe.safetensors", fitted_probe, model_id="smollm2", layer=12)   # doctest: +SKIP
    >>> load_probe("probe.safetensors").check_compatible(steerer.shape)              # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.special import expit

from dynsteer.probefile.gate import GateParams, gate_params
from dynsteer.spec import ModelShape, Site

PROBE_FILE_FORMAT = "dynsteer.probe/1"


class Calibration(BaseModel):
    """An operating point chosen on labelled data.

    Args:
        threshold: decision value; ``x·w + b > threshold`` flags positive.
        target_fpr: the false-positive rate the threshold was calibrated to.
        auroc: AUROC on the calibration data (``None``: not measured).
        n: number of samples the calibration used.
        n_negatives: how many of them were negatives (what the false-positive rate rests on; ``None``: not
            recorded, files written before it was).
        fpr: the false-positive rate of the threshold on the calibration data.
        fpr_interval: its Clopper-Pearson interval at ``confidence`` (what to expect on fresh data).
        confidence: the interval's level.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    threshold: float
    target_fpr: float = Field(ge=0.0, le=1.0)
    auroc: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(ge=0)
    n_negatives: int | None = Field(default=None, ge=0)
    fpr: float | None = Field(default=None, ge=0.0, le=1.0)
    fpr_interval: tuple[float, float] | None = None
    confidence: float | None = Field(default=None, gt=0.0, lt=1.0)


class ProbeMeta(BaseModel):
    """Validated metadata of a probe file.

    Args:
        format: file format version, always ``"dynsteer.probe/1"``.
        model_id: model the probe was trained on (engine ``model``: a path or hub name).
        hidden_size: length of ``weight``.
        layer: decoder layer whose residual it reads.
        site: residual site it reads.
        method: how it was made (estimator name, data description).
        bias: ``b`` of ``decision = x·w + b`` (in the space ``weight`` acts on).
        calibration: optional operating point.
        extra: free-form string annotations.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["dynsteer.probe/1"] = PROBE_FILE_FORMAT
    model_id: str
    hidden_size: int = Field(gt=0)
    layer: int = Field(ge=0)
    site: Site = "post_block"
    method: str = ""
    bias: float
    calibration: Calibration | None = None
    extra: dict[str, str] = Field(default_factory=dict)


@dataclass
class Probe:
    """A loaded probe: weights, optional standardisation, metadata.

    Attributes:
        weight: ``[hidden]`` float32 as stored.
        meta: validated metadata (``meta.bias`` is the bias).
        mean: optional per-feature mean ``[hidden]``; ``scale``: optional per-feature scale.
    """

    weight: np.ndarray
    meta: ProbeMeta
    mean: np.ndarray | None = None
    scale: np.ndarray | None = None

    @property
    def layer(self) -> int:
        return self.meta.layer

    @property
    def site(self) -> Site:
        return self.meta.site

    def linear_form(self) -> tuple[np.ndarray, float]:
        """``(w [hidden] float64, b)`` with ``decision = x·w + b`` on the raw residual (standardisation folded in)."""
        w = self.weight.astype(np.float64)
        b = float(self.meta.bias)
        if self.scale is not None:
            w = w / self.scale.astype(np.float64)
        if self.mean is not None:
            b -= float(self.mean.astype(np.float64) @ w)
        return w, b

    def decision_function(self, X: np.ndarray) -> np.ndarray:
        w, b = self.linear_form()
        return np.asarray(X, dtype=np.float64) @ w + b

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """``[n, 2]``: ``[1 − σ(d), σ(d)]`` with ``d = decision_function(X)``, as the estimators that wrote it
        (scikit-learn's convention; column 1 is the positive class; probabilities only for logistic probes)."""
        p = expit(self.decision_function(X))
        return np.stack([1.0 - p, p], axis=1)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Class ``1`` (positive) or ``0`` per row: ``decision > threshold``, where the threshold is the file's
        calibration threshold when it has one (an operating point chosen at a target FPR), else 0 (the estimators'
        own ``predict``)."""
        threshold = self.meta.calibration.threshold if self.meta.calibration is not None else 0.0
        return (self.decision_function(X) > threshold).astype(np.int64)

    def gate_params(self, *, calibrated: bool = False) -> GateParams:
        """The equivalent gate (architecture §4); ``calibrated=True`` centres it on the calibration threshold."""
        w, b = self.linear_form()
        at = self.meta.calibration.threshold if calibrated and self.meta.calibration is not None else 0.0
        return gate_params(w, b, at=at)

    def check_compatible(self, shape: ModelShape, model_id: str | None = None, *, strict_model_id: bool = False
                         ) -> None:
        """Check that this probe can run on an engine of ``shape`` (e.g. ``steerer.shape``).

        Args:
            shape: the engine's model shape (layer count, hidden size, hooked sites and layers).
            model_id: the engine's model id; defaults to ``shape.model_id``. Empty on either side: not compared.
            strict_model_id: raise instead of warning when the model ids differ.

        Raises:
            ValueError: hidden size differs, layer out of range, site or layer not hooked (or, with
                ``strict_model_id``, a different model id); the message says what the probe expects and what the
                engine has.
        """
        m = self.meta
        where = f"probe (layer {m.layer}, site {m.site!r}, trained on {m.model_id or 'an unnamed model'!r})"
        if m.hidden_size != shape.hidden_size:
            raise ValueError(f"{where} has hidden size {m.hidden_size}, but the engine's model "
                             f"{shape.model_id or '?'!r} has hidden size {shape.hidden_size}: it was trained on a "
                             f"different model")
        if not 0 <= m.layer < shape.num_layers:
            raise ValueError(f"{where} reads layer {m.layer}, but the engine's model has only {shape.num_layers} "
                             f"layers (0..{shape.num_layers - 1})")
        if m.site not in shape.sites:
            raise ValueError(f"{where} reads site {m.site!r}, which this engine does not hook (hooked: "
                             f"{list(shape.sites)}); add it to DynsteerConfig(sites=...)")
        if shape.layers is not None and m.layer not in shape.layers:
            raise ValueError(f"{where} reads layer {m.layer}, which this engine does not hook (hooked: "
                             f"{list(shape.layers)}); add it to DynsteerConfig(layers=...)")
        engine_id = model_id if model_id is not None else shape.model_id
        if m.model_id and engine_id and m.model_id.rstrip("/") != engine_id.rstrip("/"):
            msg = (f"{where} was trained on model {m.model_id!r} but the engine runs {engine_id!r}; shapes match, "
                   f"so it will run, but its scores mean nothing unless these are the same weights")
            if strict_model_id:
                raise ValueError(msg)
            warnings.warn(msg, UserWarning, stacklevel=2)


def save_probe(path: str | Path, probe: Any, bias: float | None = None, *, model_id: str, layer: int,
               site: Site = "post_block", method: str | None = None, calibration: Calibration | dict | None = None,
               mean: np.ndarray | None = None, scale: np.ndarray | None = None,
               extra: dict[str, str] | None = None) -> Path:
    """Write a probe file atomically (temporary file in the same directory, then rename).

    Args:
        path: output file (``.safetensors``).
        probe: a fitted estimator with ``linear_form()`` (its raw-space ``(w, b)`` is stored; ``bias`` must be
            ``None``), or a weight vector ``[hidden]``.
        bias: the bias when ``probe`` is a weight vector.
        model_id: model the probe belongs to (e.g. ``steerer.shape.model_id``).
        layer: decoder layer.
        site: residual site.
        method: description; defaults to the estimator's class name.
        calibration: optional :class:`Calibration` (or its dict).
        mean: optional standardisation mean (then ``weight`` acts on standardised inputs).
        scale: optional standardisation scale.
        extra: free-form string annotations.

    Returns:
        The path written.
    """
    from safetensors.numpy import save_file

    if hasattr(probe, "linear_form"):
        if bias is not None:
            raise ValueError("pass either a fitted estimator or (weight, bias), not both")
        weight, bias = probe.linear_form()
        method = type(probe).__name__ if method is None else method
    else:
        if bias is None:
            raise ValueError("a weight vector needs its bias")
        weight = probe
    weight = np.ascontiguousarray(np.asarray(weight), dtype=np.float32)
    if weight.ndim != 1:
        raise ValueError(f"weight must be 1-D [hidden], got shape {weight.shape}")
    tensors = {"weight": weight}
    for name, arr in (("mean", mean), ("scale", scale)):
        if arr is not None:
            arr = np.ascontiguousarray(np.asarray(arr), dtype=np.float32)
            if arr.shape != weight.shape:
                raise ValueError(f"{name} has shape {arr.shape}, weight has {weight.shape}")
            tensors[name] = arr
    for name, arr in tensors.items():
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{name} contains NaN or infinite values")
    meta = ProbeMeta(model_id=model_id, hidden_size=weight.shape[0], layer=layer, site=site, method=method or "",
                     bias=float(bias), calibration=calibration, extra=extra or {})
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": PROBE_FILE_FORMAT, "probe": meta.model_dump_json()})
        os.replace(tmp, path)  # readers never see a half-written file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_probe(path: str | Path) -> Probe:
    """Read and validate a probe file written by :func:`save_probe`.

    Raises:
        ValueError: not a probe file, unknown format version, invalid metadata or tensors of the wrong shape.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        raw = dict(f.metadata() or {})
        if raw.get("format") != PROBE_FILE_FORMAT:
            raise ValueError(f"{path}: not a {PROBE_FILE_FORMAT} probe file (format={raw.get('format')!r})")
        try:
            meta = ProbeMeta.model_validate(json.loads(raw["probe"]))
        except (KeyError, json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: invalid probe metadata: {exc}") from None
        tensors = {k: f.get_tensor(k).astype(np.float32) for k in f.keys()}
    if "weight" not in tensors:
        raise ValueError(f"{path}: probe file has no 'weight' tensor")
    for name, arr in tensors.items():
        if arr.shape != (meta.hidden_size,):
            raise ValueError(f"{path}: tensor {name!r} has shape {arr.shape}, metadata says hidden size "
                             f"{meta.hidden_size}")
    return Probe(weight=tensors["weight"], meta=meta, mean=tensors.get("mean"), scale=tensors.get("scale"))


__all__ = ["Calibration", "PROBE_FILE_FORMAT", "Probe", "ProbeMeta", "load_probe", "save_probe"]
