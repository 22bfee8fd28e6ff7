"""``overhead.py``'s catalogue: every mode (an engine and a workload; a row of the tables), the engines they run on,
the pairs compared, the targets, and where in the model each mode steers (module docstring of ``overhead.py``)."""

from __future__ import annotations

from dataclasses import dataclass

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
    # stream bandwidth: capture buffers at post_block of every layer, a monitor reading 8 of them or all of them
    Mode("s_idle", "stream engine idle (capture buffers at every layer)", "dynsteer-stream", False),
    Mode("stream8", "stream every generated token, 8 layers, to a monitor", "dynsteer-stream", False, 5.0),
    Mode("streamall", "stream every generated token, every layer, to a monitor", "dynsteer-stream", False),
    Mode("streamall16", "stream every generated token, every layer, bfloat16, to a monitor", "dynsteer-stream",
         False),
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
    # an A/B of code in one run: the same workloads on an engine importing dynsteer from another checkout
    # (--base-checkout), against this checkout's engine (pairs below)
    Mode("o_idle", "idle, base checkout", "dynsteer-base", False),
    Mode("o_prdyn", "per-request dynamic, base checkout", "dynsteer-base", True),
    Mode("o_sync", "per-request dynamic + sync controller, base checkout", "dynsteer-base", True),
    Mode("o_capidle", "capture-enabled idle, base checkout", "dynsteer-base-capture", False),
    Mode("o_capture", "capture every generated token, 1 layer, base checkout", "dynsteer-base-capture", False),
]
BY_KEY = {m.key: m for m in MODES}
# Informative pairs besides "vs absent" and each mode's own target (no target of their own). Steering modes against
# the same engine's idle mode: an engine process can sit a point or two off another for a whole run (same code, same
# GPU), which every "vs absent" figure carries and a comparison within one engine does not.
EXTRA_PAIRS = [("aa3", "aa"), ("idle2", "idle"), ("idle3", "idle"), ("hwsteered", "hwidle"), ("hook", "eager"),
               ("capture", "capidle"), ("stream", "capidle"), ("stream8", "s_idle"), ("streamall", "s_idle"),
               ("streamall16", "s_idle"),
               *((k, "idle") for k in ("static1", "static8", "pr1", "pr16", "pr64", "pr64n", "gate", "prdyn",
                                       "hwload")),
               *((k, "i_idle") for k in ("i_static1", "i_pr64", "i_prdyn")), ("l_static1", "l_idle"),
               ("l_idle", "b_idle"), ("idle", "b_idle"),
               # this checkout against the base checkout, mode by mode (--base-checkout)
               ("idle", "o_idle"), ("prdyn", "o_prdyn"), ("sync", "o_sync"), ("capidle", "o_capidle"),
               ("capture", "o_capture")]
ENGINES = ["absent", "absent2", "dynsteer", "hotwire", "hook", "dynsteer-capture", "dynsteer-stream",
           "dynsteer-inline", "dynsteer-bare", "dynsteer-1layer", "absent3", "dynsteer2", "dynsteer3", "dynsteer-base",
           "dynsteer-base-capture"]  # priority
# started once the engine they copy is up: they read its compile cache rather than race to write it
CLONES = {"absent2": "absent", "absent3": "absent", "dynsteer2": "dynsteer", "dynsteer3": "dynsteer"}
ENGINE_KIND = {"absent": "absent", "absent2": "absent", "absent3": "absent", "dynsteer": "dynsteer",
               "dynsteer2": "dynsteer", "dynsteer3": "dynsteer",
               "dynsteer-capture": "dynsteer", "dynsteer-stream": "dynsteer",
               "dynsteer-inline": "dynsteer", "dynsteer-bare": "dynsteer", "dynsteer-1layer": "dynsteer",
               "dynsteer-base": "dynsteer", "dynsteer-base-capture": "dynsteer",
               "hotwire": "hotwire", "hook": "hook"}
REDUCED_MODES = ["absent", "aa", "idle", "static1", "static8", "pr64", "gate", "prdyn", "sync", "hwload", "hwidle",
                 "hwsteered", "capidle", "capture", "stream"]
ABSENT_MODES = ("absent", "aa", "aa3")
IDLE_MODES = ("idle", "idle2", "idle3")  # the same idle mode on engines alike


# the streams of the stream-bandwidth engine, by mode (``stream`` reads the capture engine's one-layer stream)
STREAM_OF_MODE = {"stream": "resid", "stream8": "resid8", "streamall": "residall", "streamall16": "residall16"}


# ---- where the modes steer (the worker builds its workloads there; the report lists them) -----------------------
def steer_layer(num_layers: int) -> int:
    """The one layer of every 1-layer mode (static, per-request, hotwire's workload, the hook, capture)."""
    return num_layers // 2


def spread_layers(n: int, num_layers: int) -> list[int]:
    n = min(n, num_layers)
    return sorted({round(i * (num_layers - 1) / max(n - 1, 1)) for i in range(n)})


def gate_places(num_layers: int) -> tuple[int, int]:
    """Monitor layer and the layer its gated vector steers (as in the earlier dynamic_overhead.py)."""
    return num_layers // 2, min(num_layers - 1, num_layers // 2 + 4)


