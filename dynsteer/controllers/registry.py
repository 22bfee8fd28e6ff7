"""Custom sync controllers the operator allows: names in the engine config or entry points, never import paths.

A request names a controller (``SyncControllerSpec(kind="custom", name=...)``); only names registered here, at engine
start, can be built. The frontend checks names without importing anything; workers import a factory on first use.

Example:
    >>> reg = ControllerRegistry({"my_latch": "dynsteer.controllers.sync:ThresholdLatch"})
    >>> reg.build("my_latch", {"on": 1.0, "off": 0.0, "scale": 2.0}, max_scale=100.0).on_step   # doctest: +ELLIPSIS
    <bound method GuardedController.on_step of ...>
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

ENTRY_POINT_GROUP = "dynsteer.controllers"


class ControllerFault(RuntimeError):
    """A custom controller raised or returned a value the engine does not accept; its request is stopped."""


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


class ControllerRegistry:
    """Registered custom controllers: ``{name: "package.module:Factory"}`` plus the entry-point group
    :data:`ENTRY_POINT_GROUP` (the engine config wins on a name clash)."""

    def __init__(self, configured: dict[str, str] | None = None) -> None:
        self._eps = _entry_points()
        self._paths = dict(configured or {})
        self._factories: dict[str, Callable[..., Any]] = {}

    def names(self) -> set[str]:
        return set(self._eps) | set(self._paths)

    def __contains__(self, name: object) -> bool:
        return name in self._paths or name in self._eps

    def factory(self, name: str) -> Callable[..., Any]:
        fn = self._factories.get(name)
        if fn is None:
            if name in self._paths:
                module, _, attr = self._paths[name].partition(":")
                fn = getattr(importlib.import_module(module), attr)
            elif name in self._eps:
                fn = self._eps[name].load()
            else:
                raise KeyError(name)
            self._factories[name] = fn
        return fn

    def build(self, name: str, options: dict[str, Any] | None, max_scale: float) -> "GuardedController":
        """Build ``name`` with ``options`` as keyword arguments, guarded by ``max_scale``.

        Raises:
            ControllerFault: unknown name, the factory raised, or it built something that is not a controller.
        """
        from dynsteer.controllers.sync import SyncController

        try:
            ctrl = self.factory(name)(**(options or {}))
        except KeyError:
            raise ControllerFault(f"unknown controller {name!r}") from None
        except Exception as exc:  # noqa: BLE001 - operator code; the request fails, the engine does not
            raise ControllerFault(f"controller {name!r} could not be built with these options: {exc!r}") from None
        if not isinstance(ctrl, SyncController):
            raise ControllerFault(f"controller {name!r} built {type(ctrl).__name__}, which lacks "
                                  f"initial_state/on_step")
        return GuardedController(ctrl, name, max_scale)


@dataclass(frozen=True)
class GuardedController:
    """A custom controller whose every output is checked: finite and ``|scale| ≤ max_scale``; anything else (an
    exception included) raises :class:`ControllerFault`, which stops the request instead of steering it with it."""

    inner: Any
    name: str
    max_scale: float

    def initial_state(self) -> Any:
        try:
            return self.inner.initial_state()
        except Exception as exc:  # noqa: BLE001
            raise ControllerFault(f"controller {self.name!r} failed in initial_state: {exc!r}") from None

    def on_step(self, state: Any, obs: Any) -> tuple[Any, float]:
        try:
            state, scale = self.inner.on_step(state, obs)
            scale = float(scale)
        except Exception as exc:  # noqa: BLE001
            raise ControllerFault(f"controller {self.name!r} failed in on_step: {exc!r}") from None
        if not math.isfinite(scale) or abs(scale) > self.max_scale:
            raise ControllerFault(f"controller {self.name!r} returned scale {scale!r}; outputs must be finite and "
                                  f"within the engine's limit max_dyn_scale = {self.max_scale:g}")
        return state, scale
