"""The frozen, strict pydantic base of every policy schema, and its finiteness check."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


def finite_fields(*names: str) -> Any:
    """A field validator refusing NaN and ±inf in the float fields ``names`` (``None`` passes), naming the field."""

    def check(cls: type, v: float | None, info: Any) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{info.field_name} must be finite, got {v}")
        return v

    return field_validator(*names)(check)


class FrozenModel(BaseModel):
    """Frozen, strict base. Equality compares the JSON form, so models holding numpy vectors compare by value."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.model_dump(mode="json") == other.model_dump(mode="json")  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self).__name__, json.dumps(self.model_dump(mode="json"), sort_keys=True)))
