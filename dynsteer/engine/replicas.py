"""Data parallelism (``--data-parallel-size N``): which replica a process serves, and control RPCs to each replica.

vLLM 0.26 runs a dense model's data-parallel ranks as independent engine cores behind one API server
(``EngineCoreProc(engine_index=r)``, its ``parallel_config.data_parallel_size`` reset to 1 and
``data_parallel_index`` kept at ``r``). The API server's client (``DPLBAsyncMPClient``) sends every utility call,
``collective_rpc`` included, to every engine core and returns the first one's reply. So global steering, named
vectors and presets reach every replica; :func:`each_replica` is for calls whose every reply matters (per-replica
descriptions), and :func:`rpc_in_order` for state changes: vLLM's client gathers its per-engine sends as tasks,
which start only at the event loop's next turn, so a request admitted meanwhile could reach a replica ahead of the
change its cache salt already names (``engine/server.py``'s ordering rule); :func:`rpc_in_order` queues the call on
every replica's input socket before it first awaits.

Each replica binds its own monitor endpoints (:meth:`dynsteer.config.MonitorConfig.for_replica`) and names itself
in its frames' header (``replica``); its command desk takes commands for its own requests only.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any


def replica_index(vllm_config: Any) -> int:
    """The data-parallel replica this process (engine core or worker) serves; 0 without data parallelism."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for attr in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel, attr, None)
        if isinstance(value, int):
            return value
    return 0


def replica_count(vllm_config: Any) -> int:
    """How many data-parallel replicas the API server's engine has (its own config keeps the full size)."""
    return int(getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_size", 1) or 1)


async def each_replica(engine: Any, method: str, args: tuple = ()) -> list[list[Any]]:
    """``collective_rpc(method, args)`` on every replica of an ``AsyncLLM``: one list of worker replies per
    replica, in replica order (one entry without data parallelism)."""
    client = getattr(engine, "engine_core", None)
    engines = list(getattr(client, "core_engines", ()) or ())
    if len(engines) <= 1:
        return [await engine.collective_rpc(method, args=args)]
    return list(await asyncio.gather(*(client._call_utility_async("collective_rpc", method, None, args, None,
                                                                  engine=e) for e in engines)))


async def rpc_in_order(engine: Any, method: str, args: tuple = ()) -> list[Any]:
    """``engine.collective_rpc(method, args=args)`` whose message is on every replica's input socket before this
    coroutine first yields (see the module docstring); returns the first replica's worker replies."""
    client = getattr(engine, "engine_core", None)
    engines = list(getattr(client, "core_engines", ()) or ())
    if len(engines) <= 1:
        return await engine.collective_rpc(method, args=args)  # vLLM sends before its first await
    from vllm.v1.engine import EngineCoreRequestType

    loop = asyncio.get_running_loop()
    replies, sends = [], []
    for target in engines:  # what AsyncMPClient._call_utility_async does, without an await between the sends
        call_id = uuid.uuid1().int >> 64
        reply = loop.create_future()
        client.utility_results[call_id] = reply
        message = (EngineCoreRequestType.UTILITY.value,
                   *client.encoder.encode((client.client_index, call_id, "collective_rpc", (method, None, args, None))))
        sends.append(client._send_input_message(message, target, args))
        replies.append(reply)
    client._ensure_output_queue_task()
    await asyncio.gather(*sends)
    return (await asyncio.gather(*replies))[0]
