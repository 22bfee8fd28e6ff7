"""``overhead.py``'s worker side: one engine in its own process, and its modes' workloads.

A worker builds one ``vllm.LLM`` from its configuration (``lib.overhead.bench`` writes it), answers ``READY``, then
one line per command (:func:`handle`): ``run`` (a timed call of a mode, set up and torn down outside the timed
window; its tokens on request) or ``profile`` (a call under vLLM's torch profiler). Runs inside the engine's worker
process; the hook peer's engine core processes import this module too (``install_hook`` is pickled by reference).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from lib.overhead.modes import (HOTWIRE_VECTOR_ID, N_POLICIES, STREAM_OF_MODE, TIMED_STD, gate_places, spread_layers,
                                steer_layer)


class Workload:
    """One engine's modes: how each is set up, timed and torn down (runs inside the engine's worker process)."""

    def __init__(self, llm, cfg: dict) -> None:
        import numpy as np
        from vllm import SamplingParams

        self.np, self.llm, self.cfg = np, llm, cfg
        mc = json.loads((Path(cfg["model_dir"]) / "config.json").read_text())
        self.num_layers, self.hidden, vocab = mc["num_hidden_layers"], mc["hidden_size"], mc["vocab_size"]
        self.layer = steer_layer(self.num_layers)
        self.params = SamplingParams(temperature=0.0, max_tokens=cfg["tokens"], ignore_eos=True, detokenize=False)
        self.vocab = vocab
        self.prompts = {b: self.prompts_for(b, None) for b in cfg["batches"]}
        self.kind = cfg["kind"]
        self.steerer = None
        # what the stream modes' monitor received: bytes of every frame (GB/s in the report), rows against all
        self.stream_bytes = self.stream_rows = self.stream_rows_want = 0
        self._payloads: dict = {}
        if self.kind == "dynsteer" and cfg["engine"] != "dynsteer-bare":  # the bare engine has no runtime
            import dynsteer

            self.steerer = dynsteer.attach(llm)
            self.steerer.register_vector(HOTWIRE_VECTOR_ID, self.vec(0))
            for i in range(64):  # pr64n's catalogue: the vectors of pr64, registered by name
                self.steerer.register_vector(f"pr{i}", self.vec(100 + i))
            # capture delivery as the caller sees it (RPC, the worker's take and pack, mapping the files), per call
            self.deliver_ms, take = 0.0, self.steerer.take_captures

            def timed_take(tags):
                t0 = time.perf_counter()
                try:
                    return take(tags)
                finally:
                    self.deliver_ms += (time.perf_counter() - t0) * 1e3
            self.steerer.take_captures = timed_take

    def prompts_for(self, batch: int, repeat: int | None) -> list[dict]:
        """``batch`` distinct random prompts, the same in every engine and mode: those of timed repeat ``repeat``
        (fresh each repeat), or with ``None`` the fixed ones of warm-up and verification. Fresh prompts per repeat
        keep prefix caching out of the comparison: no engine's prefill ever hits a block of an earlier call (the
        absent engine would otherwise reuse its prompt blocks every call, while the dynsteer engine's other modes
        salt theirs differently in between and evict them)."""
        rng = self.np.random.default_rng([batch] if repeat is None else [batch, 1 + repeat])
        return [{"prompt_token_ids": rng.integers(self.vocab // 100, self.vocab - 1, self.cfg["prompt_len"]).tolist()}
                for _ in range(batch)]

    def vec(self, seed: int):
        rng = self.np.random.default_rng(1000 + seed)
        return (rng.standard_normal(self.hidden) * TIMED_STD).astype(self.np.float32)

    # -- mode set-up ------------------------------------------------------------------------------------------------
    def policy(self, k: int, scale: float, force_open: bool, controller: bool):
        """Per-request / global dynamic policy ``k``; ``force_open`` (verification) opens the gate and latch on
        every token, so the gated vector must change the tokens."""
        from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule, SyncControllerSpec

        np = self.np
        mon_layer, act_layer = gate_places(self.num_layers)
        rng = np.random.default_rng(10 + k)
        probe = rng.standard_normal(self.hidden).astype(np.float32)
        probe /= np.linalg.norm(probe)
        mon = ProbeGate(name="m", layer=mon_layer, direction=probe, sharpness=4.0,
                      threshold=-1e6 if force_open else 0.0)
        act = Action(kind="add", layer=act_layer, vector=(rng.standard_normal(self.hidden) * TIMED_STD).astype(
            np.float32), scale=scale)
        ctrl = None
        if controller:
            on, off = (-1e6, -1e6) if force_open else (0.0, -0.5)
            ctrl = SyncControllerSpec(kind="ema_latch", alpha=0.3, on=on, off=off, scale=1.0)
        return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act])], controller=ctrl)

    def payloads(self, key: str, scale: float, force_open: bool) -> list[str]:
        """Per-request payloads (packed once, reused: a fixed catalogue, as in production traffic)."""
        memo = (key, scale, force_open)
        if memo not in self._payloads:
            from dynsteer import AddVector, SteeringSpec, encode_payload

            if key == "pr64n":
                out = [encode_payload(SteeringSpec(vectors=[AddVector(layer=self.layer, vector=f"pr{i}", scale=scale)]))
                       for i in range(64)]
            elif key.startswith("pr") and key[2:].isdigit():
                n = int(key[2:])
                out = [encode_payload(SteeringSpec(vectors=[AddVector(layer=self.layer, vector=self.vec(100 + i),
                                                                      scale=scale)])) for i in range(n)]
            elif key == "hwload":
                out = [encode_payload(SteeringSpec(vectors=[AddVector(layer=self.layer, vector=HOTWIRE_VECTOR_ID,
                                                                      scale=scale)]))]
            else:  # prdyn, sync
                out = [encode_payload(None, policy=self.policy(k, scale, force_open, key == "sync"))
                       for k in range(N_POLICIES)]
            self._payloads[memo] = out
        return self._payloads[memo]

    def prepare(self, key: str, batch: int, scale: float = 1.0, force_open: bool = False,
                max_tokens: int | None = None, repeat: int | None = None):
        """Set up ``key`` (outside the timed window); returns ``(call, teardown)``; ``call()`` is what is timed.

        ``scale`` multiplies every vector of the mode; ``force_open`` opens gates and latches on every token (both
        only for verification calls); ``repeat``: the timed repeat, whose fresh prompts the call uses."""
        from dynsteer import AddVector, CaptureSpec, SteeringSpec, steer_params

        base = self.params if max_tokens is None else self.params.clone()
        if max_tokens is not None:
            base.max_tokens = max_tokens
        prompts = self.prompts[batch] if repeat is None else self.prompts_for(batch, repeat)
        llm, st = self.llm, self.steerer
        params = base
        teardown = None
        key = re.sub(r"^[ibol]_", "", key)  # the inline, bare, base-checkout and 1-layer engines' modes: same workloads
        if key in ("static1", "static8"):
            layers = [self.layer] if key == "static1" else spread_layers(8, self.num_layers)
            st.apply_steering_spec(SteeringSpec(vectors=[AddVector(layer=l, vector=self.vec(10 + l), scale=scale)
                                                         for l in layers]))
            teardown = st.clear_all
        elif key == "gate":
            st.set_policy(self.policy(0, scale, force_open, controller=False))
            teardown = st.clear_policy
        elif key in ("pr1", "pr16", "pr64", "pr64n", "hwload", "prdyn", "sync"):
            bodies = self.payloads(key, scale, force_open)
            params = [steer_params(base, None, payload=bodies[i % len(bodies)]) for i in range(batch)]
        elif key == "hwsteered":
            spec = json.dumps({"id": HOTWIRE_VECTOR_ID, "layer": self.layer, "scale": scale})
            params = [base.clone() for _ in range(batch)]
            for p in params:
                p.extra_args = {**(p.extra_args or {}), "hotwire": spec}
        elif key == "hook":
            import functools

            # pickled by reference to this module (never __main__), so any vLLM process can unpickle it
            llm.apply_model(functools.partial(install_hook, self.layer, (self.vec(0) * scale).tolist()))
            teardown = lambda: llm.apply_model(functools.partial(remove_hook, self.layer))  # noqa: E731
        elif key == "capture":
            spec = CaptureSpec(sites=["post_block"], layers=[self.layer], positions="all_generated")
            want = base.max_tokens - 1  # the last token is never fed back: no residual

            def call():
                outs = st.generate(prompts, base, capture=spec, use_tqdm=False)
                assert all(o.capture is not None and len(o.capture.positions) == want for o in outs), "capture rows"
                return outs

            return call, None
        elif key in STREAM_OF_MODE:
            from dynsteer.monitor.client import MonitorClient
            from lib.stream_reader import FrameReader

            mcfg = self.cfg["dynsteer"]["monitor"]
            mon = MonitorClient(mcfg["endpoint"], mcfg["command_endpoint"], name="bench",
                                streams=[STREAM_OF_MODE[key]], policy="drop", max_pending=1 << 20, window=1024)
            reader = FrameReader(mon, on_bytes=self._count_stream_bytes)
            want = len(prompts) * (base.max_tokens - 1)

            def call():
                start = reader.rows
                outs = llm.generate(prompts, params, use_tqdm=False)
                reader.settle(start + want, poll_s=0.0005)
                self.stream_rows += reader.rows - start
                self.stream_rows_want += want
                # the every-layer stream is measured as it comes: what it delivers under drop is its result
                assert key.startswith("streamall") or reader.rows - start == want, \
                    f"stream rows {reader.rows - start} != {want}"
                return outs

            teardown = reader.close
            return call, teardown
        # per-request params are fresh clones every call (vLLM may annotate a request's params: never reuse them)
        return (lambda: llm.generate(prompts, params, use_tqdm=False)), teardown

    def _count_stream_bytes(self, nbytes: int) -> None:
        self.stream_bytes += nbytes

    def counters(self) -> dict | None:
        """dynsteer's worker counters (rank 0), for per-step host time."""
        if self.steerer is None:
            return None
        d = self.steerer.describe()[0]
        dyn = d.get("dynamic") or {}
        return {"steps": d["stats"]["steps"], "rows_written": d.get("rows_written", 0), **{k: dyn.get(k, 0) for k in (
            "dynamic_steps", "sync_steps", "host_sync_steps", "host_ms", "wait_ms", "controller_ms")},
            # capture delivery (the call's tail): time in take_captures and packing in the engine core, the spool
            # writer's queue, and the whole delivery in the caller
            **{k: d["stats"].get(k, 0) for k in ("takes", "take_ms", "take_backlog", "pack_ms")},
            "deliver_ms": self.deliver_ms, "stream_bytes": self.stream_bytes,
            "stream_rows": self.stream_rows, "stream_rows_want": self.stream_rows_want}


