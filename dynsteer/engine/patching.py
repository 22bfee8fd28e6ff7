"""Every override of a vLLM attribute goes through this module: applied once, recorded, listed by ``dynsteer doctor``.

dynsteer runs inside an unmodified vLLM by replacing some of its methods (the plugin's post-import hooks call the
patchers of :mod:`~dynsteer.engine.adapters`, ``frontend``, ``admission``, ``prefix_cache``, ``scheduler``,
``commands``, ``runner``, ``worker_ext`` and ``server``). Each replacement goes through :func:`patch`, which

- applies it once per owner and attribute: a later call for the same pair (the plugin registered twice, a test
  patching again) leaves the first replacement in place and returns False. A class is patched in its own
  ``__dict__``: a subclass that inherits the attribute is an owner of its own;
- records it as a :class:`Patch` (the owner's qualified name, the attribute, dynsteer's function, why), so
  :func:`applied` (and ``dynsteer doctor``, through the workers' ``dynsteer_patches``) lists what this process
  changed in vLLM;
- can be undone with :func:`restore` (tests).

Overrides that are not set once at import are recorded where they are made (:func:`record`), so the list is
complete: an instance attribute switched on only while some request needs it (:class:`Switch`), a class attribute
swapped for one step, a steered subclass that dynsteer moves instances to.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any, Literal

Kind = Literal["replaced", "added", "switched", "subclass"]


@dataclass(frozen=True)
class Patch:
    """One vLLM attribute dynsteer overrides.

    Args:
        owner: Qualified name of the class or module that holds the attribute.
        name: The attribute.
        function: Qualified name of dynsteer's replacement (where it is defined, whatever ``functools.wraps`` says).
        why: What dynsteer needs it for.
        kind: ``"replaced"`` (set once; the attribute existed), ``"added"`` (set once; it did not), ``"switched"``
            (installed only while needed: an instance attribute or a class attribute swapped for a step), or
            ``"subclass"`` (a subclass overriding it, which dynsteer moves instances to).
    """

    owner: str
    name: str
    function: str
    why: str
    kind: Kind = "replaced"


@dataclass
class _Applied:
    patch: Patch
    replacement: Any
    original: Any  # what the owner's own __dict__ held (None where it did not hold the attribute)
    own: bool


_lock = threading.Lock()
_applied: dict[tuple[Any, str], _Applied] = {}  # by (owner object, attribute): what patch() set
_recorded: dict[tuple[Any, str, str], Patch] = {}  # by (owner object, attribute, function): see record()


def qualname(obj: Any) -> str:
    """``module.Qualified.name`` of a class, module or function; a function's own (``functools.wraps`` copies the
    wrapped function's names onto a wrapper, so those of its code object and globals are read)."""
    if isinstance(obj, ModuleType):
        return obj.__name__
    code = getattr(obj, "__code__", None)
    if code is not None:
        module = getattr(obj, "__globals__", {}).get("__name__", getattr(obj, "__module__", "?"))
        return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def patch(owner: Any, name: str, replacement: Any, *, why: str) -> bool:
    """Set ``owner.name = replacement`` unless dynsteer has patched that attribute of ``owner`` already.

    Args:
        owner: A vLLM class or module (or a stand-in for one in tests).
        name: The attribute to replace or add.
        replacement: dynsteer's function (it usually wraps the attribute it replaces, read by the caller first).
        why: One line for ``dynsteer doctor``: what dynsteer needs the override for.

    Returns:
        Whether it was set now (False: already patched; the first replacement stays).
    """
    key = (owner, name)
    with _lock:
        if key in _applied:
            return False
        own = name in vars(owner)
        kind: Kind = "replaced" if own or hasattr(owner, name) else "added"
        _applied[key] = _Applied(Patch(qualname(owner), name, qualname(replacement), why, kind), replacement,
                                 vars(owner).get(name), own)
        setattr(owner, name, replacement)
    return True


def is_patched(owner: Any, name: str) -> bool:
    """Whether :func:`patch` has set ``owner.name`` (and it was not restored since)."""
    return (owner, name) in _applied


def restore(owner: Any, name: str) -> bool:
    """Undo :func:`patch` of ``owner.name``: the owner's own attribute comes back (or goes, where it inherited it).
    Returns whether anything was patched."""
    with _lock:
        entry = _applied.pop((owner, name), None)
        if entry is None:
            return False
        if entry.own:
            setattr(owner, name, entry.original)
        else:
            delattr(owner, name)
    return True


def record(owner: Any, name: str, replacement: Any, *, why: str, kind: Kind) -> None:
    """Record an override dynsteer makes other than by :func:`patch` (``"switched"`` or ``"subclass"``: see
    :class:`Patch`); recording the same function for the same owner and attribute again keeps one entry."""
    function = qualname(replacement)
    with _lock:
        _recorded.setdefault((owner, name, function), Patch(qualname(owner), name, function, why, kind))


def applied() -> list[Patch]:
    """Every override this process has made or recorded, by owner and attribute."""
    with _lock:
        patches = [a.patch for a in _applied.values()] + list(_recorded.values())
    return sorted(set(patches), key=lambda p: (p.owner, p.name, p.kind))


def applied_json() -> list[dict[str, str]]:
    """:func:`applied` as plain dicts (what crosses vLLM's RPC hop)."""
    return [asdict(p) for p in applied()]


class Switch:
    """One attribute of one object switched between what it had and a hook (an instance attribute).

    For methods vLLM calls once per request and step, which dynsteer needs only while some request needs them:
    switched off, vLLM's own method runs and a step calls no dynsteer code. Recorded as a ``"switched"`` override
    of the object's class.
    """

    def __init__(self, obj: Any, name: str, hook: Any, *, why: str) -> None:
        record(type(obj), name, hook, why=why, kind="switched")
        self.obj, self.name, self.hook = obj, name, hook
        self.own = name in vars(obj)  # someone else's instance attribute: restored rather than deleted
        self.orig = vars(obj).get(name)
        self.on = False

    def set(self, on: bool) -> None:
        if on == self.on:
            return
        if on:
            setattr(self.obj, self.name, self.hook)
        elif self.own:
            setattr(self.obj, self.name, self.orig)
        else:
            delattr(self.obj, self.name)
        self.on = on
