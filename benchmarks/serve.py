"""Serving under load: ``vllm serve`` against ``dynsteer serve`` through an async streaming OpenAI client.

Three servers of one model run side by side on one device: ``vllm`` and ``vllm_aa`` (plain ``vllm serve``, dynsteer's
plugin off; the pair is the A/A control) and ``dynsteer`` (``dynsteer serve``). Traffic goes to one server at a time:
for each concurrency, a round sends one batch of streaming ``/v1/completions`` requests to each entry (``vllm``,
``vllm_aa``, then ``dynsteer`` under each traffic mix), in an order rotated every round, and the report pairs every
entry's round with ``vllm``'s round at the same concurrency (median over rounds of the per-round ratios, as
``overhead.py`` does). Every request's prompt is fresh random token ids, so no request reads another's prefix cache,
and generates exactly ``--output-tokens`` tokens (``ignore_eos``).

Traffic mixes (``--mixes``) on ``dynsteer``: ``none`` (nothing steered), ``registered`` (half the requests name a
registered vector), ``inline`` (half carry the vector as a JSON list), ``dynamic`` (half carry a per-request dynamic
policy, direction and action as JSON lists), ``dynamic-b64`` (the same policy with its vectors as ``{"b64": ...}``:
what the body's JSON parsing on the API server's event loop adds to ``dynamic``), ``global`` (a global dynamic policy
set over HTTP steers every request), ``preset`` (half name a registered preset with a parameter), ``reports`` (half
carry the dynamic policy and ask for a per-token report), ``monitor`` (nothing steered; a monitor in this process
subscribes to a stream of every request's generated tokens at the middle layer, reads every value of every frame and
must receive every row: a short count is an error; the report gives the rows and GB/s it received). With ``monitor``
among the mixes the dynsteer server holds a capture buffer at that layer and declares the stream for every mix (a
stream nobody subscribes to costs nothing; an idle capture buffer, nothing measurable offline).

Per entry and round: output tokens per second over the batch, TTFT, TPOT (per request: time from the first to the
last token over the tokens after the first) and inter-token latency (gaps between streamed chunks), p50 and p99;
errors (any non-200, or a stream that ends short) are counted and the first are kept.

    python3 benchmarks/serve.py --shape llama3-8b --tokenizer DIR --out benchmarks/results   # a GPU, one call
    python benchmarks/serve.py --cpu-smoke --out /tmp                                             # tiny model, CPU
    python benchmarks/serve.py --from-json REPORT --plot fig.png                                  # re-print, plot

``--budget-min`` stops starting rounds once another would not fit; the report is rewritten after every round.
``--ramp-s`` spreads each batch's first requests over that many seconds: requests of one length started together
finish together, so by default a batch runs in waves, each wave's TTFT its whole prefill (which makes TTFT swing with
anything that shifts when requests finish); spread starts keep prefills inside decode steps, as steady traffic does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgspec

from lib.engines import LLAMA3_8B, gpu_memory, kv_bytes_per_token, weight_bytes
from lib.pyspy import Sampler, print_summaries
from lib.report import git_sha, host_facts, save_json, utc_now
from lib.serve import CPU_ARGS, CPU_ENV, Server, VanillaServer, http_json
from lib.stream_reader import FrameReader
from lib.stats import paired, quantile

JSON_HEADERS = {"Content-Type": "application/json"}
# One streamed chunk's JSON, with msgspec (several times faster than ``json.loads``): the client parses every chunk of
# every request on one event loop, and a chunk that carries a per-token report is larger than a plain one, so a slow
# parse would be charged to the requests that ask for reports.
decode_chunk = msgspec.json.Decoder().decode
MIXES = ("none", "registered", "inline", "dynamic", "dynamic-b64", "global", "preset", "reports", "monitor")
METRICS = ("tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99")
NAME = "bench"  # the served model name, the registered vector's and the preset's


# ---- the model -------------------------------------------------------------------------------------------------------
def shaped_model(shape: str, tokenizer: Path, dest: Path) -> Path:
    """A dummy-weight model directory: ``shape``'s config with the vocabulary of ``tokenizer`` (a directory holding
    ``tokenizer.json`` and ``tokenizer_config.json``), whose files are copied beside it."""
    assert shape == "llama3-8b", shape
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    dest.mkdir(parents=True, exist_ok=True)
    cfg = dict(LLAMA3_8B, vocab_size=vocab, bos_token_id=1, eos_token_id=2)
    (dest / "config.json").write_text(json.dumps(cfg))
    for f in tokenizer.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, dest / f.name)
    return dest


# ---- memory ---------------------------------------------------------------------------------------------------------
SERVERS, SHARE, OVERHEAD = 3, 0.3, 3 << 30  # resident servers, each one's share of the GPU, its activations/graphs


def kv_budget(cfg: dict, total: int, kv_gib: float | None, tokens_per_request: int,
              concurrency: int) -> tuple[int, str | None]:
    """KV bytes per server for ``SERVERS`` servers resident on a GPU of ``total`` bytes, each held to ``SHARE`` of it
    (bf16 weights + KV + ``OVERHEAD`` must fit): ``kv_gib`` if given (``ValueError`` naming ``--kv-gib`` when it
    cannot fit), else the most that fits, at most 16 GiB. The note says when ``concurrency`` requests cannot all hold
    their KV at once (they queue, which changes what is measured)."""
    room = int(SHARE * total) - weight_bytes(cfg, 2) - OVERHEAD
    if room <= 0:
        raise ValueError(f"the model does not fit {SERVERS} servers on a GPU of {total / 2**30:.0f} GiB")
    kv = min(room, 16 << 30) if kv_gib is None else int(kv_gib * 2**30)
    if kv > room:
        raise ValueError(f"--kv-gib: {kv_gib} GiB per server does not fit {SERVERS} servers on a GPU of "
                         f"{total / 2**30:.0f} GiB (at most {room / 2**30:.1f})")
    per_request = tokens_per_request * kv_bytes_per_token(cfg, 2)
    note = (f"KV of {kv / 2**30:.1f} GiB per server holds {kv // per_request} requests, fewer than concurrency "
            f"{concurrency}: the rest queue") if concurrency * per_request > kv else None
    return kv, note


# ---- the mixes -------------------------------------------------------------------------------------------------------
class Mixes:
    """Each mix's set-up and tear-down on the dynsteer server and the ``steering`` object of request ``i``."""

    def __init__(self, hidden: int, layers: int, seed: int = 0) -> None:
        import numpy as np

        from dynsteer.vectors.values import pack_vector

        rng = random.Random(seed)
        self.vector = [round(rng.gauss(0, 1) / hidden ** 0.5, 6) for _ in range(hidden)]
        self.direction = [round(rng.gauss(0, 1) / hidden ** 0.5, 6) for _ in range(hidden)]
        self.layer, self.monitor_layer = layers // 2, max(0, layers // 2 - 2)
        self.policy = self.dynamic_policy(self.direction, self.vector)
        # the steered half's object per mix, built once (the client sends the same one with every request)
        self.objects = {
            "registered": {"spec": {"vectors": [{"layer": self.layer, "vector": NAME, "scale": 1.0}]}},
            "inline": {"spec": {"vectors": [{"layer": self.layer, "vector": self.vector, "scale": 1.0}]}},
            "dynamic": {"policy": self.policy},
            "dynamic-b64": {"policy": self.dynamic_policy(*(pack_vector(np.asarray(v, np.float32))
                                                             for v in (self.direction, self.vector)))},
            "preset": {"preset": NAME, "params": {"scale": 2.0}},
            "reports": {"policy": self.policy, "report": "tokens"}}

    def dynamic_policy(self, direction: Any, vector: Any) -> dict:
        """The dynamic mixes' policy with these direction and action vectors (lists or ``{"b64": ...}``)."""
        # threshold 0 on a random direction: the gate is open on some tokens and shut on others, as a real one is
        return {"monitors": [{"name": "m", "layer": self.monitor_layer, "direction": direction, "sharpness": 4.0,
                              "threshold": 0.0}],
                "rules": [{"monitor": "m", "actions": [{"kind": "add", "layer": self.layer, "vector": vector}]}]}

    def setup(self, mix: str, call: Callable[[str, str, dict | None], Any]) -> None:
        if mix in ("registered", "preset"):
            call("POST", "/v1/steering/vectors", {"name": NAME, "vector": self.vector})
        if mix == "preset":
            call("PUT", f"/v1/steering/presets/{NAME}", {
                "spec": {"vectors": [{"layer": self.layer, "vector": NAME, "scale": "$scale"}]},
                "params": {"scale": {"default": 1.0, "min": 0.0, "max": 16.0}}})
        if mix == "global":
            call("PUT", "/v1/steering/policy", {"policy": self.policy})

    def teardown(self, mix: str, call: Callable[[str, str, dict | None], Any]) -> None:
        if mix == "global":
            call("DELETE", "/v1/steering/policy", None)
        if mix == "preset":
            call("DELETE", f"/v1/steering/presets/{NAME}", None)
        if mix in ("registered", "preset"):
            call("DELETE", f"/v1/steering/vectors/{NAME}", None)

    def steering(self, mix: str, i: int) -> dict | None:
        """Request ``i``'s steering object (every other request is steered in the half mixes)."""
        return None if i % 2 else self.objects.get(mix)  # none, global: no object


