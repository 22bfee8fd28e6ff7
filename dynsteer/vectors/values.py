"""Vectors as values: conversion and a compact binary wire form.

Inline vectors never travel as JSON float lists: on the wire and in JSON they are ``{"b64": <little-endian float32>}``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Mapping

import numpy as np
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema


def as_vector(value: Any) -> np.ndarray:
    """Convert a list, numpy array, torch tensor or ``{"b64": ...}`` dict to a 1-D float32 numpy array."""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) % 4:
            raise ValueError(f"packed vector has {len(value)} bytes, not a multiple of 4 (float32)")
        arr = np.frombuffer(value, dtype="<f4")
    elif isinstance(value, Mapping):
        arr = unpack_vector(value)
    elif hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor without importing torch here
        arr = value.detach().to("cpu").float().numpy()
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            raise ValueError("expected a vector: a list of numbers")
        try:
            arr = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"expected a vector: a list of numbers ({exc})") from None
    else:
        raise ValueError(f"expected a vector (list, numpy array, tensor or {{'b64': ...}}), got {type(value).__name__}")
    try:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"expected a vector of numbers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D vector, got shape {tuple(arr.shape)}")
    return arr


def pack_vector(arr: np.ndarray) -> dict[str, str]:
    """The wire form of a vector: base64 of little-endian float32 bytes."""
    return {"b64": base64.b64encode(np.ascontiguousarray(arr, dtype="<f4").tobytes()).decode("ascii")}


def unpack_vector(obj: Mapping[str, Any]) -> np.ndarray:
    """Inverse of :func:`pack_vector`; raises ``ValueError`` on malformed bytes."""
    if set(obj) - {"b64", "dtype"} or "b64" not in obj:
        raise ValueError(f"packed vector must be {{'b64': str}}, got keys {sorted(obj)}")
    if obj.get("dtype", "float32") != "float32":
        raise ValueError(f"packed vector dtype must be float32, got {obj['dtype']!r}")
    try:
        raw = base64.b64decode(obj["b64"], validate=True)
    except (binascii.Error, TypeError) as exc:
        raise ValueError(f"packed vector is not valid base64: {exc}") from None
    if len(raw) % 4:
        raise ValueError(f"packed vector has {len(raw)} bytes, not a multiple of 4 (float32)")
    return np.frombuffer(raw, dtype="<f4").astype(np.float32)


Vector = Annotated[
    np.ndarray,
    BeforeValidator(as_vector),
    PlainSerializer(pack_vector, when_used="json"),
    WithJsonSchema({"type": "object", "properties": {"b64": {"type": "string"}}, "required": ["b64"]}),
]
"""A pydantic field type for vectors: accepts lists/arrays/tensors/packed dicts; serialises to the packed form."""
