"""The random-direction control of a sweep variant: the same policy or spec with every added vector replaced by a
seeded random direction of the same norm.

A control keeps everything else of its variant: layer, site, tier, scale, monitors, rules, gates and controller, so
it applies the same relative dose (:mod:`dynsteer.dose`) at the same places and tokens. What a steered variant gains
over its control is what its *direction* contributes; what both lose in fluency, any push of that size costs.

The direction of the ``k``-th additive entry (in field order: a spec's ``vectors[i]``, a policy's ``add`` actions
rule by rule) is ``normal(0, I)`` drawn from ``numpy.random.default_rng([seed, k])``, rescaled to the replaced
vector's norm (float64, then stored as float32 like every vector): one direction per entry for the whole sweep, so
controls differ from each other only where their variants do.

Example:
    >>> from dynsteer.spec import AddVector, SteeringSpec
    >>> spec = SteeringSpec(vectors=[AddVector(layer=1, vector=[3.0, 4.0], scale=2.0)])
    >>> ctl = random_control(spec, seed=0)
    >>> float(np.linalg.norm(ctl.vectors[0].vector)), ctl.vectors[0].scale
    (5.0, 2.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from dynsteer.policy import DynamicSteeringPolicy
from dynsteer.spec import SteeringSpec, SteeringValidationError
from dynsteer.vectors import as_vector

__all__ = ["adds_anything", "random_control", "random_direction"]

T = TypeVar("T", DynamicSteeringPolicy, SteeringSpec)


def random_direction(dim: int, norm: float, seed: int, slot: int = 0) -> np.ndarray:
    """A float32 vector of ``dim`` entries and norm ``norm``, in a direction fixed by ``(seed, slot)``.

    Example:
        >>> v = random_direction(64, 2.5, seed=3)
        >>> round(float(np.linalg.norm(v.astype(np.float64))), 5), bool((v == random_direction(64, 2.5, 3)).all())
        (2.5, True)
    """
    d = np.random.default_rng([seed, slot]).standard_normal(dim)
    return (d * (float(norm) / np.linalg.norm(d))).astype(np.float32)


def _vector(value: Any, named: Mapping[str, np.ndarray] | None, where: str) -> np.ndarray:
    if isinstance(value, str):
        if not named or value not in named:
            raise SteeringValidationError(f"{where}.vector: unknown vector name {value!r}")
        value = named[value]
    return as_vector(value).astype(np.float64)


def _entries(obj: DynamicSteeringPolicy | SteeringSpec) -> list[tuple[str, Any]]:
    if isinstance(obj, SteeringSpec):
        return [(f"vectors[{i}]", v) for i, v in enumerate(obj.vectors)]
    return [(f"rules[{i}].actions[{j}]", a) for i, r in enumerate(obj.rules) for j, a in enumerate(r.actions)
            if a.kind == "add"]


def adds_anything(obj: DynamicSteeringPolicy | SteeringSpec) -> bool:
    """Whether ``obj`` adds anything: a non-zero scale times a registered name or a non-zero vector (only then has it
    a control)."""
    return any(float(e.scale) != 0.0 and (isinstance(e.vector, str) or np.any(as_vector(e.vector) != 0))
               for _, e in _entries(obj))


def random_control(obj: T, seed: int = 0, named: Mapping[str, np.ndarray] | None = None) -> T:
    """``obj`` with each added vector replaced by :func:`random_direction` of its size and norm (slot ``k`` for the
    ``k``-th additive entry); everything else unchanged.

    Args:
        obj: a policy or a static spec.
        seed: the directions' seed.
        named: registered vectors, for entries naming one (the control holds the random vector inline).

    Raises:
        SteeringValidationError: an entry names a vector ``named`` lacks.
    """
    replaced = {}
    for k, (where, e) in enumerate(_entries(obj)):
        v = _vector(e.vector, named, where)
        replaced[where] = e.model_copy(update={"vector": random_direction(v.shape[0], np.linalg.norm(v), seed, k)})
    if isinstance(obj, SteeringSpec):
        return obj.model_copy(update={"vectors": tuple(replaced[f"vectors[{i}]"] for i in range(len(obj.vectors)))})
    rules = tuple(r.model_copy(update={"actions": tuple(replaced.get(f"rules[{i}].actions[{j}]", a)
                                                        for j, a in enumerate(r.actions))})
                  for i, r in enumerate(obj.rules))
    return obj.model_copy(update={"rules": rules})
