"""``overhead.py``'s run: which engines (those the modes need, that fit in GPU memory), their start-up, warm-up and
verification, the timed repeats in rotating order, the profiles, and the report's JSON (module docstring of
``overhead.py``)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from lib.engines import (EngineDied, EngineFarm, find_wheel, gpu_memory, install_hotwire,
                         kv_bytes_per_token, shape_config, visible_plugins, weight_bytes)
from lib.overhead.modes import (BY_KEY, CLONES, ENGINE_KIND, ENGINES, VERIFY_ESCALATION, gate_places, spread_layers,
                                steer_layer)
from lib.overhead.report import comparisons, pooled, split_report, step_lists
from lib.report import git_sha, host_facts, save_json, utc_now
from lib.traces import summarize_trace

BENCHMARKS = Path(__file__).resolve().parents[2]
REPO = BENCHMARKS.parent
SCRIPT = BENCHMARKS / "overhead.py"  # every engine is ``overhead.py --worker <config>``


class Bench:
    """One run: which engines, their start-up, warm-up and verification, the timed repeats, the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.perf_counter()
        self.budget_s = args.max_minutes * 60
        self.out_dir = Path(args.out or (tempfile.mkdtemp(prefix="overhead-smoke-") if args.cpu_smoke else
                                         BENCHMARKS / "results"))
        self.work_dir = Path(tempfile.mkdtemp(prefix="overhead-run-"))
        print(f"engine logs and scratch: {self.work_dir}", flush=True)
        if args.model_dir:
            self.model_dir = Path(args.model_dir)
        elif args.cpu_smoke:
            from dynsteer.testing.tiny_models import tiny_model

            self.model_dir = tiny_model("llama")
        else:
            self.model_dir = self.work_dir / f"{args.shape}-shape"
            self.model_dir.mkdir()
            (self.model_dir / "config.json").write_text(json.dumps(shape_config(args.shape, args.layers)))
        self.mcfg = json.loads((self.model_dir / "config.json").read_text())
        self.num_layers = self.mcfg["num_hidden_layers"]
        self.dtype_bytes = 4 if args.dtype in ("float32", "float") else 2
        max_batch = max(args.batches)
        self.max_model_len = -(-(args.prompt_len + args.tokens + 16) // 16) * 16
        # enough KV for the largest batch (and a margin), whatever the memory left on the device; per rank (vLLM's
        # kv_cache_memory_bytes is per GPU)
        self.kv_bytes = max(int(kv_bytes_per_token(self.mcfg, self.dtype_bytes, args.tp) * max_batch
                                * (self.max_model_len + 32) * 1.1), 256 << 20)
        self.modes: list[str] = list(args.modes)
        self.engines: list[str] = []
        self.skipped: dict[str, str] = {}
        self.envs: dict[str, dict] = {}
        self.plugins: dict[str, list[str]] = {}
        self.cfgs: dict[str, dict] = {}
        self.farm = EngineFarm(SCRIPT, self.work_dir)
        self.live = self.farm.live  # the engines up and not dead
        self.hotwire_dir: Path | None = None
        self.hotwire_version: str | None = None
        self.device = "?"
        self.info0: dict = {}
        self.startup_s = 0.0
        self.seconds: dict[str, dict[str, list[float]]] = {}
        self.host: dict[str, dict[str, Counter]] = defaultdict(dict)
        self.splits: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        # per timed call: CPU seconds per wall second of the frontend and the engine core (host-bound steps show
        # as an engine core near 1.0)
        self.cpu_busy: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        self.errors: dict[str, str] = {}
        self.verification: dict[str, dict] = {}
        self.profiles: dict = {}
        self.stacks: dict = {}  # --py-spy: per (mode, batch), each process's threads
        self.affinity: dict = {}
        self.host_facts = host_facts()
        self.burn_in_calls: dict[str, dict[str, list[dict]]] = {}
        self.repeats_done, self.stopped_early = 0, False
        self.date = utc_now()
        self.json_path = self.out_dir / "overhead.json"  # named once the device is known

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    # -- engines ------------------------------------------------------------------------------------------------------
    def choose_engines(self) -> None:
        """The engines the modes need and were asked for, their environments (hotwire on its engine's path only),
        and those that fit in GPU memory."""
        args = self.args
        need = [e for e in ENGINES if any(BY_KEY[k].engine == e for k in self.modes)]
        engines = [e for e in need if not args.engines or e in args.engines or e in ("absent", "absent2")]
        self.skipped.update({e: "not requested (--engines)" for e in need if e not in engines})
        if not args.base_checkout:
            self.skipped.update({e: "no --base-checkout" for e in engines if e.startswith("dynsteer-base")})
            engines = [e for e in engines if not e.startswith("dynsteer-base")]
        if "hotwire" in engines:
            self._install_hotwire()
        env_base = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false"}
        if args.cpu_smoke:  # as tests/conftest.py builds CPU engines
            env_base.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
            if args.tp == 2:  # two CPU workers, one core each, spawned (tests/conftest.py's cpu_tp_env)
                env_base.update(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_WORKER_MULTIPROC_METHOD="spawn")
        for e in ENGINES:
            env = dict(env_base)
            path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "hotwire-site" not in p]
            if e == "hotwire" and self.hotwire_dir is not None:
                path.insert(0, str(self.hotwire_dir))
            if e.startswith("dynsteer-base") and args.base_checkout:  # its dynsteer (and plugin entry) from there
                path.insert(0, str(Path(args.base_checkout).resolve()))
            env["PYTHONPATH"] = os.pathsep.join(path)
            if ENGINE_KIND[e] != "dynsteer":
                env["DYNSTEER_DISABLE"] = "1"
            if e == "hook":  # apply_model pickles the hook installer; its processes import it from benchmarks/
                env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
                env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS)] + path)
            self.envs[e] = env
        for e in engines + (["hotwire"] if self.hotwire_dir is not None and "hotwire" not in engines else []):
            seen = visible_plugins(self.envs[e])
            if e != "hotwire" and "hotwire" in seen:  # installed globally: keep it out by vLLM's allow-list
                self.envs[e]["VLLM_PLUGINS"] = ",".join(p for p in seen if p != "hotwire")
                seen = [p for p in seen if p != "hotwire"] + ["(hotwire excluded by VLLM_PLUGINS)"]
            self.plugins[e] = seen
        if self.hotwire_dir is not None and "hotwire" not in self.plugins.get("hotwire", []):
            self.skipped.setdefault("hotwire", f"its entry point is not visible ({self.plugins.get('hotwire')})")
        print(f"vllm.general_plugins visible per engine: {self.plugins}", flush=True)
        engines = [e for e in engines if e not in self.skipped]
        gpu = None if args.cpu_smoke else gpu_memory(args.tp)
        if gpu is None and not args.cpu_smoke and args.tp > 1:
            sys.exit(f"--tp {args.tp}: fewer than {args.tp} GPUs visible")
        if gpu is not None:  # keep what fits, in priority order; every engine's ranks share the same GPUs
            name, total, free = gpu
            per = weight_bytes(self.mcfg, self.dtype_bytes, args.tp) + self.kv_bytes + (3 << 30) // 2
            per += (1 << 30) if args.tp > 1 else 0  # NCCL's and the custom all-reduce's buffers per rank
            room, kept = free * 0.95, []
            for e in engines:
                need_b = per + ((1 << 30) if ENGINE_KIND[e] == "dynsteer" else 0)  # + dynsteer's tables
                if room >= need_b:
                    kept.append(e)
                    room -= need_b
                else:
                    self.skipped[e] = (f"does not fit in GPU memory ({free / 2**30:.0f} GiB free, ~"
                                       f"{need_b / 2**30:.0f} GiB per engine and GPU; fewer --layers would fit "
                                       "more engines)")
            engines = kept
            print(f"{name}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free; engines {engines}", flush=True)
        if "absent" not in engines or "absent2" not in engines:
            sys.exit("the absent engines cannot run: nothing to compare with")
        self.engines = engines
        for k in self.modes:
            if BY_KEY[k].engine not in engines:
                print(f"mode {k!r} not run: engine {BY_KEY[k].engine} skipped ({self.skipped[BY_KEY[k].engine]})")
        self.modes = [k for k in self.modes if BY_KEY[k].engine in engines]

    def _install_hotwire(self) -> None:
        wheel = find_wheel(self.args.hotwire_wheel, REPO)
        if wheel is None:
            self.skipped["hotwire"] = "no wheel (--hotwire-wheel)"
            return
        self.hotwire_dir, msg = install_hotwire(wheel, self.work_dir)
        if self.hotwire_dir is None:
            self.skipped["hotwire"] = msg
            return
        m = re.search(r"hotwire_vllm-([^-]+)", wheel.name)
        self.hotwire_version = m.group(1) if m else "?"
        print(f"hotwire {self.hotwire_version}: {msg} into {self.hotwire_dir}", flush=True)
        if self.args.cpu_smoke:
            self.skipped["hotwire"] = ("CPU: hotwire's steering op is a Triton kernel (CUDA only); wheel install "
                                       "and entry-point visibility checked only")

    def start_engines(self) -> None:
        """All at once (``absent2`` once ``absent`` is up, to read its compile cache rather than race to write it),
        or one after another with ``--serial-start``."""
        args = self.args
        base = dict(model_dir=str(self.model_dir), load_format=args.load_format, dtype=args.dtype, eager=args.eager,
                    batches=args.batches, tokens=args.tokens, prompt_len=args.prompt_len,
                    max_model_len=self.max_model_len,
                    max_num_batched_tokens=max(max(args.batches) * args.prompt_len, self.max_model_len, 512),
                    gpu_util=args.gpu_util, kv_bytes=self.kv_bytes, verify_scale=args.verify_scale,
                    timing_split=args.timing_split, tp=args.tp)
        for e in self.engines:
            dyn = None
            if ENGINE_KIND[e] == "dynsteer":
                from dynsteer.config import MonitorConfig

                # default DynsteerConfig but for rows: every mode's configurations at once (module docstring)
                dyn = {"max_rows": max(64, max(args.batches) + 2) + 32}
                if e == "dynsteer-inline":
                    dyn.update(forward="inline")
                if e == "dynsteer-bare":  # nothing hooked: the plugin's glue around vLLM's own forward
                    dyn.update(layers=[], require=False)
                if e == "dynsteer-1layer":
                    dyn.update(layers=[steer_layer(self.num_layers)])
                if e in ("dynsteer-capture", "dynsteer-base-capture"):
                    layer = steer_layer(self.num_layers)
                    # the async tier's stream of the same place: costs nothing until a monitor subscribes (mode
                    # "stream" runs one in the engine's process, reading every frame)
                    mon = MonitorConfig.private(streams={"resid": {"places": [f"{layer}.post_block"]}})
                    dyn.update(capture_sites=["post_block"], capture_layers=[layer],
                               monitor=mon.model_dump(mode="json"))
                if e == "dynsteer-stream":
                    # capture buffers at every layer; a monitor subscribes to 8 of them (mode stream8) or to all
                    every = list(range(self.num_layers))
                    mon = MonitorConfig.private(streams={
                        "resid8": {"places": [f"{l}.post_block" for l in spread_layers(8, self.num_layers)]},
                        "residall": {"places": [f"{l}.post_block" for l in every]},
                        "residall16": {"places": [f"{l}.post_block" for l in every], "dtype": "bfloat16"}})
                    dyn.update(capture_sites=["post_block"], capture_layers=every, monitor=mon.model_dump(mode="json"))
            self.cfgs[e] = dict(base, engine=e, kind=ENGINE_KIND[e], dynsteer=dyn,
                                profile_dir=str(self.work_dir / "profile" / e) if args.profile else None)
        failed = self.farm.start({e: self.cfgs[e] for e in self.engines}, self.envs, CLONES, args.start_timeout,
                                 serial=args.serial_start, first="absent")
        if "hotwire" in self.live and not self.live["hotwire"].info.get("hotwire_loaded"):
            print("hotwire: warning: the plugin module is not loaded in the frontend process", flush=True)
        for e, why in failed.items():
            self.skipped[e] = "failed to start: " + why.splitlines()[0][:200]
        if "absent" not in self.live or "absent2" not in self.live:
            self.close()
            sys.exit("the absent engines did not start")
        self.modes = [k for k in self.modes if BY_KEY[k].engine in self.live]
        self.seconds = {k: {str(b): [] for b in args.batches} for k in self.modes}
        if args.pin_cores:
            self.affinity = self.farm.pin(*args.pin_cores)
            print(f"engines pinned (frontend / engine core cores): {self.affinity}", flush=True)
        self.startup_s = self.elapsed()
        self.info0 = self.live["absent"].info
        self.device = self.info0["device"]
        suffix = "-reduced" if args.reduced else ("-cpu-smoke" if args.cpu_smoke else "")
        self.json_path = self.out_dir / (f"overhead-{self.device.replace(' ', '_')}-"
                                         f"{dt.date.today().isoformat()}{suffix}.json")
        print(f"all engines up after {self.startup_s:.0f} s on {self.device}", flush=True)

    def run(self, k: str, batch: int, fatal: bool = True, **extra) -> dict | None:
        """One call of mode ``k``; ``None`` if it failed: the mode is then dropped (unless not ``fatal``: a
        verification call), or the engine's modes if it died."""
        name = BY_KEY[k].engine
        if name not in self.live or k in self.errors:
            return None
        try:  # the reply's cpu_busy: how busy the frontend and the engine core were over the call
            res = self.farm.call(name, {"op": "run", "mode": k, "batch": batch, **extra}, self.args.run_timeout)
        except EngineDied as exc:  # its modes stop here (the farm dropped it); the others go on
            for m in self.modes:
                if BY_KEY[m].engine == name:
                    self.errors.setdefault(m, f"engine died: {str(exc)[:300]}")
            print(f"{name}: died\n{exc}", flush=True)
            return None
        if "error" in res:
            print(f"{k}: error: {res['error']}", flush=True)
            if not fatal:
                return res
            self.errors[k] = res["error"]
            return None
        return res

    # -- measurement --------------------------------------------------------------------------------------------------
    def warm_up_and_verify(self) -> None:
        """One call per (mode, batch): first-call costs, and the greedy tokens compared with ``absent``'s."""
        args = self.args
        for batch in args.batches:
            ref = (self.run("absent", batch, tokens=True) or {}).get("tokens")
            for k in self.modes[1:]:
                res = self.run(k, batch, tokens=True)
                if res is None or ref is None:
                    continue
                changed = sum(a != b for a, b in zip(res["tokens"], ref))
                entry = {"requests": len(ref), "changed_timed": changed}
                # the timed vectors too small to move these tokens: the same mode with bigger vectors, gates open
                for scale in ([args.verify_scale * f for f in VERIFY_ESCALATION] if BY_KEY[k].steers else []):
                    if entry.get("changed_verify", changed) == len(ref):
                        break
                    ver = self.run(k, batch, fatal=False, tokens=True, scale=scale, force_open=True)
                    if ver is None or "error" in ver:
                        entry["verify_error"] = (ver or {}).get("error", "engine died")
                        break
                    entry.update(changed_verify=sum(a != b for a, b in zip(ver["tokens"], ref)), verify_scale=scale)
                self.verification.setdefault(k, {"per_batch": {}})["per_batch"][str(batch)] = entry
        for k, v in self.verification.items():
            per = v["per_batch"].values()
            if BY_KEY[k].steers:
                v["steering_changed_tokens"] = all(max(e["changed_timed"], e.get("changed_verify", 0))
                                                   == e["requests"] for e in per)
            else:
                v["steering_changed_tokens"] = None
                v["tokens_equal_absent"] = all(e["changed_timed"] == 0 for e in per)
        print(f"warm-up and verification done after {self.elapsed():.0f} s", flush=True)

    def order(self, i: int) -> list[str]:
        """The modes still running, rotated by ``i``: repeat ``i``'s order within each batch size."""
        plan = [k for k in self.modes if k not in self.errors]
        return plan[i % len(plan):] + plan[:i % len(plan)]

    def burn_in(self) -> None:
        """``--burn-in`` untimed repeats before the timed ones (every mode and batch, rotated the same way, prompts
        of their own): their calls' seconds and decode steps are kept in the report (``burn_in_calls``), out of
        every comparison."""
        for i in range(self.args.burn_in):
            t0 = time.perf_counter()
            for batch in self.args.batches:
                for k in self.order(i):
                    res = self.run(k, batch, repeat=10_000 + i)
                    if res is not None:
                        self.burn_in_calls.setdefault(k, {}).setdefault(str(batch), []).append(
                            {"s": res["s"], "step_ms": res["split"]["step_ms"] if res.get("split") else None})
            print(f"burn-in repeat {i + 1}/{self.args.burn_in} done in {time.perf_counter() - t0:.0f} s", flush=True)

    def measure(self) -> None:
        """Timed repeats: every (engine, mode) once per batch size, in an order rotated by one each repeat; no
        repeat starts that would end past the budget (one always runs); the JSON is rewritten after each."""
        args = self.args
        reserve_s = 30 + (10 * len(self.modes) if args.profile else 0)  # report, plot (and the profile calls)
        last_s = 0.0
        for rep in range(args.repeats):
            if self.budget_s and rep >= 1 and self.elapsed() + last_s * 1.1 + reserve_s > self.budget_s:
                self.stopped_early = True
                print(f"--max-minutes: stopping after {rep} repeats ({self.elapsed():.0f} s used)", flush=True)
                break
            t0 = time.perf_counter()
            for batch in args.batches:
                for k in self.order(rep):
                    res = self.run(k, batch, repeat=rep)
                    if res is None:
                        continue
                    self.seconds[k][str(batch)].append(res["s"])
                    if "split" in res:
                        self.splits[k][str(batch)].append(res["split"])
                    if "counters" in res:
                        self.host[k].setdefault(str(batch), Counter()).update(res["counters"])
                    if "cpu_busy" in res:
                        self.cpu_busy[k][str(batch)].append(res["cpu_busy"])
            for per in self.seconds.values():  # a mode that failed mid-repeat: keep the lists aligned by repeat
                for xs in per.values():
                    del xs[self.repeats_done + 1:]
            self.repeats_done += 1
            last_s = time.perf_counter() - t0
            self.save(self.report())
            print(f"repeat {rep + 1}/{args.repeats} done in {last_s:.0f} s", flush=True)

    def profile(self) -> None:
        """vLLM's torch profiler over one short call per (engine, mode); traces and summaries under the output."""
        args = self.args
        if self.budget_s and self.elapsed() + 30 > self.budget_s:
            print("--profile skipped: budget spent", flush=True)
            return
        batches = args.profile_batch or [max(args.batches)]
        dest = self.out_dir / f"{self.json_path.stem}-profile"
        dest.mkdir(parents=True, exist_ok=True)
        for batch in batches:
            for k in [k for k in self.modes if k not in self.errors]:
                key = k if len(batches) == 1 else f"{k}@b{batch}"
                eng = self.live.get(BY_KEY[k].engine)
                if eng is None:
                    continue
                try:
                    res = eng.call({"op": "profile", "mode": k, "batch": batch, "tokens": args.profile_tokens},
                                   args.run_timeout)
                except EngineDied as exc:
                    self.profiles[key] = {"error": str(exc)[:300]}
                    continue
                if "error" in res:
                    self.profiles[key] = {"error": res["error"]}
                    continue
                entry: dict = {"batch": batch, "files": res["files"]}
                for name in res["files"]:
                    shutil.copy2(Path(self.cfgs[eng.name]["profile_dir"]) / name, dest / name)
                    if ".pt.trace.json" in name:
                        try:
                            entry["summary"] = summarize_trace(dest / name, args.profile_tokens)
                        except Exception as exc:  # noqa: BLE001 - a trace we cannot read must not cost the report
                            entry["summary_error"] = repr(exc)
                self.profiles[key] = entry
        (dest / "summary.json").write_text(json.dumps(self.profiles, indent=1))
        print(f"profiles: {dest}", flush=True)

    def spy(self) -> None:
        """py-spy over one call per (engine, mode) at each ``--profile-batch``: where each process's threads spend
        their samples (``stacks`` in the report; gzipped raw files in the scratch folder, or beside the report with
        ``--py-spy-raw``). Not timed: sampling slows what it watches."""
        from lib.pyspy import Sampler, print_summaries

        args = self.args
        dest = (self.out_dir if args.py_spy_raw else self.work_dir) / f"{self.json_path.stem}-pyspy"
        sampler = Sampler(args.py_spy, dest, rate=args.py_spy_rate, mode=args.py_spy_mode)
        for batch in args.profile_batch or [max(args.batches)]:
            for k in [k for k in self.modes if k not in self.errors]:
                if self.budget_s and self.elapsed() + 30 > self.budget_s:
                    print("--py-spy stopped: budget spent", flush=True)
                    return
                eng = self.live.get(BY_KEY[k].engine)
                if eng is None:
                    continue
                sampler.start(eng.proc.pid, f"{k}-b{batch}")
                stacks: dict = {}
                try:
                    res = self.run(k, batch, fatal=False)
                finally:
                    stacks = sampler.stop()
                key = f"{k}@b{batch}"
                self.stacks[key] = {"s": (res or {}).get("s"), "processes": stacks}
                print_summaries(f"py-spy {key}", stacks)

    # -- report -------------------------------------------------------------------------------------------------------
    def report(self) -> dict:
        args = self.args
        secs = {k: v for k, v in self.seconds.items() if any(v.values())}
        comps = comparisons(secs, self.modes, args.batches)
        aa = comps.get("A/A control: absent2 vs absent", {}).get("per_batch", {})
        aa_pct = {b: c["median"] for b, c in aa.items() if c}
        info = self.info0
        model = (str(args.model_dir) if args.model_dir else "tiny random Llama (CPU smoke)" if args.cpu_smoke
                 else f"{args.shape} shape, {self.num_layers} layers")
        return {
            "benchmark": "overhead", "date": self.date, "device": self.device,
            "versions": {"torch": info.get("torch"), "vllm": info.get("vllm"), "triton": info.get("triton"),
                         "dynsteer": git_sha(), "hotwire": self.hotwire_version, "python": sys.version.split()[0]},
            "args": {k: v for k, v in vars(args).items() if k != "worker"},
            "model": f"{model}, load_format={args.load_format}, {args.dtype}, "
                     + ("eager" if args.eager else "CUDA graphs on") + (f", TP={args.tp}" if args.tp > 1 else ""),
            "tensor_parallel_size": args.tp,
            "engines": {e: {"kind": ENGINE_KIND[e], "dynsteer_config": self.cfgs[e]["dynsteer"],
                            "plugins_visible": self.plugins.get(e),
                            "startup_s": self.live[e].info.get("startup_s") if e in self.live else None,
                            "table_bytes": self.live[e].info.get("table_bytes") if e in self.live else None,
                            "dynsteer_from": self.live[e].info.get("dynsteer_from") if e in self.live else None}
                        for e in self.cfgs},
            "skipped": self.skipped, "errors": self.errors, "affinity": self.affinity or None,
            "burn_in_calls": self.burn_in_calls or None,
            "modes": {k: {"label": BY_KEY[k].label, "engine": BY_KEY[k].engine, "steers": BY_KEY[k].steers,
                          "target_pct": BY_KEY[k].target, "vs": BY_KEY[k].vs} for k in self.modes},
            "layers": {"steered": steer_layer(self.num_layers), "static_8": spread_layers(8, self.num_layers),
                       "monitor_and_gated": list(gate_places(self.num_layers))},
            "kv_cache_memory_bytes": self.kv_bytes, "max_model_len": self.max_model_len,
            "repeats_done": self.repeats_done, "stopped_early_by_budget": self.stopped_early,
            "elapsed_s": round(self.elapsed(), 1), "startup_s": round(self.startup_s, 1),
            "aa_pct": aa_pct, "aa_max_abs_pct": max((abs(v) for v in aa_pct.values()), default=None),
            "overhead_pct": comps,
            "tokens_per_s": {k: {b: round(int(b) * args.tokens / statistics.median(v), 1) for b, v in per.items() if v}
                             for k, per in secs.items()},
            "steering_changed_tokens": {k: v["steering_changed_tokens"] for k, v in self.verification.items()},
            "verification": self.verification,
            "host_counters": self.host,
            "host": self.host_facts,
            "cpu_busy_repeats": self.cpu_busy or None,
            "timing_split": split_report(self.splits, self.modes) if self.splits else None,
            "timing_split_repeats": self.splits or None,
            # the same comparisons on the decode step alone (steady state, request intake and tail left out)
            "step_overhead_pct": comparisons(step_lists(self.splits), self.modes, args.batches) if self.splits
            else None,
            "pooled_step_overhead_pct": pooled(step_lists(self.splits), self.modes, args.batches) if self.splits
            else None,
            "profile": self.profiles or None,
            "stacks": self.stacks or None,
            "seconds": secs,
            "seconds_by_engine": {e: {k: secs[k] for k in secs if BY_KEY[k].engine == e} for e in self.cfgs},
        }

    def save(self, report: dict) -> None:
        save_json(self.json_path, report)

    def close(self) -> None:
        self.farm.close()