def install_hook(layer_idx: int, vector: list[float], model) -> int:
    """For ``LLM.apply_model``: a plain forward hook on decoder layer ``layer_idx`` adding ``vector`` to its output
    hidden states (vLLM's Llama layers return ``(hidden_states, residual)`` and the next layer adds them, so this adds
    to the residual stream after the layer, like hotwire's op and dynsteer's ``post_block``). Bound with
    ``functools.partial`` and pickled by reference to this module (importable as ``lib.overhead.workload`` where
    ``benchmarks/`` is on the path): vLLM pickles the callable again with plain ``pickle`` when its workers are
    processes of their own."""
    import torch

    layer = next(m for name, m in model.named_modules() if name.endswith(f"layers.{layer_idx}"))
    remove_hook(layer_idx, model)
    p = next(layer.parameters())
    vec = torch.tensor(vector, dtype=p.dtype, device=p.device)

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + vec,) + tuple(output[1:])
        return output + vec

    layer._overhead_bench_hook = layer.register_forward_hook(hook)
    return 1


def remove_hook(layer_idx: int, model) -> int:
    layer = next(m for name, m in model.named_modules() if name.endswith(f"layers.{layer_idx}"))
    handle = getattr(layer, "_overhead_bench_hook", None)
    if handle is not None:
        handle.remove()
        layer._overhead_bench_hook = None
    return 1


