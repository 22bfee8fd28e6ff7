"""Compile steering specs into what one table row holds: per (layer, site), an additive vector and ordered clamps.

The effective configuration of a token is ``global + request`` for its phase (prefill or decode), with the ``base``
tier counting in both phases. A dynamic policy adds, to the decode phase only (prompt tokens are never gated), the
monitors that compute gate slots and the gated terms that read them. Compiling is pure host work, done once per
distinct configuration at admission.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dynsteer.spec import ModelShape, Phase, Site, SteeringSpec, SteeringValidationError, check_spec, resolve_vector

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy

SiteKey = tuple[int, Site]


@dataclass(frozen=True)
class Clamp:
    """One compiled clamp: unit direction, bounds (±inf for open sides), strength and the gate slot scaling the
    strength (-1: static)."""

    direction: np.ndarray
    lo: float
    hi: float
    strength: float
    gate: int = -1


@dataclass(frozen=True)
class MonitorProgram:
    """A probe gate computed at a site into one gate slot: ``σ(sharpness·(x·probe − threshold))``, 0 below floor."""

    probe: np.ndarray
    sharpness: float
    threshold: float
    floor: float


@dataclass
class SiteProgram:
    """What a row holds at one (layer, site): static vector and clamps, monitors and gated vectors by slot."""

    vec: np.ndarray | None = None
    clamps: list[Clamp] = field(default_factory=list)
    monitors: dict[int, MonitorProgram] = field(default_factory=dict)
    dyn: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.clamps or self.monitors or self.dyn or (self.vec is not None and np.any(self.vec)))


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
                  named: dict[str, np.ndarray] | None = None,
                  policy: tuple[str, "DynamicSteeringPolicy"] | None = None) -> RowContent:
    """Compile ``specs`` (applied in order, each with a field prefix for errors) for one phase.

    Args:
        policy: ``(field prefix, policy)`` of the request's dynamic policy, compiled (and validated) with the decode
            phase; the prefill phase takes only its prompt-level monitors.

    Raises:
        SteeringValidationError: a bad field, more clamps at one place than the engine's ``max_clamps``, or more
            gate slots than its ``max_gates``.
    """
    sites: dict[SiteKey, SiteProgram] = {}
    budget = MagnitudeBudget(shape.max_abs_value)
    for prefix, spec in specs:
        check_spec(spec, shape, named, prefix)
        for i, e in enumerate(spec.vectors):
            if e.tier not in ("base", phase) or e.scale == 0.0:
                continue
            v = resolve_vector(e.vector, f"{prefix}vectors[{i}].vector", shape, named)
            budget.add(abs(e.scale) * max_abs(v), f"{prefix}vectors[{i}].scale")
            v = v * np.float32(e.scale)
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
    if policy is not None and phase == "prefill":  # prompt-level monitors only: they score, never steer
        from dynsteer.steering.dynamic import compile_prompt_monitors

        prefix, pol = policy
        for key, extra in compile_prompt_monitors(pol, shape, prefix).items():
            sites.setdefault(key, SiteProgram()).monitors.update(extra.monitors)
    if policy is not None and phase == "decode":  # prompt tokens are never gated: the prefill row acts on nothing
        from dynsteer.steering.dynamic import compile_policy  # the policy schema imports this package's spec

        prefix, pol = policy
        for key, extra in compile_policy(pol, shape, named, prefix, budget).items():
            prog = sites.setdefault(key, SiteProgram())
            prog.monitors.update(extra.monitors)
            prog.dyn.update(extra.dyn)
            for c in extra.clamps:
                if len(prog.clamps) >= shape.max_clamps:
                    raise SteeringValidationError(
                        f"{prefix}rules: more than {shape.max_clamps} clamps/ablations (static and gated) at "
                        f"layer {key[0]} site {key[1]!r} (raise the engine's max_clamps)")
                prog.clamps.append(c)
    sites = {k: p for k, p in sites.items() if p.active}
    return RowContent(sites=sites, digest=_digest(sites) if sites else b"")


class MagnitudeBudget:
    """What one configuration may add to a residual element, summed over its entries (``Limits.max_abs_value``).

    Each additive entry spends ``|scale|·max|vector|`` (gated entries at the largest scale their controller can
    output); the entry that overspends is named in the error. Summing over sites is conservative: the residual at
    the last layer carries every earlier site's addition.
    """

    def __init__(self, limit: float) -> None:
        self.limit, self.spent = limit, 0.0

    def add(self, amount: float, field: str) -> None:
        self.spent += amount
        if not np.isfinite(amount) or amount > self.limit:
            raise SteeringValidationError(f"{field}: the entry adds up to {amount:.4g} to a residual element, over "
                                          f"the engine's limit max_abs_value = {self.limit:g}")
        if self.spent > self.limit:
            raise SteeringValidationError(f"{field}: with this entry the configuration adds up to {self.spent:.4g} "
                                          f"to a residual element (all its sites together), over the engine's "
                                          f"limit max_abs_value = {self.limit:g}")


def max_abs(v: np.ndarray) -> float:
    """``max|v|`` in float64 (0 for an empty vector): what an additive entry spends of a :class:`MagnitudeBudget`."""
    return float(np.max(np.abs(v.astype(np.float64)))) if v.size else 0.0


def _digest(sites: dict[SiteKey, SiteProgram]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for (layer, site) in sorted(sites):
        prog = sites[(layer, site)]
        h.update(f"{layer}:{site}:".encode())
        if prog.vec is not None:
            h.update(b"v" + prog.vec.tobytes())
        for c in prog.clamps:
            h.update(b"c" + c.direction.tobytes() + np.array([c.lo, c.hi, c.strength, c.gate], np.float64).tobytes())
        for slot in sorted(prog.monitors):
            m = prog.monitors[slot]
            h.update(b"m%d" % slot + m.probe.tobytes() + np.array([m.sharpness, m.threshold, m.floor]).tobytes())
        for slot in sorted(prog.dyn):
            h.update(b"d%d" % slot + prog.dyn[slot].tobytes())
    return h.digest()


def prefill_fingerprint(specs: list[tuple[str, SteeringSpec]], shape: ModelShape,
                        named: dict[str, np.ndarray] | None = None) -> str:
    """A short hex id of the effective prefill configuration ('' when prompt tokens are unsteered).

    It forks the prefix-cache key: requests whose prompt KV would differ never share cached blocks.
    """
    return compile_phase(specs, "prefill", shape, named).digest.hex()
