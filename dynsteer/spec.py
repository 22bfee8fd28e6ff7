"""User-facing steering schema: what to add, clamp or ablate, where, and for which tokens.

Everything here is pydantic, immutable and free of vLLM imports, so a spec can be built in a notebook, saved as
YAML/JSON, shipped per request, and validated against a model's shape before anything reaches the engine.

Example:
    >>> import numpy as np
    >>> from dynsteer import SteeringSpec, AddVector
    >>> spec = SteeringSpec(vectors=[AddVector(layer=3, site="post_block", vector=np.ones(64), scale=2.0)])
    >>> spec.layers()
    [3]
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, StrictFloat, StrictInt,
                      WithJsonSchema, field_validator, model_validator)

from dynsteer.vectors import as_vector, pack_vector

Site = Literal["pre_attn", "post_attn", "post_block"]
"""Residual-stream hook sites, in forward order within a decoder layer."""
SITES: tuple[Site, ...] = ("pre_attn", "post_attn", "post_block")

Tier = Literal["base", "prefill", "decode"]
"""Which tokens an entry acts on: every token, prompt tokens only, or generated tokens only."""
TIERS: tuple[Tier, ...] = ("base", "prefill", "decode")
Phase = Literal["prefill", "decode"]

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""What a registered name (vector, probe, controller, consumer) and a request tag look like: no path separators."""


def check_name(value: Any, what: str = "name") -> str:
    """``value`` if it is a well-formed name; otherwise ``ValueError`` saying what a name may hold."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    if not NAME_PATTERN.fullmatch(value):
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise ValueError(f"{what} {shown!r} is not a valid name (letters, digits, '.', '_', '-'; at most 128; "
                         f"starting with a letter or digit)")
    return value


def _vector_source(value: Any) -> str | np.ndarray:
    # One validator for the name-or-vector union: pydantic's own union would report every branch's error
    # (``vector.str: Input should be a valid string`` for a malformed inline vector).
    if isinstance(value, str):
        return check_name(value, "vector name")
    try:
        return as_vector(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"expected a registered vector name or an inline vector: {exc}") from None


def _serialize_source(value: str | np.ndarray) -> Any:
    return value if isinstance(value, str) else pack_vector(value)


VectorSource = Annotated[
    Union[str, np.ndarray],
    BeforeValidator(_vector_source),
    PlainSerializer(_serialize_source, when_used="json"),
    WithJsonSchema({"anyOf": [{"type": "string"},
                              {"type": "object", "properties": {"b64": {"type": "string"}}, "required": ["b64"]}]}),
]
"""A registered vector's name, or an inline vector (list, numpy array, torch tensor or ``{"b64": ...}``)."""

Layer = Annotated[StrictInt, Field(ge=0)]
"""A decoder layer index: an int (``"1"``, ``1.0`` and ``True`` are rejected, not coerced)."""
Real = StrictFloat
"""A number (int or float; strings and booleans are rejected, not coerced)."""

SPEC_VERSION = 1


class SteeringValidationError(ValueError):
    """A steering spec or payload does not fit the model; the message names the offending field."""


def field_path(parts: Any) -> str:
    """A field's path as every dynsteer error names it: ``spec.vectors[0].layer`` (list indices in brackets).

    ``parts`` is a pydantic error location; the names pydantic gives union branches and wrappers
    (``float``, ``literal['a','b']``, ``function-after[...]``) are not fields and are left out."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and p.isidentifier() and p not in _UNION_BRANCHES:
            out += f".{p}"
    return out.lstrip(".")


# the names pydantic gives a union's plain-type branches in a location ("default.float"); no dynsteer field has them
_UNION_BRANCHES = frozenset({"int", "float", "str", "bool", "bytes", "none", "list", "dict", "tuple", "set"})


def error_text(err: Any) -> str:
    """A pydantic error's message without the ``Value error, `` prefix (the field is named before the colon)."""
    msg = str(err["msg"])
    return msg[len("Value error, "):] if msg.startswith("Value error, ") else msg


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    # Value semantics through the canonical JSON form: field-wise comparison would hit numpy's ambiguous truth value.
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.model_dump_json() == other.model_dump_json()  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.model_dump_json()))


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class AddVector(_Frozen):
    """Add ``scale * vector`` to the residual stream at ``(layer, site)`` for the tokens of ``tier``.

    Args:
        layer: decoder layer index (0-based).
        site: residual hook site.
        vector: registered name or inline vector of the model's hidden size.
        scale: multiplier applied to the vector.
        tier: ``base`` (all tokens), ``prefill`` (prompt tokens) or ``decode`` (generated tokens).
    """

    kind: Literal["add"] = "add"
    layer: Layer
    site: Site = "post_block"
    vector: VectorSource
    scale: Real = 1.0
    tier: Tier = "base"

    @field_validator("scale")
    @classmethod
    def _scale_finite(cls, v: float) -> float:
        return _finite("scale", v)


