"""Worker-side control methods, reached with ``llm.collective_rpc("dynsteer_<name>", args=...)`` on every rank.

The plugin adds them to vLLM's ``WorkerWrapperBase`` (the object ``collective_rpc`` resolves method names on), so no
``worker_extension_cls`` flag is needed and a user's own extension class stays free. Arguments and results are plain
JSON-like values: they cross vLLM's msgpack hop between the user's process and the engine core.
"""

from __future__ import annotations

import time
from typing import Any

from dynsteer.capture.result import pack_records
from dynsteer.capture.spec import CaptureSpec
from dynsteer.engine import keys, patching
from dynsteer.engine.adapters import SUPPORTED_ARCHITECTURES
from dynsteer.engine.build import UnsupportedArchitectureError
from dynsteer.engine.runner import runtime_of
from dynsteer.request.payload import decode_payload
from dynsteer.spec import check_name
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.vectors import unpack_vector


def _runtime(wrapper: Any) -> SteeringRuntime:
    runner = wrapper.worker.model_runner
    rt = runtime_of(runner)
    if rt is None:
        arch = (runner.model_config.architectures or ["?"])[0]
        raise UnsupportedArchitectureError(f"dynsteer: architecture {arch!r} is not supported "
                                           f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    return rt


def dynsteer_describe(self: Any) -> dict[str, Any]:
    """Shape, table usage and counters of this rank's runtime."""
    return _runtime(self).describe()


def dynsteer_set_global(self: Any, payload: str) -> str:
    """Replace the global spec and dynamic policy (a packed payload; no policy removes it); returns the new
    spec's prefill fingerprint."""
    rt = _runtime(self)
    decoded = decode_payload(payload, field="global", limits=rt.limits)
    rt.set_global(decoded.spec, decoded.policy)
    return rt.global_fingerprint()


def dynsteer_register_vector(self: Any, name: str, packed: dict[str, str]) -> None:
    """Register (or replace) a named vector that request payloads may reference (within
    ``Limits.max_named_vectors``: the frontend checks first, so a refused registration changes nothing anywhere)."""
    _runtime(self).register_vector(check_name(name, "vector name"), unpack_vector(packed))


def dynsteer_unregister_vector(self: Any, name: str) -> None:
    """Forget a named vector and the rows compiled with it."""
    _runtime(self).unregister_vector(name)


def dynsteer_set_capture(self: Any, spec: dict[str, Any] | None) -> None:
    """Capture every request admitted from now on with ``spec`` (a CaptureSpec as JSON; None turns it off)."""
    rt = _runtime(self)
    if rt.capture is None:
        raise ValueError("capture: this engine has no capture places; set DynsteerConfig(capture_sites=...)")
    parsed = None if spec is None else CaptureSpec.model_validate(spec)
    if parsed is not None:
        # the configured names, on every rank (only the rank that emits builds the consumers themselves)
        parsed.check(rt.shape, rt.capture.engine_places, consumers=rt.consumer_names)
    rt.capture.global_spec = parsed


def dynsteer_take_captures(self: Any, tags: list[str], host: str | None = None) -> list[dict[str, Any]]:
    """Finish and return the in-memory captures with these tags (rank 0 returns data; other ranks return []).

    ``host``: the caller's host id; on the same host the arrays travel through shared memory.
    """
    rt = _runtime(self)
    records = rt.take_captures(tags)
    t0 = time.perf_counter()
    packed = pack_records(records, host)
    rt.stats.pack_ms += (time.perf_counter() - t0) * 1e3
    return packed


def dynsteer_take_traces(self: Any, tags: list[str]) -> list[dict[str, Any]]:
    """Dynamic-steering traces of finished requests with these tags (every rank returns its own: they must agree)."""
    return _runtime(self).take_traces(tags)


def dynsteer_patches(self: Any) -> dict[str, list[dict[str, str]]]:
    """The vLLM attributes dynsteer overrides in this worker's process (``dynsteer doctor``; read only); the engine
    core adds its own process's (``engine.command_desk``)."""
    return {keys.PATCHES_WORKER: patching.applied_json()}


RPC_METHODS = {keys.RPC_DESCRIBE: dynsteer_describe, keys.RPC_SET_GLOBAL: dynsteer_set_global,
               keys.RPC_REGISTER_VECTOR: dynsteer_register_vector,
               keys.RPC_UNREGISTER_VECTOR: dynsteer_unregister_vector, keys.RPC_SET_CAPTURE: dynsteer_set_capture,
               keys.RPC_TAKE_CAPTURES: dynsteer_take_captures, keys.RPC_TAKE_TRACES: dynsteer_take_traces,
               keys.RPC_PATCHES: dynsteer_patches}


def install(wrapper_cls: type) -> None:
    """Add the methods to vLLM's ``WorkerWrapperBase`` (``collective_rpc`` resolves method names on it)."""
    for name, fn in RPC_METHODS.items():
        patching.patch(wrapper_cls, name, fn, why="a dynsteer control method for collective_rpc")
