"""Sparse-autoencoder decoders as steering directions: read an SAE's decoder and take feature rows.

Two safetensors layouts are read:

* SAELens: ``W_dec`` of shape ``[d_sae, d_model]``, one row per feature;
* a PyTorch ``nn.Linear(d_sae, d_model)`` decoder: ``decoder.weight`` of shape ``[d_model, d_sae]`` (transposed on
  reading; :attr:`SaeDecoder.layout` says which one was found).

When a ``cfg.json`` sits beside the weights (SAELens writes one), its ``d_in`` and ``d_sae`` must match the decoder's
shape, and its ``hook_name`` gives the layer and site: ``blocks.<L>.hook_resid_pre`` → ``pre_attn``,
``blocks.<L>.hook_resid_mid`` → ``post_attn``, ``blocks.<L>.hook_resid_post`` → ``post_block``, all at layer ``L``.

Example:
    >>> dec = load_sae_decoder("sae/")                              # doctest: +SKIP
    >>> dec.layout, dec.layer, dec.site                              # doctest: +SKIP
    ('W_dec [d_sae, d_model]', 6, 'post_block')
    >>> v = dec.direction([123])                                     # doctest: +SKIP
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

WEIGHT_FILES = ("sae_weights.safetensors", "model.safetensors")
HOOK = re.compile(r"blocks\.(\d+)\.hook_resid_(pre|mid|post)")
HOOK_SITES = {"pre": "pre_attn", "mid": "post_attn", "post": "post_block"}


@dataclass
class SaeDecoder:
    """An SAE's decoder, rows per feature.

    Attributes:
        W_dec: ``[d_sae, d_model]`` float32.
        layout: which tensor was read (``"W_dec [d_sae, d_model]"`` or ``"decoder.weight [d_model, d_sae],
            transposed"``).
        layer: the layer from ``cfg.json``'s ``hook_name`` (``None`` without one).
        site: the site from ``hook_name`` (``None`` without one).
        hook_name: ``cfg.json``'s hook name, as written.
        source: the weights file read.
        cfg: ``cfg.json`` as read (empty without one).
    """

    W_dec: np.ndarray
    layout: str
    layer: int | None = None
    site: str | None = None
    hook_name: str | None = None
    source: str = ""
    cfg: dict[str, Any] = field(default_factory=dict)

    @property
    def d_sae(self) -> int:
        return int(self.W_dec.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.W_dec.shape[1])

    def direction(self, features: Sequence[int], coefficients: Sequence[float] | None = None) -> np.ndarray:
        """``Σ coefficient_i · W_dec[feature_i]`` (coefficients default to 1), float32 ``[d_model]``.

        Raises:
            ValueError: no feature, a feature index out of ``0..d_sae-1``, or a coefficient count that differs.
        """
        features = [int(f) for f in features]
        if not features:
            raise ValueError("features: empty; give at least one feature index")
        for i, f in enumerate(features):
            if not 0 <= f < self.d_sae:
                raise ValueError(f"features[{i}]: index {f} out of range (0..{self.d_sae - 1}; this SAE has "
                                 f"d_sae={self.d_sae})")
        coef = [1.0] * len(features) if coefficients is None else [float(c) for c in coefficients]
        if len(coef) != len(features):
            raise ValueError(f"coefficients: {len(coef)} given for {len(features)} features")
        rows = self.W_dec[features].astype(np.float64)
        return (np.asarray(coef) @ rows).astype(np.float32)


def _weights_file(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"{path}: no such SAE file or directory")
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    found = sorted(path.glob("*.safetensors"))
    if len(found) != 1:
        raise ValueError(f"{path}: expected {' or '.join(WEIGHT_FILES)} or one .safetensors file, found "
                         f"{[p.name for p in found] or 'none'}")
    return found[0]


def hook_place(hook_name: str) -> tuple[int, str]:
    """``(layer, site)`` of a residual-stream hook name such as ``blocks.6.hook_resid_post``."""
    m = HOOK.fullmatch(hook_name.strip())
    if m is None:
        raise ValueError(f"cfg.json hook_name: {hook_name!r} is not a residual-stream hook "
                         f"(blocks.<L>.hook_resid_pre|mid|post); give the layer and site yourself")
    return int(m.group(1)), HOOK_SITES[m.group(2)]


def load_sae_decoder(path: str | Path, cfg_path: str | Path | None = None) -> SaeDecoder:
    """Read an SAE's decoder from a safetensors file or a directory holding one (and ``cfg.json``).

    Args:
        path: the weights file, or a directory with ``sae_weights.safetensors`` (SAELens), ``model.safetensors`` or a
            single ``.safetensors`` file.
        cfg_path: the SAE's config (default: ``cfg.json`` beside the weights, when present).

    Raises:
        ValueError: naming the tensor or ``cfg.json`` field: no ``W_dec`` nor ``decoder.weight``, a tensor that is not
            2-D, a shape that disagrees with ``cfg.json``'s ``d_in``/``d_sae``, or an unreadable ``cfg.json``.
    """
    from safetensors import safe_open

    weights = _weights_file(Path(path))
    with safe_open(str(weights), framework="numpy") as f:
        keys = set(f.keys())
        if "W_dec" in keys:
            name, layout = "W_dec", "W_dec [d_sae, d_model]"
            W = f.get_tensor("W_dec")
        elif "decoder.weight" in keys:
            name, layout = "decoder.weight", "decoder.weight [d_model, d_sae], transposed"
            W = f.get_tensor("decoder.weight")
        else:
            raise ValueError(f"{weights}: no SAE decoder: expected 'W_dec' [d_sae, d_model] or 'decoder.weight' "
                             f"[d_model, d_sae], found tensors {sorted(keys)}")
    if W.ndim != 2:
        raise ValueError(f"{weights}: {name} has shape {tuple(W.shape)}; expected a matrix")
    W = np.ascontiguousarray((W.T if name == "decoder.weight" else W), dtype=np.float32)
    if not np.all(np.isfinite(W)):
        raise ValueError(f"{weights}: {name} contains NaN or infinite values")

    cfg_file = Path(cfg_path) if cfg_path is not None else weights.parent / "cfg.json"
    cfg: dict[str, Any] = {}
    if cfg_path is not None or cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{cfg_file}: cannot read the SAE config ({exc})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_file}: expected a JSON object")
    shape = f"{name} has shape {tuple(W.shape) if name == 'W_dec' else tuple(W.T.shape)}"
    for key, got, axis in (("d_sae", W.shape[0], "features"), ("d_in", W.shape[1], "model dimensions")):
        if key in cfg and int(cfg[key]) != got:
            raise ValueError(f"{cfg_file}: {key}={cfg[key]} but {weights.name}'s {shape} ({got} {axis}); is the "
                             f"decoder stored in the other layout?")
    # SAELens keeps hook_name at the top level of cfg.json, or under "metadata" in newer versions
    hook = cfg.get("hook_name") or (cfg.get("metadata") or {}).get("hook_name")
    layer, site = hook_place(hook) if hook else (None, None)
    return SaeDecoder(W_dec=W, layout=layout, layer=layer, site=site, hook_name=hook, source=str(weights), cfg=cfg)


__all__ = ["SaeDecoder", "hook_place", "load_sae_decoder"]
