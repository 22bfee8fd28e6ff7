"""A made steering vector: ``{layer: vector}`` at one site, with what it was made from, saved as a vector file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dynsteer.vectors.fileformat import load_vector, save_vector

_CORE = ("format", "site", "model_id", "method", "layers", "norms")


@dataclass
class SteeringVectors:
    """Per-layer steering vectors and their provenance.

    Attributes:
        vectors: ``{layer: float32 [hidden]}``.
        site: the residual site they were made at.
        model_id: the model they were made on (empty when not known).
        method: ``caa``, ``pca``, ``probe`` or ``sae``.
        meta: annotations saved with them (``n_pairs``, ``positions``, ``data_sha256``, ``probe``, ``sae``, ...).
    """

    vectors: dict[int, np.ndarray]
    site: str
    model_id: str
    method: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def layers(self) -> list[int]:
        return sorted(self.vectors)

    @property
    def hidden_size(self) -> int:
        return int(next(iter(self.vectors.values())).shape[0])

    @property
    def norms(self) -> dict[int, float]:
        return {k: float(np.linalg.norm(np.asarray(v, np.float64))) for k, v in sorted(self.vectors.items())}

    def save(self, path: str | Path) -> Path:
        """Write the vector file (:func:`dynsteer.vectors.save_vector`); loadable wherever vector files are."""
        save_vector(path, self.vectors, site=self.site, model_id=self.model_id, method=self.method, **self.meta)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "SteeringVectors":
        """Read any vector file; annotations written as JSON come back as values."""
        vectors, raw = load_vector(path)
        meta = {k: _value(v) for k, v in raw.items() if k not in _CORE}
        return cls(vectors=vectors, site=raw.get("site", "post_block"), model_id=raw.get("model_id", ""),
                   method=raw.get("method", ""), meta=meta)

    def check_hidden_size(self, hidden_size: int, model: str = "the model") -> None:
        """``ValueError`` when the vectors' length is not ``hidden_size`` (d_model mismatch)."""
        if self.hidden_size != hidden_size:
            raise ValueError(f"vector length (d_model) {self.hidden_size} does not match {model}'s hidden size "
                             f"{hidden_size}")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


__all__ = ["SteeringVectors"]
