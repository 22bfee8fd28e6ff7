"""``dynsteer serve`` (tiny Llama on CPU) receiving a few hundred distinct large payloads over HTTP: the API server
and the engine core each end within their memos' budgets (+10 %) of the resident memory they had once warm."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import psutil
import pytest

from dynsteer.request.payload import encode_payload
from dynsteer.spec import AddVector, SteeringSpec
from tests.conftest import ON_GPU, console_script, served

KEY = "test-key-adm"
HIDDEN = 128
BUDGET = 8 << 20  # Limits.cache_bytes: each process holds two memos (API server: admission and decoded payloads;
# engine core: decoded payloads and compiled rows)
WARM, SENT = 40, 300


def _payload(seed: int) -> str:
    """A valid payload of 250 additive vectors, distinct per seed: about 190 KB."""
    rng = np.random.default_rng(seed)
    return encode_payload(SteeringSpec(vectors=[AddVector(layer=i % 4, vector=(rng.standard_normal(HIDDEN) * 0.01)
                                                          .astype(np.float32)) for i in range(250)]))


def _processes(port: int) -> dict[str, psutil.Process]:
    """The API server (this test's child serving ``port``) and its descendants (the engine core, its workers), by
    name and pid."""
    api = next(p for p in psutil.Process().children() if str(port) in p.cmdline())
    return {f"{p.name()}[{p.pid}]": p for p in (api, *api.children(recursive=True))}


@pytest.mark.skipif(ON_GPU, reason="CPU memory of a CPU engine")
def test_serve_holds_distinct_large_payloads_within_memo_budgets(tiny_llama_path, tmp_path):
    cfg = {"dynsteer": {"max_rows": 16, "limits": {"cache_bytes": BUDGET}}}
    exe = console_script()
    ports: list[int] = []

    def command(port: int, args: list[str]) -> list[str]:
        ports.append(port)
        return [str(exe), "serve", str(tiny_llama_path), "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", "256", "--max-num-seqs", "8", "--api-key", KEY, "--seed", "0",
                "--additional-config", json.dumps(cfg), *args]

    with served(command, tmp_path / "server.log") as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id

        def complete(seed: int) -> str:
            out = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=2, temperature=0,
                                            extra_body={"vllm_xargs": {"dynsteer": _payload(seed)}})
            return out.choices[0].finish_reason

        procs = _processes(ports[0])
        assert len(procs) >= 2, procs  # the API server and at least the engine core
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(complete, range(WARM)))  # warm: allocator pools, lazily built validators
            start = {name: p.memory_info().rss for name, p in procs.items()}
            assert all(pool.map(complete, range(WARM, WARM + SENT)))
        grown = {name: p.memory_info().rss - start[name] for name, p in procs.items()}
        allowed = 1.1 * 2 * BUDGET
        assert all(g <= allowed for g in grown.values()), (
            f"{SENT} distinct ~190 KB payloads grew resident memory by {grown} bytes; the memos may hold {allowed:.0f}"
            f" per process (start {start})")
