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
* ``hook``: the style of chatspace / vllm-lens: ``enforce_eager=True`` and a plain PyTorch forward hook on one decoder
  layer adding a vector to its output hidden states, installed and removed through ``LLM.apply_model`` (the callable
  is pickled into vLLM's engine core, and again into its workers where they are processes of their own: a
  ``functools.partial`` of a function of this module, imported as ``overhead`` from ``benchmarks/`` on that engine's
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
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from static_overhead import LLAMA3_8B  # noqa: E402

try:
    import psutil  # CPU accounting per call, --pin-cores

    HAVE_PSUTIL = True
except ImportError:
    HAVE_PSUTIL = False

REPO = Path(__file__).resolve().parent.parent
AA_TARGET_PCT = 0.3
TIMED_STD = 0.01  # entries of every timed vector: N(0, 0.01²), as in the earlier benchmarks
N_POLICIES = 4  # distinct per-request dynamic policies spread over a batch
HOTWIRE_VECTOR_ID = "bench"
VERIFY_ESCALATION = (1, 10, 50)  # × --verify-scale, until every request's tokens changed (stays far below the
# engine's max_abs_value: timed entries ~0.01, so 0.01 × 4σ × 5000 = 200 < 1e4)


@dataclass(frozen=True)
class Mode:
    key: str  # command-line name
    label: str  # table row
    engine: str
    steers: bool  # must change greedy tokens
    target: float | None = None  # % over ``vs``
    vs: str | None = "absent"  # the mode its target is measured against


MODES = [
    Mode("absent", "absent (baseline)", "absent", False, vs=None),
    Mode("aa", "absent2 (A/A control)", "absent2", False, AA_TARGET_PCT),
    # a third identical engine: three A/A pairs per run (the spread between engine processes, not one draw of it)
    Mode("aa3", "absent3 (second A/A control)", "absent3", False, AA_TARGET_PCT),
    Mode("idle", "idle (dynsteer loaded, nothing set)", "dynsteer", False, 0.3),
    # more engines like dynsteer, run idle: the idle figure as a mean over engines (module docstring)
    Mode("idle2", "idle, second dynsteer engine", "dynsteer2", False),
    Mode("idle3", "idle, third dynsteer engine", "dynsteer3", False),
    Mode("static1", "static global, 1 layer", "dynsteer", True, 0.5),
    Mode("static8", "static global, 8 layers", "dynsteer", True, 1.5),
    Mode("pr1", "per-request static, 1 config", "dynsteer", True),
    Mode("pr16", "per-request static, 16 configs", "dynsteer", True),
    Mode("pr64", "per-request static, 64 configs", "dynsteer", True, 1.5),
    # the same 64 vectors registered by name: a payload of ~100 bytes instead of the inline vector's ~22 KB
    Mode("pr64n", "per-request static, 64 configs naming registered vectors", "dynsteer", True),
    Mode("gate", "global gate (global dynamic policy)", "dynsteer", True, 1.0),
    Mode("prdyn", "per-request dynamic", "dynsteer", True, 1.5),
    Mode("sync", "per-request dynamic + sync controller", "dynsteer", True, 0.3, vs="prdyn"),
    Mode("hwload", "dynsteer on hotwire's workload", "dynsteer", True, 0.0, vs="hwsteered"),
    Mode("capidle", "capture-enabled idle", "dynsteer-capture", False),
    Mode("capture", "capture every generated token, 1 layer", "dynsteer-capture", False, 2.0),
    Mode("stream", "stream every generated token, 1 layer, to a monitor", "dynsteer-capture", False, 3.0),
    # the same default config with forward="inline" (site work traced into the compiled graph, fusable by inductor)
    Mode("i_idle", "idle, forward=inline", "dynsteer-inline", False, 0.3),
    Mode("i_static1", "static global, 1 layer, forward=inline", "dynsteer-inline", True, 0.5),
    Mode("i_pr64", "per-request static, 64 configs, forward=inline", "dynsteer-inline", True, 1.5),
    Mode("i_prdyn", "per-request dynamic, forward=inline", "dynsteer-inline", True, 1.5),
    # where the idle engine's cost sits: dynsteer's plugin loaded but no layer hooked (scheduler and runner glue
    # only, vLLM's own compiled forward), and one hooked layer (2 of the 64 add-norms are dynsteer's kernel)
    Mode("b_idle", "idle, no layer hooked (plugin glue only)", "dynsteer-bare", False),
    Mode("l_idle", "idle, 1 layer hooked", "dynsteer-1layer", False),
    Mode("l_static1", "static global, 1 layer, 1 layer hooked", "dynsteer-1layer", True),
    Mode("hwidle", "hotwire-vllm idle", "hotwire", False),
    Mode("hwsteered", "hotwire-vllm steered, 1 layer", "hotwire", True),
    Mode("eager", "eager peer, no hook", "hook", False),
    Mode("hook", "eager peer + forward hook, 1 layer", "hook", True),
]
BY_KEY = {m.key: m for m in MODES}
# Informative pairs besides "vs absent" and each mode's own target (no target of their own). Steering modes against
# the same engine's idle mode: an engine process can sit a point or two off another for a whole run (same code, same
# GPU), which every "vs absent" figure carries and a comparison within one engine does not.
EXTRA_PAIRS = [("aa3", "aa"), ("idle2", "idle"), ("idle3", "idle"), ("hwsteered", "hwidle"), ("hook", "eager"),
               ("capture", "capidle"), ("stream", "capidle"),
               *((k, "idle") for k in ("static1", "static8", "pr1", "pr16", "pr64", "pr64n", "gate", "prdyn",
                                       "hwload")),
               *((k, "i_idle") for k in ("i_static1", "i_pr64", "i_prdyn")), ("l_static1", "l_idle"),
               ("l_idle", "b_idle"), ("idle", "b_idle")]
ENGINES = ["absent", "absent2", "dynsteer", "hotwire", "hook", "dynsteer-capture",
           "dynsteer-inline", "dynsteer-bare", "dynsteer-1layer", "absent3", "dynsteer2", "dynsteer3"]  # priority
# started once the engine they copy is up: they read its compile cache rather than race to write it
CLONES = {"absent2": "absent", "absent3": "absent", "dynsteer2": "dynsteer", "dynsteer3": "dynsteer"}
ENGINE_KIND = {"absent": "absent", "absent2": "absent", "absent3": "absent", "dynsteer": "dynsteer",
               "dynsteer2": "dynsteer", "dynsteer3": "dynsteer",
               "dynsteer-capture": "dynsteer",
               "dynsteer-inline": "dynsteer", "dynsteer-bare": "dynsteer", "dynsteer-1layer": "dynsteer",
               "hotwire": "hotwire", "hook": "hook"}
REDUCED_MODES = ["absent", "aa", "idle", "static1", "static8", "pr64", "gate", "prdyn", "sync", "hwload", "hwidle",
                 "hwsteered", "capidle", "capture", "stream"]


# ---- shapes and workloads (worker side; the parent only needs the layer choices) -----------------------------------
def steer_layer(num_layers: int) -> int:
    """The one layer of every 1-layer mode (static, per-request, hotwire's workload, the hook, capture)."""
    return num_layers // 2


def spread_layers(n: int, num_layers: int) -> list[int]:
    n = min(n, num_layers)
    return sorted({round(i * (num_layers - 1) / max(n - 1, 1)) for i in range(n)})


def gate_places(num_layers: int) -> tuple[int, int]:
    """Monitor layer and the layer its gated vector steers (as in dynamic_overhead.py)."""
    return num_layers // 2, min(num_layers - 1, num_layers // 2 + 4)


def kv_bytes_per_token(cfg: dict, dtype_bytes: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def weight_bytes(cfg: dict, dtype_bytes: int) -> int:
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    embed = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return (n * per_layer + embed + h) * dtype_bytes


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
        from dynsteer import Action, DynamicSteeringPolicy, Monitor, Rule, SyncControllerSpec

        np = self.np
        mon_layer, act_layer = gate_places(self.num_layers)
        rng = np.random.default_rng(10 + k)
        probe = rng.standard_normal(self.hidden).astype(np.float32)
        probe /= np.linalg.norm(probe)
        mon = Monitor(name="m", layer=mon_layer, direction=probe, sharpness=4.0,
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
        key = re.sub(r"^[ibl]_", "", key)  # the inline, bare and 1-layer engines' modes run the same workloads
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

            import overhead  # by reference (not __main__), so any vLLM process can unpickle it

            llm.apply_model(functools.partial(overhead.install_hook, self.layer, (self.vec(0) * scale).tolist()))
            teardown = lambda: llm.apply_model(functools.partial(overhead.remove_hook, self.layer))  # noqa: E731
        elif key == "capture":
            spec = CaptureSpec(sites=["post_block"], layers=[self.layer], positions="all_generated")
            want = base.max_tokens - 1  # the last token is never fed back: no residual

            def call():
                outs = st.generate(prompts, base, capture=spec, use_tqdm=False)
                assert all(o.capture is not None and len(o.capture.positions) == want for o in outs), "capture rows"
                return outs

            return call, None
        elif key == "stream":
            import threading

            from dynsteer.monitor.client import Monitor

            mcfg = self.cfg["dynsteer"]["monitor"]
            mon = Monitor(mcfg["endpoint"], mcfg["command_endpoint"], name="bench", streams=["resid"],
                          policy="drop", max_pending=1 << 20, window=1024)
            rows, stop = [0], threading.Event()

            def read() -> None:  # a monitor that never fires: it reads and scores every frame
                while not stop.is_set():
                    frame = mon.recv(timeout_s=0.05)
                    if frame is not None:
                        next(iter(frame.values.values())).sum()
                        rows[0] += len(frame.positions)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            want = len(prompts) * (base.max_tokens - 1)

            def call():
                start = rows[0]
                outs = llm.generate(prompts, params, use_tqdm=False)
                deadline = time.perf_counter() + 30
                while rows[0] - start < want and time.perf_counter() < deadline:
                    time.sleep(0.0005)
                assert rows[0] - start == want, f"stream rows {rows[0] - start} != {want}"
                return outs

            def teardown() -> None:
                stop.set()
                reader.join()
                mon.close()

            return call, teardown
        # per-request params are fresh clones every call (vLLM may annotate a request's params: never reuse them)
        return (lambda: llm.generate(prompts, params, use_tqdm=False)), teardown

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
            "deliver_ms": self.deliver_ms}


def install_hook(layer_idx: int, vector: list[float], model) -> int:
    """For ``LLM.apply_model``: a plain forward hook on decoder layer ``layer_idx`` adding ``vector`` to its output
    hidden states (vLLM's Llama layers return ``(hidden_states, residual)`` and the next layer adds them, so this adds
    to the residual stream after the layer, like hotwire's op and dynsteer's ``post_block``). Bound with
    ``functools.partial`` and pickled by reference to this module (importable as ``overhead``): vLLM pickles the
    callable again with plain ``pickle`` when its workers are processes of their own."""
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

    kw = dict(model=cfg["model_dir"], load_format=cfg["load_format"], skip_tokenizer_init=True, dtype=cfg["dtype"],
              max_model_len=cfg["max_model_len"], max_num_seqs=max(cfg["batches"]),
              max_num_batched_tokens=cfg["max_num_batched_tokens"], gpu_memory_utilization=cfg["gpu_util"],
              kv_cache_memory_bytes=cfg["kv_bytes"], seed=0, enforce_eager=cfg["eager"] or cfg["kind"] == "hook")
    if cfg.get("dynsteer") is not None:
        kw["additional_config"] = {"dynsteer": cfg["dynsteer"]}
    if cfg.get("timing_split"):  # vLLM's per-request timestamps (every engine alike): the call's phases
        kw["disable_log_stats"] = False
    if cfg.get("profile_dir"):
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": cfg["profile_dir"],
                                 "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True}
    t0 = time.perf_counter()
    llm = LLM(**kw)
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
        info["table_bytes"] = work.steerer.describe()[0]["table_bytes"]
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


# ---- the parent: engines as worker processes ------------------------------------------------------------------------
class EngineDied(RuntimeError):
    pass


class Engine:
    """A worker process holding one engine, driven over stdin / stdout (a reader thread, so waits can time out)."""

    def __init__(self, name: str, cfg: dict, env: dict, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.started = time.perf_counter()
        self.info: dict = {}

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(("READY ", "RESULT ", "ERROR ")):
                self.lines.put(line)
        self.lines.put(None)  # end of output: the process is gone

    def _next(self, timeout: float) -> tuple[str, dict]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise EngineDied(f"engine {self.name}: no answer within {timeout:.0f} s") from None
        if line is None:
            self.log.flush()
            raise EngineDied(f"engine {self.name} died; end of {self.log_path}:\n"
                             + self.log_path.read_text(errors="replace")[-4000:])
        tag, _, body = line.partition(" ")
        return tag, json.loads(body)

    def wait_ready(self, timeout: float) -> dict:
        tag, self.info = self._next(timeout)
        assert tag == "READY", tag
        return self.info

    def call(self, cmd: dict, timeout: float) -> dict:
        """Send one command; the reply (``{"error": ...}`` when the worker raised)."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        tag, body = self._next(timeout)
        return body if tag == "RESULT" else {"error": body.get("error", "?")}

    def close(self, timeout: float = 30) -> None:
        try:
            if not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except Exception:  # noqa: BLE001 - a stuck engine must not keep the report from being written
            self.proc.kill()
            self.proc.wait(timeout=30)


def install_hotwire(wheel: Path, dest: Path) -> tuple[Path | None, str]:
    """``pip install --no-deps --target`` (unzip if pip cannot), so only the hotwire engine's path sees it."""
    target = dest / "hotwire-site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
           str(wheel)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        import zipfile

        try:
            zipfile.ZipFile(wheel).extractall(target)  # a wheel is a zip of the site-packages layout
        except Exception as exc:  # noqa: BLE001
            return None, f"pip failed ({proc.stderr.strip()[-300:]}) and unzip failed ({exc})"
    return target, "installed"


def visible_plugins(env: dict) -> list[str]:
    """The ``vllm.general_plugins`` entry points a process with ``env`` would load."""
    code = ("from importlib.metadata import entry_points as e; import json; "
            "print(json.dumps(sorted(p.name for p in e(group='vllm.general_plugins'))))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else [f"? {proc.stderr.strip()[-200:]}"]


def gpu_memory() -> tuple[str, int, int] | None:
    """(name, total bytes, free bytes) of the engines' GPU (the first of ``CUDA_VISIBLE_DEVICES``, which
    nvidia-smi itself ignores) from nvidia-smi, so the parent never opens a CUDA context."""
    index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,"
                              "nounits", "-i", index], capture_output=True, text=True, timeout=30).stdout
        name, total, free = [x.strip() for x in out.strip().split(",")]
        return name, int(total) << 20, int(free) << 20
    except Exception:  # noqa: BLE001 - no GPU, no nvidia-smi
        return None


def git_sha() -> str:
    """``$DYNSTEER_GIT_SHA`` if set (a device machine's copy of ``.git`` may be stale), else ``git rev-parse``."""
    if os.environ.get("DYNSTEER_GIT_SHA"):
        return os.environ["DYNSTEER_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if sha:
            return sha + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return os.environ.get("DYNSTEER_GIT_SHA", "unknown (no git; set DYNSTEER_GIT_SHA)")


# ---- statistics, table, plot ----------------------------------------------------------------------------------------
def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def paired(xs: list[float], ys: list[float]) -> dict | None:
    """Overhead of xs over ys in %, from per-repeat paired ratios (the lists are aligned by repeat)."""
    n = min(len(xs), len(ys))
    if n == 0:
        return None
    pct = [(x / y - 1) * 100 for x, y in zip(xs[:n], ys[:n])]
    r = lambda v: round(v, 3)  # noqa: E731
    return {"median": r(statistics.median(pct)), "min": r(min(pct)), "max": r(max(pct)), "q25": r(quantile(pct, .25)),
            "q75": r(quantile(pct, .75)), "n": n,
            # less sensitive to one slow run than a ratio of single runs
            "of_medians": r((statistics.median(xs[:n]) / statistics.median(ys[:n]) - 1) * 100),
            "of_minima": r((min(xs[:n]) / min(ys[:n]) - 1) * 100)}


def comparisons(seconds: dict, modes: list[str], batches: list[int]) -> dict:
    """Every mode against absent (with its target where that is its reference), each mode against its own
    reference, and the informative peer pairs."""
    pairs = []
    for k in modes:
        m = BY_KEY[k]
        if k != "absent":
            pairs.append((k, "absent", m.target if m.vs == "absent" else None))
        if m.vs not in (None, "absent"):
            pairs.append((k, m.vs, m.target))
    pairs += [(a, b, None) for a, b in EXTRA_PAIRS]
    out = {}
    for a, b, target in pairs:
        if a not in seconds or b not in seconds:
            continue
        per = {str(bs): paired(seconds[a].get(str(bs), []), seconds[b].get(str(bs), [])) for bs in batches}
        if any(per.values()):
            label = "A/A control: absent2 vs absent" if a == "aa" else f"{BY_KEY[a].label} vs {BY_KEY[b].label}"
            out[label] = {"a": a, "b": b, "target_pct": target, "per_batch": per}
    return out


ABSENT_MODES = ("absent", "aa", "aa3")
IDLE_MODES = ("idle", "idle2", "idle3")  # the same idle mode on engines alike


def _mean_by_repeat(seconds: dict, keys: list[str], b: str) -> list[float]:
    """The per-repeat mean over ``keys`` (repeats aligned by index; as many as all of them have)."""
    runs = [seconds[k].get(b, []) for k in keys]
    return [statistics.mean(r[i] for r in runs) for i in range(min(map(len, runs)))]


def pooled(seconds: dict, modes: list[str], batches: list[int]) -> dict | None:
    """Against the mean of the absent engines, repeat by repeat: with three (``aa3`` run), every mode with a target
    against ``absent``; with two idle engines or more (``idle2``, ``idle3``), the idle engines' mean too. One engine
    process can sit a point off another for a whole run; a mean over several draws of that offset is steadier than
    any one. ``None`` when neither applies."""
    absents = [a for a in ABSENT_MODES if a in seconds]
    idles = [k for k in IDLE_MODES if k in seconds]
    if len(absents) < 3 and (len(idles) < 2 or len(absents) < 2):
        return None
    out = {}
    if len(absents) == 3:
        for k in modes:
            m = BY_KEY[k]
            if k in ABSENT_MODES or m.vs != "absent" or m.target is None:
                continue
            per = {b: paired(seconds[k].get(b, []), _mean_by_repeat(seconds, absents, b)) for b in map(str, batches)}
            if any(per.values()):
                out[f"{m.label} vs the mean of the three absent engines"] = {"a": k, "b": "absent_pool",
                                                                            "target_pct": m.target, "per_batch": per}
    if len(idles) >= 2:
        per = {b: paired(_mean_by_repeat(seconds, idles, b), _mean_by_repeat(seconds, absents, b))
               for b in map(str, batches)}
        if any(per.values()):
            out[f"idle, mean of {len(idles)} dynsteer engines vs the mean of {len(absents)} absent engines"] = {
                "a": "idle", "b": "absent_pool", "target_pct": BY_KEY["idle"].target, "per_batch": per}
    return out


def step_lists(splits: dict) -> dict:
    """The mean decode step (ms) of every repeat, per mode and batch, shaped like ``seconds``."""
    return {k: {b: [x["step_ms"] for x in xs] for b, xs in per.items()} for k, per in splits.items()}


def split_report(splits: dict, modes: list[str]) -> dict:
    """Per mode and batch: each phase's median over repeats, and its paired median difference from absent's (ms;
    the ramp and tail per call, the step per decode step). Repeats pair by index, as in :func:`comparisons`."""
    out: dict = {}
    for k in modes:
        for b, xs in splits.get(k, {}).items():
            ref = splits.get("absent", {}).get(b, [])
            entry = {}
            for phase in ("ramp_ms", "step_ms", "tail_ms"):
                vals = [x[phase] for x in xs]
                diffs = [x[phase] - r[phase] for x, r in zip(xs, ref)]
                entry[phase] = {"median": round(statistics.median(vals), 4),
                                "vs_absent": round(statistics.median(diffs), 4) if diffs and k != "absent" else None}
            out.setdefault(k, {})[b] = entry
    return out


def status(value: float, target: float | None, aa: float | None, is_aa: bool) -> str:
    if target is None:
        return ""
    if is_aa:
        return "✓" if abs(value) <= target else "✗"
    if value <= target:
        return "✓"
    return "≈" if aa is not None and value <= target + abs(aa) else "✗"


def print_comparisons(title: str, comps: dict, batches: list, verification: dict, first_row: str = "") -> None:
    """One markdown table of comparisons, each cell marked against its target with that table's own A/A."""
    aa = {b: c["median"] for b, c in comps.get("A/A control: absent2 vs absent", {}).get("per_batch", {}).items()
          if c}
    print()
    print(f"| {title} | " + " | ".join(f"batch {b}" for b in batches) + " | target | steering changed tokens |")
    print("|---" * (len(batches) + 3) + "|")
    if first_row:
        print(first_row)
    for label, comp in comps.items():
        a, target, is_aa = comp["a"], comp["target_pct"], comp["a"] in ABSENT_MODES
        cells = []
        for b in batches:
            c = comp["per_batch"].get(str(b))
            cells.append("—" if c is None else
                         f"{c['median']:+.2f} {status(c['median'], target, aa.get(str(b)), is_aa)}".strip())
        tgt = "" if target is None else (f"\\|x\\| ≤ {target:g}" if is_aa else
                                         "≤ 0 (never slower)" if target == 0 else f"≤ +{target:g}")
        ver = verification.get(a, {}).get("steering_changed_tokens")
        vcell = "—" if ver is None else ("yes" if ver else "**NO ⚠**")
        flag = " ⚠ steering not verified" if ver is False else ""
        print(f"| {label}{flag} | " + " | ".join(cells) + f" | {tgt} | {vcell} |")


def print_mode_table(title: str, per_mode: dict, batches: list, cell: Any) -> None:
    """A markdown table, a row per mode and a column per batch: ``cell(mode, batch, entry)`` for each entry present
    (``—`` where none); nothing when ``per_mode`` is empty."""
    if not per_mode:
        return
    print(f"\n| {title} | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---" * (len(batches) + 1) + "|")
    for k, per in per_mode.items():
        cells = [cell(k, str(b), per[str(b)]) if per.get(str(b)) else "—" for b in batches]
        print(f"| {BY_KEY[k].label} | " + " | ".join(cells) + " |")


def print_tables(report: dict) -> None:
    batches = report["args"]["batches"]
    aa = report.get("aa_pct") or {}
    verification = report.get("verification", {})
    tps = report["tokens_per_s"].get("absent", {})
    print_comparisons("comparison (overhead % of the whole call, median of paired ratios)", report["overhead_pct"],
                      batches, verification,
                      "| absent (tok/s) | " + " | ".join(f"{tps.get(str(b), 0):.0f}" for b in batches) + " | | |")
    if report.get("step_overhead_pct"):
        print_comparisons("comparison (overhead % of the mean decode step, median of paired ratios)",
                          report["step_overhead_pct"], batches, verification)
    if report.get("pooled_step_overhead_pct"):
        print_comparisons("comparison (overhead % of the mean decode step against the mean of the absent engines)",
                          report["pooled_step_overhead_pct"], batches, verification)
    skipped = report.get("skipped") or {}
    for name, why in skipped.items():
        print(f"| ({name}: not run: {why}) |" + " |" * (len(batches) + 2))
    # per-step host time
    host = report.get("host_counters") or {}

    def wall_cell(k: str, b: str, xs: list[float]) -> str:
        cell = f"{statistics.median(xs) / report['args']['tokens'] * 1e3:.3f}"
        c = host.get(k, {}).get(b)
        if c and c.get("steps") and c.get("dynamic_steps"):  # dynamic-tier host work, when any
            cell += (f" [{c['host_ms'] / c['steps']:.3f} / {c['controller_ms'] / c['steps']:.3f} / "
                     f"{c['wait_ms'] / c['steps']:.3f}]")
        if c and c.get("takes"):  # capture delivery per call: engine core (take, pack), writer's queue, caller
            n = c["takes"]
            cell += (f" {{take {c['take_ms'] / n:.2f} + pack {c.get('pack_ms', 0) / n:.2f} ms, writer queue "
                     f"{c['take_backlog'] / n:.1f}, caller {c.get('deliver_ms', 0) / n:.2f} ms}}")
        if c and c.get("rows_written"):  # rows rewritten in timed calls: the row pool is too small
            cell += f" ({c['rows_written'] / len(xs):.1f} rows)"
        return cell

    print_mode_table("mode: wall ms per step [dynsteer host ms per step: staging / read-back / waiting] {capture per "
                     "call: take_captures + packing ms in the engine core, spool writer queue then, the caller's whole "
                     "delivery ms} (table rows written per timed call)", report["seconds"], batches, wall_cell)
    print_mode_table("mode: CPU busy over the call, frontend / engine core (median; max for the engine core)",
                     report.get("cpu_busy_repeats") or {}, batches,
                     lambda k, b, xs: f"{statistics.median(x['front'] for x in xs):.2f} / "
                                      f"{statistics.median(x['core'] for x in xs):.2f} "
                                      f"({max(x['core'] for x in xs):.2f})")
    print_mode_table("mode: ramp ms / decode step ms / tail ms (paired median difference from absent)",
                     report.get("timing_split") or {}, batches,
                     lambda k, b, e: " / ".join(
                         f"{e[p]['median']:.3f}" + ("" if e[p]["vs_absent"] is None else f" ({e[p]['vs_absent']:+.3f})")
                         for p in ("ramp_ms", "step_ms", "tail_ms")))
    print("\nA/A (absent2 vs absent, paired median): "
          + ", ".join(f"batch {b}: {aa[str(b)]:+.2f} %" for b in batches if str(b) in aa)
          + f" (aim ≤ {AA_TARGET_PCT} %); repeats: {report['repeats_done']}")


def plot(report: dict, path: Path) -> Path | None:
    """Overhead % vs batch size, one line per mode (vs absent), the A/A band shaded: whole calls, mean decode steps
    (when the report has the timing split), and the peers in a panel of their own."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot (re-plot elsewhere with --from-json)")
        return None
    batches = report["args"]["batches"]
    whole, step = report["overhead_pct"], report.get("step_overhead_pct")
    comps = {c["a"]: c for c in whole.values() if c["b"] == "absent" and c["a"] != "aa"}
    peers = {"eager", "hook"}
    panels = [("whole call: dynsteer and hotwire-vllm", whole, [k for k in comps if k not in peers])]
    if step:
        panels.append(("mean decode step: dynsteer and hotwire-vllm", step, [k for k in comps if k not in peers]))
    if any(k in comps for k in peers):
        panels.append(("eager forward-hook peer (and hotwire's workload)", whole,
                       [k for k in comps if k in peers or k in ("hwsteered", "hwload")]))
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels) + 3, 6), squeeze=False)
    colors = plt.get_cmap("tab20")
    for ax, (title, src, keys) in zip(axes[0], panels):
        aa = src.get("A/A control: absent2 vs absent")
        by_mode = {c["a"]: c for c in src.values() if c["b"] == "absent" and c["a"] != "aa"}
        if aa:
            xs = [b for b in batches if aa["per_batch"].get(str(b))]
            med = [abs(aa["per_batch"][str(b)]["median"]) for b in xs]
            ax.fill_between(xs, [-m for m in med], med, color="grey", alpha=0.35,
                            label="A/A: ± |paired median| (absent2 vs absent)")
            ax.fill_between(xs, [aa["per_batch"][str(b)]["q25"] for b in xs],
                            [aa["per_batch"][str(b)]["q75"] for b in xs], color="grey", alpha=0.15,
                            label="A/A: quartiles of paired ratios")
        for i, k in enumerate(keys):
            if k not in by_mode:
                continue
            per = by_mode[k]["per_batch"]
            xs = [b for b in batches if per.get(str(b))]
            ver = report.get("verification", {}).get(k, {}).get("steering_changed_tokens")
            ax.plot(xs, [per[str(b)]["median"] for b in xs], marker="o", color=colors(i % 20),
                    linestyle="--" if ver is False else "-",
                    label=BY_KEY[k].label + (" (steering NOT verified)" if ver is False else ""))
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("decode batch size")
        ax.set_ylabel("overhead vs absent (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{report['device']}, {report['model']}, {report['args']['tokens']} tokens, "
                 f"{report['repeats_done']} repeats ({report['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- profile summaries ----------------------------------------------------------------------------------------------
def summarize_trace(path: Path, steps: int, top: int = 15) -> dict:
    """Top CPU ops by self time and top device kernels by time, per step, from a chrome trace of torch.profiler; the
    device's busy / idle time, idle time by tenth of the call, and the batch of the first steps (a batch prefilled in
    more steps than vLLM alone takes shows requests reaching the engine core late)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels: Counter = Counter()
    host_self: Counter = Counter()
    threads: dict = defaultdict(list)
    spans: list = []  # device intervals, for the time the device sat idle waiting for work
    device_events: list = []  # (start, duration, name) of every kernel / copy, for the steady-state window
    batches: list = []  # vLLM's per-step annotations ("execute_context_<reqs>(<tokens>)_generation_<reqs>(<tokens>)")
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        if cat == "user_annotation" and str(e.get("name", "")).startswith("execute_context_"):
            batches.append((e["ts"], e["name"]))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[e["name"]] += e["dur"]
            spans.append((e["ts"], e["ts"] + e["dur"]))
            device_events.append((e["ts"], e["dur"], e["name"]))
        elif cat in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function"):
            threads[(e.get("pid"), e.get("tid"))].append(e)
    for evs in threads.values():  # self time: an event's duration less that of the events nested in it
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []

        def pop() -> None:
            _, ev, child = stack.pop()
            if ev.get("cat") != "user_annotation":
                host_self[ev["name"]] += ev["dur"] - child

        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                pop()
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e, 0.0])
        while stack:
            pop()
    per = lambda c: [[name, round(us / steps, 2)] for name, us in c.most_common(top)]  # noqa: E731
    # Device idle between its first and last kernel: gaps where it waited for the host (a host-bound step shows
    # here, not in kernel time). Gaps over 20 µs are counted separately: launch latency is a few µs.
    spans.sort()
    busy, idle, big, end = 0.0, 0.0, 0.0, None
    tenths = [0.0] * 10  # idle time by tenth of the call: the first tenths hold admission (requests trickling in)
    first, last = (spans[0][0], max(b for _, b in spans)) if spans else (0.0, 1.0)
    for a, b in spans:
        if end is not None and a > end:
            idle += a - end
            big += a - end if a - end > 20 else 0.0
            tenths[min(9, int((end - first) / max(last - first, 1e-9) * 10))] += a - end
        busy += max(0.0, b - max(a, end if end is not None else a))
        end = b if end is None else max(end, b)
    # the batch of each of the first steps (one annotation per step and thread: deduplicated by name in order)
    seen: list = []
    for _, name in sorted(batches):
        short = name.removeprefix("execute_context_").replace("_generation_", " + decode ")
        if not seen or seen[-1] != short:
            seen.append(short)
    return {"steps": steps, "first_steps": seen[:4], "device_idle_ms_by_tenth": [round(x / 1e3, 2) for x in tenths],
            "host_self_us_per_step_total": round(sum(host_self.values()) / steps, 1),
            "device_us_per_step_total": round(sum(kernels.values()) / steps, 1),
            "device_busy_us_per_step": round(busy / steps, 1), "device_idle_us_per_step": round(idle / steps, 1),
            "device_idle_gaps_over_20us_per_step": round(big / steps, 1),
            "top_host_ops_self_us_per_step": per(host_self), "top_device_kernels_us_per_step": per(kernels),
            "steady": steady_window(device_events, batches)}