# ---- the monitor mix -------------------------------------------------------------------------------------------------
STREAM = "resid"


def monitor_config(layer: int) -> dict:
    """The dynsteer server's config for the ``monitor`` mix: a capture buffer at ``layer`` and stream ``resid`` of
    every request's generated tokens there, on private ipc endpoints."""
    from dynsteer.config import MonitorConfig

    mon = MonitorConfig.private(streams={STREAM: {"places": [f"{layer}.post_block"], "requests": "all",
                                                  "positions": "generated"}})
    return {"capture_sites": ["post_block"], "capture_layers": [layer], "monitor": mon.model_dump(mode="json")}


class StreamMonitor(FrameReader):
    """A monitor service in this process, subscribed to the stream before the traffic starts (no command: it
    measures delivery)."""

    def __init__(self, cfg: dict, url: str) -> None:
        from dynsteer.monitor.client import MonitorClient

        mon = cfg["monitor"]
        # drop rather than block: a monitor that falls behind shows as missing rows, never as a stalled engine
        client = MonitorClient(mon["endpoint"], mon["command_endpoint"], name="serve-bench", streams=[STREAM],
                               policy="drop", max_pending=1 << 20, window=1024)
        status, reply = http_json(url, "GET", f"/v1/steering/streams/{STREAM}/subscribers?min=1&timeout_s=60")
        if status != 200:
            client.close()
            raise RuntimeError(f"monitor: not subscribed to {STREAM!r}: HTTP {status}: {reply}")
        super().__init__(client, name="serve-bench-monitor")


