"""The frozen, strict pydantic base of every policy schema, and its finiteness check."""

from __future__ import annotations

import json
import math

from pydantic import BaseModel, ConfigDict


def require_finite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


class FrozenModel(BaseModel):
    """Frozen, strict base. Equality compares the JSON form, so models holding numpy vectors compare by value."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.model_dump(mode="json") == other.model_dump(mode="json")  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self).__name__, json.dumps(self.model_dump(mode="json"), sort_keys=True)))
