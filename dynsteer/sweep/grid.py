"""Parameter grids over any field of a pydantic model (a policy or a steering spec).

A grid axis is written ``path=v1,v2,...`` where ``path`` addresses a field the way validation errors name it
(``rules[0].actions[0].scale``, ``monitors[0].threshold``, ``vectors[1].layer``, ``max_relative_dose``) and each
value is parsed as YAML (``2`` an int, ``2.5`` a float, ``null``, ``true``, ``[1, 2]``, ``{limit: 0.5}``).
A variant is one point of the cartesian product of the axes, applied to the base model and validated again, so a
value a field does not accept fails with pydantic's message naming the field.

Example:
    >>> from dynsteer.spec import AddVector, SteeringSpec
    >>> base = SteeringSpec(vectors=[AddVector(layer=1, vector=[1.0, 0.0], scale=1.0)])
    >>> axes = [parse_axis("vectors[0].scale=0,2.5"), parse_axis("vectors[0].layer=1,2")]
    >>> [apply_point(base, p).vectors[0].scale for p in grid_points(axes)]
    [0.0, 0.0, 2.5, 2.5]
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any, Optional, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field

M = TypeVar("M", bound=BaseModel)

__all__ = ["GridAxis", "GridPathError", "apply_point", "grid_points", "parse_axis", "parse_path", "point_label"]

_TOKEN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*)*")


class GridPathError(ValueError):
    """A grid path that does not address a field of the model (a wrong name, an index out of range)."""


class GridAxis(BaseModel):
    """One swept field and its values (in order).

    Attributes:
        path: the field's path (``rules[0].actions[0].scale``).
        values: the values it takes (JSON-like: numbers, strings, booleans, ``None``, lists, dicts).
        names: how each value is named in variant labels and plots (e.g. the file a vector came from); ``None``:
            the values themselves.
    """

    model_config = ConfigDict(frozen=True)

    path: str = Field(min_length=1)
    values: tuple[Any, ...] = Field(min_length=1)
    names: Optional[tuple[str, ...]] = None

    def name(self, value: Any) -> str:
        """How ``value`` (one of :attr:`values`) is shown."""
        if self.names is not None and value in self.values:
            return self.names[self.values.index(value)]
        return _fmt(value)

    def model_post_init(self, __context: Any) -> None:
        parse_path(self.path)


def parse_path(path: str) -> list[str | int]:
    """``"rules[0].actions[1].scale"`` → ``["rules", 0, "actions", 1, "scale"]``.

    Raises:
        ValueError: a malformed path.
    """
    if not _PATH.fullmatch(path):
        raise ValueError(f"grid path {path!r}: expected field names joined by '.', each optionally followed by "
                         f"[index] (e.g. rules[0].actions[0].scale)")
    return [name if name else int(index) for name, index in _TOKEN.findall(path)]


def parse_axis(text: str) -> GridAxis:
    """Parse ``path=v1,v2,...`` (values as YAML; a value holding commas can be bracketed: ``x=[1, 2],[3, 4]``).

    Raises:
        ValueError: no ``=``, an empty path or value list, a malformed path or value.
    """
    path, sep, rest = text.partition("=")
    if not sep or not path.strip() or not rest.strip():
        raise ValueError(f"grid axis {text!r}: expected PATH=VALUE[,VALUE...]")
    try:
        values = yaml.safe_load(f"[{rest}]")
    except yaml.YAMLError as exc:
        raise ValueError(f"grid axis {text!r}: values are not valid YAML: {exc}") from None
    if not values:
        raise ValueError(f"grid axis {text!r}: no values")
    return GridAxis(path=path.strip(), values=tuple(values))


def grid_points(axes: list[GridAxis]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, the first axis varying slowest: ``[{path: value, ...}, ...]``."""
    if not axes:
        return [{}]
    paths = [a.path for a in axes]
    if len(set(paths)) != len(paths):
        raise ValueError(f"grid: a path appears twice ({', '.join(paths)})")
    return [dict(zip(paths, combo)) for combo in itertools.product(*(a.values for a in axes))]


def _set(data: Any, keys: list[str | int], value: Any, path: str) -> Any:
    if not keys:
        return value
    key, rest = keys[0], keys[1:]
    if isinstance(key, int):
        if not isinstance(data, (list, tuple)) or key >= len(data):
            have = len(data) if isinstance(data, (list, tuple)) else "no list"
            raise GridPathError(f"grid path {path!r}: index [{key}] out of range ({have} entries)")
        items = list(data)
        items[key] = _set(items[key], rest, value, path)
        return items
    if not isinstance(data, dict):
        raise GridPathError(f"grid path {path!r}: {key!r} is not a field here")
    if key not in data and rest:
        raise GridPathError(f"grid path {path!r}: no field {key!r} (fields: {', '.join(sorted(data))})")
    return {**data, key: _set(data.get(key), rest, value, path)}


def apply_point(base: M, point: dict[str, Any]) -> M:
    """A copy of ``base`` with each ``path: value`` of ``point`` set, validated again.

    Raises:
        GridPathError: a path that addresses no field; ``pydantic.ValidationError`` (a ``ValueError``) for a value
            the field rejects (an unknown field name at the end of a path is rejected this way too).
    """
    if not point:
        return base
    data = base.model_dump(mode="python", exclude_none=True)
    for path, value in point.items():
        data = _set(data, parse_path(path), value, path)
    return type(base).model_validate(data)


def point_label(point: dict[str, Any], axes: Sequence[GridAxis] = ()) -> str:
    """``"scale=2, threshold=0.5"``: each path's last field name with its value (the full path where two clash;
    a value as its axis names it, when ``axes`` has the path)."""
    short = [str(parse_path(p)[-1]) for p in point]
    names = [s if short.count(s) == 1 else p for s, p in zip(short, point)]
    by_path = {a.path: a for a in axes}
    shown = [by_path[p].name(v) if p in by_path else _fmt(v) for p, v in point.items()]
    return ", ".join(f"{n}={v}" for n, v in zip(names, shown)) or "base"


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
