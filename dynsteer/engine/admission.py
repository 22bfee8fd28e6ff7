"""Admission off the event loop of an ``AsyncLLM`` (the OpenAI server of ``dynsteer serve``, or a user's own).

vLLM's ``AsyncLLM.add_request`` calls ``InputProcessor.process_inputs`` synchronously on the event loop, and
dynsteer's admission (decoding, validating and compiling a payload: milliseconds for a large one) runs inside it
(:func:`dynsteer.engine.frontend.patch_input_processor`). Left there, one client's heavy payloads would stall every
request the server handles. :func:`patch_async_llm` admits a payload string the admission memo does not hold yet
*before* ``add_request`` goes on, in a small thread pool the loop awaits; the result fills the memo, and
``process_inputs`` then hits it (or takes the result handed to it, :data:`~dynsteer.engine.frontend.HANDED`, when the
memo could not keep it).

What this guarantees:

- A request without a payload, or whose payload body is admitted already, never waits for another request's
  admission: it never enters the pool. On the loop it costs the envelope check (size, tag) and a digest of the
  body (``hashlib`` releases the GIL while it hashes).
- Requests carrying the same new body share one admission: later ones await the first.
- Admission holds the GIL for most of its work (Python, msgspec, pydantic), so the pool adds no CPU: what it adds is
  preemption. CPython hands the GIL to a waiting thread every ``sys.getswitchinterval()`` (5 ms), so while an
  admission runs, the loop keeps about half of the interpreter and waits for it at most one switch interval or the
  longest single C call of the admission (a base64 or msgpack decode, pydantic validating one list: a few ms at
  the default 4 MiB payload limit), never the whole admission. One worker: more would split the GIL more ways (the
  loop's share falls to 1/(n+1)) and admit no faster; new bodies are admitted in arrival order.
- Correctness does not depend on it. The pool admits on a snapshot of the admission state
  (:meth:`~dynsteer.engine.frontend.FrontendState.snapshot`) and stores the result under the key taken with it; if the
  configuration changed meanwhile (a vector registered, the global set), ``process_inputs`` misses and admits
  synchronously, as without this module. A payload the pool rejects raises its ``SteeringValidationError`` from
  ``add_request`` (a 400 naming the field), exactly what ``process_inputs`` would raise; nothing is memoised for it.
- The offline ``LLM`` (``LLMEngine.add_request``) is untouched: it admits in ``process_inputs``, in the caller's
  thread.
- A JSON form of the payload (``dynsteer.request.json_form``) is packed here first, in the same pool unless the
  JSON-form memo holds it; the request then goes on with the packed payload.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dynsteer.engine import patching
from dynsteer.engine.frontend import HANDED, FrontendState, frontend_state, payload_field, renamed
from dynsteer.engine.keys import PAYLOAD_KEY
from dynsteer.request.json_form import is_packed
from dynsteer.spec import SteeringValidationError

WORKERS = 1

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="dynsteer-admission")
        return _pool


async def admit_off_loop(state: FrontendState, payload: str) -> tuple[Any, Any] | None:
    """Admit ``payload`` in the pool unless ``state``'s memo holds it: returns the memo key and the result (None on
    a hit); raises ``SteeringValidationError`` naming the field when it cannot be admitted."""
    key = state.memo_key(payload)  # checks size and tag first
    if key is None or state.holds(key):
        return None
    pending = state._pending.get(key)
    if pending is None:
        pending = asyncio.get_running_loop().run_in_executor(_executor(), state.snapshot().fill, key, payload)
        state._pending[key] = pending
        pending.add_done_callback(functools.partial(_settled, state, key))
    # a request cancelled meanwhile (its client left) leaves the admission to finish: the next one hits the memo
    return key, await asyncio.shield(pending)


async def pack_off_loop(state: FrontendState, payload: Any, field: str) -> str:
    """``payload`` (a JSON form) packed, in the pool unless ``state``'s memo holds it; raises
    ``SteeringValidationError`` naming the field."""
    key = state.pack_key(payload, field)
    hit = state.packed(key)
    if hit is not None:
        return hit
    return await asyncio.get_running_loop().run_in_executor(_executor(), state.snapshot().pack_fill, key, payload,
                                                            field)


def _settled(state: FrontendState, key: Any, future: asyncio.Future) -> None:
    state._pending.pop(key, None)
    if not future.cancelled():
        future.exception()  # retrieved: every waiter may have left, and the error is theirs, not the loop's


def patch_async_llm(cls: type) -> None:
    """Admit a request's payload off the event loop before ``AsyncLLM.add_request`` processes its inputs."""
    orig = cls.add_request

    @functools.wraps(orig)
    async def add_request(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(params, "extra_args", None) or {}
        payload = extra.get(PAYLOAD_KEY)
        handed = None
        if payload is not None:
            state = frontend_state(self.input_processor)
            field = payload_field(extra)
            try:
                if not is_packed(payload):  # a JSON form, packed once here: process_inputs then sees the packed one
                    payload = await pack_off_loop(state, payload, field)
                    params.extra_args = {**extra, PAYLOAD_KEY: payload}
                handed = await admit_off_loop(state, payload)
            except SteeringValidationError as exc:
                raise renamed(exc, field) from None
        if handed is None:
            return await orig(self, request_id, prompt, params, *args, **kwargs)
        token = HANDED.set(handed)  # process_inputs, called synchronously within, takes it
        try:
            return await orig(self, request_id, prompt, params, *args, **kwargs)
        finally:
            HANDED.reset(token)

    patching.patch(cls, "add_request", add_request,
                   why="admit a new payload in a thread pool, off the event loop, before vLLM processes the inputs")