def llm_kwargs(cfg: dict) -> dict:
    """``vllm.LLM``'s arguments for an engine of configuration ``cfg`` (``lib.overhead.bench`` writes it)."""
    kw = dict(model=cfg["model_dir"], load_format=cfg["load_format"], skip_tokenizer_init=True, dtype=cfg["dtype"],
              max_model_len=cfg["max_model_len"], max_num_seqs=max(cfg["batches"]),
              max_num_batched_tokens=cfg["max_num_batched_tokens"], gpu_memory_utilization=cfg["gpu_util"],
              kv_cache_memory_bytes=cfg["kv_bytes"], seed=0, enforce_eager=cfg["eager"] or cfg["kind"] == "hook")
    if cfg.get("tp", 1) > 1:
        kw["tensor_parallel_size"] = cfg["tp"]
    if cfg.get("dynsteer") is not None:
        kw["additional_config"] = {"dynsteer": cfg["dynsteer"]}
    if cfg.get("timing_split"):  # vLLM's per-request timestamps (every engine alike): the call's phases
        kw["disable_log_stats"] = False
    if cfg.get("profile_dir"):
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": cfg["profile_dir"],
                                 "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True}
    return kw


def single_engine_cfg(model_dir: str, load_format: str, dtype: str, kv_bytes: int, batch: int, tokens: int,
                      eager: bool) -> dict:
    """The configuration of one dynsteer engine outside the engine farm (the dev scripts' single engines), for
    :func:`llm_kwargs` and :class:`Workload`: ``batch`` requests of 32-token prompts, ``tokens`` generated."""
    return dict(model_dir=str(model_dir), load_format=load_format, dtype=dtype, eager=eager, batches=[batch],
                tokens=tokens, prompt_len=32, max_model_len=256, kind="dynsteer", engine="dynsteer",
                max_num_batched_tokens=max(batch * 32, 512), gpu_util=0.92, kv_bytes=kv_bytes,
                dynsteer={"max_rows": batch + 34})


