"""Compile steering specs into what one table row holds: per (layer, site), an additive vector and ordered clamps.

The effective configuration of a token is ``global + request`` for its phase (prefill or decode), with the ``base``
tier counting in both phases. Compiling is pure host work, done once per distinct configuration at admission.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from dynsteer.spec import ModelShape, Phase, Site, SteeringSpec, SteeringValidationError, check_spec, resolve_vector

SiteKey = tuple[int, Site]


@dataclass(frozen=True)
class Clamp:
    """One compiled clamp: unit direction, bounds (±inf for open sides) and strength."""

    direction: np.ndarray
    lo: float
    hi: float
    strength: float


@dataclass
class SiteProgram:
    """What a row holds at one (layer, site)."""

    vec: np.ndarray | None = None
    clamps: list[Clamp] = field(default_factory=list)


@dataclass(frozen=True)
class RowContent:
    """A compiled configuration for one phase; ``digest`` identifies it for deduplication."""

    sites: dict[SiteKey, SiteProgram]
    digest: bytes

    @property
    def empty(self) -> bool:
        return not self.sites


EMPTY = RowContent(sites={}, digest=b"")


def compile_phase(specs: list[tuple[str, SteeringSpec]], phase: Phase, shape: ModelShape,
                  named: dict[str, np.ndarray] | None = None) -> RowContent:
    """Compile ``specs`` (applied in order, each with a field prefix for errors) for one phase.

    Raises:
        SteeringValidationError: a bad field, or more clamps at one place than the engine's ``max_clamps``.
    """
    sites: dict[SiteKey, SiteProgram] = {}
    for prefix, spec in specs:
        check_spec(spec, shape, named, prefix)
        for i, e in enumerate(spec.vectors):
            if e.tier not in ("base", phase) or e.scale == 0.0:
                continue
            v = resolve_vector(e.vector, f"{prefix}vectors[{i}].vector", shape, named) * np.float32(e.scale)
            prog = sites.setdefault((e.layer, e.site), SiteProgram())
            prog.vec = v if prog.vec is None else prog.vec + v
        for i, c in enumerate(spec.all_clamps()):
            if c.tier not in ("base", phase):
                continue
            u = resolve_vector(c.direction, f"{prefix}clamps[{i}].direction", shape, named).astype(np.float64)
            u = (u / np.linalg.norm(u)).astype(np.float32)
            prog = sites.setdefault((c.layer, c.site), SiteProgram())
            if len(prog.clamps) >= shape.max_clamps:
                raise SteeringValidationError(
                    f"{prefix}clamps[{i}]: more than {shape.max_clamps} clamps/ablations at layer {c.layer} "
                    f"site {c.site!r} (raise the engine's max_clamps)")
            prog.clamps.append(Clamp(u, -np.inf if c.lo is None else c.lo, np.inf if c.hi is None else c.hi,
                                     c.strength))
    sites = {k: p for k, p in sites.items() if p.clamps or (p.vec is not None and np.any(p.vec))}
    return RowContent(sites=sites, digest=_digest(sites) if sites else b"")


def _digest(sites: dict[SiteKey, SiteProgram]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for (layer, site) in sorted(sites):
        prog = sites[(layer, site)]
        h.update(f"{layer}:{site}:".encode())
        if prog.vec is not None:
            h.update(b"v" + prog.vec.tobytes())
        for c in prog.clamps:
            h.update(b"c" + c.direction.tobytes() + np.array([c.lo, c.hi, c.strength], np.float64).tobytes())
    return h.digest()


def prefill_fingerprint(specs: list[tuple[str, SteeringSpec]], shape: ModelShape,
                        named: dict[str, np.ndarray] | None = None) -> str:
    """A short hex id of the effective prefill configuration ('' when prompt tokens are unsteered).

    It forks the prefix-cache key: requests whose prompt KV would differ never share cached blocks.
    """
    return compile_phase(specs, "prefill", shape, named).digest.hex()