class ProjectionClamp(_Frozen):
    """Clamp the residual's projection on a direction: ``p = h·û; h += strength·(clip(p, lo, hi) − p)·û``.

    Args:
        layer: decoder layer index.
        site: residual hook site.
        direction: registered name or inline vector; normalised to unit length when compiled.
        lo: lower bound on the projection (``None``: open).
        hi: upper bound on the projection (``None``: open).
        strength: 1 clamps fully, 0.5 moves half-way to the bound.
        tier: which tokens it acts on.
    """

    kind: Literal["clamp"] = "clamp"
    layer: Layer
    site: Site = "post_block"
    direction: VectorSource
    lo: Real | None = None
    hi: Real | None = None
    strength: Real = Field(default=1.0, gt=0.0)
    tier: Tier = "base"

    @model_validator(mode="after")
    def _bounds(self) -> "ProjectionClamp":
        if self.lo is None and self.hi is None:
            raise ValueError("a projection clamp needs lo, hi or both")
        for name in ("lo", "hi", "strength"):
            v = getattr(self, name)
            if v is not None:
                _finite(name, v)
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise ValueError(f"lo ({self.lo}) must not exceed hi ({self.hi})")
        return self


class Ablation(_Frozen):
    """Directional ablation: remove the component along ``direction`` (a clamp to ``[0, 0]``).

    Args:
        layer: decoder layer index.
        site: residual hook site.
        direction: registered name or inline vector.
        strength: 1 removes the component entirely.
        tier: which tokens it acts on.
    """

    kind: Literal["ablate"] = "ablate"
    layer: Layer
    site: Site = "post_block"
    direction: VectorSource
    strength: Real = Field(default=1.0, gt=0.0)
    tier: Tier = "base"

    def as_clamp(self) -> ProjectionClamp:
        return ProjectionClamp(layer=self.layer, site=self.site, direction=self.direction, lo=0.0, hi=0.0,
                               strength=self.strength, tier=self.tier)


class SteeringSpec(_Frozen):
    """A complete static steering configuration; entries at the same place and tier add up (clamps apply in order).

    Example:
        >>> spec = SteeringSpec(ablations=[Ablation(layer=2, direction=[1.0, 0.0, 0.0, 0.0])])
        >>> SteeringSpec.model_validate_json(spec.model_dump_json()) == spec
        True
    """

    version: Literal[1] = SPEC_VERSION
    vectors: tuple[AddVector, ...] = ()
    clamps: tuple[ProjectionClamp, ...] = ()
    ablations: tuple[Ablation, ...] = ()

    def is_empty(self) -> bool:
        return not (self.vectors or self.clamps or self.ablations)

    def all_clamps(self) -> tuple[ProjectionClamp, ...]:
        """Clamps and ablations in application order (clamps first, then ablations)."""
        return self.clamps + tuple(a.as_clamp() for a in self.ablations)

    def layers(self) -> list[int]:
        return sorted({e.layer for e in (*self.vectors, *self.clamps, *self.ablations)})

    def touches_prefill(self) -> bool:
        """True when any entry changes prompt tokens (and so their KV): it must fork the prefix-cache key."""
        return any(e.tier != "decode" for e in (*self.vectors, *self.clamps, *self.ablations))

    def touches_decode(self) -> bool:
        return any(e.tier != "prefill" for e in (*self.vectors, *self.clamps, *self.ablations))

    def merged(self, other: "SteeringSpec") -> "SteeringSpec":
        """This spec's entries followed by ``other``'s."""
        return SteeringSpec(vectors=self.vectors + other.vectors, clamps=self.clamps + other.clamps,
                            ablations=self.ablations + other.ablations)

    def without(self, layer: int, site: Site | None = None, kinds: tuple[str, ...] = ("add", "clamp", "ablate"),
                tier: Tier | None = None) -> "SteeringSpec":
        """A copy with the entries of ``kinds`` at ``layer`` (and ``site`` / ``tier``, if given) removed."""

        def keep(e: Any) -> bool:
            return not (e.kind in kinds and e.layer == layer and (site is None or e.site == site)
                        and (tier is None or e.tier == tier))

        return SteeringSpec(vectors=tuple(filter(keep, self.vectors)), clamps=tuple(filter(keep, self.clamps)),
                            ablations=tuple(filter(keep, self.ablations)))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "SteeringSpec":
        import yaml

        return cls.model_validate(yaml.safe_load(text))


