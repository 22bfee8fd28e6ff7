"""A long soak of ``dynsteer serve`` with a monitor: mixed traffic, global-policy churn and monitor commands.

One ``dynsteer serve`` of the tiny local Llama (CPU) with the async tier on (a stream of tagged requests, private
``ipc://`` endpoints) and these bounded loops on loopback, all at once until the time is up:

* ``--clients`` HTTP clients, each sending completions in turn: unsteered (its text must equal the baseline taken
  before anything else ran), static per-request steering (a few inline vectors, plus now and then a fresh one so
  the admission memos turn over; each configuration must always give the same text) and per-request dynamic
  policies (tagged: the monitor sees them);
* the global policy set (a gate that never opens on these prompts, so unsteered texts must not change) and cleared
  over ``/v1/steering/policy``, and the same through the monitor's ``global`` command (granted to it);
* a monitor (``dynsteer.monitor.MonitorClient``) reading the stream and sending ``threshold``, ``rule``, ``steer`` and
  ``abort`` commands to the tagged requests it sees; every ack is ``applied`` or a rejection naming a field (a
  request that finished meanwhile), never an internal error;
* a sampler recording, every ``--sample-s`` seconds, the resident memory and open file descriptors of the server's
  processes (API server, engine core and any children).

It exits 1 on any error, any unsteered text differing from its baseline, a steered configuration giving two texts,
or memory / descriptors not flat (the last third of the run against the middle third: RSS within ``--rss-slack-mb``,
descriptors within ``--fd-slack``). The JSON report holds every sample; ``--plot`` draws the curves.

    python benchmarks/soak.py --minutes 30 --out benchmarks/results/soak-cpu.json --plot benchmarks/results/soak-cpu.png
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from lib.serve import Server, http_json

KEY = "soak-key"
MON_LAYER, ACT_LAYER = 1, 2
PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and",
           "hello world, this is", "the weather today is", "my favourite food is", "the capital of the country"]
MONITOR = "soak-mon"


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        import dynsteer
        from dynsteer import Action, AddVector, DynamicSteeringPolicy, ProbeGate, Rule, SteeringSpec
        from dynsteer.config import MonitorConfig, StreamSpec
        from dynsteer.testing.tiny_models import tiny_model

        self.args = args
        self.model = str(tiny_model("llama"))
        self.hidden = 128
        rng = np.random.default_rng(0)
        self.mon_cfg = MonitorConfig.private(
            streams={"dyn": StreamSpec(places=(f"{MON_LAYER}.post_block",), requests="tagged", tag_prefix="dyn")},
            grants={"*": ("abort", "steer", "threshold", "rule"), MONITOR: ("abort", "steer", "threshold", "rule",
                                                                           "global")})
        self.config = {"dynsteer": {"max_gates": 2, "max_rows": 32, "capture_sites": ["post_block"],
                                    "capture_layers": [MON_LAYER], "monitor": self.mon_cfg.model_dump(mode="json"),
                                    "limits": {"cache_bytes": args.cache_mb << 20}}}
        direction = np.eye(self.hidden, dtype=np.float32)[0]
        act = Action(kind="add", layer=ACT_LAYER, vector=(rng.standard_normal(self.hidden) * 6).astype(np.float32))
        # never opens on these prompts: the global policy must leave unsteered texts as they were
        self.quiet_policy = DynamicSteeringPolicy(
            monitors=[ProbeGate(name="q", layer=MON_LAYER, direction=direction, sharpness=4.0, threshold=1e6)],
            rules=[Rule(monitor="q", actions=[act])])
        self.dyn_policy = DynamicSteeringPolicy(
            monitors=[ProbeGate(name="m", layer=MON_LAYER, direction=direction, sharpness=4.0, threshold=-1e3)],
            rules=[Rule(monitor="m", actions=[act], scope="next_step")])
        self.vectors = [(rng.standard_normal(self.hidden) * 6).astype(np.float32) for _ in range(4)]
        self.static_payloads = [dynsteer.encode_payload(SteeringSpec(vectors=[AddVector(layer=ACT_LAYER, vector=v,
                                                                                        tier="decode")]))
                                for v in self.vectors]
        self._spec = lambda v: SteeringSpec(vectors=[AddVector(layer=ACT_LAYER, vector=v, tier="decode")])
        self._encode = dynsteer.encode_payload
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.seen: dict[tuple[int, int], str] = {}  # (static config, prompt) -> text
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.server: Server | None = None
        self.proc: subprocess.Popen | None = None
        self.url = ""

    # ---- server ------------------------------------------------------------------------------------------------
    def start_server(self, log: Path) -> None:
        self.server = Server(self.model, log, ["--max-num-seqs", "16", "--api-key", KEY, "--additional-config",
                                               json.dumps(self.config)])
        try:
            self.url = self.server.start(timeout=600)
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        self.proc = self.server.proc

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()

    # ---- HTTP ------------------------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any] | None, method: str = "POST") -> tuple[int, dict[str, Any]]:
        return http_json(self.url, method, path, body, key=KEY)

    def complete(self, prompt: str, payload: str | None) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": self.args.tokens,
                                "temperature": 0.0}
        if payload is not None:
            body["vllm_xargs"] = {"dynsteer": payload}
        return self._post("/v1/completions", body)

    # ---- loops -----------------------------------------------------------------------------------------------------
    def _error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)
            self.counts["errors"] += 1

    def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            i = rng.randrange(len(PROMPTS))
            kind = rng.choice(("unsteered", "static", "static", "dynamic"))
            payload, key = None, None
            if kind == "static":
                if rng.random() < 0.1:  # a fresh configuration: the memos see distinct payloads all the time
                    v = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(self.hidden).astype(np.float32)
                    payload = self._encode(self._spec(v * 6))
                    kind = "fresh"
                else:
                    k = rng.randrange(len(self.static_payloads))
                    payload, key = self.static_payloads[k], (k, i)
            elif kind == "dynamic":
                payload = self._encode(None, tag=f"dyn-{uuid.uuid4().hex[:12]}", policy=self.dyn_policy)
            status, out = self.complete(PROMPTS[i], payload)
            if status != 200:
                self._error(f"{kind} request: HTTP {status}: {str(out)[:300]}")
                continue
            text = out["choices"][0]["text"]
            with self.lock:
                self.counts[kind] += 1
                if kind == "unsteered" and text != self.baseline[i]:
                    self.counts["unsteered_mismatch"] += 1
                    self.errors.append(f"unsteered prompt {i}: {text!r} != baseline {self.baseline[i]!r}")
                if key is not None:
                    if self.seen.setdefault(key, text) != text:
                        self.counts["static_mismatch"] += 1
                        self.errors.append(f"static config {key}: {text!r} != {self.seen[key]!r}")

    def churn_loop(self) -> None:
        on = False
        while not self.stop.wait(self.args.churn_s):
            on = not on
            if on:
                body = {"policy": self.quiet_policy.model_dump(mode="json", exclude_none=True)}
                status, out = self._post("/v1/steering/policy", body, "PUT")
            else:
                status, out = self._post("/v1/steering/policy", None, "DELETE")
            if status != 200:
                self._error(f"global policy {'set' if on else 'clear'}: HTTP {status}: {str(out)[:300]}")
            with self.lock:
                self.counts["global_changes"] += 1

    def monitor_loop(self) -> None:
        from dynsteer.commands import GlobalCommand, RuleCommand, SteerCommand, ThresholdCommand, AbortCommand
        from dynsteer.monitor.client import MonitorClient

        rng = random.Random(7)
        last_global = time.monotonic()
        with MonitorClient(self.mon_cfg.endpoint, self.mon_cfg.command_endpoint, name=MONITOR, streams=["dyn"],
                     policy="drop") as mon:
            while not self.stop.is_set():
                frame = mon.recv(timeout_s=0.5)
                commands = []
                if frame is not None:
                    with self.lock:
                        self.counts["frames"] += 1
                        self.counts["frame_rows"] += len(frame.positions)
                    for req in frame.req_ids:
                        r = rng.random()
                        if r < 0.05:
                            commands.append(AbortCommand(request=req, reason="soak"))
                        elif r < 0.15:
                            commands.append(ThresholdCommand(request=req, monitor="m",
                                                             threshold=rng.choice((-1e3, 1e3))))
                        elif r < 0.20:
                            commands.append(RuleCommand(request=req, rule=0, enabled=rng.random() < 0.5))
                        elif r < 0.25:
                            v = self.vectors[rng.randrange(len(self.vectors))]
                            commands.append(SteerCommand(request=req, spec=self._spec(v)))
                if time.monotonic() - last_global > self.args.churn_s * 3:
                    last_global = time.monotonic()
                    policy = self.quiet_policy if rng.random() < 0.5 else None
                    commands.append(GlobalCommand(policy=policy))
                sent = [(mon.commands.send(c), c.op) for c in commands]  # all sent, then every ack collected
                for cid, op in sent:
                    try:
                        ack = mon.commands.wait(cid, timeout_s=60)
                    except TimeoutError as exc:
                        self._error(f"command {op}: {exc}")
                        continue
                    with self.lock:
                        self.counts[f"cmd_{op}_{ack.status}"] += 1
                    if ack.status != "applied" and (not ack.error or "internal error" in ack.error
                                                    or ":" not in ack.error):
                        self._error(f"command {op} rejected without a field: {ack.error!r}")

    def sampler_loop(self, t0: float) -> None:
        import psutil

        root = psutil.Process(self.proc.pid)
        while True:
            procs = [root]
            try:
                procs += root.children(recursive=True)
            except psutil.Error:
                pass
            rss, fds = {}, {}
            for p in procs:
                try:
                    name = f"{p.pid}:{' '.join(p.cmdline()[:2])[-40:]}"
                    rss[name] = p.memory_info().rss
                    fds[name] = p.num_fds()
                except psutil.Error:
                    continue
            with self.lock:
                self.samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(sum(rss.values()) / 2**20, 1),
                                     "fds": sum(fds.values()), "processes": len(rss),
                                     "per_process_rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()},
                                     "requests": sum(self.counts[k] for k in ("unsteered", "static", "fresh",
                                                                              "dynamic"))})
            if self.stop.wait(self.args.sample_s):
                return

    # ---- run ---------------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        workdir = Path(tempfile.mkdtemp(prefix="dynsteer-soak-"))
        self.start_server(workdir / "server.log")
        try:
            self.baseline = []
            for p in PROMPTS:
                status, out = self.complete(p, None)
                if status != 200:
                    raise SystemExit(f"baseline request failed: {status} {out}")
                self.baseline.append(out["choices"][0]["text"])
            t0 = time.monotonic()
            threads = [threading.Thread(target=self.sampler_loop, args=(t0,), daemon=True),
                       threading.Thread(target=self.monitor_loop, daemon=True),
                       threading.Thread(target=self.churn_loop, daemon=True)]
            threads += [threading.Thread(target=self.client_loop, args=(s,), daemon=True)
                        for s in range(self.args.clients)]
            for t in threads:
                t.start()
            end = t0 + self.args.minutes * 60
            while time.monotonic() < end and self.proc.poll() is None:
                time.sleep(5)
                with self.lock:
                    done = sum(self.counts[k] for k in ("unsteered", "static", "fresh", "dynamic"))
                    last = self.samples[-1] if self.samples else {}
                print(f"[soak] {time.monotonic() - t0:7.0f} s  requests {done}  errors {self.counts['errors']}  "
                      f"rss {last.get('rss_mb', 0):.0f} MB  fds {last.get('fds', 0)}", flush=True)
            if self.proc.poll() is not None:
                self._error(f"the server exited with {self.proc.returncode}")
            self.stop.set()
            for t in threads:
                t.join(120)
            self.duration_s = time.monotonic() - t0
            # the unsteered baseline once more, after everything
            for i, p in enumerate(PROMPTS):
                status, out = self.complete(p, None)
                if status != 200 or out["choices"][0]["text"] != self.baseline[i]:
                    self._error(f"final unsteered prompt {i}: {status} {str(out)[:200]}")
        finally:
            self.stop.set()
            self.stop_server()
        return self.report(workdir / "server.log")

    def report(self, log: Path) -> dict[str, Any]:
        n = len(self.samples)
        mid = self.samples[n // 3: 2 * n // 3] or self.samples
        tail = self.samples[2 * n // 3:] or self.samples
        rss_mid = float(np.mean([s["rss_mb"] for s in mid])) if mid else 0.0
        rss_tail = float(np.mean([s["rss_mb"] for s in tail])) if tail else 0.0
        fd_mid = max((s["fds"] for s in mid), default=0)
        fd_tail = max((s["fds"] for s in tail), default=0)
        flat_rss = rss_tail - rss_mid <= self.args.rss_slack_mb
        flat_fds = fd_tail - fd_mid <= self.args.fd_slack
        ok = not self.errors and flat_rss and flat_fds
        return {"ok": ok, "minutes": self.args.minutes, "duration_s": round(getattr(self, "duration_s", 0.0), 1),
                "clients": self.args.clients, "counts": dict(self.counts), "errors": self.errors[:50],
                "rss_mb_middle_third": round(rss_mid, 1), "rss_mb_last_third": round(rss_tail, 1),
                "rss_flat": flat_rss, "fds_middle_third_max": fd_mid, "fds_last_third_max": fd_tail,
                "fds_flat": flat_fds, "cache_mb": self.args.cache_mb, "samples": self.samples,
                "server_log_tail": log.read_text()[-2000:] if self.errors else ""}


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in report["samples"]]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a.plot(t, [s["rss_mb"] for s in report["samples"]])
    a.set_ylabel("RSS of the server's processes (MB)")
    b.plot(t, [s["fds"] for s in report["samples"]], color="tab:orange")
    b.set_ylabel("open file descriptors")
    b.set_xlabel("minutes")
    c = report["counts"]
    fig.suptitle(f"dynsteer serve soak: {sum(c.get(k, 0) for k in ('unsteered', 'static', 'fresh', 'dynamic'))} "
                 f"requests, {c.get('errors', 0)} errors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--churn-s", type=float, default=5.0, help="seconds between global policy changes")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--cache-mb", type=int, default=32, help="Limits.cache_bytes of the server, in MiB")
    ap.add_argument("--rss-slack-mb", type=float, default=64.0)
    ap.add_argument("--fd-slack", type=int, default=8)
    ap.add_argument("--out", required=True, help="JSON report")
    ap.add_argument("--plot", default=None, help="PNG of the RSS and descriptor curves")
    args = ap.parse_args()
    report = Soak(args).run()
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "server_log_tail")}, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