def steady_window(device_events: list, batches: list) -> dict:
    """The second half of the call's device time (pure decode at every batch size here): the steps vLLM annotated
    there, the device's period per step, its busy and idle time per step, and every kernel with its launches and
    time per step (the whole list: an extra small kernel per layer is what a top-N list hides)."""
    if not device_events:
        return {}
    device_events.sort()
    first, last = device_events[0][0], max(a + d for a, d, _ in device_events)
    start = first + (last - first) / 2
    window = [ev for ev in device_events if ev[0] >= start]
    marks: list = []  # decode-step annotations (one per step and thread: those 0.5 ms apart count once)
    for ts, name in sorted(batches):
        if ts >= start and name.startswith("execute_context_0(0)") and (not marks or ts - marks[-1] > 500):
            marks.append(ts)
    steps = len(marks) or 1
    kernels: dict = defaultdict(lambda: [0, 0.0])
    busy, end = 0.0, None
    for a, d, name in window:
        kernels[name][0] += 1
        kernels[name][1] += d
        busy += max(0.0, a + d - max(a, end if end is not None else a))
        end = a + d if end is None else max(end, a + d)
    span = last - window[0][0]
    # the pace: from the first counted step's start to the last's (host annotations; equal to the device's pace in
    # a steady decode), per step
    period = (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else span / steps
    rows = sorted(([name[:160], round(n / steps, 3), round(us / steps, 3)] for name, (n, us) in kernels.items()),
                  key=lambda r: -r[2])
    return {"steps": steps, "period_us": round(period, 2), "busy_us_per_step": round(busy / steps, 2),
            "idle_us_per_step": round(period - busy / steps, 2),
            "launches_per_step": round(sum(n for n, _ in kernels.values()) / steps, 2), "kernels": rows}


# ---- main -----------------------------------------------------------------------------------------------------------
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
    ap.add_argument("--model-dir", help="model folder (default: a Llama-3-8B-shaped config.json, dummy weights)")
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
    return args


def cpu_list(text: str) -> set[int]:
    """``"2-3,6"`` -> ``{2, 3, 6}``."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin_spec(text: str) -> tuple[list[int], list[int]]:
    """``--pin-cores FRONT:CORE`` (or one list for both), checked against the cpus this process may use."""
    front, _, core = text.partition(":")
    try:
        sets = cpu_list(front), cpu_list(core or front)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pin-cores: {text!r} is not FRONT:CORE cpu lists (e.g. 2-3:4-7)")
    allowed = os.sched_getaffinity(0)
    for cpus in sets:
        if not cpus or not cpus <= allowed:
            raise argparse.ArgumentTypeError(f"--pin-cores: {sorted(cpus)} is not within the usable cpus "
                                             f"{sorted(allowed)}")
    return sorted(sets[0]), sorted(sets[1])


def pin_engine(pid: int, front: list[int], core: list[int]) -> dict:
    """Pin every thread of worker ``pid`` to ``front`` and every thread of its descendants (the engine core) to
    ``core`` (threads started later inherit their creator's mask). Returns what was pinned."""
    proc = psutil.Process(pid)
    done = {"front": front, "core": core, "threads": 0, "processes": 0}
    for p, cpus in [(proc, front)] + [(c, core) for c in proc.children(recursive=True)]:
        try:
            for t in p.threads():
                os.sched_setaffinity(t.id, cpus)
                done["threads"] += 1
            done["processes"] += 1
        except (psutil.NoSuchProcess, ProcessLookupError):  # a helper process that exited meanwhile
            continue
    return done


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by worker ``pid`` (the frontend: ``LLM``) and by its descendants
    (vLLM's engine core, which runs the model runner, and any helper it started); read between calls."""
    def used(p: "psutil.Process") -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.NoSuchProcess:
            return 0.0

    proc = psutil.Process(pid)
    return used(proc), sum(used(c) for c in proc.children(recursive=True))


def host_facts() -> dict:
    """The host the run's engines share: CPU model, logical CPUs, load (runs on different leases differ)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu_model": model, "logical_cpus": os.cpu_count(), "loadavg": list(os.getloadavg())}


def find_wheel(arg: str | None) -> Path | None:
    cands = [arg, os.environ.get("HOTWIRE_WHEEL")]
    for folder in (REPO / ".gpu-carry", Path("/tmp/hw")):
        cands += [str(p) for p in sorted(folder.glob("hotwire_vllm-*.whl"))] if folder.is_dir() else []
    return next((Path(c) for c in cands if c and Path(c).is_file()), None)


class Bench:
    """One run: which engines, their start-up, warm-up and verification, the timed repeats, the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.perf_counter()
        self.budget_s = args.max_minutes * 60
        self.out_dir = Path(args.out or (tempfile.mkdtemp(prefix="overhead-smoke-") if args.cpu_smoke else
                                         REPO / "benchmarks" / "results"))
        self.work_dir = Path(tempfile.mkdtemp(prefix="overhead-run-"))
        print(f"engine logs and scratch: {self.work_dir}", flush=True)
        if args.model_dir:
            self.model_dir = Path(args.model_dir)
        elif args.cpu_smoke:
            from dynsteer.testing.tiny_models import tiny_model

            self.model_dir = tiny_model("llama")
        else:
            self.model_dir = self.work_dir / "llama3-8b-shape"
            self.model_dir.mkdir()
            (self.model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
        self.mcfg = json.loads((self.model_dir / "config.json").read_text())
        self.num_layers = self.mcfg["num_hidden_layers"]
        self.dtype_bytes = 4 if args.dtype in ("float32", "float") else 2
        max_batch = max(args.batches)
        self.max_model_len = -(-(args.prompt_len + args.tokens + 16) // 16) * 16
        # enough KV for the largest batch (and a margin), whatever the memory left on the device
        self.kv_bytes = max(int(kv_bytes_per_token(self.mcfg, self.dtype_bytes) * max_batch
                                * (self.max_model_len + 32) * 1.1), 256 << 20)
        self.modes: list[str] = list(args.modes)
        self.engines: list[str] = []
        self.skipped: dict[str, str] = {}
        self.envs: dict[str, dict] = {}
        self.plugins: dict[str, list[str]] = {}
        self.cfgs: dict[str, dict] = {}
        self.live: dict[str, Engine] = {}
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
        self.affinity: dict = {}
        self.host_facts = host_facts()
        self.burn_in_calls: dict[str, dict[str, list[dict]]] = {}
        self.repeats_done, self.stopped_early = 0, False
        self.date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
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
        if "hotwire" in engines:
            self._install_hotwire()
        env_base = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false"}
        if args.cpu_smoke:  # as tests/conftest.py builds CPU engines
            env_base.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
        for e in ENGINES:
            env = dict(env_base)
            path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "hotwire-site" not in p]
            if e == "hotwire" and self.hotwire_dir is not None:
                path.insert(0, str(self.hotwire_dir))
            env["PYTHONPATH"] = os.pathsep.join(path)
            if ENGINE_KIND[e] != "dynsteer":
                env["DYNSTEER_DISABLE"] = "1"
            if e == "hook":  # apply_model pickles the hook installer; its processes import it from benchmarks/
                env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
                env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent)] + path)
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
        gpu = gpu_memory()
        if gpu is not None:  # keep what fits, in priority order
            name, total, free = gpu
            per = weight_bytes(self.mcfg, self.dtype_bytes) + self.kv_bytes + (3 << 30) // 2
            room, kept = free * 0.95, []
            for e in engines:
                need_b = per + ((1 << 30) if ENGINE_KIND[e] == "dynsteer" else 0)  # + dynsteer's tables
                if room >= need_b:
                    kept.append(e)
                    room -= need_b
                else:
                    self.skipped[e] = (f"does not fit in GPU memory ({free / 2**30:.0f} GiB free, ~"
                                       f"{need_b / 2**30:.0f} GiB per engine; an H200 holds all six)")
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
        wheel = find_wheel(self.args.hotwire_wheel)
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
                    timing_split=args.timing_split)
        for e in self.engines:
            dyn = None
            if ENGINE_KIND[e] == "dynsteer":
                # default DynsteerConfig but for rows: every mode's configurations at once (module docstring)
                dyn = {"max_rows": max(64, max(args.batches) + 2) + 32}
                if e == "dynsteer-inline":
                    dyn.update(forward="inline")
                if e == "dynsteer-bare":  # nothing hooked: the plugin's glue around vLLM's own forward
                    dyn.update(layers=[], require=False)
                if e == "dynsteer-1layer":
                    dyn.update(layers=[steer_layer(self.num_layers)])
                if e == "dynsteer-capture":
                    from dynsteer.config import MonitorConfig

                    layer = steer_layer(self.num_layers)
                    # the async tier's stream of the same place: costs nothing until a monitor subscribes (mode
                    # "stream" runs one in the engine's process, reading every frame)
                    mon = MonitorConfig.private(streams={"resid": {"places": [f"{layer}.post_block"]}})
                    dyn.update(capture_sites=["post_block"], capture_layers=[layer],
                               monitor=mon.model_dump(mode="json"))
            self.cfgs[e] = dict(base, engine=e, kind=ENGINE_KIND[e], dynsteer=dyn,
                                profile_dir=str(self.work_dir / "profile" / e) if args.profile else None)
        failed: dict[str, str] = {}
        deadline = time.perf_counter() + args.start_timeout

        def start(e: str) -> None:
            self.live[e] = Engine(e, self.cfgs[e], self.envs[e], self.work_dir)

        def ready(e: str) -> None:
            try:
                info = self.live[e].wait_ready(max(deadline - time.perf_counter(), 1.0))
                print(f"{e}: engine up in {time.perf_counter() - self.live[e].started:.0f} s", flush=True)
            except EngineDied as exc:
                failed[e] = str(exc)
                print(f"{e}: FAILED to start\n{exc}", flush=True)
                self.live.pop(e).close(5)
                return
            if e == "hotwire" and not info.get("hotwire_loaded"):
                print("hotwire: warning: the plugin module is not loaded in the frontend process", flush=True)

        clones = [e for e in self.engines if e in CLONES]
        for e in [e for e in self.engines if e not in CLONES]:
            start(e)
            if args.serial_start or e == "absent":
                ready(e)
        for origin in dict.fromkeys(CLONES[e] for e in clones):  # absent is up; dynsteer may still be starting
            if origin in self.live and not self.live[origin].info:
                ready(origin)
            if origin not in self.live:
                failed.update({e: f"{origin}, the engine it copies, did not start" for e in clones
                               if CLONES[e] == origin})
                continue
            for e in (e for e in clones if CLONES[e] == origin):
                start(e)
                if args.serial_start:
                    ready(e)
        for e in [e for e in self.engines if e in self.live and not self.live[e].info]:
            ready(e)
        for e, why in failed.items():
            self.skipped[e] = "failed to start: " + why.splitlines()[0][:200]
        if "absent" not in self.live or "absent2" not in self.live:
            self.close()
            sys.exit("the absent engines did not start")
        self.modes = [k for k in self.modes if BY_KEY[k].engine in self.live]
        self.seconds = {k: {str(b): [] for b in args.batches} for k in self.modes}
        if args.pin_cores:
            self.affinity = {e: pin_engine(eng.proc.pid, *args.pin_cores) for e, eng in self.live.items()}
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
        eng = self.live.get(BY_KEY[k].engine)
        if eng is None or k in self.errors:
            return None
        try:
            before = cpu_seconds(eng.proc.pid) if HAVE_PSUTIL else None
            res = eng.call({"op": "run", "mode": k, "batch": batch, **extra}, self.args.run_timeout)
            after = cpu_seconds(eng.proc.pid) if HAVE_PSUTIL else None
            # how busy the frontend and the engine core were over the call (1.0: a core flat out)
            if before and after and res.get("s"):
                res["cpu_busy"] = {"front": round((after[0] - before[0]) / res["s"], 3),
                                   "core": round((after[1] - before[1]) / res["s"], 3)}
        except EngineDied as exc:  # its modes stop here; the others go on
            for m in self.modes:
                if BY_KEY[m].engine == eng.name:
                    self.errors.setdefault(m, f"engine died: {str(exc)[:300]}")
            self.live.pop(eng.name).close(5)
            print(f"{eng.name}: died\n{exc}", flush=True)
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

    # -- report -------------------------------------------------------------------------------------------------------
    def report(self) -> dict:
        args = self.args
        secs = {k: v for k, v in self.seconds.items() if any(v.values())}
        comps = comparisons(secs, self.modes, args.batches)
        aa = comps.get("A/A control: absent2 vs absent", {}).get("per_batch", {})
        aa_pct = {b: c["median"] for b, c in aa.items() if c}
        info = self.info0
        model = (str(args.model_dir) if args.model_dir else "tiny random Llama (CPU smoke)" if args.cpu_smoke
                 else "Llama-3-8B shape")
        return {
            "benchmark": "overhead", "date": self.date, "device": self.device,
            "versions": {"torch": info.get("torch"), "vllm": info.get("vllm"), "triton": info.get("triton"),
                         "dynsteer": git_sha(), "hotwire": self.hotwire_version, "python": sys.version.split()[0]},
            "args": {k: v for k, v in vars(args).items() if k != "worker"},
            "model": f"{model}, load_format={args.load_format}, {args.dtype}, "
                     + ("eager" if args.eager else "CUDA graphs on"),
            "engines": {e: {"kind": ENGINE_KIND[e], "dynsteer_config": self.cfgs[e]["dynsteer"],
                            "plugins_visible": self.plugins.get(e),
                            "startup_s": self.live[e].info.get("startup_s") if e in self.live else None,
                            "table_bytes": self.live[e].info.get("table_bytes") if e in self.live else None}
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
            "seconds": secs,
            "seconds_by_engine": {e: {k: secs[k] for k in secs if BY_KEY[k].engine == e} for e in self.cfgs},
        }

    def save(self, report: dict) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(self.json_path)

    def close(self) -> None:
        """Closing stdin ends a worker; all at once, so their shutdowns overlap."""
        for eng in self.live.values():
            try:
                eng.proc.stdin.close()
            except OSError:
                pass
        for eng in self.live.values():
            eng.close(timeout=30)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
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
    bench = Bench(args)
    bench.choose_engines()
    bench.start_engines()
    try:
        bench.warm_up_and_verify()
        bench.burn_in()
        bench.measure()
        if args.profile:
            bench.profile()
        report = bench.report()
        bench.save(report)  # before the engines close: a slow shutdown must not cost the report
        print_tables(report)
        png = plot(report, bench.json_path.with_suffix(".png"))
        print(f"wrote {bench.json_path}" + (f" and {png}" if png else ""), flush=True)
    finally:
        bench.close()


if __name__ == "__main__":
    main()
