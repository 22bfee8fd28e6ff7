"""Admission memos (frontend and worker) are keyed by the global configuration's content, not by a counter: a
global set and cleared again (``with steerer.steering(...)``) leaves earlier admissions cached, while a request
admitted under another global still gets that global's fingerprints and rows; a memo hit still checks the request's
own tag (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

import dynsteer.steering.requests as requests_mod
from dynsteer.engine.frontend import FrontendState
from dynsteer.request.payload import config_fingerprint, encode_payload
from dynsteer.request.compile_spec import compile_phase
from dynsteer.spec import AddVector, ModelShape, SteeringSpec, SteeringValidationError
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.tables import SteeringTables

H = 16
SHAPE = ModelShape(num_layers=4, hidden_size=H, sites=("post_block",))


def _vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(H).astype(np.float32)


PAYLOAD = encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=_vec(1))]))
GLOBAL = SteeringSpec(vectors=[AddVector(layer=2, vector=_vec(2))])


def test_fingerprint_is_content_identity():
    assert config_fingerprint(SteeringSpec()) == config_fingerprint(SteeringSpec())
    assert config_fingerprint(GLOBAL) == config_fingerprint(SteeringSpec(vectors=[AddVector(layer=2,
                                                                                             vector=_vec(2))]))
    assert config_fingerprint(GLOBAL) != config_fingerprint(SteeringSpec())
    other = SteeringSpec(vectors=[AddVector(layer=2, vector=_vec(2), scale=1.5)])
    assert config_fingerprint(other) != config_fingerprint(GLOBAL)


def test_frontend_memo_survives_a_global_set_and_cleared(monkeypatch):
    state = FrontendState(SHAPE, capacity=8)
    calls = []
    real = FrontendState._admit
    monkeypatch.setattr(FrontendState, "_admit", lambda self, p: (calls.append(p), real(self, p))[1])
    plain = state.admit(PAYLOAD)
    under_global_state = FrontendState(SHAPE, capacity=8, global_spec=GLOBAL)
    expected_global = real(under_global_state, PAYLOAD)[:4]
    state.set_global(GLOBAL)
    assert state.admit(PAYLOAD) == expected_global != plain  # another global: admitted afresh, its fingerprints
    assert len(calls) == 2
    state.set_global(SteeringSpec())
    assert state.admit(PAYLOAD) == plain and len(calls) == 2  # back to the first global: a memo hit
    state.set_global(GLOBAL)
    assert state.admit(PAYLOAD) == expected_global and len(calls) == 2
    state.register("w", _vec(3))  # a named vector changes: every admission is stale
    assert state.admit(PAYLOAD) == expected_global and len(calls) == 3


def _runtime() -> SteeringRuntime:
    tables = SteeringTables([(l, "post_block") for l in range(4)], H, num_rows=8, max_clamps=1, max_tokens=8)
    return SteeringRuntime(SHAPE, tables)


def _expected(global_spec: SteeringSpec, phase: str) -> bytes:
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=_vec(1))])
    return compile_phase([("global.", global_spec), ("req.", spec)], phase, SHAPE).digest


def test_worker_compile_memo_survives_a_global_set_and_cleared(monkeypatch):
    rt = _runtime()
    calls = []
    real = requests_mod.compile_phase
    monkeypatch.setattr(requests_mod, "compile_phase", lambda *a, **k: (calls.append(a[1]), real(*a, **k))[1])
    rt.admit("r1", PAYLOAD, prompt_len=3)
    assert rt.requests["r1"].decode.digest == _expected(SteeringSpec(), "decode")
    rt.release(["r1"])
    n = len(calls)
    rt.set_global(GLOBAL)
    rt.admit("r2", PAYLOAD, prompt_len=3)  # under the global: compiled with it
    entry = rt.requests["r2"]
    assert entry.prefill.digest == _expected(GLOBAL, "prefill") and entry.decode.digest == _expected(GLOBAL, "decode")
    assert len(calls) > n
    rt.release(["r2"])
    rt.set_global(SteeringSpec())
    n = len(calls)
    rt.admit("r3", PAYLOAD, prompt_len=3)  # the first global again: its compiled contents are reused
    entry = rt.requests["r3"]
    assert entry.decode.digest == _expected(SteeringSpec(), "decode")
    assert len(calls) == n  # nothing compiled for the request
    np.testing.assert_array_equal(rt.tables.vec_at((1, "post_block"), entry.rows[1]).numpy(), _vec(1))
    np.testing.assert_array_equal(rt.tables.vec_at((2, "post_block"), entry.rows[1]).numpy(), np.zeros(H))


def test_worker_keeps_live_requests_rows_exact_across_global_toggles():
    rt = _runtime()
    rt.admit("r1", PAYLOAD, prompt_len=3)
    for spec in (GLOBAL, SteeringSpec(), GLOBAL):
        rt.set_global(spec)
        entry = rt.requests["r1"]
        assert entry.decode.digest == _expected(spec, "decode")
        row = entry.rows[1]
        np.testing.assert_array_equal(rt.tables.vec_at((1, "post_block"), row).numpy(), _vec(1))
        np.testing.assert_array_equal(rt.tables.vec_at((2, "post_block"), row).numpy(),
                                      _vec(2) if spec is GLOBAL else np.zeros(H))



def test_tag_is_checked_on_a_memo_hit():
    state = FrontendState(SHAPE, capacity=8)
    state.admit(PAYLOAD)
    state.admit(f"{PAYLOAD}~run-1.a_b")  # same body, a good tag: a hit
    for bad in ("../../etc/passwd", "a" * 200, "-leading-dash"):
        with pytest.raises(SteeringValidationError, match=r"^extra_args\.dynsteer\.tag: "):
            state.admit(f"{PAYLOAD}~{bad}")  # the body is cached; the tag is this request's own
