"""Old public names kept for one release: a module ``__getattr__`` that hands out the new object and warns.

The alias is the renamed object itself (not a subclass), so ``isinstance``, equality, validation and serialisation
behave exactly as with the new name; only looking the old name up warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed(module: str, names: Mapping[str, tuple[str, Any]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name in ``names`` (``{old: (new, object)}``) with a
    :class:`DeprecationWarning` that names the new one.

    Example:
        >>> __getattr__ = renamed(__name__, {"Monitor": ("ProbeGate", ProbeGate)})   # doctest: +SKIP
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new, obj = names[name]
        warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release; use {module}.{new}",
                      DeprecationWarning, stacklevel=2)
        return obj

    return __getattr__
