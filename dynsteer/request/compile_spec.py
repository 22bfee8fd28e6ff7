"""Compile steering specs into what one table row holds: per (layer, site), an additive vector and ordered clamps.

The effective configuration of a token is ``global + request`` for its phase (prefill or decode), with the ``base``
tier counting in both phases. A dynamic policy adds, to the decode phase only (prompt tokens are never gated), the
monitors that compute gate slots and the gated terms that read them. Compiling is pure host work, done once per
distinct configuration at admission.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from dynsteer.request.compile_policy import compile_policy, compile_prompt_monitors
from dynsteer.request.programs import Clamp, MagnitudeBudget, RowContent, SiteKey, SiteProgram, max_abs
from dynsteer.spec import ModelShape, Phase, SteeringSpec, SteeringValidationError, check_spec, resolve_vector

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy


def compile_phase(specs: list[tuple[str, SteeringSpec]], phase: Phase, shape: ModelShape,
                  named: dict[str, np.ndarray] | None = None,
                  policy: tuple[str, DynamicSteeringPolicy] | None = None) -> RowContent:
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
        prefix, pol = policy
        for key, extra in compile_prompt_monitors(pol, shape, prefix).items():
            sites.setdefault(key, SiteProgram()).monitors.update(extra.monitors)
    if policy is not None and phase == "decode":  # prompt tokens are never gated: the prefill row acts on nothing
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

