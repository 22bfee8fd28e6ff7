"""Static-steering overhead on GPU: decode throughput with dynsteer absent, loaded-idle, and steering 1 or 8 layers.

An 8B-shaped Llama (``load_format="dummy"``: random weights, no download, no tokenizer) generates 128 tokens for
decode batches of 1, 16 and 64 with CUDA graphs on (vLLM's defaults). Every mode runs in its own fresh interpreter
within one invocation, and the report gives each mode's throughput as a ratio to ``absent``.

    PYTHONPATH=/opt/vllm-site python3 benchmarks/static_overhead.py --out benchmarks/results

Results: ``benchmarks/results/static_overhead-<device>-<date>.json`` (+ a markdown table on stdout).
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

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
TARGETS = {"idle": 0.003, "1 layer": 0.005, "8 layers": 0.015}
# dynsteer engine configurations compared (DynsteerConfig fields)
VARIANTS = {
    "op": {},                                                   # defaults: 3 sites × all layers, 2 clamp slots
    "op-post_block": {"sites": ["post_block"]},                # one site per layer
    "inline": {"forward": "inline"},                           # torch ops traced into the graph
    "inline-k0": {"forward": "inline", "max_clamps": 0},       # additive only: fusable gather-add
}


def worker(args: argparse.Namespace) -> None:
    """One engine, one mode family; prints a JSON line with tokens/s per (mode, batch)."""
    import numpy as np
    from vllm import LLM, SamplingParams

    forward = args.forward[0]
    extra = {} if args.mode == "absent" else {"additional_config": {"dynsteer": VARIANTS[forward]}}
    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=1024, max_num_seqs=max(args.batches), gpu_memory_utilization=0.85, seed=0, **extra)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    modes = ["absent"] if args.mode == "absent" else ["idle", "1 layer", "8 layers"]
    prefix = "" if args.mode == "absent" else f"{forward}: "
    steerer = None
    if args.mode != "absent":
        import dynsteer

        steerer = dynsteer.attach(llm)
    results: dict[str, dict[str, float]] = {}
    for mode in modes:
        if steerer is not None:
            steerer.clear_all()
            n_layers = {"idle": 0, "1 layer": 1, "8 layers": 8}[mode]
            for layer in range(n_layers):
                vec = rng.standard_normal(steerer.hidden_size).astype(np.float32) * 0.01
                steerer.set_layer_vector(4 + 3 * layer, vec)
        key = prefix + mode if args.mode != "absent" else mode
        results[key] = {}
        for batch in args.batches:
            prompts = [{"prompt_token_ids": rng.integers(1000, 100000, args.prompt_len).tolist()}
                       for _ in range(batch)]
            llm.generate(prompts, params, use_tqdm=False)  # warm-up (and graph capture for this size)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                times.append(time.perf_counter() - t0)
                assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
            results[key][str(batch)] = batch * args.tokens / statistics.median(times)
    print("RESULT " + json.dumps(results), flush=True)


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The options every overhead benchmark shares (output folder, batch sizes, lengths, repeats)."""
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)


def write_report(report: dict, out_dir: str) -> Path:
    """Write ``report`` as ``<out_dir>/<benchmark>-<device>-<date>.json`` and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{report['benchmark']}-{report['device'].replace(' ', '_')}-{report['date'][:10]}.json"
    path.write_text(json.dumps(report, indent=2))
    return path


def print_table_head(first: str, batches: list) -> None:
    """The first two lines of a markdown table with one column per decode batch size."""
    print(f"| {first} | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---" * (len(batches) + 1) + "|")


def run_worker(script: str, mode: str, label: str, model_dir: Path, args: argparse.Namespace,
               extra: list[str]) -> dict:
    """Run ``script``'s worker for ``mode`` in a fresh interpreter (dynsteer disabled for ``absent``) and return
    the JSON of its ``RESULT`` line; exit with its output if it has none."""
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    if mode == "absent":
        env["DYNSTEER_DISABLE"] = "1"
    cmd = [sys.executable, script, "--worker", mode, "--model-dir", str(model_dir), "--tokens", str(args.tokens),
           "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats), "--batches",
           *map(str, args.batches), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{label} worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    print(f"{label}: {line}", flush=True)
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--forward", nargs="+", default=["op", "op-post_block", "inline-k0"], choices=list(VARIANTS),
                    help="dynsteer configurations to measure (see VARIANTS)")
    ap.add_argument("--worker", choices=["absent", "loaded"], dest="mode")
    ap.add_argument("--model-dir")
    args = ap.parse_args()
    if args.mode:
        return worker(args)

    import torch

    model_dir = Path(tempfile.mkdtemp(prefix="llama8b-shape-"))
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    results: dict[str, dict[str, float]] = {}
    for mode, forward in [("absent", "op")] + [("loaded", f) for f in args.forward]:
        results.update(run_worker(__file__, mode, f"{mode}/{forward}", model_dir, args, ["--forward", forward]))
    base = results["absent"]
    ratios = {m: {b: results[m][b] / base[b] for b in base} for m in results if m != "absent"}
    from importlib.metadata import version

    report = {
        "benchmark": "static_overhead", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": version("vllm"),
        "model": "Llama-3-8B shape, load_format=dummy, bf16", "output_tokens": args.tokens,
        "prompt_tokens": args.prompt_len, "repeats": args.repeats, "tokens_per_s": results,
        "ratio_vs_absent": ratios,
        "overhead_pct": {m: {b: round((1 / r - 1) * 100, 3) for b, r in rs.items()} for m, rs in ratios.items()},
        "targets_pct": {m: t * 100 for m, t in TARGETS.items()},
        "variants": {k: VARIANTS[k] for k in args.forward},
    }
    path = write_report(report, args.out)
    print_table_head("mode", list(base))
    print("| absent (tok/s) | " + " | ".join(f"{base[b]:.0f}" for b in base) + " |")
    for m, rs in report["overhead_pct"].items():
        target = TARGETS[m.split(": ")[-1]] * 100
        print(f"| {m} (overhead %, target ≤ {target:g}) | " + " | ".join(f"{v:+.2f}" for v in rs.values()) + " |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
