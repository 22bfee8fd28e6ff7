"""benchmarks/serve.py's sizing of three resident servers on one GPU (no GPU needed)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serve  # noqa: E402
from lib.engines import LLAMA3_8B, kv_bytes_per_token, weight_bytes  # noqa: E402

CFG = dict(LLAMA3_8B, vocab_size=49152)  # the benchmark's 8B shape with SmolLM2's tokenizer
H100, H200 = 81559 << 20, 143771 << 20  # what nvidia-smi reports


@contextlib.asynccontextmanager
async def completions_server(handler) -> AsyncIterator[str]:
    """A loopback aiohttp server answering ``/v1/completions`` with ``handler``; yields its base URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_the_kv_cache_is_the_most_three_servers_fit():
    kv, note = serve.kv_budget(CFG, H200, None, 384, 256)
    assert kv == 16 << 30 and note is None  # an H200 holds the default at every concurrency
    kv, note = serve.kv_budget(CFG, H100, None, 384, 64)
    assert weight_bytes(CFG, 2) + kv + serve.OVERHEAD <= serve.SHARE * H100 < weight_bytes(CFG, 2) + (16 << 30)
    assert note is None and kv >= 64 * 384 * kv_bytes_per_token(CFG, 2)
    kv, note = serve.kv_budget(CFG, H100, None, 384, 256)  # c256 does not fit an H100's share: said, not hidden
    assert note is not None and "fewer than concurrency 256" in note


def test_a_kv_size_that_cannot_fit_names_the_option():
    with pytest.raises(ValueError, match=r"^--kv-gib: 16.0 GiB per server does not fit 3 servers on a GPU of 80 GiB"):
        serve.kv_budget(CFG, H100, 16.0, 384, 64)
    assert serve.kv_budget(CFG, H100, 5.0, 384, 64)[0] == 5 << 30


def test_the_b64_mix_sends_the_dynamic_policy_with_its_vectors_packed():
    """``dynamic-b64`` is ``dynamic`` with each vector as little-endian float32 base64: the same policy to dynsteer."""
    import numpy as np

    from dynsteer.policy import DynamicSteeringPolicy

    mixes = serve.Mixes(hidden=64, layers=4)
    lists, packed = mixes.steering("dynamic", 0)["policy"], mixes.steering("dynamic-b64", 0)["policy"]
    assert set(packed["monitors"][0]["direction"]) == {"b64"} and len(str(packed)) < len(str(lists))
    a, b = DynamicSteeringPolicy.model_validate(lists), DynamicSteeringPolicy.model_validate(packed)
    assert np.array_equal(a.monitors[0].direction, b.monitors[0].direction)
    assert np.array_equal(a.rules[0].actions[0].vector, b.rules[0].actions[0].vector)
    assert a.monitors[0].threshold == b.monitors[0].threshold == 0.0
    assert mixes.steering("dynamic-b64", 1) is None  # every other request unsteered, as in the other half mixes


def test_a_half_mixs_steered_and_plain_requests_are_summarised_apart(capsys):
    """Each half's p50 against vllm's, paired by round: a cost on the steered requests alone shows on that half."""
    def run(ttft, tpot, halves=None):
        out = {"errors": 0, "tok_s": 1000.0, "ttft_p50": ttft, "ttft_p99": ttft, "tpot_p50": tpot, "tpot_p99": tpot,
               "itl_p50": tpot, "itl_p99": tpot}
        return out | ({"halves": halves} if halves else {})

    rounds = {"16": {
        "vllm": [run(100.0, 10.0), run(200.0, 10.0)],
        "dynsteer:dynamic": [run(125.0, 10.0, {"steered": {"ttft_p50": 150.0, "tpot_p50": 10.2},
                                               "plain": {"ttft_p50": 100.0, "tpot_p50": 10.0}}),
                             run(250.0, 10.0, {"steered": {"ttft_p50": 300.0, "tpot_p50": 10.2},
                                               "plain": {"ttft_p50": 200.0, "tpot_p50": 10.0}})],
        "dynsteer:none": [run(100.0, 10.0), run(200.0, 10.0)]}}
    summary = serve.summarise({"rounds": rounds})
    halves = summary["16"]["dynsteer:dynamic"]["halves"]
    assert halves["steered"]["ttft_p50_vs_vllm_pct"] == pytest.approx(50.0)
    assert halves["plain"]["ttft_p50_vs_vllm_pct"] == pytest.approx(0.0)
    assert halves["steered"]["tpot_p50_vs_vllm_pct"] == pytest.approx(2.0)
    assert halves["steered"]["ttft_p50"] == 225.0  # the median over rounds
    assert "halves" not in summary["16"]["dynsteer:none"]
    serve.print_summary(summary)
    assert "| dynsteer:dynamic | +50.0 | +0.0 | +2.0 | +0.0 |" in capsys.readouterr().out


