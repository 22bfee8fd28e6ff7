"""Steering vectors from files made elsewhere: a dynsteer probe file, or a sparse autoencoder's decoder rows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dynsteer.probefile.fileformat import load_probe
from dynsteer.vectors.directions import rescale
from dynsteer.vectors.made import SteeringVectors
from dynsteer.vectors.sae import load_sae_decoder


def from_probe(path: str | Path, *, norm: float | None = None) -> SteeringVectors:
    """The probe's direction at its layer and site: the unit vector ``w/‖w‖`` of its raw-space weights (its
    standardisation folded in), the direction of its gate (:func:`dynsteer.probes.gate_params`), pointing to the
    positive class; ``norm`` rescales it (default: unit length).

    Raises:
        ValueError: not a probe file (naming the file).
    """
    probe = load_probe(path)
    direction = probe.gate_params().probe
    meta = {"probe": Path(path).name, "probe_method": probe.meta.method}
    if norm is not None:
        meta["rescaled_to"] = float(norm)
    return SteeringVectors(vectors={probe.layer: rescale(direction, norm if norm is not None else 1.0)},
                           site=probe.site, model_id=probe.meta.model_id, method="probe", meta=meta)


def from_sae(path: str | Path, features: Sequence[int], *, coefficients: Sequence[float] | None = None,
             layer: int | None = None, site: str | None = None, norm: float | None = None, model_id: str | None = None,
             cfg_path: str | Path | None = None) -> SteeringVectors:
    """The sum of an SAE's decoder rows for ``features`` (each times its coefficient, default 1).

    Args:
        path: SAE weights (a file or a directory; see :func:`dynsteer.vectors.sae.load_sae_decoder`).
        features: feature indices.
        coefficients: one per feature.
        layer: the layer; required when there is no ``cfg.json`` hook name, and must agree with it otherwise.
        site: the site (default: from the hook name, else ``post_block``).
        norm: rescale to this L2 norm (default: the rows' sum as it is).
        model_id: the model (default: ``cfg.json``'s ``model_name``).
        cfg_path: the SAE config (default: ``cfg.json`` beside the weights).

    Raises:
        ValueError: naming the field: a feature out of range, a shape that disagrees with ``cfg.json``, no layer, or
            a layer or site that disagrees with the hook name.
    """
    dec = load_sae_decoder(path, cfg_path)
    if dec.layer is not None and layer is not None and layer != dec.layer:
        raise ValueError(f"layer: {layer} given, but cfg.json hook_name {dec.hook_name!r} says layer {dec.layer}")
    if dec.site is not None and site is not None and site != dec.site:
        raise ValueError(f"site: {site!r} given, but cfg.json hook_name {dec.hook_name!r} says {dec.site!r}")
    chosen = layer if layer is not None else dec.layer
    if chosen is None:
        raise ValueError(f"layer: {dec.source} has no cfg.json hook_name to take the layer from; give the layer")
    vector = rescale(dec.direction(features, coefficients), norm, "the decoder rows' sum")
    meta = {"sae": Path(dec.source).name, "sae_layout": dec.layout, "features": [int(f) for f in features]}
    if coefficients is not None:
        meta["coefficients"] = [float(c) for c in coefficients]
    if dec.hook_name:
        meta["hook_name"] = dec.hook_name
    if norm is not None:
        meta["rescaled_to"] = float(norm)
    mid = model_id if model_id is not None else str(dec.cfg.get("model_name") or "")
    return SteeringVectors(vectors={chosen: vector}, site=site or dec.site or "post_block", model_id=mid,
                           method="sae", meta=meta)


__all__ = ["from_probe", "from_sae"]
