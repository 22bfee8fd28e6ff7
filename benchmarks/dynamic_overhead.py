"""Dynamic-steering and capture overhead on GPU, as ratios to dynsteer absent, measured in one run.

An 8B-shaped Llama (``load_format="dummy"``) generates 128 tokens at decode batches 1, 16 and 64 with CUDA graphs on.
Two engines run in fresh interpreters: dynsteer absent, and dynsteer loaded with the dynamic tier (``max_gates=2``)
and capture buffers at one place. The loaded engine is measured in several modes, switched between runs:

* ``idle``: nothing set (the cost of the hooks, the dynamic tables and the capture buffers);
* ``capture``: every request captures ``all_generated`` at the capture place (rows copied out every step);
* ``global gate``: a global policy, monitor at the middle layer (16), a gated vector 4 layers later, the gate open on
  about half the tokens;
* ``per-request``: four different policies (probe, threshold) spread over the batch, one per request;
* ``sync``: per-request policies with an EMA-latch sync controller (on the device by default: ``--sync-tier host``
  runs a second loaded engine whose controllers run in Python on the host, which waits for every step).

The sync tier's own host cost is also read from the workers' counters: time per step spent staging, in read-back
bookkeeping (and host-tier controllers), and waiting for the previous step.

    PYTHONPATH=/opt/vllm-site python3 benchmarks/dynamic_overhead.py --out benchmarks/results

Results: ``benchmarks/results/dynamic_overhead-<device>-<date>.json`` (+ a markdown table on stdout).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_overhead import LLAMA3_8B, add_common_args, print_table_head, run_worker, write_report  # noqa: E402

TARGETS_PCT = {"idle (capture enabled)": 0.3, "global gate": 1.0, "per-request": 1.5}
MODES = ["idle", "capture", "global gate", "per-request", "sync"]


def places(num_layers: int) -> tuple[int, int]:
    """Monitor (and capture) layer, and the layer the gated vector steers."""
    return num_layers // 2, min(num_layers - 1, num_layers // 2 + 4)


def engine_config(sites: list[str], num_layers: int, sync_tier: str = "device") -> dict:
    return {"sites": sites, "max_gates": 2, "capture_sites": ["post_block"],
            "capture_layers": [places(num_layers)[0]], "sync_tier": sync_tier}


def policies(hidden: int, num_layers: int, n: int, controller: bool):
    """``n`` policies with different probes and thresholds; the gate opens on roughly half the tokens."""
    import numpy as np

    from dynsteer import Action, DynamicSteeringPolicy, Monitor, Rule, SyncControllerSpec

    mon_layer, act_layer = places(num_layers)
    out = []
    for i in range(n):
        rng = np.random.default_rng(10 + i)
        probe = rng.standard_normal(hidden).astype(np.float32)
        probe /= np.linalg.norm(probe)
        mon = Monitor(name="m", layer=mon_layer, direction=probe, sharpness=4.0, threshold=0.0)
        act = Action(kind="add", layer=act_layer, vector=rng.standard_normal(hidden).astype(np.float32) * 0.01)
        ctrl = SyncControllerSpec(kind="ema_latch", alpha=0.3, on=0.0, off=-0.5, scale=1.0) if controller else None
        out.append(DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act])], controller=ctrl))
    return out


def worker(args: argparse.Namespace) -> None:
    """One engine; prints a JSON line with tokens/s per (mode, batch) and the sync counters."""
    import numpy as np
    from vllm import LLM, SamplingParams

    loaded = args.mode != "absent"
    tier = "host" if args.mode == "loaded-host" else "device"
    model_cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    num_layers, vocab = model_cfg["num_hidden_layers"], model_cfg["vocab_size"]
    extra = {"additional_config": {"dynsteer": engine_config(args.sites, num_layers, tier)}} if loaded else {}
    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=1024, max_num_seqs=max(args.batches), gpu_memory_utilization=0.85, seed=0, **extra)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    results: dict[str, dict[str, float]] = {}
    runs: dict[str, dict[str, list[float]]] = {}
    sync: dict[str, dict[str, float]] = {}
    if not loaded:
        modes = ["absent"]
    else:
        import dynsteer
        from dynsteer import CaptureSpec

        steerer = dynsteer.attach(llm)
        modes = [m for m in args.modes if m in MODES] if tier == "device" else ["sync"]
        capture = CaptureSpec(sites=["post_block"], layers=[places(num_layers)[0]], positions="all_generated")
    for mode in modes:
        results[mode] = {}
        for batch in args.batches:
            prompts = [{"prompt_token_ids": rng.integers(vocab // 100, vocab - 1, args.prompt_len).tolist()}
                       for _ in range(batch)]

            def run() -> list:
                if mode in ("absent", "idle", "global gate"):
                    return llm.generate(prompts, params, use_tqdm=False)
                if mode == "capture":
                    return steerer.generate(prompts, params, capture=capture, use_tqdm=False)
                pols = policies(steerer.hidden_size, num_layers, 4, controller=mode == "sync")
                return steerer.generate(prompts, params, policy=[pols[i % 4] for i in range(batch)], use_tqdm=False)

            if mode == "global gate":
                steerer.set_policy(policies(steerer.hidden_size, num_layers, 1, controller=False)[0])
            run()  # warm-up (and graph capture for this size)
            before = steerer.describe()[0]["dynamic"] if loaded else None
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = run()
                times.append(time.perf_counter() - t0)
                assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
                if mode == "capture":
                    assert all(o.capture is not None and len(o.capture.positions) == args.tokens - 1 for o in outs)
            if loaded:
                after = steerer.describe()[0]["dynamic"]
                steps = max(after["dynamic_steps"] - before["dynamic_steps"], 1)
                sync[f"{label(mode, tier)}/{batch}"] = {
                    "steps": after["dynamic_steps"] - before["dynamic_steps"],
                    "sync_steps": after["sync_steps"] - before["sync_steps"],
                    "host_sync_steps": after["host_sync_steps"] - before["host_sync_steps"],
                    "host_ms_per_step": (after["host_ms"] - before["host_ms"]) / steps,
                    "wait_ms_per_step": (after["wait_ms"] - before["wait_ms"]) / steps,
                    "controller_ms_per_step": (after["controller_ms"] - before["controller_ms"]) / steps}
                steerer.clear_policy()
            results[mode][str(batch)] = batch * args.tokens / statistics.median(times)
            runs.setdefault(label(mode, tier), {})[str(batch)] = times
    results = {label(m, tier) if loaded else m: v for m, v in results.items()}
    print("RESULT " + json.dumps({"tokens_per_s": results, "sync": sync, "seconds": runs}), flush=True)


def label(mode: str, tier: str) -> str:
    return f"{mode} (host tier)" if tier == "host" else mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--sites", nargs="+", default=["post_block"], help="DynsteerConfig.sites of the loaded engine")
    ap.add_argument("--worker", choices=["absent", "loaded", "loaded-host"], dest="mode")
    ap.add_argument("--modes", nargs="+", default=MODES, help="modes of the loaded engine")
    ap.add_argument("--sync-tier", nargs="+", default=["device"], choices=["device", "host"],
                    help="engines to load: the device sync tier and/or the host one (a second engine)")
    ap.add_argument("--model-dir", help="a model directory (default: a fresh Llama-3-8B-shaped config.json)")
    args = ap.parse_args()
    if args.mode:
        return worker(args)

    import torch

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        model_dir = Path(tempfile.mkdtemp(prefix="llama8b-shape-"))
        (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    results: dict[str, dict[str, float]] = {}
    sync: dict = {}
    seconds: dict = {}
    workers = ["absent"] + ["loaded" if t == "device" else "loaded-host" for t in args.sync_tier]
    for mode in workers:
        got = run_worker(__file__, mode, mode, model_dir, args, ["--sites", *args.sites, "--modes", *args.modes])
        results.update(got["tokens_per_s"])
        sync.update(got["sync"])
        seconds.update(got.get("seconds", {}))
    base = results["absent"]
    overhead = {m: {b: round((base[b] / results[m][b] - 1) * 100, 3) for b in base} for m in results if m != "absent"}
    import vllm

    report = {
        "benchmark": "dynamic_overhead", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "vllm": vllm.__version__,
        "model": str(args.model_dir or "Llama-3-8B shape") + ", load_format=dummy, bf16, CUDA graphs on", "output_tokens": args.tokens,
        "prompt_tokens": args.prompt_len, "repeats": args.repeats, "engine_config": engine_config(args.sites, num_layers),
        "tokens_per_s": results, "overhead_pct_vs_absent": overhead, "sync_counters": sync, "seconds": seconds,
        "targets_pct": TARGETS_PCT,
    }
    path = write_report(report, args.out)
    print_table_head("mode", list(base))
    print("| absent (tok/s) | " + " | ".join(f"{base[b]:.0f}" for b in base) + " |")
    for m, rs in overhead.items():
        print(f"| {m} (overhead %) | " + " | ".join(f"{v:+.2f}" for v in rs.values()) + " |")
    for key, c in sync.items():
        if c["steps"]:
            print(f"{key}: read-back/controllers {c['controller_ms_per_step']:.4f} ms/step, staging "
                  f"{c['host_ms_per_step']:.4f} ms/step, waiting {c['wait_ms_per_step']:.4f} ms/step, sync steps "
                  f"{c['sync_steps']} (host-tier {c['host_sync_steps']})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