def with_monitor(res: dict, mon: StreamMonitor, n: int, n_out: int) -> dict:
    """The batch's result with what the monitor received: every generated token but the last (never fed back) of
    every request is a row; a short count is an error."""
    want = n * (n_out - 1)
    mon.settle(want)
    res["monitor"] = {"rows": mon.rows, "rows_want": want, "mb": round(mon.bytes / 1e6, 1),
                      "gb_s": round(mon.bytes / 1e9 / res["wall_s"], 4) if res.get("wall_s") else None}
    if mon.rows != want:
        res["errors"] += 1
        res["first_errors"] = [f"monitor received {mon.rows} of {want} stream rows"] + res["first_errors"][:2]
    return res


# ---- the client ------------------------------------------------------------------------------------------------------
async def one_request(session: Any, url: str, body: bytes, n_out: int) -> dict:
    """One streaming completion of an encoded JSON ``body``: TTFT, the chunks' arrival times, the tokens the usage
    reports, or the error."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    try:
        async with session.post(url + "/v1/completions", data=body, headers=JSON_HEADERS) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:300]}"}
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = decode_chunk(data)
                if chunk.get("choices"):
                    arrivals.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - a failed request is data: counted and kept
        return {"error": repr(exc)[:300]}
    if tokens != n_out or not arrivals:
        return {"error": f"stream ended with {tokens} of {n_out} tokens ({len(arrivals)} chunks)"}
    return {"ttft": arrivals[0] - t0, "tpot": (arrivals[-1] - arrivals[0]) / max(1, tokens - 1),
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])], "tokens": tokens}


async def batch(url: str, n: int, concurrency: int, n_in: int, n_out: int, vocab: int, rng: random.Random,
                steering: Callable[[int], dict | None], ramp_s: float = 0.0) -> dict:
    """``n`` requests, ``concurrency`` at a time, each with fresh random prompt ids; the batch's metrics.

    ``ramp_s``: the first ``concurrency`` requests start evenly spread over this many seconds instead of together.
    Requests of one length started together finish together, so the batch runs in waves whose TTFT is a whole
    wave's prefill; spread starts stay spread (each request that ends lets the next one in at its own time), so each
    prefill shares its step with decodes, as under steady traffic."""
    import aiohttp

    prompts = [[rng.randrange(100, vocab - 100) for _ in range(n_in)] for _ in range(n)]
    # Encoded before the clock starts: the client is one event loop, and encoding a body with an 8B model's vectors
    # as JSON lists takes milliseconds, which would delay every request in flight (TTFT and inter-token gaps of
    # plain requests too) and be charged to the server.
    bodies, steered = [], []
    for i in range(n):
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": n_out, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        st = steering(i)
        if st is not None:
            body["steering"] = st
        bodies.append(json.dumps(body).encode())
        steered.append(st is not None)
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as s:
        async def run(i: int) -> dict:
            async with sem:  # (taken in order: the first ``concurrency`` requests hold the slots while they wait)
                if ramp_s and i < concurrency:
                    await asyncio.sleep(i * ramp_s / concurrency)
                return {**await one_request(s, url, bodies[i], n_out), "steered": steered[i]}

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(n)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    out: dict[str, Any] = {"n": n, "errors": len(errors), "first_errors": errors[:3], "wall_s": round(wall, 3)}
    if ok:
        ms = lambda v: round(v * 1e3, 3)  # noqa: E731
        ttft, tpot = [r["ttft"] for r in ok], [r["tpot"] for r in ok]
        itl = [g for r in ok for g in r["itl"]]
        out |= {"tok_s": round(sum(r["tokens"] for r in ok) / wall, 2),
                "ttft_p50": ms(quantile(ttft, .5)), "ttft_p99": ms(quantile(ttft, .99)),
                "tpot_p50": ms(quantile(tpot, .5)), "tpot_p99": ms(quantile(tpot, .99)),
                "itl_p50": ms(quantile(itl, .5)), "itl_p99": ms(quantile(itl, .99))}
        # a half mix's cost may sit on its steered requests or on every request of their steps: both halves' p50s
        halves = {"steered": [r for r in ok if r["steered"]], "plain": [r for r in ok if not r["steered"]]}
        if all(halves.values()):
            out["halves"] = {k: {"ttft_p50": ms(quantile([r["ttft"] for r in rs], .5)),
                                 "tpot_p50": ms(quantile([r["tpot"] for r in rs], .5))} for k, rs in halves.items()}
    return out


# ---- the report ------------------------------------------------------------------------------------------------------
def summarise(report: dict) -> dict:
    """Per concurrency and entry: each metric's median over rounds and its paired change against ``vllm`` in %."""
    out: dict[str, dict] = {}
    for conc, entries in report["rounds"].items():
        base = entries.get("vllm", [])
        out[conc] = {}
        for entry, runs in entries.items():
            row: dict[str, Any] = {"errors": sum(r["errors"] for r in runs), "rounds": len(runs)}
            mon = [r["monitor"] for r in runs if "monitor" in r]
            if mon:  # the monitor mix: what its subscriber received
                row["monitor"] = {"gb_s": statistics.median(m["gb_s"] or 0.0 for m in mon),
                                  "rows_share": round(sum(m["rows"] for m in mon) / max(1, sum(m["rows_want"]
                                                                                              for m in mon)), 6)}
            for m in METRICS:
                xs = [r[m] for r in runs if m in r]
                if xs:
                    row[m] = round(statistics.median(xs), 3)
                if entry != "vllm":
                    pairs = [(r[m], b[m]) for r, b in zip(runs, base) if m in r and m in b]
                    if pairs:
                        row[f"{m}_vs_vllm_pct"] = paired([x for x, _ in pairs], [y for _, y in pairs])["median"]
            halves = {}  # a half mix: its steered and its plain requests apart, each against vllm's requests
            for half in ("steered", "plain"):
                for m in ("ttft_p50", "tpot_p50"):
                    pairs = [(r["halves"][half][m], b[m]) for r, b in zip(runs, base) if "halves" in r and m in b]
                    if pairs:
                        halves.setdefault(half, {})[m] = round(statistics.median(x for x, _ in pairs), 3)
                        halves[half][f"{m}_vs_vllm_pct"] = paired([x for x, _ in pairs], [y for _, y in pairs])["median"]
            if halves:
                row["halves"] = halves
            out[conc][entry] = row
    return out


