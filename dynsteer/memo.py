"""Memos on the request path, bounded by the bytes they keep resident (architecture §10).

Admission, payload decoding and the workers' compiled rows memoise their work per payload body. A client chooses
those bodies, so a memo must never hold what it sent: keys carry a digest of the body (:func:`body_digest`), and
each entry is charged what it keeps alive (:func:`resident_bytes` of its key and value, plus the cache's own
bookkeeping per entry). Resident memory of a :class:`BoundedMemo` then stays within its budget whatever the
payloads' number, size or shape (long capture-position lists decode to far more bytes than they take on the wire).

Contract of a key: a tuple of digests (``bytes``), ints and objects shared by every entry (a field name, the
engine's ``Limits``, the global configuration's fingerprint); only the tuple, its ints and its ``bytes`` are charged.
"""

from __future__ import annotations

import enum
import gc
import hashlib
import sys
import threading
import types
from typing import Any, Generic, Hashable, TypeVar

import numpy as np
from cachetools import LRUCache

V = TypeVar("V")

# What a memo's bookkeeping costs per entry on top of key and value: cachetools' LRUCache keeps three dicts (data,
# sizes, recency order) and the (size, value) pair. About 330 bytes right after the dicts grow (their worst point),
# measured with tracemalloc; rounded up.
ENTRY_OVERHEAD = 384

_MANAGED_DICT = 1 << 4  # Py_TPFLAGS_MANAGED_DICT: instance attributes may live in an array getsizeof misses

_SCALARS = frozenset({int, float, str, bytes})
_ALIGN, _SMALL = 16, 512  # pymalloc's alignment and largest size class (CPython 3.11, 64-bit)

# Never an entry's own: classes, modules, code and callables reach the whole program.
_SHARED = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.FrameType, enum.Enum)


def body_digest(body: str) -> bytes:
    """Content identity of a packed payload body: what memos key it by (collision-resistant: a hit stands for an
    admission of exactly these bytes). SHA-256, which CPUs with SHA extensions (x86, ARM) run at about twice
    blake2b's speed: every request is digested on the API server and again on each worker, and a dynamic policy
    for an 8B model is some 45 kB."""
    return hashlib.sha256(body.encode("utf-8", "surrogatepass")).digest()


def _block(size: int) -> int:
    """What an allocation of ``size`` bytes takes: pymalloc rounds small objects up to its alignment, glibc's
    malloc adds a size word to larger blocks (numpy buffers, long strings) and rounds them likewise."""
    return (size + _ALIGN - 1) & -_ALIGN if size <= _SMALL else (size + 8 + _ALIGN - 1) & -_ALIGN


def resident_bytes(obj: Any) -> int:
    """Bytes ``obj`` and everything it references keep allocated: Python objects as ``sys.getsizeof`` counts them
    (containers, strings, ints, floats, model and dataclass instances with their ``__dict__``), and numpy arrays
    with the buffer they view (a decoded vector's ``bytes``, counted once), each rounded up as the allocator does
    (a 28-byte int takes 32). A long list of scalars is summed without walking it (each int counted as large as
    the largest). Classes, modules and callables are shared, never counted; other objects shared with others are
    counted in full (an upper bound)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        kind = type(o)
        if kind in _SCALARS:  # the most frequent case, and nothing to walk
            if id(o) not in seen:
                seen.add(id(o))
                total += _block(sys.getsizeof(o))
            continue
        if o is None or kind is bool or id(o) in seen or isinstance(o, _SHARED):
            continue
        seen.add(id(o))
        size = sys.getsizeof(o)
        if kind is np.ndarray:
            if o.base is None:  # it owns its data: a block of its own
                total += _block(size - o.nbytes) + _block(o.nbytes)
            else:
                total += _block(size)
                stack.append(o.base)
            continue
        total += _block(size)
        if (kind is tuple or kind is list) and len(o) > 16:  # a list of scalars (capture positions): counted in C
            kinds = set(map(type, o))
            if kinds == {int}:
                total += len(o) * _block(sys.getsizeof(max(max(o), -min(o))))  # none larger than the largest
                continue
            if kinds <= _SCALARS:
                total += sum(map(sys.getsizeof, o)) + (_ALIGN - 1) * len(o)
                continue
        if kind.__flags__ & _MANAGED_DICT:
            o.__dict__  # noqa: B018 - as a dict (sized with its values) rather than values getsizeof cannot see
        stack.extend(gc.get_referents(o))
    return total


def key_bytes(key: tuple[Any, ...]) -> int:
    """What a key (see the module's contract) adds per entry: its tuple, digests and ints."""
    return sys.getsizeof(key) + sum(sys.getsizeof(k) for k in key if isinstance(k, (bytes, int)))


class BoundedMemo(Generic[V]):
    """A least-recently-used memo whose entries' resident bytes stay within ``budget``; thread-safe (admission
    fills it from a worker thread while the event loop reads it).

    Example:
        >>> memo = BoundedMemo(1 << 20)
        >>> memo.put((body_digest("ds1:..."),), ("fingerprint",))
        >>> memo.get((body_digest("ds1:..."),))
        ('fingerprint',)
    """

    def __init__(self, budget: int) -> None:
        self._lock = threading.Lock()
        self._cache: LRUCache = LRUCache(maxsize=budget, getsizeof=lambda entry: entry[0])

    @property
    def budget(self) -> int:
        return self._cache.maxsize

    @property
    def currsize(self) -> int:
        """Bytes charged to the entries held now."""
        return self._cache.currsize

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._cache

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            hit = self._cache.get(key)
        return None if hit is None else hit[1]

    def put(self, key: tuple[Any, ...], value: V) -> None:
        """Remember ``value``, charged its resident bytes (sized outside the lock); one larger than the whole
        budget is not kept."""
        size = key_bytes(key) + resident_bytes(value) + ENTRY_OVERHEAD
        with self._lock:
            if size <= self._cache.maxsize:
                self._cache[key] = (size, value)

    def resize(self, budget: int) -> None:
        """Take a new budget (an engine's ``Limits.cache_bytes``; one engine configuration per process): entries
        are dropped when it changes."""
        with self._lock:
            if budget != self._cache.maxsize:
                self._cache = LRUCache(maxsize=budget, getsizeof=lambda entry: entry[0])

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