def worker(cfg: dict) -> None:
    """One engine. Reads ``{"op": ...}`` lines on stdin, answers ``RESULT {...}`` (or ``ERROR {...}``) lines."""
    # Results go to the original stdout; everything else written to fd 1 (vLLM, its engine core, profiler tables)
    # goes to the log with stderr, so it can never split a result line.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(tag: str, obj: dict) -> None:
        out.write(f"{tag} {json.dumps(obj)}\n")
        out.flush()

    if cfg["kind"] == "hotwire":  # hotwire reads its vectors from files at model load: write ours first
        import numpy as np
        import torch

        vec_dir = Path(tempfile.mkdtemp(prefix="hotwire-vectors-"))
        hidden = json.loads((Path(cfg["model_dir"]) / "config.json").read_text())["hidden_size"]
        rng = np.random.default_rng(1000)  # == Workload.vec(0), the vector of dynsteer's hotwire workload
        torch.save(torch.from_numpy((rng.standard_normal(hidden) * TIMED_STD).astype(np.float32)),
                   vec_dir / f"{HOTWIRE_VECTOR_ID}.pt")
        os.environ["HOTWIRE_VECTORS"] = str(vec_dir)
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(cfg))
    work = Workload(llm, cfg)
    import torch
    import vllm

    info = {"startup_s": round(time.perf_counter() - t0, 1), "torch": torch.__version__, "vllm": vllm.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "hotwire_loaded": "hotwire" in sys.modules, "dynsteer_loaded": _dynsteer_registered()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if work.steerer is not None:
        import dynsteer

        info["table_bytes"] = work.steerer.describe()[0]["table_bytes"]
        info["dynsteer_from"] = str(Path(dynsteer.__file__).resolve().parent)  # --base-checkout's engines: there
    reply("READY", info)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply("RESULT", handle(work, cmd))
        except Exception as exc:  # noqa: BLE001 - the parent decides; this engine may still serve other modes
            import traceback

            traceback.print_exc()
            reply("ERROR", {"error": f"{type(exc).__name__}: {exc}"[:2000]})


def timing_split(outs: list, m0: float, m1: float, tokens: int) -> dict | None:
    """A call's phases from vLLM's per-request timestamps (engine core, ``time.monotonic``, one clock per host):
    ``ramp_ms`` from the call's start until every request has its first token (request intake and prefills),
    ``step_ms`` the mean decode step after that (until the last request's last token), ``tail_ms`` from there until
    the call returns (finishing, outputs, the caller's work such as capture delivery). ``None`` without stats."""
    stats = [o.metrics for o in outs]
    if not stats or any(m is None or not getattr(m, "first_token_ts", 0.0) for m in stats):
        return None
    first = max(m.first_token_ts for m in stats)
    last = max(m.last_token_ts for m in stats)
    return {"ramp_ms": (first - m0) * 1e3, "step_ms": (last - first) * 1e3 / max(tokens - 1, 1),
            "tail_ms": (m1 - last) * 1e3}


def _dynsteer_registered() -> bool:
    mod = sys.modules.get("dynsteer.engine.plugin")
    return bool(mod is not None and getattr(mod, "_registered", False))


def handle(work: Workload, cmd: dict) -> dict:
    op, key, batch = cmd["op"], cmd.get("mode"), cmd.get("batch")
    if op == "run":  # timed; tokens returned on request (warm-up / verification)
        call, teardown = work.prepare(key, batch, cmd.get("scale", 1.0), cmd.get("force_open", False),
                                      repeat=cmd.get("repeat"))
        before = work.counters()
        try:
            m0 = time.monotonic()
            t0 = time.perf_counter()
            outs = call()
            seconds = time.perf_counter() - t0
            m1 = time.monotonic()
        finally:
            if teardown is not None:
                teardown()
        after = work.counters()
        assert all(len(o.outputs[0].token_ids) == work.params.max_tokens for o in outs), "short output"
        res: dict = {"s": seconds}
        split = timing_split(outs, m0, m1, work.params.max_tokens)
        if split is not None:
            res["split"] = split
        if before is not None:
            res["counters"] = {k: after[k] - before[k] for k in after}
        if cmd.get("tokens"):
            res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        return res
    if op == "profile":
        pdir = Path(work.cfg["profile_dir"])
        seen = set(os.listdir(pdir)) if pdir.exists() else set()
        call, teardown = work.prepare(key, batch, max_tokens=cmd["tokens"])
        work.llm.start_profile()
        try:
            call()
        finally:
            work.llm.stop_profile()
            if teardown is not None:
                teardown()
        stem = f"{work.cfg['engine']}--{slug(key)}-b{batch}"
        files = []
        for name in sorted(set(os.listdir(pdir)) - seen):  # this call's trace and table: give them our names
            src = pdir / name
            if src.is_file():
                dst = pdir / (f"{stem}.txt" if name.endswith(".txt") else
                              f"{stem}.pt.trace.json" + (".gz" if name.endswith(".gz") else ""))
                src.rename(dst)
                files.append(dst.name)
        return {"files": files}
    raise ValueError(f"unknown op {op!r}")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
