"""Capture overhead on GPU: what enabling capture costs when nobody captures, and what capturing traffic costs.

Three engines of an 8B-shaped Llama (``load_format="dummy"``, bf16, CUDA graphs on) stay alive side by side on one
GPU, each in its own process: vLLM without dynsteer (``absent``), dynsteer with its default configuration and no
capture buffers (``base``), a second such engine (``twin``: the A/A control, i.e. what two identical engines differ by
in this set-up, the noise floor any other overhead must be read against), and ``base`` plus capture buffers at
``post_block`` of every layer (``capture``). The
parent interleaves them: each repeat measures every (engine, mode) once per batch size, in rotating order, so drift
in clocks or host load hits all of them alike, and overheads are medians of per-repeat paired ratios. All idle runs
come first; capturing traffic (whose data the host then holds and frees) is measured after them, against the median
idle time of the same engine.

Modes of the ``capture`` engine: ``idle`` (buffers present, no request captures), ``capture 1 place`` (every request
captures ``all_generated`` at one layer) and ``capture 8 places`` (eight layers). Capturing requests are timed end to
end as a user sees them (``Steerer.generate``: generation plus returning every captured row to the caller, float32);
the delivery part (``take_captures``) is also reported on its own.

    PYTHONPATH=/opt/vllm-site python3 benchmarks/capture_overhead.py --out benchmarks/results \
        --engines base twin capture --repeats 15

The report keeps every run's seconds (``seconds``), so other statistics can be computed from it later.

Results: ``benchmarks/results/capture_overhead-<device>-<date>.json`` and a markdown table on stdout. Target (issue
#3): capture-enabled idle ≤ +0.3% (against the same engine without capture buffers).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_overhead import LLAMA3_8B, print_table_head, write_report  # noqa: E402

TARGET_IDLE_PCT = 0.3
ENGINES = {  # name -> DynsteerConfig fields (None: dynsteer disabled in that engine's processes)
    "absent": None,
    "base": {},
    "twin": {},  # base again, in its own process: the A/A control (what two identical engines differ by)
    "capture": {"capture_sites": ["post_block"]},
}
MODES = {"absent": ["idle"], "base": ["idle"], "twin": ["idle"],
         "capture": ["idle", "capture 1 place", "capture 8 places"]}


def capture_layers(mode: str, num_layers: int) -> list[int]:
    n = int(mode.split()[1])
    return sorted({round(i * (num_layers - 1) / max(n - 1, 1)) for i in range(n)})


def worker(args: argparse.Namespace) -> None:
    """One engine; answers ``{"batch": B, "mode": M}`` lines on stdin with ``{"s": seconds, "deliver_s": ...}``."""
    import numpy as np
    from vllm import LLM, SamplingParams

    cfg = ENGINES[args.engine]
    model_cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    num_layers, vocab = model_cfg["num_hidden_layers"], model_cfg["vocab_size"]
    extra = {} if cfg is None else {"additional_config": {"dynsteer": cfg}}
    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
              max_model_len=1024, max_num_seqs=max(args.batches), gpu_memory_utilization=args.gpu_util, seed=0,
              enforce_eager=args.eager, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    prompts = {b: [{"prompt_token_ids": np.random.default_rng(b).integers(vocab // 100, vocab - 1,
                                                                        args.prompt_len).tolist()}
                   for _ in range(b)] for b in args.batches}
    steerer = deliver = None
    if cfg is not None:
        import dynsteer
        from dynsteer import CaptureSpec

        steerer = dynsteer.attach(llm)
        take = steerer.take_captures
        deliver = [0.0]

        def timed_take(tags):  # the delivery part of a capturing generate, timed on its own
            t0 = time.perf_counter()
            got = take(tags)
            deliver[0] += time.perf_counter() - t0
            return got

        steerer.take_captures = timed_take
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        batch, mode = cmd["batch"], cmd["mode"]
        if deliver is not None:
            deliver[0] = 0.0
        t0 = time.perf_counter()
        if mode == "idle":
            outs = llm.generate(prompts[batch], params, use_tqdm=False)
        else:
            spec = CaptureSpec(sites=["post_block"], layers=capture_layers(mode, num_layers),
                               positions="all_generated")
            outs = steerer.generate(prompts[batch], params, capture=spec, use_tqdm=False)
            want = args.tokens - 1  # the last token is never fed back: no residual
            assert all(o.capture is not None and len(o.capture.positions) == want for o in outs), mode
        seconds = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
        print("RESULT " + json.dumps({"s": seconds, "deliver_s": deliver[0] if deliver else 0.0}), flush=True)


class Engine:
    """A worker process holding one engine, driven over stdin/stdout."""

    def __init__(self, name: str, model_dir: Path, args: argparse.Namespace) -> None:
        env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
        if ENGINES[name] is None:
            env["DYNSTEER_DISABLE"] = "1"
        cmd = [sys.executable, __file__, "--worker", name, "--model-dir", str(model_dir), "--tokens",
               str(args.tokens), "--prompt-len", str(args.prompt_len), "--dtype", args.dtype, "--gpu-util",
               str(args.gpu_util), "--batches", *map(str, args.batches)] + (["--eager"] if args.eager else [])
        self.name = name
        self.log = open(Path(tempfile.gettempdir()) / f"capture_overhead-{name}.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.log.flush()
        tail = Path(self.log.name).read_text()[-6000:]
        sys.exit(f"engine {self.name} died:\n{tail}")

    def run(self, batch: int, mode: str) -> dict:
        self.proc.stdin.write(json.dumps({"batch": batch, "mode": mode}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9, help="repeats of the idle phase")
    ap.add_argument("--traffic-repeats", type=int, default=3, help="repeats of the capturing-traffic phase")
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="start no further repeat after this long (0: no limit); each phase still runs two")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-util", type=float, default=0.2, help="per engine (up to four share the GPU)")
    ap.add_argument("--eager", action="store_true", help="CUDA graphs off (a CPU smoke run)")
    ap.add_argument("--model-dir", help="a model directory (default: a fresh Llama-3-8B-shaped config.json)")
    ap.add_argument("--worker", choices=list(ENGINES), dest="engine")
    args = ap.parse_args()
    if args.engine:
        return worker(args)

    import torch

    model_dir = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(prefix="llama8b-shape-"))
    if not args.model_dir:
        (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    started = time.perf_counter()
    names = [n for n in ENGINES if n in args.engines]
    engines = {}
    for name in names:  # one at a time: vLLM sizes its KV cache from the memory free while it starts
        t0 = time.perf_counter()
        engines[name] = Engine(name, model_dir, args)
        print(f"{name}: engine up in {time.perf_counter() - t0:.0f} s", flush=True)
    # Idle runs first, all of them, then capturing traffic: captured data (host memory, pinned blocks) must not
    # linger into an idle measurement.
    phases = [[(n, "idle") for n in names], [(n, m) for n in names for m in MODES[n] if m != "idle"]]
    runs = [r for phase in phases for r in phase]
    times: dict[str, dict[int, list[float]]] = {f"{n}/{m}": {b: [] for b in args.batches} for n, m in runs}
    deliver: dict[str, dict[int, list[float]]] = {f"{n}/{m}": {b: [] for b in args.batches} for n, m in runs}
    for phase, repeats in zip(phases, (args.repeats, args.traffic_repeats)):
        if not phase or not repeats:
            continue
        for name, mode in phase:  # warm-up: graphs for every batch size, first-call costs
            for batch in args.batches:
                engines[name].run(batch, mode)
        for rep in range(repeats):
            if args.max_minutes and time.perf_counter() - started > args.max_minutes * 60 and rep >= 2:
                print(f"{phase[0][1]} phase: stopped after {rep} repeats (--max-minutes)", flush=True)
                break
            for batch in args.batches:
                order = phase[rep % len(phase):] + phase[:rep % len(phase)]
                for name, mode in order:
                    got = engines[name].run(batch, mode)
                    times[f"{name}/{mode}"][batch].append(got["s"])
                    deliver[f"{name}/{mode}"][batch].append(got["deliver_s"])
            print(f"{phase[0][1]} phase: repeat {rep + 1}/{repeats} done", flush=True)
    for eng in engines.values():
        eng.close()

    def paired(a: str, b: str) -> dict[str, dict[str, float]]:
        """Overhead of run a over run b in %, from the per-repeat ratios (median, min, max); traffic runs are
        compared with the median idle time (they ran in another phase)."""
        out = {}
        for batch in args.batches:
            xs, ys = times[a][batch], times[b][batch]
            same_phase = a.endswith("/idle") == b.endswith("/idle")
            pct = ([(x / y - 1) * 100 for x, y in zip(xs, ys)] if same_phase else
                   [(x / statistics.median(ys) - 1) * 100 for x in xs])
            out[str(batch)] = {"median": round(statistics.median(pct), 3), "min": round(min(pct), 3),
                               "max": round(max(pct), 3),
                               # less sensitive to single slow runs than paired ratios of independent runs
                               "of_medians": round((statistics.median(xs) / statistics.median(ys) - 1) * 100, 3),
                               "of_minima": round((min(xs) / min(ys) - 1) * 100, 3)}
        return out

    times = {k: per for k, per in times.items() if all(per.values())}  # modes of a phase that did not run: none
    comparisons = {}
    for label, a, b in [("A/A control: twin idle (vs base)", "twin/idle", "base/idle"),
                        ("dynsteer loaded, idle (vs absent)", "base/idle", "absent/idle"),
                        ("capture-enabled idle (vs base)", "capture/idle", "base/idle"),
                        ("capture-enabled idle (vs absent)", "capture/idle", "absent/idle"),
                        ("capture 1 place (vs capture-enabled idle)", "capture/capture 1 place", "capture/idle"),
                        ("capture 8 places (vs capture-enabled idle)", "capture/capture 8 places", "capture/idle")]:
        if a in times and b in times:
            comparisons[label] = paired(a, b)
    tok_s = {k: {str(b): round(b * args.tokens / statistics.median(v), 1) for b, v in per.items()}
             for k, per in times.items()}
    deliver_ms = {k: {str(b): round(statistics.median(v) * 1e3, 2) for b, v in per.items()}
                  for k, per in deliver.items() if "place" in k and k in times}
    import vllm

    report = {
        "benchmark": "capture_overhead", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "vllm": vllm.__version__, "model": str(args.model_dir or "Llama-3-8B shape") + f", load_format=dummy, {args.dtype}",
        "cuda_graphs": not args.eager, "output_tokens": args.tokens, "prompt_tokens": args.prompt_len,
        "repeats": {"idle": len(next(iter(times[f"{names[0]}/idle"].values()))),
                    "traffic": len(next(iter(times["capture/capture 1 place"].values())))
                    if "capture/capture 1 place" in times else 0},
        "engines": {n: ENGINES[n] for n in names}, "tokens_per_s": tok_s, "overhead_pct": comparisons,
        "deliver_ms_median": deliver_ms, "seconds": times, "target_pct": {"capture-enabled idle (vs base)": TARGET_IDLE_PCT},
    }
    path = write_report(report, args.out)
    print_table_head("run", args.batches)
    for k, per in tok_s.items():
        print(f"| {k} (tok/s) | " + " | ".join(f"{per[str(b)]:.0f}" for b in args.batches) + " |")
    for k, per in comparisons.items():
        cells = [f"{per[str(b)]['median']:+.2f} [{per[str(b)]['min']:+.2f}, {per[str(b)]['max']:+.2f}]"
                 for b in args.batches]
        print(f"| {k}, % median [min, max] | " + " | ".join(cells) + " |")
        print(f"| {k}, % of medians / of minima | " +
              " | ".join(f"{per[str(b)]['of_medians']:+.2f} / {per[str(b)]['of_minima']:+.2f}" for b in args.batches)
              + " |")
    for k, per in deliver_ms.items():
        print(f"| {k}: take_captures (ms) | " + " | ".join(f"{per[str(b)]:.1f}" for b in args.batches) + " |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
