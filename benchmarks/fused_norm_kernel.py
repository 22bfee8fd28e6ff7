"""The device side of the fused forward: dynsteer's ``steer_add_rms_norm`` against the add + RMS norm it replaces.

In the fused forward (``DynsteerConfig.forward="fused"``) each decoder layer's two add-norms are dynsteer's kernel,
which also runs the steering sites before them. An idle engine therefore differs from vLLM on the device only by that
kernel's speed against the norm inductor compiles from vLLM's ``fused_add_rms_norm``. This measures both over the 64
add-norms of a 32-layer, 4096-wide model, captured in CUDA graphs and replayed alternately (bf16):

* ``vllm``: ``torch.compile`` of vLLM's native ``fused_add_rms_norm`` (``fused_reference.add_rms_norm_reference``,
  equal to it bit for bit: what inductor compiles in an engine with ``custom_ops: none``), chained as in a model;
* ``idle``: dynsteer's kernel with the default engine's tables (dynamic tier on), every token on row 0;
* ``static``: every token on a row adding a vector at both sites of every norm;
* ``static1``: every token on a row adding a vector at one site of the model (a global 1-layer spec: the other 95
  sites see a row with nothing there);
* ``dynamic``: every token on a row with a monitor gate and a gated vector at both sites;
* with ``--launch-probe``, ``plain`` (the add-norm kernel alone, 9 launch arguments) and ``bare`` (dynsteer's
  kernel with no site: 50 arguments, no site code): the same math launched leaner, to tell an idle norm's cost
  over vLLM's apart into arguments, code and math.

Back to back, every operand of a norm sits in L2; in a model the GEMMs between norms evict it, and a kernel of one
program per token then costs its chain of memory round trips. ``--evict-mb 64`` writes a scratch buffer before
each norm; ``--gemm-mb 64`` puts a GEMM between norms whose output feeds the next one, as a model's projections do
(H200, 2026-11-24: the engine's profile had dynsteer's norms at +31 µs per forward at batch 1, which the first
reproduces and the back-to-back chain does not). ``--llama`` puts a Llama-3-8B layer's projections between norms
instead (attention side: the ``q`` part of ``qkv_proj``, then ``o_proj``; MLP side: ``gate_up_proj``, SiLU and
product, ``down_proj``; bf16, one set of weights shared by every layer, each larger than L2), so each norm reads the
output of the GEMM kind it follows in an engine. ``--traced`` adds both chains compiled whole by torch.compile: the
traced op launched from inductor's code against inductor's own add-norm. ``--kernel-times`` profiles a few replays
of each graph and reports its largest kernels' mean duration per call, the add-norms among them (the engine
profile's measure, which a graph's total time folds into its neighbours').

    python3 benchmarks/fused_norm_kernel.py --out benchmarks/results
    python3 benchmarks/fused_norm_kernel.py --tokens 1 64 --gemm-mb 64 --traced --out benchmarks/results
    python3 benchmarks/fused_norm_kernel.py --tokens 1 64 --llama --traced --kernel-times --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from dynsteer import DynsteerConfig, SITES  # noqa: E402
from dynsteer.kernels.triton_fused import add_rms_norm_triton, steer_add_rms_norm_triton  # noqa: E402
from dynsteer.steering.site import SiteHook, fused_add_rms_norm  # noqa: E402
from dynsteer.steering.tables import SteeringTables  # noqa: E402
from lib.graphs import alternate, capture_graph, kernel_times, time_replays
from lib.report import print_table_head, utc_now, write_report
from lib.stats import paired_difference


def build(layers: int, hidden: int, max_tokens: int) -> tuple[SteeringTables, list[tuple[SiteHook, SiteHook]]]:
    """Default tables and, per norm, the pair of sites the fused forward runs in it."""
    cfg = DynsteerConfig()
    tables = SteeringTables([(l, s) for l in range(layers) for s in SITES], hidden, cfg.max_rows, cfg.max_clamps,
                            max_tokens, device="cuda", max_gates=cfg.max_gates)
    hooks = {(l, s): SiteHook(tables, l, s) for l in range(layers) for s in SITES}
    pairs = []
    for layer in range(layers):
        if layer:  # input norm: post_block of the layer before, then pre_attn
            pairs.append((hooks[(layer - 1, "post_block")], hooks[(layer, "pre_attn")]))
        pairs.append((hooks[(layer, "post_attn")], None))  # the mid norm
    return tables, pairs


def fill_rows(tables: SteeringTables, hidden: int, steered_layer: int) -> None:
    """Row 1: a vector at every site (``static``); row 2: the same vector plus a monitor and a gated vector
    (``dynamic``); row 3: row 1's vector at one site only, ``post_block`` of ``steered_layer`` (``static1``). Each
    with its ``row_live`` flags (the kernels skip a site whose flags are 0)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (layer, site) in tables.sites:
        v = tables.views(layer, site)
        v["vec"][1] = v["vec"][2] = torch.randn(hidden, device="cuda", generator=gen) * 0.01
        v["mon_mask"][2] = 1
        v["mon_probe"][2, 0] = torch.randn(hidden, device="cuda", generator=gen) / hidden ** 0.5
        v["mon_sharp"][2, 0] = 4.0
        v["dyn_mask"][2] = 1
        v["dyn_vec"][2, 0] = torch.randn(hidden, device="cuda", generator=gen) * 0.01
        v["row_live"][1], v["row_live"][2] = 1, 1 | 4 | 8
    mid = tables.views(steered_layer, "post_block")
    mid["vec"][3] = mid["vec"][1]
    mid["row_live"][3] = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="before each add-norm, write a scratch buffer of this size (MB), evicting L2 as the GEMMs "
                         "between a model's norms do (0: back-to-back norms, their operands L2-resident)")
    ap.add_argument("--gemm-mb", type=int, default=0,
                    help="between add-norms, a GEMM of the norm's output with a weight of this size (MB, bf16) whose "
                         "output feeds the next norm, as a model's projections do (evicts L2 and keeps the chain's "
                         "dependencies under torch.compile; exclusive with --evict-mb)")
    ap.add_argument("--traced", action="store_true",
                    help="also time the kernel as torch.compile launches it in an engine (the traced op)")
    ap.add_argument("--llama", action="store_true",
                    help="between add-norms, a Llama-3-8B layer's projections (exclusive with --gemm-mb / --evict-mb)")
    ap.add_argument("--kernel-times", action="store_true",
                    help="also report each graph's largest kernels' mean duration per call (profiled replays)")
    ap.add_argument("--launch-probe", action="store_true",
                    help="also time the same math launched leaner: 'plain', the add-norm kernel alone (9 arguments, "
                         "no site code); 'bare', dynsteer's kernel with no site (its 50 arguments, the site code "
                         "compiled away): where an idle norm's cost over vLLM's comes from (arguments, code, math)")
    ap.add_argument("--num-warps", type=int, default=0,
                    help="launch dynsteer's kernel with this many warps (0: its own choice by row width)")
    args = ap.parse_args()
    if args.llama and (args.gemm_mb or args.evict_mb):
        ap.error("--llama puts a layer's projections between norms: leave out --gemm-mb and --evict-mb")
    if args.num_warps:  # tuning: the launcher reads the choice through this module global
        import dynsteer.kernels.triton_fused as triton_fused
        triton_fused._num_warps = lambda block_h: args.num_warps
    from dynsteer.kernels.fused_reference import add_rms_norm_reference  # vLLM's native add-norm, bit for bit

    dtype = torch.bfloat16
    compiled = torch.compile(add_rms_norm_reference, dynamic=False)
    tables, pairs = build(args.layers, args.hidden, max(args.tokens))
    fill_rows(tables, args.hidden, args.layers // 2)
    weight = (1 + 0.1 * torch.randn(args.hidden, device="cuda")).to(dtype)
    rows = {}
    scratch = torch.empty(max(args.evict_mb, 1) << 20, dtype=torch.uint8, device="cuda")
    wide = max(args.gemm_mb << 20, 1) // (2 * args.hidden)
    proj = (torch.randn(args.hidden, max(wide, args.hidden), device="cuda") / args.hidden ** 0.5).to(dtype)

    def evict() -> None:
        if args.evict_mb:
            scratch.fill_(1)

    if args.llama:  # Llama-3-8B: q 4096, o_proj 4096², gate_up 2 × 14336, down_proj 14336 → 4096
        def dense(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, device="cuda") / rows ** 0.5).to(dtype)
        w_q, w_o = dense(args.hidden, args.hidden), dense(args.hidden, args.hidden)
        w_gu, w_down = dense(args.hidden, 2 * 14336), dense(14336, args.hidden)

    def project(x: torch.Tensor, i: int) -> torch.Tensor:
        """Norm ``i``'s input from the previous norm's output: a layer's projections (--llama: even norms are mid
        norms, after attention; odd ones input norms, after the MLP), a GEMM (--gemm-mb) or as is."""
        if args.llama:
            if i % 2 == 0:
                return torch.mm(torch.mm(x, w_q), w_o)
            g, u = torch.mm(x, w_gu).chunk(2, dim=-1)
            return torch.mm(torch.nn.functional.silu(g) * u, w_down)
        return torch.mm(x, proj)[:, :args.hidden] if args.gemm_mb else x

    for T in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(T)
        h = torch.randn(T, args.hidden, device="cuda", dtype=dtype, generator=gen)
        r = torch.randn(T, args.hidden, device="cuda", dtype=dtype, generator=gen)

        def vllm_chain(norm):
            """vLLM's add-norms in a model's chain, ``norm`` the reference compiled alone or as is (to be compiled
            with the whole chain)."""
            def run():
                x, res = h, r
                for i in range(len(pairs)):
                    evict()
                    x, res = norm(project(x, i), res, weight, 1e-5)
                return x
            return run

        native = vllm_chain(compiled)

        def ours():
            x, res = h, r
            for i, (first, second) in enumerate(pairs):
                evict()
                x, res = fused_add_rms_norm(first, second, project(x, i), res, weight, 1e-5)
            return x

        graphs = {"vllm": capture_graph(native), "ours": capture_graph(ours)}
        runs = {"vllm": ("vllm", 0), "idle": ("ours", 0), "static": ("ours", 1), "static1": ("ours", 3),
                "dynamic": ("ours", 2)}
        if args.launch_probe:
            graphs["plain"] = capture_graph(vllm_chain(add_rms_norm_triton))
            graphs["bare"] = capture_graph(vllm_chain(
                lambda x, res, w, eps: steer_add_rms_norm_triton(x, res, w, eps, tables.row_index, [], [], [])))
            runs.update({"plain": ("plain", 0), "bare": ("bare", 0)})
        if args.traced:  # as in a compiled engine: the traced op launched from inductor's generated code, against
            # vLLM's add-norm compiled by inductor in the same graph (both chains compiled whole)
            graphs["traced"] = capture_graph(torch.compile(ours, dynamic=False))
            graphs["vllm_traced"] = capture_graph(torch.compile(vllm_chain(add_rms_norm_reference), dynamic=False))
            runs.update({"vllm_traced": ("vllm_traced", 0), "idle_traced": ("traced", 0),
                         "static1_traced": ("traced", 3)})

        def measure(name: str) -> float:
            graph, row = runs[name]
            tables.row_index[:T] = row
            return time_replays(graphs[graph], args.replays)

        us = alternate(list(runs), args.rounds, measure)
        row = {f"{name}_us": round(statistics.median(v), 2) for name, v in us.items()}
        if args.kernel_times:
            row["kernel_us_per_call"] = {
                name: kernel_times(graphs[graph], lambda v=v: tables.row_index[:T].fill_(v))
                for name, (graph, v) in runs.items()}
        tables.row_index.zero_()
        for name in [n for n in runs if not n.startswith("vllm")]:
            base = "vllm_traced" if name.endswith("_traced") else "vllm"  # compiled whole against compiled whole
            row[f"{name}_delta_us"], row[f"{name}_delta_us_range"] = paired_difference(us[base], us[name])
        rows[str(T)] = row
        print(f"T={T}: {json.dumps(row)}", flush=True)
    report = {
        "benchmark": "fused_norm_kernel", "date": utc_now(),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16",
        "layers": args.layers, "hidden": args.hidden, "norms": len(pairs), "replays": args.replays,
        "rounds": args.rounds, "evict_mb": args.evict_mb, "gemm_mb": args.gemm_mb, "num_warps": args.num_warps or None,
        "llama": args.llama,
        "commit": os.environ.get("DYNSTEER_GIT_SHA"),
        "tokens": rows,
    }
    path = write_report(report, args.out)
    print_table_head("tokens per forward", args.tokens)
    for key, label in [("vllm_us", f"{len(pairs)} compiled vLLM add-norms (µs)"),
                       ("idle_delta_us", "dynsteer's kernel, idle: difference (µs)"),
                       ("plain_delta_us", "the add-norm kernel alone (9 arguments): difference (µs)"),
                       ("bare_delta_us", "dynsteer's kernel without sites (50 arguments): difference (µs)"),
                       ("static_delta_us", "every token steered (static): difference (µs)"),
                       ("static1_delta_us", "every token steered at one site of 96: difference (µs)"),
                       ("dynamic_delta_us", "every token gated (monitor + gated vector): difference (µs)"),
                       ("idle_traced_delta_us", "compiled whole (the traced op), idle: difference (µs)"),
                       ("static1_traced_delta_us", "compiled whole, steered at one site: difference (µs)")]:
        if key not in rows[str(args.tokens[0])]:
            continue
        print(f"| {label} | " + " | ".join(f"{rows[str(T)][key]:+.2f}" for T in args.tokens) + " |")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
