"""Vectors in policy and spec files by reference: ``{file: ...}``, ``{name: ...}`` or the string forms.

A ``vector`` (actions, ``vectors[i]``) or ``direction`` (monitors, clamps, ablations) field of a file loaded by
:func:`dynsteer.sweep.load_target` may hold, instead of an inline vector (a list or ``{b64: ...}``):

* ``{file: path.npy}`` or ``"file:path.npy"`` — a 1-D numpy array file;
* ``{file: path.safetensors}`` — a steering-vector file (:func:`dynsteer.vectors.save_vector`): the vector of the
  entry's own ``layer``, or of ``{file: ..., layer: N}``, or the file's only layer;
* ``{name: registered}`` or a bare string — a vector registered on the engine (``--vector NAME=FILE`` on the CLI,
  :meth:`dynsteer.Steerer.register_vector` in Python); a monitor's ``direction`` must be inline or a file.

Relative paths are read against the policy file's directory. A grid axis over a vector field
(``--grid 'rules[0].actions[0].vector=file:a.npy,file:b.npy'``) takes the same forms, paths relative to the
current directory, and names its variants by the files (``vector=a.npy``). Files are read once, when the file is loaded, so the
sweep's fingerprint holds their values. A reference that cannot be read raises ``ValueError`` naming the field
(``rules[0].actions[0].vector: ...``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dynsteer.sweep.grid import GridAxis, parse_path
from dynsteer.vectors import as_vector, load_vector, pack_vector

__all__ = ["VECTOR_FIELDS", "load_vector_file", "resolve_axis_refs", "resolve_vector_refs"]

VECTOR_FIELDS = ("vector", "direction")
"""Field names that hold a vector in policies and specs."""

FILE_PREFIX = "file:"


def load_vector_file(path: str | Path, layer: int | None = None) -> np.ndarray:
    """The vector in a ``.npy`` file, or ``layer``'s vector in a steering-vector ``.safetensors`` file (its only
    layer when ``layer`` is ``None``).

    Raises:
        ValueError: a missing or unreadable file, not 1-D, a layer the file lacks, an unknown extension.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such file: {str(p)!r}")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{str(p)!r} is not a numpy array file: {exc}") from None
        return as_vector(np.asarray(arr))
    if p.suffix == ".safetensors":
        try:
            by_layer, _ = load_vector(p)
        except ValueError:
            raise
        except Exception as exc:  # safetensors raises its own error types on a corrupt header
            raise ValueError(f"{str(p)!r} is not a steering-vector file: {exc}") from None
        if layer is None:
            if len(by_layer) != 1:
                raise ValueError(f"{str(p)!r} holds layers {sorted(by_layer)}: say which with {{file: ..., layer: N}}")
            return as_vector(next(iter(by_layer.values())))
        if layer not in by_layer:
            raise ValueError(f"{str(p)!r} has no vector for layer {layer} (layers: {sorted(by_layer)})")
        return as_vector(by_layer[layer])
    raise ValueError(f"{str(p)!r}: expected a .npy or a steering-vector .safetensors file")


def _ref(value: Any, entry: Mapping[str, Any], base_dir: Path, field: str) -> Any:
    """The JSON form of one vector field's value (a reference resolved; anything else unchanged)."""
    if isinstance(value, str) and value.startswith(FILE_PREFIX):
        value = {"file": value[len(FILE_PREFIX):]}
    if not isinstance(value, Mapping) or "b64" in value:
        return value
    keys = set(value)
    if keys == {"name"}:
        if "monitors[" in field and ".direction" in field:
            raise ValueError(f"{field}: a monitor's direction cannot be a registered name (give a file or a vector)")
        if not isinstance(value["name"], str):
            raise ValueError(f"{field}: name must be a string, got {type(value['name']).__name__}")
        return value["name"]
    if "file" in keys and keys <= {"file", "layer"}:
        if not isinstance(value["file"], str) or not value["file"]:
            raise ValueError(f"{field}: file must be a path")
        layer = value.get("layer", entry.get("layer"))
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise ValueError(f"{field}: layer must be an integer, got {layer!r}")
        path = Path(value["file"]).expanduser()
        if not path.is_absolute():
            path = base_dir / path
        try:
            return pack_vector(load_vector_file(path, layer))
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None
    raise ValueError(f"{field}: expected an inline vector, {{b64: ...}}, {{file: path}} (.npy or .safetensors, "
                     f"optionally with layer), {{name: registered}} or 'file:path'; got keys {sorted(keys)}")


def resolve_vector_refs(data: Any, base_dir: str | Path = ".", _path: str = "") -> Any:
    """A copy of a policy's or spec's JSON-like ``data`` with every vector reference replaced by its vector's
    ``{b64: ...}`` form (files) or name (registered names).

    Raises:
        ValueError: naming the field whose reference is malformed or unreadable.
    """
    if isinstance(data, Mapping):
        out = {}
        for k, v in data.items():
            where = f"{_path}.{k}" if _path else str(k)
            out[k] = (_ref(v, data, Path(base_dir), where) if k in VECTOR_FIELDS
                      else resolve_vector_refs(v, base_dir, where))
        return out
    if isinstance(data, list):
        return [resolve_vector_refs(v, base_dir, f"{_path}[{i}]") for i, v in enumerate(data)]
    return data


def resolve_axis_refs(axis: GridAxis, base: Mapping[str, Any], base_dir: str | Path = ".") -> GridAxis:
    """``axis`` with vector references among its values resolved (an axis over a ``vector``/``direction`` field),
    each named by its file or registered name; other axes unchanged.

    Args:
        axis: the grid axis.
        base: the base policy's or spec's JSON form (a safetensors file's layer defaults to the entry's ``layer``).
        base_dir: where relative paths are read from.

    Raises:
        ValueError: naming the axis and the value that cannot be read.
    """
    keys = parse_path(axis.path)
    if keys[-1] not in VECTOR_FIELDS:
        return axis
    entry: Any = base
    for k in keys[:-1]:
        try:
            entry = entry[k]
        except (KeyError, IndexError, TypeError):
            return axis  # a path that names no field: SweepConfig.check_paths says so
    entry = entry if isinstance(entry, Mapping) else {}
    values, names = [], []
    for i, v in enumerate(axis.values):
        ref = {"file": v[len(FILE_PREFIX):]} if isinstance(v, str) and v.startswith(FILE_PREFIX) else v
        values.append(_ref(v, entry, Path(base_dir), f"--grid {axis.path} (value {i + 1})"))
        if isinstance(ref, Mapping) and "file" in ref:
            names.append(Path(str(ref["file"])).name + (f":{ref['layer']}" if "layer" in ref else ""))
        elif isinstance(ref, Mapping) and "name" in ref:
            names.append(str(ref["name"]))
        else:
            names.append(v if isinstance(v, str) else f"inline {i + 1}")
    return GridAxis(path=axis.path, values=tuple(values), names=tuple(names))
