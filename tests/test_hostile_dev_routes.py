"""vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``) under ``dynsteer serve``: the same rule as the steering
routes, and no ``dynsteer_*`` state change through ``/collective_rpc`` (architecture §10).

In process, on the app the endpoint plugin sees: vLLM's own dev routers, dynsteer's ``attach_router``, and a
stand-in engine client that records what reaches it. The same over real HTTP is in ``tests/test_serve.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from dynsteer.engine.server import SteeringEndpoints

KEY = "dev-key-51c2"
LOCAL, REMOTE = ("127.0.0.1", 5123), ("10.1.2.3", 5123)


class Engine:
    """Records the calls vLLM's dev routes make on the engine client."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method, tuple(args)))
        return [{"rank": 0}]

    async def reset_prefix_cache(self, *args, **kwargs):
        self.calls.append(("reset_prefix_cache",))
        return True

    async def sleep(self, *args, **kwargs):
        self.calls.append(("sleep",))


def make_app(keys: list[str], allow_remote: bool = False) -> tuple[FastAPI, Engine]:
    from vllm.entrypoints.serve import register_vllm_dev_api_routers

    app = FastAPI()
    register_vllm_dev_api_routers(app)  # before endpoint plugins, as vLLM's build_app does
    SteeringEndpoints(allow_remote=allow_remote).attach_router(app)
    engine = Engine()
    app.state.engine_client = engine
    app.state.dynsteer = {"engine": None, "keys": [hashlib.sha256(k.encode()).digest() for k in keys]}
    return app, engine


def rpc(client: TestClient, method: str, args=(), key: str | None = None):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return client.post("/collective_rpc", content=json.dumps({"method": method, "args": list(args)}),
                       headers={"Content-Type": "application/json", **headers})


STATE_CHANGES = [("dynsteer_set_global", ["ds1:gqRzcGVjgA=="]),
                 ("dynsteer_register_vector", ["v", {"b64": "AAAAAA=="}]),
                 ("dynsteer_unregister_vector", ["v"]), ("dynsteer_set_capture", [None]),
                 ("dynsteer_take_captures", [["t"]]), ("dynsteer_take_traces", [["t"]])]


def test_collective_rpc_needs_the_api_key():
    app, engine = make_app([KEY])
    with TestClient(app, client=REMOTE) as client:
        for key in (None, "wrong", KEY + "x"):
            for method, args in [*STATE_CHANGES, ("dynsteer_describe", []), ("get_model_inspection", [])]:
                reply = rpc(client, method, args, key)
                assert reply.status_code == 401, (method, key, reply.text)
            for path in ("/reset_prefix_cache", "/sleep"):  # every dev route, not only /collective_rpc
                assert client.post(path, headers={} if key is None else {"Authorization": f"Bearer {key}"}
                                   ).status_code == 401
        assert engine.calls == []  # nothing reached the engine
        reply = rpc(client, "dynsteer_describe", key=KEY)
        assert reply.status_code == 200 and reply.json() == {"results": [{"rank": 0}]}
        assert rpc(client, "get_model_inspection", key=KEY).status_code == 200
        assert client.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert [c[:2] for c in engine.calls] == [("collective_rpc", "dynsteer_describe"),
                                             ("collective_rpc", "get_model_inspection"), ("reset_prefix_cache",)]


def test_collective_rpc_refuses_dynsteer_state_changes_even_with_the_key():
    """Only /v1/steering/* changes steering: a dynsteer_* call here would bypass the frontend's admission state."""
    app, engine = make_app([KEY])
    with TestClient(app, client=LOCAL) as client:
        for method, args in STATE_CHANGES:
            reply = rpc(client, method, args, KEY)
            assert reply.status_code == 403, (method, reply.text)
            message = reply.json()["error"]["message"]
            assert message.startswith(f"method: '{method}' is not callable through /collective_rpc"), message
    assert engine.calls == []


@pytest.mark.parametrize("allow_remote", [False, True])
def test_without_a_key_dev_routes_answer_loopback_only(allow_remote):
    app, engine = make_app([], allow_remote=allow_remote)
    with TestClient(app, client=REMOTE) as client:
        reply = rpc(client, "dynsteer_describe")
        assert reply.status_code == (200 if allow_remote else 403), reply.text
        assert client.post("/sleep").status_code == (200 if allow_remote else 403)
        assert rpc(client, "dynsteer_set_global", ["ds1:gqRzcGVjgA=="]).status_code == 403
    with TestClient(app, client=LOCAL) as client:
        assert rpc(client, "dynsteer_describe").status_code == 200
        assert rpc(client, "dynsteer_register_vector", ["v", {"b64": "AAAAAA=="}]).status_code == 403
    assert [c[1] for c in engine.calls if c[0] == "collective_rpc"] == ["dynsteer_describe"] * (2 if allow_remote
                                                                                                 else 1)


def test_routes_outside_the_dev_set_are_left_alone():
    """The guard matches vLLM's dev routes only (a route it does not know is not touched, whatever its path)."""
    app, _ = make_app([KEY])

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    with TestClient(app, client=REMOTE) as client:
        assert client.get("/health").status_code == 200


def test_plain_vllm_serve_with_dynsteer_loaded_refuses_dynsteer_state_changes_over_collective_rpc():
    """Under plain ``vllm serve`` (no steering routes, no key rule of dynsteer's) the plugin still keeps
    ``/collective_rpc`` from changing steering behind the frontend's admission state."""
    import vllm.entrypoints.serve as serve

    from dynsteer.engine.dev_routes import patch_dev_routes

    patch_dev_routes(serve)  # what the general plugin does when vLLM's API server imports the module
    patch_dev_routes(serve)  # idempotent
    app = FastAPI()
    serve.register_vllm_dev_api_routers(app)
    engine = Engine()
    app.state.engine_client = engine
    with TestClient(app, client=LOCAL) as client:
        for method, args in STATE_CHANGES:
            reply = rpc(client, method, args)
            assert reply.status_code == 403, (method, reply.text)
            assert reply.json()["error"]["message"].startswith(f"method: '{method}' is not callable"), reply.text
        assert rpc(client, "dynsteer_describe").status_code == 200
        assert rpc(client, "get_model_inspection").status_code == 200
        assert client.post("/reset_prefix_cache").status_code == 200  # vLLM's own dev routes are vLLM's business
    assert [c[:2] for c in engine.calls] == [("collective_rpc", "dynsteer_describe"),
                                             ("collective_rpc", "get_model_inspection"), ("reset_prefix_cache",)]


#: a FastAPI that includes routers by reference (``app.router.routes`` holds the included router, not its routes), as
#: GPU hosts install it; the guard must find vLLM's development routes there too
NEWER_FASTAPI = "0.165.0"
RERUN = "DYNSTEER_FASTAPI_RERUN"


@pytest.mark.skipif(os.environ.get(RERUN) != "1", reason="runs inside the newer-FastAPI rerun only")
def test_the_rerun_runs_the_newer_fastapi():
    import fastapi

    assert fastapi.__version__ == NEWER_FASTAPI


@pytest.mark.skipif(os.environ.get(RERUN) == "1", reason="the rerun itself")
def test_every_guard_test_holds_with_fastapi_including_routers_by_reference(tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                           "--target", str(target), f"fastapi=={NEWER_FASTAPI}"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode:
        pytest.skip(f"pip cannot install fastapi {NEWER_FASTAPI} here: {proc.stderr[-300:]}")
    env = {**os.environ, RERUN: "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(target),
                                                                                 os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stdout[-4000:]
    assert "failed" not in run.stdout and "7 passed" in run.stdout, run.stdout[-2000:]
