"""What to capture: sites, layers, token positions and output dtype (pydantic, no vLLM import).

Positions are absolute token positions in the request's sequence. A generated token's residual exists once the
token is fed back as input, so ``all_generated`` covers every generated token except the last one.

Example:
    >>> CaptureSpec(layers=[3, 5], sites=["post_block"], positions="last_prompt").places()
    [(3, 'post_block'), (5, 'post_block')]
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from dynsteer.spec import ModelShape, Site, SteeringValidationError, check_site

PositionMode = Literal["last_prompt", "all_prompt", "all_generated", "all"]
Positions = Union[PositionMode, tuple[StrictInt, ...]]
CaptureDType = Literal["float32", "bfloat16", "float16"]


class CaptureSpec(BaseModel):
    """Capture the unsteered residual stream at ``sites`` × ``layers`` for the selected token positions.

    Args:
        layers: decoder layers.
        sites: residual sites (``pre_attn``, ``post_attn``, ``post_block``).
        positions: ``last_prompt``, ``all_prompt``, ``all_generated``, ``all`` or explicit absolute positions.
        dtype: dtype of the returned arrays.
        consumers: names of the engine's configured consumers that receive this capture (``memory`` returns it to
            the caller).

    Layers, sites and consumers are each listed at most once (the places are their product: repeats would only
    multiply the work).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[StrictInt, ...] = Field(min_length=1)
    sites: tuple[Site, ...] = ("post_block",)
    positions: Positions = "last_prompt"
    dtype: CaptureDType = "float32"
    consumers: tuple[str, ...] = ("memory",)

    @field_validator("layers", "sites", "consumers")
    @classmethod
    def _once_each(cls, v: tuple[Any, ...], info: Any) -> tuple[Any, ...]:
        first: dict[Any, int] = {}
        for i, item in enumerate(v):
            if item in first:
                shown = repr(item) if len(repr(item)) <= 40 else repr(item)[:37] + "..."
                raise ValueError(f"{shown} is listed twice (items {first[item]} and {i})")
            first[item] = i
        return v

    def places(self) -> list[tuple[int, Site]]:
        return [(layer, site) for layer in self.layers for site in self.sites]

    def check(self, shape: ModelShape, captured: set[tuple[int, Site]], field: str = "capture",
              consumers: Collection[str] | None = None) -> None:
        """Raise naming the field when a place is out of range or has no capture buffer in this engine, or (given
        the engine's configured ``consumers``) a consumer is not one of them."""
        if consumers is not None:
            for i, name in enumerate(self.consumers):
                if name not in consumers:
                    shown = name if len(name) <= 40 else name[:37] + "..."
                    raise SteeringValidationError(
                        f"{field}.consumers[{i}]: unknown consumer {shown!r} (configured: "
                        f"{', '.join(sorted(consumers)) or 'none'}; the operator configures them with "
                        f"DynsteerConfig(capture_consumers=...))")
        for i, layer in enumerate(self.layers):
            if not 0 <= layer < shape.num_layers:
                raise SteeringValidationError(f"{field}.layers[{i}]: layer {layer} out of range (0..{shape.num_layers - 1})")
        for layer, site in self.places():
            if site in dict(shape.absent_sites):  # the architecture has no such site: say which and why
                check_site(site, shape, f"{field}.sites")
            if (layer, site) not in captured:
                raise SteeringValidationError(
                    f"{field}: ({layer}, {site!r}) has no capture buffer in this engine; enable it with "
                    f"DynsteerConfig(capture_sites=..., capture_layers=...)")
        if not isinstance(self.positions, str) and any(p < 0 for p in self.positions):
            raise SteeringValidationError(f"{field}.positions: positions must be >= 0")