def test_the_client_sends_each_body_encoded_before_the_clock_and_marks_its_half(monkeypatch):
    """``batch`` encodes every request body before timing (a large JSON body encoded on the client's one event loop
    would delay every request in flight), and the server gets exactly the JSON each request was built with."""
    import asyncio
    import json
    import random

    from aiohttp import web

    n_out, received, encodes_at_first_request = 3, [], []
    dumps = serve.json.dumps
    calls = []

    def counting_dumps(obj, *a, **k):
        calls.append(1)
        return dumps(obj, *a, **k)

    async def completions(request: web.Request) -> web.StreamResponse:
        if not received:
            encodes_at_first_request.append(len(calls))
        assert request.content_type == "application/json"
        received.append(await request.json())
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(n_out):
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\ndata: [DONE]\n\n' % n_out)
        return resp

    async def main() -> dict:
        async with completions_server(completions) as url:
            return await serve.batch(url, 6, 2, 4, n_out, 1000, random.Random(0),
                                     lambda i: None if i % 2 else {"vector": "v", "scale": float(i)})

    monkeypatch.setattr(serve.json, "dumps", counting_dumps)
    out = asyncio.run(main())
    monkeypatch.undo()
    assert out["errors"] == 0 and out["n"] == 6 and encodes_at_first_request == [6]
    assert sorted(json.dumps(b.get("steering")) for b in received) == sorted(
        json.dumps(None if i % 2 else {"vector": "v", "scale": float(i)}) for i in range(6))
    assert all(len(b["prompt"]) == 4 and b["stream"] for b in received)
    assert set(out["halves"]) == {"steered", "plain"}


def test_a_ramp_spreads_the_first_requests_starts_and_keeps_the_concurrency():
    """``ramp_s`` starts the first ``concurrency`` requests evenly over the ramp (a wave started together would stay
    one), and never has more than ``concurrency`` requests in flight."""
    import asyncio
    import random
    import time

    from aiohttp import web

    n, conc, ramp, n_out = 8, 4, 0.4, 2
    starts, in_flight, most = {}, [0], [0]

    async def completions(request: web.Request) -> web.StreamResponse:
        t = time.perf_counter()
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        starts[(await request.json())["steering"]["i"]] = t
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(n_out):
            await asyncio.sleep(0.05)
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\ndata: [DONE]\n\n' % n_out)
        in_flight[0] -= 1
        return resp

    async def main(ramp_s: float) -> dict:
        async with completions_server(completions) as url:
            return await serve.batch(url, n, conc, 4, n_out, 1000, random.Random(0), lambda i: {"i": i}, ramp_s)

    out = asyncio.run(main(ramp))
    first = [starts[i] for i in range(conc)]
    gaps = [b - a for a, b in zip(first, first[1:])]
    assert out["errors"] == 0 and len(starts) == n and most[0] <= conc
    assert min(gaps) > 0.6 * ramp / conc, gaps  # spread, in order: about ramp / concurrency apart
    starts.clear()
    asyncio.run(main(0.0))
    first = [starts[i] for i in range(conc)]
    assert max(first) - min(first) < 0.6 * ramp / conc  # without a ramp: together


class CountingMonitor:
    """What ``with_monitor`` reads of a ``StreamMonitor``: rows and bytes received (no stream)."""

    def __init__(self, rows: int, nbytes: int) -> None:
        self.rows, self.bytes, self.waited_for = rows, nbytes, None

    def settle(self, want: int) -> None:
        self.waited_for = want


def test_the_monitor_mix_counts_every_generated_row_and_a_short_count_is_an_error():
    full = CountingMonitor(rows=8 * 15, nbytes=8 * 15 * 4096 * 4)
    res = serve.with_monitor({"errors": 0, "first_errors": [], "wall_s": 2.0}, full, n=8, n_out=16)
    assert full.waited_for == 8 * 15  # every token but the last of every request
    assert res["errors"] == 0 and res["monitor"] == {"rows": 120, "rows_want": 120, "mb": 2.0, "gb_s": 0.001}
    short = serve.with_monitor({"errors": 0, "first_errors": ["x"], "wall_s": 2.0}, CountingMonitor(119, 0), 8, 16)
    assert short["errors"] == 1 and short["first_errors"][0] == "monitor received 119 of 120 stream rows"
    report = {"rounds": {"4": {"vllm": [{"errors": 0, "tok_s": 10.0}],
                               "dynsteer:monitor": [{**res, "tok_s": 9.0}, {**short, "tok_s": 9.5}]}}}
    row = serve.summarise(report)["4"]["dynsteer:monitor"]
    assert row["errors"] == 1 and row["monitor"]["rows_share"] == round(239 / 240, 6)


def test_the_monitor_mix_gives_the_dynsteer_server_its_stream():
    cfg = serve.monitor_config(16)
    assert cfg["capture_layers"] == [16] and cfg["capture_sites"] == ["post_block"]
    stream = cfg["monitor"]["streams"][serve.STREAM]
    assert stream["places"] == ["16.post_block"] and stream["requests"] == "all" and stream["positions"] == "generated"
    assert cfg["monitor"]["endpoint"].startswith("ipc://")