class ModelShape(_Frozen):
    """What a spec is checked against: the engine's layer count, hidden size and hooked places."""

    num_layers: int
    hidden_size: int
    model_id: str = ""
    architecture: str = ""
    sites: tuple[Site, ...] = SITES
    # Sites the architecture does not have (e.g. post_attn in a parallel attention + MLP block), each with the reason.
    absent_sites: tuple[tuple[Site, str], ...] = ()
    layers: tuple[int, ...] | None = None  # None: every layer is hooked
    max_clamps: int = 2
    max_gates: int = 0  # gate slots per row (dynamic policies' rules); 0: the engine has no dynamic tier
    # Magnitude bounds (DynsteerConfig.limits): what one configuration may add to the residual, controller output,
    # clamp strength. Checked when a configuration is compiled, in the frontend and in the workers.
    max_abs_value: float = 1e4
    max_dyn_scale: float = 100.0
    max_clamp_strength: float = 2.0


def check_vector(arr: np.ndarray, hidden_size: int, field: str) -> np.ndarray:
    """``arr`` if it is a finite vector of ``hidden_size``; otherwise raise naming ``field``."""
    if arr.ndim != 1 or arr.shape[0] != hidden_size:
        raise SteeringValidationError(
            f"{field}: expected a vector of the model's hidden size {hidden_size}, got shape {tuple(arr.shape)}")
    if not np.all(np.isfinite(arr)):
        raise SteeringValidationError(f"{field}: vector contains NaN or infinite values")
    return arr


def resolve_vector(source: VectorSource, field: str, shape: ModelShape,
                   named: dict[str, np.ndarray] | None) -> np.ndarray:
    """Turn a name or inline vector into a checked float32 array, or raise naming ``field``."""
    if isinstance(source, str):
        if named is None or source not in named:
            known = ", ".join(sorted(named or {})) or "none registered"
            raise SteeringValidationError(f"{field}: unknown vector name {source!r} (known: {known})")
        arr = named[source]
    else:
        arr = as_vector(source)
    return check_vector(arr, shape.hidden_size, field)


def check_site(site: str, shape: ModelShape, where: str) -> None:
    """Raise naming ``where``, the site and (for a site the architecture lacks) the architecture and why."""
    if site in shape.sites:
        return
    reason = dict(shape.absent_sites).get(site)
    if reason is not None:
        raise SteeringValidationError(f"{where}.site: site {site!r} does not exist in architecture "
                                      f"{shape.architecture!r}: {reason}")
    raise SteeringValidationError(f"{where}.site: site {site!r} is not hooked in this engine "
                                  f"(hooked: {list(shape.sites)})")


def check_spec(spec: SteeringSpec, shape: ModelShape, named: dict[str, np.ndarray] | None = None,
               prefix: str = "") -> None:
    """Validate a spec against the model; raises :class:`SteeringValidationError` naming the first bad field."""
    groups: list[tuple[str, tuple[Any, ...], str]] = [
        ("vectors", spec.vectors, "vector"), ("clamps", spec.clamps, "direction"),
        ("ablations", spec.ablations, "direction")]
    for group, entries, vec_field in groups:
        for i, e in enumerate(entries):
            where = f"{prefix}{group}[{i}]"
            if e.layer >= shape.num_layers:
                raise SteeringValidationError(
                    f"{where}.layer: layer {e.layer} out of range; the model has {shape.num_layers} layers "
                    f"(0..{shape.num_layers - 1})")
            if shape.layers is not None and e.layer not in shape.layers:
                raise SteeringValidationError(f"{where}.layer: layer {e.layer} is not hooked in this engine "
                                              f"(hooked: {list(shape.layers)})")
            check_site(e.site, shape, where)
            arr = resolve_vector(getattr(e, vec_field), f"{where}.{vec_field}", shape, named)
            if vec_field == "direction":
                if not np.linalg.norm(arr.astype(np.float64)) > 0:
                    raise SteeringValidationError(f"{where}.direction: direction has zero norm")
                check_clamp_bounds(e, shape, where)


def check_clamp_bounds(entry: Any, shape: ModelShape, where: str) -> None:
    """Clamp bounds within the engine's ``max_abs_value`` and strength within ``max_clamp_strength`` (a clamp then
    keeps the residual's projection bounded: it can only move it toward ``[lo, hi]``)."""
    for name in ("lo", "hi"):
        v = getattr(entry, name, None)
        if v is not None and abs(v) > shape.max_abs_value:
            raise SteeringValidationError(f"{where}.{name}: |{name}| = {abs(v):.4g} exceeds the engine's limit "
                                          f"max_abs_value = {shape.max_abs_value:g}")
    if entry.strength > shape.max_clamp_strength:
        raise SteeringValidationError(f"{where}.strength: {entry.strength:g} exceeds the engine's limit "
                                      f"max_clamp_strength = {shape.max_clamp_strength:g}")
