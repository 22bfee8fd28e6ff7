"""Actions: what a rule's gate switches on (an add, a projection clamp or an ablation)."""

from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
from pydantic import Field, field_validator, model_validator

from dynsteer.policy._base import FrozenModel, finite_fields
from dynsteer.spec import Layer, Real, Site, VectorSource


class Action(FrozenModel):
    """One dynamic steering action, scaled by the rule's gate and the controller's ``dyn_scale``.

    Args:
        kind: ``add`` (add ``scale · vector``), ``clamp`` (projection clamp to ``[lo, hi]``) or ``ablate``
            (clamp to ``[0, 0]``).
        layer: decoder layer steered; must not be before the rule's monitor layer.
        site: residual site steered; at the monitor's layer it must not be before the monitor's site.
        vector: registered vector name or inline vector (the direction for clamp/ablate).
        scale: multiplier for ``add`` (must stay 1 for the other kinds).
        lo: clamp lower bound (``clamp`` only; ``None``: open).
        hi: clamp upper bound (``clamp`` only; ``None``: open).
        strength: clamp/ablation strength, ``> 0`` (must stay 1 for ``add``).

    Example:
        >>> Action(kind="clamp", layer=4, vector="refusal", hi=0.5).kind
        'clamp'
    """

    kind: Literal["add", "clamp", "ablate"]
    layer: Layer
    site: Site = "post_block"
    vector: VectorSource
    scale: Real = 1.0
    lo: Optional[Real] = None
    hi: Optional[Real] = None
    strength: Real = Field(default=1.0, gt=0.0)

    _finite_fields = finite_fields("scale", "lo", "hi", "strength")

    @field_validator("vector")
    @classmethod
    def _finite_vector(cls, v: Any) -> Any:
        if isinstance(v, np.ndarray) and not np.all(np.isfinite(v)):
            raise ValueError("vector contains NaN or infinite values")
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> "Action":
        if self.kind == "clamp":
            if self.lo is None and self.hi is None:
                raise ValueError("lo/hi: a clamp action needs lo, hi or both")
            if self.lo is not None and self.hi is not None and self.lo > self.hi:
                raise ValueError(f"lo: lo ({self.lo}) must not exceed hi ({self.hi})")
        elif self.lo is not None or self.hi is not None:
            raise ValueError(f"lo/hi: only clamp actions take bounds, not {self.kind!r}")
        if self.kind != "add" and self.scale != 1.0:
            raise ValueError(f"scale: only add actions take a scale (use strength for {self.kind!r})")
        if self.kind == "add" and self.strength != 1.0:
            raise ValueError("strength: add actions take a scale, not a strength")
        return self

