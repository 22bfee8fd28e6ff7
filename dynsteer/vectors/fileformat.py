"""The steering-vector file (architecture §7): safetensors with one ``layer.<L>`` float32 tensor per layer and string
metadata.

Metadata keys: ``format`` (``"dynsteer.vector/1"``), ``site``, ``model_id``, ``method``, ``layers`` (JSON list) and
``norms`` (JSON ``{layer: L2 norm}``), plus any annotations the writer adds. Vectors made by
:mod:`dynsteer.make` add ``n_pairs``, ``positions``, ``chat_template`` and ``data_sha256`` (contrastive pairs), or the
probe or SAE they came from. Non-string annotations are stored as JSON.

Example:
    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "v.safetensors")
    >>> save_vector(path, {3: np.ones(4)}, model_id="m", method="test")
    >>> vectors, meta = load_vector(path)
    >>> vectors[3].tolist(), meta["layers"], meta["norms"]
    ([1.0, 1.0, 1.0, 1.0], '[3]', '{"3": 2.0}')
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dynsteer.vectors.values import as_vector

VECTOR_FILE_FORMAT = "dynsteer.vector/1"


def save_vector(path: str | Path, vectors: Mapping[int, Any], *, site: str = "post_block", model_id: str = "",
                method: str = "", **extra: Any) -> None:
    """Write per-layer steering vectors to a safetensors file with metadata.

    Args:
        path: output file.
        vectors: ``{layer: vector}``.
        site: the site the vectors were made for.
        model_id: the model they belong to.
        method: how they were made (e.g. ``"mean difference, 60 sentences"``).
        **extra: further annotations (strings as they are, anything else as JSON).

    Raises:
        ValueError: no vectors, a negative layer, vectors of different lengths or non-finite values.
    """
    from safetensors.numpy import save_file

    if not vectors:
        raise ValueError("vectors: empty; give at least one {layer: vector}")
    tensors: dict[str, np.ndarray] = {}
    for k, v in vectors.items():
        if int(k) < 0:
            raise ValueError(f"vectors: layer {k} is negative")
        arr = as_vector(v)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"vectors[{k}]: contains NaN or infinite values")
        tensors[f"layer.{int(k)}"] = arr
    sizes = {name: a.shape[0] for name, a in tensors.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"vectors: layers have different lengths {sizes}")
    layers = sorted(int(k) for k in vectors)
    norms = {str(layer): float(np.linalg.norm(tensors[f"layer.{layer}"].astype(np.float64))) for layer in layers}
    meta = {"format": VECTOR_FILE_FORMAT, "site": site, "model_id": model_id, "method": method,
            "layers": json.dumps(layers), "norms": json.dumps(norms),
            **{k: v if isinstance(v, str) else json.dumps(v) for k, v in extra.items()}}
    tmp = Path(str(path) + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def load_vector(path: str | Path) -> tuple[dict[int, np.ndarray], dict[str, str]]:
    """Read a file written by :func:`save_vector`: ``({layer: vector}, metadata)``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = dict(f.metadata() or {})
        if meta.get("format") != VECTOR_FILE_FORMAT:
            raise ValueError(f"{path}: not a dynsteer vector file (format={meta.get('format')!r})")
        out = {int(k.split(".", 1)[1]): f.get_tensor(k).astype(np.float32) for k in f.keys()}
    return out, meta
