"""dynsteer's overhead reference: every steering mode and two peers against dynsteer absent, side by side, in one run.

Method. Engines of an 8B-shaped Llama (Llama-3-8B config, ``load_format="dummy"``, bf16, CUDA graphs on) stay alive
side by side on one GPU, each in its own worker process answering JSON lines on stdin (and vLLM's engine core in its
own process below it, as vLLM runs by default):

* ``absent`` and ``absent2``: vLLM with dynsteer disabled (``DYNSTEER_DISABLE=1``). ``absent`` is the baseline of
  every figure; ``absent2`` is the A/A control: two identical engines, whose paired-median difference is the noise
  floor every other figure must be read against (aim: ≤ 0.3 %).
* ``absent3`` (mode ``aa3``, not in ``--reduced``): a third such engine, compared with both: three A/A pairs in
  one run, and every targeted mode also against the three engines' per-repeat mean (``pooled_step_overhead_pct``;
  one engine process can sit a point or two from another for a whole run, the mean of three is steadier).
  ``--pin-cores FRONT:CORE`` pins every engine's processes, after start-up, to the same cores (on the H200 that did
  not remove the offsets: 2026-11-25, b311b42).
* ``dynsteer2`` and ``dynsteer3`` (modes ``idle2``, ``idle3``, not in ``--reduced``): more engines like ``dynsteer``,
  run idle. With two or more idle and absent engines the report compares the idle engines' per-repeat mean with the
  absent engines' (in ``pooled_step_overhead_pct``): the idle figure with each side's engine offset averaged over
  several draws (across 2026-11-25's runs, one idle engine against one absent engine ranged −1.3 … +1.4 % at
  batch 1). ``--modes absent aa aa3 idle idle2 idle3`` is that run.
* ``dynsteer``: the default ``DynsteerConfig`` (3 sites × every layer, dynamic tier ``max_gates=2``, device sync tier)
  with one change: ``max_rows = max(64, largest batch + 2) + 32``. The default 64 rows hold 63 distinct live
  configurations, the 64-config mode needs 64 at once, and one engine serves every mode's configurations in turn
  (those 64, the dynamic modes' policies, hotwire's vector, global specs): with fewer rows than that union, eviction
  of the least recently released row rewrites, at every pass, the row each configuration is about to need (on the
  H200, 9570f43: every per-request-static call rewrote all 64 rows, +3.6 % at batch 64 in a mixed run against
  +1.1 % alone). Rows only size the tables (no per-step cost); the report lists table rows written per timed call.
* ``dynsteer-capture``: the same plus capture buffers at ``post_block`` of the steered layer.
* ``dynsteer-stream`` (modes ``s_idle``, ``stream8``, ``streamall``, ``streamall16``, not in ``--reduced``): stream
  bandwidth. Capture buffers at ``post_block`` of every layer and three streams: 8 spread layers, every layer, and
  every layer as bfloat16 (2 bytes a value on the wire); a monitor in the engine's process subscribes to one of them
  and reads every value of every frame. ``stream8`` checks in every timed call that every generated token's row
  arrived; the every-layer modes are measured as they come (subscribed with ``drop``): the mode table gives the GB/s
  the monitor received (as float32 values) and, where rows were dropped, the share that arrived.
* ``dynsteer-inline``: the default config with ``forward="inline"`` (each site's work as torch ops traced into the
  compiled graph, which inductor may fuse with the neighbouring residual add and norm, instead of one opaque op
  launch per site); modes ``i_idle``, ``i_static1``, ``i_pr64``, ``i_prdyn`` (not in ``--reduced``: on the H200,
  2026-11-23, it measured +53 to +68 % against the custom op's +5 to +16 %, so the op stays the default; it is the
  first engine dropped where memory is short, e.g. on an H100).
* ``dynsteer-bare`` and ``dynsteer-1layer`` (diagnostic, not in ``--reduced``): the plugin loaded with no layer
  hooked (``layers=[]``, ``require=False``: the scheduler, runner and frontend glue around vLLM's own forward; mode
  ``b_idle``) and with one layer hooked (``layers=[middle]``: two of the 64 add-norms are dynsteer's; modes
  ``l_idle``, ``l_static1``). Together with ``idle`` they split the idle engine's cost into glue and forward.
* ``hotwire``: hotwire-vllm 0.1.2 (``--hotwire-wheel``), installed with ``pip install --no-deps --target`` into a
  private folder on that engine's ``PYTHONPATH`` only (its ``vllm.general_plugins`` entry point is found there);
  dynsteer disabled in it, and hotwire is visible to no other engine (checked before start, listed in the report).
* ``dynsteer-base`` and ``dynsteer-base-capture`` (modes ``o_idle``, ``o_prdyn``, ``o_sync``; ``o_capidle``,
  ``o_capture``): engines like ``dynsteer`` and ``dynsteer-capture`` importing dynsteer from ``--base-checkout``
  (first on their ``PYTHONPATH``): an A/B of two versions' code in one run, each mode against its counterpart on
  this checkout's engine, so that a change is not read against another day's host.
* ``hook``: the style of chatspace / vllm-lens: ``enforce_eager=True`` and a plain PyTorch forward hook on one decoder
  layer adding a vector to its output hidden states, installed and removed through ``LLM.apply_model`` (the callable
  is pickled into vLLM's engine core, and again into its workers where they are processes of their own: a
  ``functools.partial`` of a function of ``lib/overhead/workload.py``, imported from ``benchmarks/`` on that engine's
  ``PYTHONPATH``; ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in that engine only).

Each engine runs in several modes (rows of the table; all 128 generated tokens, 32-token random prompts, greedy,
``ignore_eos=True``, decode batch 1 / 16 / 64; the prompts of a batch are distinct, and fresh every repeat, so
prefix caching never favours an engine). Every repeat measures every (engine, mode) once per batch size, in an
order rotated by one each repeat, so drift in clocks or host load hits all of them alike. An overhead is the median
over repeats of the paired ratio ``t(mode, repeat) / t(absent, repeat) − 1``. Each steering mode is also reported
against the same engine's idle mode (no target of its own): a whole engine process can sit a point or two off
another for a run, which every figure against ``absent`` carries and a comparison within one engine does not.
``--from-json`` recomputes every comparison from the stored repeats. Around each timed call the parent reads the CPU
time of the engine's frontend process and of its engine core (psutil), reported per call as CPU seconds per wall
second (``cpu_busy_repeats``; an engine core near 1.0 is a host-bound call), with the host's CPU model and load
(``host``): slow calls can then be told apart as host-bound or not, and runs on different leases compared.

Modes: ``idle`` (dynsteer loaded, nothing set); static global vectors at 1 / 8 layers; per-request static vectors
with 1 / 16 / 64 distinct configurations (request ``i`` carries config ``i mod N`` in its payload; ``pr64n``: the
same 64 vectors registered by name, so payloads of ~100 bytes instead of ~22 KB); ``global gate``
(a global policy: monitor at the middle layer, gated vector 4 layers later); per-request dynamic policies (4
distinct); the same with an EMA-latch sync controller (device tier), also compared with per-request dynamic; capture
of every generated token at one layer (``Steerer.generate``: generation plus delivery of the rows to the caller);
dynsteer on hotwire's workload (every request carries one registered vector at the same layer, like hotwire's
spec); hotwire idle / steered; eager without / with the hook. Global state (a global spec or policy, the hook) is
set before and cleared after each timed call, outside the timed window; per-request payloads are encoded once and
the ``SamplingParams`` cloned outside the timed window, so a time is the engine's own (``LLM.generate``).

Verification: at warm-up every mode's greedy tokens are compared with ``absent``'s on the same prompts, once per
(mode, batch). A mode that steers must change every request's tokens; if the timed vectors (entries ~0.01) do not,
a separate verification call runs the same mode with its vectors ``--verify-scale`` (100) times larger and its gates
and latches forced open, then 10× and 50× that while some request is still unchanged, and is compared instead
(on the dummy 8B model the timed vectors already dwarf the residual; the tiny CPU model needs ~1000×). ``steering_changed_tokens`` is recorded per mode; a mode that fails is flagged in the
table. Modes that do not steer record whether their tokens equal ``absent``'s (``absent2`` must: same dummy weights).

Host time per step: dynsteer engines report their workers' counters (``Steerer.describe``: steps, dynamic-tier
staging, read-back bookkeeping and waiting) read around every timed call; ``--profile`` also runs vLLM's torch
profiler over one call per (engine, mode) at each ``--profile-batch`` (``--profile-tokens`` long) and writes each
trace plus a summary (top CPU ops by self time and top device kernels, per step; and ``steady``: the second half of
the call, pure decode, with every kernel's launches and µs per step, the step's pace and the device's busy and idle
time per step) under ``<out>/overhead-<device>-<date>-profile/`` and in the report's ``profile``.

GPU memory: each engine gets an explicit KV cache (``kv_cache_memory_bytes``, sized for the largest batch) and a
small ``gpu_memory_utilization`` (only vLLM's start-up free-memory check reads it then), so engines start in
parallel (``absent2`` after ``absent``, to reuse its compile cache). An 8B engine holds ~18 GiB: an H200 (141 GB)
takes all six, an H100 (80 GB) four; engines that do not fit (estimated from free memory) are skipped, lowest
priority first (capture, then the hook peer), and the report says so.

Tensor parallelism: ``--tp N`` gives every engine ``tensor_parallel_size=N`` on the first N GPUs (all engines share
them, one runs at a time), ``--shape llama3-70b`` the Llama-3-70B shape, ``--layers L`` fewer of its layers. Memory
and KV cache are counted per rank, so the fit check above keeps the engines whose ranks fit every GPU. Dropping
layers keeps what tensor parallelism splits (each layer's matrices and all-reduces) and shortens the step and
dynsteer's per-layer work alike. On four H100s, 32 of Llama-3-70B's layers fit the A/A pair, ``dynsteer`` and
``dynsteer-capture`` (~16 GiB a rank each); all 80 fit only the A/A pair (four H200s: the pair and ``dynsteer``)::

    python3 benchmarks/overhead.py --tp 4 --shape llama3-70b --layers 32 --modes idle pr64 prdyn capidle stream \
        --batches 1 16 64 --timing-split --max-minutes 8 --out $OUT
    .venv/bin/python benchmarks/overhead.py --cpu-smoke --tp 2 --modes idle prdyn   # CPU: two workers per engine

Commands (offline GPU host; ``. scripts/gpu_env.sh`` puts vLLM on ``PYTHONPATH`` and installs dynsteer; pass the
commit as ``DYNSTEER_GIT_SHA``, taken where the checkout lives: a device copy's ``.git`` may be missing or stale)::

    W=.gpu-carry/hotwire_vllm-0.1.2-py3-none-any.whl
    python3 benchmarks/overhead.py --hotwire-wheel $W                       # full: H200 (an H100 drops 2 engines)
    python3 benchmarks/overhead.py --hotwire-wheel $W --reduced --out $OUT  # one 10-minute device call, H100
    .venv/bin/python benchmarks/overhead.py --cpu-smoke     # CPU: tiny random Llama, ~4 min on 2 cores, temp output
    python3 benchmarks/overhead.py --from-json benchmarks/results/overhead-NVIDIA_H200-2026-11-24.json  # re-plot

Time. Full (H200, 6 engines, 18 modes × 3 batches, 15 repeats): start-up ~3-4 min (parallel), one repeat ~70 s
(the eager peer's runs dominate), ~20 min in all; ``--max-minutes`` caps it. ``--reduced`` (for one 10-minute device
call): 5 engines (absent, absent2, dynsteer, hotwire, dynsteer with capture buffers), 15 modes (idle, static 1 / 8
layers, per-request 64 configs, global gate, per-request dynamic, + sync controller, dynsteer on hotwire's workload,
hotwire idle / steered, capture-enabled idle, capture and stream every generated token at 1 layer), batches 1, 16
and 64, ``--timing-split`` on, at most 12 repeats within ``--max-minutes 7.5`` (engines not up within
``--start-timeout 360`` s are skipped). On an H200 (2026-11-24, a6cc202, ``--max-minutes 9.4``): start-up ~3.5 min,
one repeat ~33 s, 9 repeats, 9 min in all; the default 7.5 leaves time in the device call for ``gpu_env.sh``
(unpacking vLLM on a fresh machine). The hotwire wheel is
git-ignored: carry it (``.gpu-carry/…whl``) with the call, or the hotwire modes are skipped.
With ``--max-minutes`` no further repeat starts once the next one would end past the budget (at least one always
runs), and the report is written anyway; the JSON is also rewritten after every repeat, so a killed run leaves one.

Outputs: ``<out>/overhead-<device>-<date>[-reduced].json`` (device, versions, args, every repeat's seconds per
(engine, mode, batch), paired medians with min / max / quartiles, the A/A figure, verification, host counters),
a markdown table on stdout with each target beside its figure (✓ within target, ≈ within target plus the A/A
figure at that batch, ✗ beyond), and ``overhead-<device>-<date>[-reduced].png``: overhead % vs batch size, one line
per mode, the A/A band shaded. Targets: idle ≤ +0.3 %; static 1 layer ≤ +0.5 %, 8 layers ≤ +1.5 %; per-request
static 64 configs ≤ +1.5 %; global gate ≤ +1 %; per-request dynamic ≤ +1.5 %; + sync controller ≤ +0.3 % over
per-request dynamic; capture 1 layer ≤ +2 %; dynsteer ≤ hotwire-vllm on hotwire's workload.

Decode steps. A call's time also holds its request intake: ``LLM.generate`` submits the batch one request at a time
while the engine core already steps, so how the prompts split into prefill steps (and whether a step exceeds vLLM's
captured graph sizes and runs without a graph) changes from call to call: on the H200 the time until every request
has its first token ranged 32-122 ms at batch 16 within one engine and run. ``--timing-split`` (on in ``--reduced``)
turns vLLM's request statistics on in every engine and splits each call into that ramp, the mean decode step after
it and the tail, from the engine core's timestamps; every comparison is then also reported on the decode step alone
(``step_overhead_pct``), whose A/A control resolves ~0.1 point where the whole call's swings by a point or more.

The code: the modes and engines in ``lib/overhead/modes.py``, the worker's workloads in ``lib/overhead/workload.py``,
the run in ``lib/overhead/bench.py``, comparisons, tables and plot in ``lib/overhead/report.py``; the engine farm,
statistics and report files are the benchmarks' shared ``lib/`` (``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lib.engines import SHAPES, pin_spec
from lib.overhead.modes import BY_KEY, ENGINES, MODES, REDUCED_MODES


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="report folder (default benchmarks/results; --cpu-smoke: a fresh temp folder)")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--repeats", type=int, help="at most this many repeats (default 15; --reduced 12)")
    ap.add_argument("--max-minutes", type=float,
                    help="budget for the whole run: no repeat starts that would end past it (0: none; --reduced 7.5)")
    ap.add_argument("--modes", nargs="+", choices=list(BY_KEY), help="mode keys (absent and aa are always run)")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, help="engines to start (default: those the modes need)")
    ap.add_argument("--reduced", action="store_true", help="the 10-minute set (see the module docstring)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny random Llama on CPU, float32, eager, in-process "
                    "engine cores; hotwire skipped (Triton/CUDA kernel)")
    ap.add_argument("--hotwire-wheel", help="hotwire_vllm-0.1.2 wheel (default: $HOTWIRE_WHEEL, "
                    ".gpu-carry/hotwire_vllm-*.whl, /tmp/hw/hotwire_vllm-*.whl)")
    ap.add_argument("--base-checkout", metavar="DIR", help="a folder holding another version's dynsteer package "
                    "(e.g. `git archive REV dynsteer | tar x -C DIR`): modes o_idle, o_prdyn, o_sync, o_capidle, "
                    "o_capture run on engines importing it, each compared with this checkout's mode")
    ap.add_argument("--model-dir", help="model folder (default: a config.json of --shape, dummy weights)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                    help="the dummy model's shape (without --model-dir)")
    ap.add_argument("--layers", type=int, help="decoder layers of --shape (default: the model's own): the largest "
                    "shape whose compared engines fit, e.g. Llama-3-70B layers at TP=4 on four H100s")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine (each engine's ranks "
                    "on the first TP GPUs, shared by all engines; on CPU two workers of one core each)")
    ap.add_argument("--load-format", help="vLLM load_format (default dummy; --cpu-smoke: auto, the tiny weights)")
    ap.add_argument("--dtype")
    ap.add_argument("--eager", action="store_true", help="CUDA graphs and torch.compile off in every engine")
    ap.add_argument("--gpu-util", type=float, default=0.05,
                    help="per engine; with an explicit KV cache only vLLM's start-up free-memory check reads it")
    ap.add_argument("--verify-scale", type=float, default=100.0,
                    help="multiplier of the vectors in a verification call (timed vectors have entries ~0.01); "
                         "raised 10× and 50× where that still leaves a request's tokens unchanged")
    ap.add_argument("--profile", action="store_true", help="also profile one short call per (engine, mode)")
    ap.add_argument("--profile-tokens", type=int, default=16)
    ap.add_argument("--profile-batch", type=int, nargs="+", help="batch sizes to profile (default: the largest)")
    ap.add_argument("--py-spy", metavar="EXE", help="py-spy executable: after the repeats, sample every process of "
                    "each engine over one call per mode at each --profile-batch (summaries in the report's 'stacks')")
    ap.add_argument("--py-spy-rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--py-spy-mode", choices=["busy", "idle", "gil"], default="busy",
                    help="busy: running threads only; idle: waiting threads too (where each waits); gil: only the "
                         "thread holding the GIL")
    ap.add_argument("--py-spy-raw", action="store_true", help="keep py-spy's raw stacks (gzipped) beside the report "
                    "(default: in the run's scratch folder; the report's summaries are what a device run brings back)")
    ap.add_argument("--timing-split", action="store_true",
                    help="every engine keeps vLLM's request stats on; each timed call is split into ramp (until "
                         "every first token), decode step and tail, each compared with absent's")
    ap.add_argument("--serial-start", action="store_true", help="start engines one after another")
    ap.add_argument("--burn-in", type=int, default=0, metavar="N",
                    help="N untimed repeats after warm-up (their decode steps reported apart, in no comparison): "
                         "whether the dynamic modes' slow first repeats at batch 64 are a warm-up")
    ap.add_argument("--pin-cores", type=pin_spec, metavar="FRONT:CORE",
                    help="once every engine is up, pin each engine's worker process (vLLM's frontend) to the cpu "
                         "list FRONT and its engine core process(es) to CORE, every thread (e.g. 2-3:4-7); all "
                         "engines share the same cores (one runs at a time), so none sits on faster or busier ones")
    ap.add_argument("--start-timeout", type=float, help="seconds for all engines to come up (default 900; "
                    "--reduced 360); one that is not up by then is skipped")
    ap.add_argument("--run-timeout", type=float, default=600)
    ap.add_argument("--from-json", help="print the tables and draw the plot of an existing report, then exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    d = dict(batches=[1, 16, 64], tokens=128, prompt_len=32, repeats=15, max_minutes=0.0, dtype="bfloat16",
             load_format="dummy", start_timeout=900.0, modes=[m.key for m in MODES])
    if args.reduced:
        d.update(batches=[1, 16, 64], repeats=12, max_minutes=7.5, start_timeout=360, modes=REDUCED_MODES)
        args.timing_split = True
    if args.cpu_smoke:
        d.update(batches=[1, 4], tokens=8, prompt_len=8, repeats=2, dtype="float32", load_format="auto")
        args.eager = True
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.modes = ["absent", "aa"] + [k for k in args.modes if k not in ("absent", "aa")]
    if args.cpu_smoke and args.tp > 2:
        ap.error("--cpu-smoke runs at most --tp 2 (one core per CPU worker)")
    return args



def main() -> None:
    args = parse_args()
    if args.worker:
        from lib.overhead.workload import worker

        return worker(json.loads(args.worker))
    from lib.overhead.report import comparisons, plot, pooled, print_tables, step_lists

    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        # recomputed from the repeats, so a report shows the pairs this version of the script knows
        report["overhead_pct"] = comparisons(report["seconds"], report["modes"], report["args"]["batches"])
        if report.get("timing_split_repeats"):
            report["step_overhead_pct"] = comparisons(step_lists(report["timing_split_repeats"]), report["modes"],
                                                      report["args"]["batches"])
            report["pooled_step_overhead_pct"] = pooled(step_lists(report["timing_split_repeats"]), report["modes"],
                                                        report["args"]["batches"])
        print_tables(report)
        print(f"plot: {plot(report, Path(args.from_json).with_suffix('.png'))}")
        return
    from lib.overhead.bench import Bench

    bench = Bench(args)
    bench.choose_engines()
    bench.start_engines()
    try:
        bench.warm_up_and_verify()
        bench.burn_in()
        bench.measure()
        if args.profile:
            bench.profile()
        if args.py_spy:
            bench.spy()
        report = bench.report()
        bench.save(report)  # before the engines close: a slow shutdown must not cost the report
        print_tables(report)
        png = plot(report, bench.json_path.with_suffix(".png"))
        print(f"wrote {bench.json_path}" + (f" and {png}" if png else ""), flush=True)
    finally:
        bench.close()


if __name__ == "__main__":
    main()
