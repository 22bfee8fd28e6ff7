"""Prefix-cache keys in the engine core: blocks computed under steering hash with what steered them.

vLLM's block hash covers the tokens and the request's ``cache_salt``; steering changes what a block holds without
changing either. Four things keep steered and unsteered KV apart while unsteered traffic keeps its hits:

- the **cache salt**: frontend admission (:mod:`dynsteer.engine.frontend`) folds a fingerprint of the effective
  prefill configuration into ``cache_salt`` (:func:`salted`), so a prompt under prefill steering forks from its
  first block;
- **generated blocks**: ``cache_salt`` only reaches the first block, so a block holding a token decoded under static
  decode steering hashes with the admission's decode fingerprint (:data:`~dynsteer.engine.keys.DECODE_KEY`), and
  one at or after where a dynamic policy or a monitor's command acted hashes with the fold of what acted
  (:class:`ActedState`, :func:`patch_block_hashing`);
- **held-back hashing**: a request with a dynamic policy hashes a block only once the workers reported on all its
  tokens (:func:`patch_request`), and the scheduler caches no further than hashed (:func:`hashed_tokens`);
- **forks**: a command or a global change while a request is live re-keys its chain from its first uncomputed
  position (:func:`command_event`, :func:`global_change_event`, :func:`resalt`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from dynsteer.engine import patching
from dynsteer.engine.keys import ACTED_ATTR, ACTED_TAG, BLOCK_SIZE_ATTR, DECODE_KEY, DYNAMIC_KEY, SALT_TAG


def salted(cache_salt: str | None, fingerprint: str) -> str | None:
    """``cache_salt`` with a steering ``fingerprint`` folded in ('': unsteered, the salt stays as it is)."""
    if not fingerprint:
        return cache_salt
    return f"{cache_salt or ''}|{SALT_TAG}{fingerprint}"


def patch_block_hashing(module: Any) -> None:
    """Engine core: blocks holding tokens generated under steering hash with what steered them.

    ``cache_salt`` only reaches the first block; generated tokens join the hash chain later. So a block containing
    a token decoded under static decode steering gets the admission's decode fingerprint as an extra key, and a
    block containing a token at or after the first position where a dynamic policy acted gets the fold of what
    acted (:class:`ActedState`, from the workers' reports). The chain then forks from that block on, while pure
    prompt blocks, and blocks generated while nothing acted, keep their (shareable) hashes.
    """
    orig = module.generate_block_hash_extra_keys

    @functools.wraps(orig)
    def generate_block_hash_extra_keys(request: Any, start_token_idx: int, end_token_idx: int, *a: Any, **k: Any):
        extra_keys, mm_idx = orig(request, start_token_idx, end_token_idx, *a, **k)
        if end_token_idx > request.num_prompt_tokens:
            extra = (request.sampling_params and request.sampling_params.extra_args) or {}
            fp = extra.get(DECODE_KEY)
            if fp:
                extra_keys = (*(extra_keys or ()), f"{SALT_TAG}decode:{fp}")
            # a dynamic policy's reports, or monitors' commands (engine.command_desk) on any request
            acted = request.__dict__.get(ACTED_ATTR) if hasattr(request, "__dict__") else None
            if acted is None and isinstance(request, _Upto):
                acted = request.__dict__["_request"].__dict__.get(ACTED_ATTR)
            fold = acted.fold_at(end_token_idx - 1) if acted is not None else ""
            if fold:
                extra_keys = (*(extra_keys or ()), f"{ACTED_TAG}{fold}")
        return extra_keys, mm_idx

    patching.patch(module, "generate_block_hash_extra_keys", generate_block_hash_extra_keys,
                   why="blocks generated under steering hash with what steered them (decode fingerprint, acted fold)")


@dataclass
class ActedState:
    """Engine core, per request with a dynamic policy: how far the workers have reported, and where steering acted.

    ``reported``: tokens whose KV the workers computed and reported on (a block is hashed only once all its tokens
    are, so a block is never cached before its step's report: with asynchronous scheduling too). ``events``:
    ``(position, fold)`` where what acts changed; the fold chains every signature so far (forward only), so a block's
    hash carries the history up to its last token. Lives on the ``Request`` (preemption keeps it; it goes with the
    request).
    """

    reported: int = 0
    events: list[tuple[int, str]] = field(default_factory=list)
    last_signature: str = ""

    def report(self, upto: int, acted_at: int, signature: str) -> None:
        """Positions ``< upto`` are computed and reported; steering acted at ``acted_at`` (``-1``: not in this
        report) under ``signature``."""
        self.reported = max(self.reported, upto)
        if acted_at >= 0 and signature != self.last_signature:
            if self.events and acted_at <= self.events[-1][0]:
                acted_at = self.events[-1][0]  # a recomputed position (preemption): history stays in order
            self.events.append((acted_at, fold(self.events[-1][1] if self.events else "", signature)))
            self.last_signature = signature

    def command(self, position: int, signature: str) -> None:
        """A monitor's command changes what positions ``>= position`` compute (forward only, like a report)."""
        if self.events and position <= self.events[-1][0]:
            position = self.events[-1][0]
        self.events.append((position, fold(self.events[-1][1] if self.events else "", f"command|{signature}")))

    def fold_at(self, position: int) -> str:
        """The fold in effect at ``position`` ('' if nothing acted at or before it)."""
        out = ""
        for pos, f in self.events:
            if pos > position:
                break
            out = f
        return out


def fold(previous: str, signature: str) -> str:
    """Chain ``signature`` onto ``previous`` (deterministic on every process and rank)."""
    return hashlib.sha256(f"{previous}|{signature}".encode()).hexdigest()[:32]


class _Upto:
    """A request seen by vLLM's block hasher as if it had only ``num_tokens`` tokens."""

    def __init__(self, request: Any, num_tokens: int) -> None:
        self.__dict__["_request"], self.__dict__["num_tokens"] = request, num_tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_request"], name)


def _block_size(hasher: Any) -> int | None:
    """The block size vLLM's request block hasher hashes at (its closure's ``hash_block_size``), remembered on the
    function; None if it cannot be read (then every call goes to the hasher, which stops early itself)."""
    size = getattr(hasher, BLOCK_SIZE_ATTR, False)
    if size is False:
        try:
            size = inspect.getclosurevars(hasher).nonlocals.get("hash_block_size")
        except (TypeError, ValueError):
            size = None
        size = size if isinstance(size, int) and size > 0 else None
        try:
            setattr(hasher, BLOCK_SIZE_ATTR, size)
        except AttributeError:  # not a plain function: look it up every time
            pass
    return size


def patch_request(cls: type) -> None:
    """Engine core: a request with a dynamic policy hashes a block only once the workers reported on all its
    tokens (prompt tokens need no report: dynamic steering acts on decode tokens).

    Such a request becomes an instance of a subclass (:class:`HeldBackRequest`) that overrides
    ``update_block_hashes``, set once when it is made; every other request keeps vLLM's own method, so the many
    calls per step (one per request whose tokens grow) pay nothing for dynsteer. The hashes ``__init__`` computes
    before the switch are the same either way: a new request has only prompt tokens.
    """
    if patching.is_patched(cls, "__init__"):
        return
    orig_init, orig_update = cls.__init__, cls.update_block_hashes

    def update_block_hashes(self: Any) -> None:
        # called at every token appended (once per request and step): hash_limit inlined, cheapest test first, so
        # that a step that completes no block (most of them) costs a few attribute reads
        hasher = self._block_hasher
        if hasher is None:
            return orig_update(self)
        reported = self.__dict__[ACTED_ATTR].reported  # made with the switch in __init__
        size = getattr(hasher, BLOCK_SIZE_ATTR, False)
        if size is False:
            size = _block_size(hasher)
        end = (len(self.block_hashes) + 1) * size if size else 0
        if end > reported and end > self.num_prompt_tokens:
            return  # beyond max(prompt, reported) >= the limit: no new full block, no proxy, no hasher call
        limit = min(self.num_tokens, max(self.num_prompt_tokens, reported))
        if end > limit:
            return
        self.block_hashes.extend(hasher(_Upto(self, limit)))

    # a module-level name, so that pickle and copy find the class
    held = type("HeldBackRequest", (cls,), {"update_block_hashes": update_block_hashes, "__module__": __name__,
                                            "__doc__": "A vLLM request with a dynamic policy (see patch_request)."})
    globals()["HeldBackRequest"] = held
    patching.record(cls, "update_block_hashes", update_block_hashes, kind="subclass",
                    why="a request with a dynamic policy hashes a block only once the workers reported on it")

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        params = self.sampling_params
        if type(self) is cls and params is not None and DYNAMIC_KEY in (params.extra_args or {}):
            self.__class__ = held
            if self._block_hasher is not None:
                self.__dict__.setdefault(ACTED_ATTR, ActedState())

    patching.patch(cls, "__init__", __init__,
                   why="a request with a dynamic policy becomes a HeldBackRequest (its hashing waits for reports)")


def hash_limit(request: Any, acted: ActedState) -> int | None:
    """How many of a dynamic request's tokens may be hashed (computed and reported on; prompt tokens need no
    report), or None when that completes no block beyond those hashed (most decode steps)."""
    limit = min(request.num_tokens, max(request.num_prompt_tokens, acted.reported))
    size = _block_size(request._block_hasher)
    return None if size and (len(request.block_hashes) + 1) * size > limit else limit


def command_event(request: Any, signature: str, hash_block_size: int) -> None:
    """Engine core, when a command is taken at a step: positions from the first one that step computes (decode
    positions only: prompt KV is never recomputed for a command) hash with the command's fold. Hashes of blocks
    holding such positions are dropped and recomputed (none of them is cached yet: a block is cached only once all
    its tokens were scheduled, and the command precedes this step's scheduling)."""
    acted = request.__dict__.setdefault(ACTED_ATTR, ActedState())
    position = max(int(request.num_computed_tokens), int(request.num_prompt_tokens))
    acted.command(position, signature)
    keep = position // hash_block_size
    if len(request.block_hashes) > keep:
        del request.block_hashes[keep:]
        request.update_block_hashes()


def resalt(request: Any, fingerprint: str) -> None:
    """Engine core: add ``fingerprint`` to a request's cache salt and hash its whole chain again (it then shares no
    block with requests salted otherwise; none of its own blocks is cached under the new hashes yet)."""
    request.cache_salt = salted(request.cache_salt, fingerprint)
    del request.block_hashes[:]
    request.update_block_hashes()


def global_change_event(request: Any, signature: str, hash_block_size: int) -> None:
    """Engine core, after the global spec or policy changed while ``request`` is live: the workers recompile its
    rows at once, so what it computes from its first uncomputed position on may differ from what its hashes (keyed
    at admission) promise. A request still in its prompt is re-salted (its whole chain forks: the prompt's rest is
    computed under the new global); one in decode forks from that position like a command. Conservative: blocks
    computed after the change are not shared with requests admitted before or after it, even where the change
    did not act on them; blocks computed before it keep their hashes."""
    if int(request.num_computed_tokens) < int(request.num_prompt_tokens):
        resalt(request, f"global:{signature}")
    else:
        command_event(request, f"global:{signature}", hash_block_size)


def hashed_tokens(request: Any, hash_block_size: int) -> int | None:
    """Tokens of ``request`` covered by block hashes, when a dynamic policy holds its hashing back (else None)."""
    if ACTED_ATTR not in request.__dict__:
        return None
    return len(request.block_hashes) * hash_block_size
