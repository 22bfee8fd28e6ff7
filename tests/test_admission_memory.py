"""Request-path memos stay within ``Limits.cache_bytes`` (+10 %) whatever a client sends: many distinct large
payloads, long capture-position lists. Measured with tracemalloc (it traces numpy's buffers too), never with a memo's
own accounting: what clearing a memo frees is what it held (no engine)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import dynsteer.request.payload as payload_mod
from dynsteer.capture.spec import CaptureSpec
from dynsteer.config import Limits
from dynsteer.engine.frontend import FrontendState
from dynsteer.request.payload import decode_payload, encode_payload
from dynsteer.spec import AddVector, ModelShape, SteeringSpec
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.tables import SteeringTables

H = 64
SHAPE = ModelShape(num_layers=4, hidden_size=H, sites=("post_block",))
SLACK = 1.10


def _vectors(seed: int, n: int, h: int = H) -> str:
    """A valid payload of ``n`` small additive vectors (distinct per seed): about ``n * h * 5.4`` bytes."""
    rng = np.random.default_rng(seed)
    return encode_payload(SteeringSpec(vectors=[AddVector(layer=i % 4, vector=(rng.standard_normal(h) * 0.01)
                                                          .astype(np.float32)) for i in range(n)]))


def _positions(seed: int, n: int) -> str:
    """A payload capturing ``n`` explicit positions: a few bytes each on the wire, ~36 bytes each decoded."""
    return encode_payload(capture=CaptureSpec(layers=(1,), positions=tuple(range(seed * n, seed * n + n))))


@pytest.fixture
def traced() -> Iterator[Callable[[], int]]:
    """Bytes traced now (after a full collection)."""
    gc.collect()
    tracemalloc.start()
    try:
        yield lambda: (gc.collect(), tracemalloc.get_traced_memory()[0])[1]
    finally:
        tracemalloc.stop()


def _freed_by(now: Callable[[], int], clear: Callable[[], None]) -> int:
    before = now()
    clear()
    return before - now()


def test_frontend_and_payload_memos_hold_within_budget(traced):
    budget = 96 << 10
    limits = Limits(cache_bytes=budget)
    state = FrontendState(SHAPE, limits=limits, capacity=63)
    state.admit(_vectors(10_000, 24))  # warm: lazily built validators, the payload memo takes this budget
    start = traced()
    for seed in range(300):  # ~8 KB payloads; ~120 frontend entries fit
        state.admit(_vectors(seed, 24))
    grown = traced() - start
    front = _freed_by(traced, state._memo.clear)
    decoded = _freed_by(traced, payload_mod._memo.clear)
    assert front <= SLACK * budget, f"admission memo holds {front} bytes for a budget of {budget}"
    assert decoded <= SLACK * budget, f"payload memo holds {decoded} bytes for a budget of {budget}"
    assert grown <= SLACK * 2 * budget, f"admission grew memory by {grown} bytes; memos' budgets {2 * budget}"
    assert front > budget // 2  # full: the bound, not a lack of entries, is what this measured


def test_payload_memo_charges_decoded_capture_positions(traced):
    budget = 1 << 20
    limits = Limits(cache_bytes=budget)
    decode_payload(_positions(10_000, 100), limits=limits)
    start = traced()
    for seed in range(24):  # ~30 KB on the wire, ~290 KB decoded each
        decode_payload(_positions(seed, 8000), limits=limits)
    for seed in range(24):  # and payloads of vectors
        decode_payload(_vectors(seed, 40, 256), limits=limits)
    grown = traced() - start
    held = _freed_by(traced, payload_mod._memo.clear)
    assert held <= SLACK * budget, f"payload memo holds {held} bytes for a budget of {budget}"
    assert grown <= SLACK * budget, f"decoding grew memory by {grown} bytes; memo budget {budget}"


def test_worker_compile_memo_holds_within_budget(traced):
    budget = 96 << 10
    limits = Limits(cache_bytes=budget)
    tables = SteeringTables([(l, "post_block") for l in range(4)], H, num_rows=8, max_clamps=1, max_tokens=8)
    rt = SteeringRuntime(SHAPE, tables, limits=limits)
    rt.admit("warm", _vectors(10_000, 24), prompt_len=3)
    rt.release(["warm"])
    start = traced()
    for seed in range(150):  # ~8 KB payloads compiling to two rows of four 64-float vectors
        rt.admit(f"r{seed}", _vectors(seed, 24), prompt_len=3)
        rt.release([f"r{seed}"])
    grown = traced() - start
    compiled = _freed_by(traced, rt.registry.compiled.clear)
    decoded = _freed_by(traced, payload_mod._memo.clear)
    assert not rt.stats.errors, rt.stats.errors
    assert compiled <= SLACK * budget, f"compile memo holds {compiled} bytes for a budget of {budget}"
    assert decoded <= SLACK * budget, f"payload memo holds {decoded} bytes for a budget of {budget}"
    assert grown <= SLACK * 2 * budget, f"admission grew memory by {grown} bytes; memos' budgets {2 * budget}"
