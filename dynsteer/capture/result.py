"""Captures as the caller receives them, and their wire form (plain bytes + JSON-like fields: they cross vLLM's
msgpack hop between the engine and the user's process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynsteer.capture.store import CaptureRecord, Place


@dataclass
class Capture:
    """One request's captured residuals: ``capture[(layer, site)]`` is ``[len(positions), hidden]``.

    Attributes:
        tag: the request's correlation tag.
        positions: absolute token positions of the rows, ascending.
        arrays: ``{(layer, site): array}``.
        status: ``ok``, ``partial`` (a consumer failed; data here is complete) or ``error``.
        errors: what went wrong, if anything.
    """

    tag: str
    positions: np.ndarray
    arrays: dict[Place, np.ndarray]
    status: str = "ok"
    errors: list[str] = field(default_factory=list)

    def __getitem__(self, place: Place) -> np.ndarray:
        return self.arrays[place]


def _pack(arr: np.ndarray) -> dict[str, Any]:
    return {"dtype": str(arr.dtype), "shape": list(arr.shape), "data": np.ascontiguousarray(arr).tobytes()}


def _unpack(obj: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(obj["data"], dtype=obj["dtype"]).reshape(obj["shape"]).copy()


def pack_record(record: CaptureRecord) -> dict[str, Any]:
    positions, arrays = record.arrays()
    return {"tag": record.tag, "status": record.status, "errors": list(record.errors), "positions": _pack(positions),
            "arrays": {f"{layer}.{site}": _pack(a) for (layer, site), a in arrays.items()}}


def unpack_record(obj: dict[str, Any]) -> Capture:
    arrays = {}
    for key, packed in obj["arrays"].items():
        layer, site = key.split(".", 1)
        arrays[(int(layer), site)] = _unpack(packed)
    return Capture(tag=obj["tag"], positions=_unpack(obj["positions"]), arrays=arrays, status=obj["status"],
                   errors=list(obj["errors"]))
