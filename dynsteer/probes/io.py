"""Activations on disk, for training and evaluating probes from the shell (``dynsteer probe train|eval``).

Two inputs:

* an **activations file** (``.npz``, :func:`save_activations`): ``layer_<L>`` arrays ``[n, hidden]``, ``y`` ``[n]``,
  ``groups`` ``[n]`` when rows come from generated tokens (:func:`dynsteer.probes.collect_generated`: the prompt of
  each row, which training keeps whole) and a ``meta`` JSON string (site, model id, hidden size, positions); what
  :func:`dynsteer.probes.collect` returns, saved;
* a **capture folder** written by a ``filesystem`` capture consumer (read with :class:`dynsteer.CaptureReader`) plus
  labels per capture tag (:func:`activations_from_captures`): each request becomes one row, its last captured
  position or the mean over its positions.

Example:
    >>> acts = collect(steerer, sentences, labels, layers=range(4, 30, 2))     # doctest: +SKIP
    >>> save_activations("sentiment.npz", acts)                                # doctest: +SKIP
    $ dynsteer probe train sentiment.npz --out sentiment.safetensors
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dynsteer.probes.collect import Activations

ACTIVATIONS_FORMAT = "dynsteer.activations/1"


def save_activations(path: str | Path, acts: Activations) -> Path:
    """Write ``acts`` to ``path`` (``.npz``; no pickled objects)."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {f"layer_{layer}": np.asarray(x, np.float32) for layer, x in acts.X.items()}
    if acts.y is not None:
        arrays["y"] = np.asarray(acts.y)
    if acts.n_positions is not None:
        arrays["n_positions"] = np.asarray(acts.n_positions, np.int64)
    if acts.groups is not None:  # collect_generated: the prompt of each row, so training keeps prompts whole
        arrays["groups"] = np.asarray(acts.groups, np.int64)
    meta = {"format": ACTIVATIONS_FORMAT, "site": acts.site, "model_id": acts.model_id,
            "hidden_size": int(acts.hidden_size), "positions": acts.positions if isinstance(acts.positions, str)
            else "explicit"}
    arrays["meta"] = np.array(json.dumps(meta))
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def load_activations(path: str | Path) -> Activations:
    """Read a file written by :func:`save_activations` (``ValueError`` naming what is wrong otherwise)."""
    with np.load(Path(path), allow_pickle=False) as data:
        if "meta" not in data.files:
            raise ValueError(f"{path}: not a dynsteer activations file (no 'meta')")
        meta = json.loads(str(data["meta"]))
        if meta.get("format") != ACTIVATIONS_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {ACTIVATIONS_FORMAT!r}")
        X = {int(k[len("layer_"):]): np.asarray(data[k], np.float32) for k in data.files if k.startswith("layer_")}
        y = np.asarray(data["y"]) if "y" in data.files else None
        n_positions = np.asarray(data["n_positions"]) if "n_positions" in data.files else None
        groups = np.asarray(data["groups"]) if "groups" in data.files else None
    if not X:
        raise ValueError(f"{path}: no layer_<L> arrays")
    _check_rows(X, y, str(path))
    return Activations(X=X, y=y, site=meta.get("site", "post_block"), model_id=meta.get("model_id", ""),
                       hidden_size=int(meta.get("hidden_size") or next(iter(X.values())).shape[1]),
                       positions=meta.get("positions", "last_prompt"), n_positions=n_positions, groups=groups)


def read_labels(path: str | Path) -> dict[str, int]:
    """``tag,label`` rows of a CSV (a header row naming ``tag`` and ``label`` is optional); labels are 0/1."""
    labels: dict[str, int] = {}
    with open(path, newline="") as f:
        for i, row in enumerate(csv.reader(f)):
            if not row or (i == 0 and [c.strip().lower() for c in row[:2]] == ["tag", "label"]):
                continue
            if len(row) < 2:
                raise ValueError(f"{path}:{i + 1}: expected 'tag,label'")
            try:
                label = int(row[1])
            except ValueError:
                raise ValueError(f"{path}:{i + 1}: label {row[1]!r} is not 0 or 1") from None
            if label not in (0, 1):
                raise ValueError(f"{path}:{i + 1}: label {label} is not 0 or 1")
            labels[row[0].strip()] = label
    return labels


def activations_from_captures(root: str | Path, labels: Mapping[str, int] | None = None, *, site: str | None = None,
                              reduce: Literal["last", "mean"] = "last", model_id: str = "") -> Activations:
    """One row per capture tag under ``root`` (all tags, or those in ``labels``, in ``labels``' order).

    Args:
        root: a ``filesystem`` capture consumer's root.
        labels: ``{tag: 0/1}``; ``None``: every tag, unlabelled.
        site: which site's arrays to use when the captures hold several (default: the only one).
        reduce: ``last`` (the request's last captured position, e.g. ``last_prompt`` captures) or ``mean``.
    """
    from dynsteer.capture.reader import CaptureReader

    reader = CaptureReader(root)
    tags = list(labels) if labels is not None else reader.tags()
    if not tags:
        raise ValueError(f"{root}: no captures")
    rows: dict[int, list[np.ndarray]] = {}
    counts = []
    sites: set[str] = set()
    for tag in tags:
        try:
            positions, arrays, _ = reader.read(tag)
        except KeyError:
            raise ValueError(f"labels name capture {tag!r}, which is not under {root}") from None
        found = {s for (_, s) in arrays}
        if site is None and len(found) > 1:
            raise ValueError(f"capture {tag!r} holds sites {sorted(found)}: choose one with --site")
        sites |= found
        chosen = site or next(iter(found))
        layers = sorted(layer for (layer, s) in arrays if s == chosen)
        if rows and layers != sorted(rows):
            raise ValueError(f"capture {tag!r} holds layers {layers}, the others {sorted(rows)}")
        for layer in layers:
            a = np.asarray(arrays[(layer, chosen)], np.float32)
            rows.setdefault(layer, []).append(a[-1] if reduce == "last" else a.mean(axis=0))
        counts.append(len(positions))
    X = {layer: np.stack(r) for layer, r in rows.items()}
    y = None if labels is None else np.array([labels[t] for t in tags], np.int64)
    chosen = site or next(iter(sites))
    return Activations(X=X, y=y, site=chosen, model_id=model_id, hidden_size=next(iter(X.values())).shape[1],
                       positions="last_prompt" if reduce == "last" else "all_prompt",
                       n_positions=np.array(counts if reduce == "mean" else [1] * len(counts)))


def _check_rows(X: dict[int, np.ndarray], y: Any, where: str) -> None:
    n = {layer: x.shape[0] for layer, x in X.items()}
    if len(set(n.values())) != 1 or any(x.ndim != 2 for x in X.values()):
        raise ValueError(f"{where}: layer arrays must be [n, hidden] with the same n, got {n}")
    if y is not None and len(y) != next(iter(n.values())):
        raise ValueError(f"{where}: y has {len(y)} labels for {next(iter(n.values()))} rows")