def print_summary(summary: dict) -> None:
    heads = ("tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99")
    for conc, rows in summary.items():
        print(f"\nconcurrency {conc} (change against vllm, median of per-round ratios, %)")
        print("| entry | errors | " + " | ".join(heads) + " |")
        print("|---" * (len(heads) + 2) + "|")
        for entry, row in rows.items():
            cells = [f"{row[f'{m}_vs_vllm_pct']:+.1f}" if f"{m}_vs_vllm_pct" in row else
                     (f"{row[m]:.1f}" if m in row else "-") for m in METRICS]
            print(f"| {entry} | {row['errors']} | " + " | ".join(cells) + " |")
        for entry, row in rows.items():
            if "monitor" in row:
                print(f"{entry}: the monitor received {row['monitor']['rows_share']:.2%} of the stream's rows, "
                      f"{row['monitor']['gb_s']:.3f} GB/s (median over rounds)")
        halves = {entry: row["halves"] for entry, row in rows.items() if "halves" in row}
        if halves:
            print("\nhalf mixes: each half's p50 against vllm's requests (%)")
            print("| entry | steered TTFT | plain TTFT | steered TPOT | plain TPOT |\n|---|---|---|---|---|")
            for entry, h in halves.items():
                cells = [f"{h[half][f'{m}_vs_vllm_pct']:+.1f}" if f"{m}_vs_vllm_pct" in h.get(half, {}) else "-"
                         for m in ("ttft_p50", "tpot_p50") for half in ("steered", "plain")]
                print(f"| {entry} | " + " | ".join(cells) + " |")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    shown = ("tok_s", "ttft_p50", "tpot_p50", "tpot_p99")
    fig, axes = plt.subplots(1, len(summary), figsize=(5 * len(summary), 4.5), squeeze=False)
    for ax, (conc, rows) in zip(axes[0], summary.items()):
        entries = [e for e in rows if e != "vllm"]
        width = 0.8 / len(shown)
        for k, m in enumerate(shown):
            ax.bar([i + k * width for i in range(len(entries))],
                   [rows[e].get(f"{m}_vs_vllm_pct", 0.0) for e in entries], width, label=m)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(entries))], entries, rotation=35, ha="right")
        ax.set_title(f"concurrency {conc}")
        ax.set_ylabel("change against vllm serve (%)")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(f"{report['device']}, {report['model']}: dynsteer serve against vllm serve (vllm_aa: A/A)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- the run ---------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["llama3-8b"], help="a dummy-weight model of this shape (GPU)")
    ap.add_argument("--tokenizer", type=Path, help="directory with the tokenizer files for --shape")
    ap.add_argument("--model", help="a model directory (real weights) instead of --shape")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny local Llama on CPU, small batches")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--requests", type=int, nargs="+", help="requests per batch, one per concurrency "
                    "(default: 4 x concurrency, at least 64, at most 512)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ramp-s", type=float, default=0.0,
                    help="spread each batch's first requests' starts over this many seconds (0: all at once, so "
                         "requests arrive in waves); the batch's wall time and tok/s include the ramp")
    ap.add_argument("--input-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    ap.add_argument("--kv-gib", type=float, help="KV cache per server (GPU; default: the most that fits three "
                    "servers, at most 16)")
    ap.add_argument("--budget-min", type=float, default=8.5, help="start no round that would end after this")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--label", default="")
    ap.add_argument("--plot")
    ap.add_argument("--py-spy", help="py-spy executable: after the rounds, profile --profile entries once each")
    ap.add_argument("--py-spy-mode", choices=["busy", "idle", "gil"], default="busy",
                    help="busy: running threads only; idle: waiting threads too; gil: the thread holding the GIL")
    ap.add_argument("--profile", nargs="+", default=["vllm", "dynsteer:none"], metavar="ENTRY",
                    help="entries to profile (e.g. vllm dynsteer:reports), at the largest concurrency")
    ap.add_argument("--keep-logs", action="store_true", help="copy the servers' logs beside the report")
    ap.add_argument("--from-json", help="re-print (and --plot) a report")
    args = ap.parse_args()

    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        print_summary(report["summary"])
        if args.plot:
            plot(report, args.plot)
        return 0

    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="dynsteer-serve-bench-"))
    common = ["--served-model-name", NAME, "--max-num-seqs", str(max(args.concurrency))]
    if args.cpu_smoke:
        from dynsteer.testing.tiny_models import tiny_model

        model, base, env = str(tiny_model("llama")), CPU_ARGS, CPU_ENV
        device = "cpu"
        args.input_tokens, args.output_tokens = min(args.input_tokens, 64), min(args.output_tokens, 16)
    else:
        model = args.model or str(shaped_model(args.shape, args.tokenizer, work / "model"))
        gpu = gpu_memory()
        kv, note = (kv_budget(json.loads((Path(model) / "config.json").read_text()), gpu[1], args.kv_gib,
                              args.input_tokens + args.output_tokens, max(args.concurrency))
                    if gpu else (int((args.kv_gib or 16.0) * 2**30), None))
        if note:
            print(f"[serve] {note}", flush=True)
        base = ["--max-model-len", str(max(1024, args.input_tokens + args.output_tokens)),
                "--kv-cache-memory-bytes", str(kv), "--gpu-memory-utilization", str(SHARE)]
        base += [] if args.model else ["--load-format", "dummy"]
        env = {}
        device = (gpu_memory() or ("cuda",))[0]
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab, hidden, layers = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    mixes = Mixes(hidden, layers)
    dyn_cfg = monitor_config(mixes.layer) if "monitor" in args.mixes else None
    servers: dict[str, Server] = {
        "vllm": VanillaServer(model, work / "vllm.log", common, base=base, env=env),
        "dynsteer": Server(model, work / "dynsteer.log", common + (
            ["--additional-config", json.dumps({"dynsteer": dyn_cfg})] if dyn_cfg else []), base=base, env=env),
        "vllm_aa": VanillaServer(model, work / "vllm_aa.log", common, base=base, env=env)}
    requests = args.requests or [min(512, max(64, 4 * c)) for c in args.concurrency]
    report: dict[str, Any] = {
        "benchmark": "serve", "date": utc_now(), "device": device, "git": git_sha(), "host": host_facts(),
        "model": args.model or (f"{args.shape} shape, dummy weights, vocab {vocab}" if args.shape else "tiny llama"),
        "input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "ramp_s": args.ramp_s,
        "concurrency": args.concurrency, "requests": requests, "mixes": args.mixes, "server_args": base + common,
        "dynsteer_config": dyn_cfg, "rounds": {str(c): {} for c in args.concurrency}, "summary": {}}
    name = f"serve-{device.replace(' ', '_')}-{report['date'][:10]}{'-' + args.label if args.label else ''}.json"
    path = Path(args.out) / name
    entries = [("vllm", "none"), ("vllm_aa", "none")] + [("dynsteer", m) for m in args.mixes]
    rng = random.Random(0)
    try:
        # vllm and dynsteer start at once; vllm_aa once vllm is up, to read its compile cache
        servers["vllm"].launch()
        servers["dynsteer"].launch()
        servers["vllm"].wait(900)
        servers["vllm_aa"].launch()
        for s in ("dynsteer", "vllm_aa"):
            servers[s].wait(900)
        report["startup_s"] = round(time.monotonic() - t_start, 1)
        print(f"[serve] servers up in {report['startup_s']} s", flush=True)
        def call(method: str, path: str, body: dict | None) -> Any:
            status, out = http_json(servers["dynsteer"].url, method, path, body)
            if status >= 400:
                raise RuntimeError(f"{method} {path}: HTTP {status}: {out}")
            return out

        def run_entry(server: str, mix: str, conc: int, n: int, n_out: int) -> dict:
            mon = None
            if server == "dynsteer":
                mixes.setup(mix, call)
                if mix == "monitor":
                    mon = StreamMonitor(dyn_cfg, servers[server].url)
            try:
                res = asyncio.run(batch(servers[server].url, n, conc, args.input_tokens, n_out, vocab, rng,
                                        lambda i: mixes.steering(mix, i) if server == "dynsteer" else None,
                                        args.ramp_s))
                return with_monitor(res, mon, n, n_out) if mon is not None else res
            finally:
                if mon is not None:
                    mon.close()
                if server == "dynsteer":
                    mixes.teardown(mix, call)

        for server, mix in entries:  # warm-up: first requests, first payloads, each mix's memo
            warm = run_entry(server, mix, args.concurrency[0], args.concurrency[0], min(16, args.output_tokens))
            if warm["errors"]:
                raise RuntimeError(f"warm-up of {server}/{mix} failed: {warm['first_errors']}")
        round_s: list[float] = []
        for r in range(args.rounds):
            elapsed = time.monotonic() - t_start
            if round_s and elapsed + max(round_s) > args.budget_min * 60:
                print(f"[serve] budget: stopping after {r} rounds", flush=True)
                break
            t_round = time.monotonic()
            for conc, n in zip(args.concurrency, requests):
                order = entries[r % len(entries):] + entries[:r % len(entries)]
                for server, mix in order:
                    key = server if server != "dynsteer" else f"dynsteer:{mix}"
                    res = run_entry(server, mix, conc, n, args.output_tokens)
                    report["rounds"][str(conc)].setdefault(key, []).append(res)
                    print(f"[serve] round {r} c={conc} {key}: {res.get('tok_s')} tok/s, TTFT p50 "
                          f"{res.get('ttft_p50')} ms, TPOT p50 {res.get('tpot_p50')} ms, errors {res['errors']}"
                          + (f", halves {res['halves']}" if "halves" in res else "")
                          + (f", monitor {res['monitor']}" if "monitor" in res else ""),
                          flush=True)
            round_s.append(time.monotonic() - t_round)
            report["summary"] = summarise(report)
            report["rounds_done"] = r + 1
            save_json(path, report)
        if args.py_spy:  # not timed: py-spy's sampling slows what it watches
            sampler = Sampler(args.py_spy, Path(args.out) / f"{path.stem}-profiles", mode=args.py_spy_mode)
            conc, n = args.concurrency[-1], requests[-1]
            for key in args.profile:
                server, _, mix = key.partition(":")
                sampler.start(servers[server].proc.pid, key.replace(":", "-"))
                stacks: dict = {}
                try:
                    res = run_entry(server, mix or "none", conc, n, args.output_tokens)
                finally:
                    stacks = sampler.stop()
                report.setdefault("profiled", {})[key] = {**res, "stacks": stacks}
                print(f"[serve] profiled {key} at c={conc}: {res.get('tok_s')} tok/s", flush=True)
                print_summaries(f"[serve] where {key}'s processes spent their samples", stacks)
    finally:
        for s in servers.values():
            s.stop()
        if args.keep_logs:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            for s in servers:
                shutil.copy(servers[s].log, Path(args.out) / f"{path.stem}-{s}.log")
    report["summary"] = summarise(report)
    report["errors"] = sum(r["errors"] for rows in report["rounds"].values() for runs in rows.values() for r in runs)
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    save_json(path, report)
    print_summary(report["summary"])
    print(f"\n[serve] report: {path}; errors {report['errors']}")
    if args.plot:
        plot(report, args.plot)
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
