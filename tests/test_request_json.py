"""The API server's request bodies: msgspec where it decodes them, the standard library's result everywhere."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from starlette.requests import Request

from dynsteer.engine import patching
from dynsteer.engine.request_json import loads, patch_request_json

BODIES = [
    b'{"model": "m", "prompt": [1, 2, 3], "steering": {"policy": {"monitors": [{"direction": [0.1, -2.5e-3, 1e300]}]}}}',
    b'{"a": 1, "a": 2}',  # duplicate keys: the last wins
    b'{"x": NaN, "y": Infinity, "z": -Infinity}',  # not JSON, yet json.loads takes it
    b'{"big": 123456789012345678901234567890}',  # past 64 bits
    b'{"s": "\\ud800 lone surrogate", "t": "caf\\u00e9 \xc3\xa9"}',
    '{"utf16": "body"}'.encode("utf-16"),  # json.loads detects the encoding
    b'  [1, 2.5, true, false, null, "x", {"k": []}]  ',
    b"-0.0",
]


@pytest.mark.parametrize("body", BODIES)
def test_bodies_parse_to_what_json_loads_returns(body):
    want, got = json.loads(body), loads(body)
    assert repr(got) == repr(want)  # repr: NaN compares unequal to itself, -0.0 equal to 0.0


def test_floats_are_the_standard_librarys_to_the_last_bit():
    vals = np.random.default_rng(0).standard_normal(4096).astype(np.float32).tolist()
    body = json.dumps({"vector": vals}).encode()
    assert loads(body)["vector"] == json.loads(body)["vector"]


@pytest.mark.parametrize("body", [b"", b"{", b'{"a": }', b"[1, 2", b"\xff\xfe\xfd"])
def test_invalid_bodies_raise_what_json_loads_raises(body):
    with pytest.raises(Exception) as want:
        json.loads(body)
    with pytest.raises(type(want.value)) as got:
        loads(body)
    assert str(got.value) == str(want.value)


def test_the_patched_request_reads_its_body_once_with_msgspec(monkeypatch):
    class Req(Request):  # a stand-in owner: the real class is patched only in dynsteer serve's API server
        pass

    try:
        patch_request_json(Req)
        body = b'{"prompt": [1, 2], "steering": {"spec": {"vectors": []}}}'
        calls = []

        async def receive():
            calls.append(1)
            return {"type": "http.request", "body": body, "more_body": False}

        req = Req({"type": "http", "method": "POST", "headers": []}, receive)
        monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("json.loads used for a strict JSON body"))
        first = asyncio.run(req.json())
        assert first == {"prompt": [1, 2], "steering": {"spec": {"vectors": []}}}
        assert asyncio.run(req.json()) is first and calls == [1]
    finally:
        patching.restore(Req, "json")
