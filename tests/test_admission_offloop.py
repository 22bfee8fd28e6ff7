"""Admission off the event loop: an ``AsyncLLM`` (in this process, tiny Llama on CPU) whose admission of one new
payload is held on a ``threading.Event`` still completes requests without a payload, and requests whose payload is
admitted already, meanwhile; the held payload's request then completes; a bad payload is still a ``ValueError``
naming the field. And a new payload is admitted once, in the pool, even when the memo can keep nothing."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from dynsteer.config import Limits
from dynsteer.engine.frontend import FrontendState, frontend_state
from dynsteer.request.payload import encode_payload
from dynsteer.spec import AddVector, ModelShape, SteeringSpec, SteeringValidationError
from tests.conftest import ENGINE_DEFAULTS, ON_GPU

HIDDEN = 128
HOLD_S = 15.0  # an admission on the loop (no pool) holds everything this long, then the test fails


def _payload(seed: int) -> str:
    vector = (np.random.default_rng(seed).standard_normal(HIDDEN) * 4).astype(np.float32)
    return encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=vector)]))


@pytest.mark.skipif(ON_GPU, reason="CPU engine in this process")
def test_requests_complete_while_another_payloads_admission_is_held(tiny_llama_path, monkeypatch):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    held, cached = _payload(1), _payload(2)
    entered, release = threading.Event(), threading.Event()
    held_admissions: list[bool] = []  # one per admission of the held body: True if it was released in time
    real = FrontendState._admit

    def admit(self: FrontendState, payload: object) -> object:
        if payload == held:
            entered.set()
            held_admissions.append(release.wait(HOLD_S))
        return real(self, payload)

    monkeypatch.setattr(FrontendState, "_admit", admit)

    def params(payload: str | None) -> SamplingParams:
        return SamplingParams(max_tokens=4, temperature=0.0,
                              extra_args=None if payload is None else {"dynsteer": payload})

    async def main() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_llama_path), **ENGINE_DEFAULTS))
        try:
            async def run(request_id: str, payload: str | None) -> object:
                final = None
                async for out in engine.generate("the quick brown fox", params(payload), request_id):
                    final = out
                return final

            await run("warm", cached)  # admitted and memoised before anything is held
            first = asyncio.create_task(run("held-1", held))
            second = asyncio.create_task(run("held-2", f"{held}~same-body"))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            # on the loop, the held admission would block these until it times out
            plain = await asyncio.wait_for(run("plain", None), HOLD_S * 2)
            hit = await asyncio.wait_for(run("hit", f"{cached}~tagged"), HOLD_S * 2)
            during = not release.is_set() and not held_admissions
            release.set()
            outs = await asyncio.gather(first, second)
            assert during, "requests without a new payload waited for another payload's admission"
            assert plain.finished and hit.finished and all(o.finished for o in outs)
            assert held_admissions == [True], "one admission for both requests with the held body"
            with pytest.raises(ValueError, match=r"^extra_args\.dynsteer\.spec\.vectors\[0\]\.vector") as info:
                await run("bad", encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector="unregistered")])))
            assert isinstance(info.value, SteeringValidationError)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_new_payload_is_admitted_once_in_the_pool_even_when_the_memo_keeps_nothing(monkeypatch):
    from dynsteer.engine.admission import patch_async_llm

    state = FrontendState(ModelShape(num_layers=4, hidden_size=HIDDEN), limits=Limits(cache_bytes=0), capacity=8)
    on_loop_thread: list[bool] = []
    real = FrontendState._admit
    monkeypatch.setattr(FrontendState, "_admit", lambda self, p: (
        on_loop_thread.append(threading.current_thread() is threading.main_thread()), real(self, p))[1])

    class Engine:  # AsyncLLM's shape as the patch sees it: add_request processes inputs synchronously
        def __init__(self) -> None:
            self.input_processor = SimpleNamespace(_dynsteer_frontend=state)

        async def add_request(self, request_id: str, prompt: str, params: object) -> object:
            return frontend_state(self.input_processor).admit(params.extra_args["dynsteer"])

    patch_async_llm(Engine)
    params = SimpleNamespace(extra_args={"dynsteer": _payload(3)})
    admitted = asyncio.run(Engine().add_request("r", "p", params))
    assert on_loop_thread == [False], "admitted on the event loop's thread, or twice"
    assert admitted == state.admit_uncached(_payload(3))[:4]
