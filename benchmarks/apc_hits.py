"""Prefix-cache hit rates under steering: what dynamic and decode-only steering keep of vLLM's automatic prefix caching.

Two workloads, each run under four steering scenarios on one engine (prefix caching on, 16-token blocks):

* ``shared_prefix``: ``--requests`` prompts share a system prefix of ``--prefix-blocks`` blocks and differ after it;
  one request warms the cache, then the rest run as one batch. Hit rate = prefix-cache hits / queried prompt tokens
  of that batch. Every scenario should keep the unsteered rate: none of them steers a prompt token.
* ``multi_turn``: ``--conversations`` distinct prompts; turn 1 generates ``--turn1-blocks`` blocks; turn 2's prompt
  is turn 1's prompt + output + 3 tokens. Hit rate = hits / queried tokens of the turn-2 batch. Unsteered traffic
  reuses every full block of turn 1; a policy whose gate never fires must keep exactly that; a gate that first fires
  at position ``p`` keeps every block before ``p``'s block and none from it on; decode-only static steering keeps the
  prompt's blocks only (turn 2 prefills turn 1's output unsteered, so the KV turn 1 computed under steering must not
  be served).

Scenarios: ``unsteered``; ``decode_static`` (a per-request vector on the decode tier); ``never`` (a per-request
dynamic policy whose monitor never crosses its threshold); ``midway`` (per conversation, a threshold that the
monitor first crosses about midway through turn 1: picked from a probe run's scores, sharpness 1e4, gate floor 0.5).
Each figure is checked against the block arithmetic above (``expected``); ``--strict`` exits 1 on any mismatch.

    .venv/bin/python benchmarks/apc_hits.py                      # CPU: tiny Llama, float32, eager (~2 min)
    python3 benchmarks/apc_hits.py --out $OUT                    # GPU: bf16, CUDA graphs (async scheduling on)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 16
MON_LAYER, ACT_LAYER = 1, 2
NEVER = 1e9


def _unit(h: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(h)
    return (v / np.linalg.norm(v)).astype(np.float32)


def _vec(h: int, seed: int, scale: float = 6.0) -> np.ndarray:
    return (np.random.default_rng(100 + seed).standard_normal(h) * scale).astype(np.float32)


def _counters(llm: Any) -> tuple[int, int]:
    names = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")
    got = {m.name: m.value for m in llm.get_metrics() if m.name in names}
    return int(got.get("vllm:prefix_cache_hits", 0)), int(got.get("vllm:prefix_cache_queries", 0))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from vllm import LLM

        import dynsteer
        from dynsteer import DynsteerConfig

        self.args = args
        self.gpu = torch.cuda.is_available() and not args.cpu
        cfg = DynsteerConfig(max_gates=2)
        kw: dict[str, Any] = dict(max_model_len=512, max_num_seqs=max(args.requests, args.conversations), seed=0,
                                  enable_prefix_caching=True, block_size=BLOCK, disable_log_stats=False)
        if self.gpu:
            kw.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_util)
        else:
            kw.update(dtype="float32", enforce_eager=True)
        self.llm = LLM(model=str(args.model), **kw, **cfg.engine_kwargs())
        self.st = dynsteer.attach(self.llm)
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        self.async_scheduling = bool(getattr(sched, "async_scheduling", False))
        self.vocab = min(int(self.llm.llm_engine.model_config.get_vocab_size()), 30000)
        self.rng = np.random.default_rng(args.seed)

    # ---- steering -------------------------------------------------------------------------------------------------
    def _policy(self, threshold: float, sharpness: float = 4.0, floor: float = 0.0) -> Any:
        from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule

        h = self.st.hidden_size
        mon = ProbeGate(name="m", layer=MON_LAYER, direction=_unit(h, 0), sharpness=sharpness, threshold=threshold)
        act = Action(kind="add", layer=ACT_LAYER, vector=_vec(h, 1))
        return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act], gate_floor=floor)])

    def _decode_spec(self) -> Any:
        from dynsteer import AddVector, SteeringSpec

        return SteeringSpec(vectors=[AddVector(layer=ACT_LAYER, vector=_vec(self.st.hidden_size, 1), tier="decode")])

    def _midway(self, prompts: list[dict], params: Any) -> tuple[list[Any], list[int | None]]:
        """Per prompt, a threshold the monitor first crosses after the first generated block and before the last;
        returns the policies and the positions where they are expected to first fire (None: no such crossing)."""
        probe = self.st.generate(prompts, params, policy=self._policy(NEVER, sharpness=1.0))
        pols, at = [], []
        for p, out in zip(prompts, probe):
            scores, pos = out.trace.scores().astype(np.float64).ravel(), np.asarray(out.trace.position)
            n0 = len(p["prompt_token_ids"])
            best, k_best = 0.0, None
            for k in range(1, len(scores)):
                if not (n0 + BLOCK <= pos[k] < n0 + (self.args.turn1_blocks - 1) * BLOCK):
                    continue
                gap = scores[k] - scores[:k].max()
                if gap > best:
                    best, k_best = gap, k
            if k_best is None:
                pols.append(self._policy(NEVER))
                at.append(None)
            else:
                thr = float(scores[k_best] - best / 2)
                pols.append(self._policy(thr, sharpness=1e4, floor=0.5))
                at.append(int(pos[k_best]))
        return pols, at

    def _steering(self, scenario: str, prompts: list[dict], params: Any) -> dict[str, Any]:
        if scenario == "unsteered":
            return {}
        if scenario == "decode_static":
            return {"steering": self._decode_spec()}
        if scenario == "never":
            return {"policy": self._policy(NEVER)}
        pols, _ = self._midway(prompts, params)
        return {"policy": pols}

    # ---- workloads ------------------------------------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(100, self.vocab, n)]

    def shared_prefix(self, scenario: str) -> dict[str, Any]:
        from vllm import SamplingParams

        a = self.args
        prefix = self._tokens(a.prefix_blocks * BLOCK)
        prompts = [{"prompt_token_ids": prefix + self._tokens(BLOCK // 2)} for _ in range(a.requests)]
        params = SamplingParams(temperature=0.0, max_tokens=2 * BLOCK, ignore_eos=True)
        kw = self._steering(scenario, prompts, params)
        if isinstance(kw.get("policy"), list):  # one policy per prompt: the warm-up takes the first
            kw_first, kw_rest = {"policy": kw["policy"][:1]}, {"policy": kw["policy"][1:]}
        else:
            kw_first = kw_rest = kw
        self.llm.reset_prefix_cache()
        self.st.generate(prompts[:1], params, **kw_first)
        h0, q0 = _counters(self.llm)
        self.st.generate(prompts[1:], params, **kw_rest)
        h1, q1 = _counters(self.llm)
        expected = (a.requests - 1) * a.prefix_blocks * BLOCK
        return dict(hits=h1 - h0, queries=q1 - q0, expected_hits=expected)

    def multi_turn(self, scenario: str) -> dict[str, Any]:
        from vllm import SamplingParams

        a = self.args
        n1 = a.turn1_blocks * BLOCK
        p1 = SamplingParams(temperature=0.0, max_tokens=n1, ignore_eos=True)
        p2 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [{"prompt_token_ids": self._tokens(a.prompt_len)} for _ in range(a.conversations)]
        fired_expected: list[int | None] = [None] * len(prompts)
        if scenario == "midway":
            pols, fired_expected = self._midway(prompts, p1)
            kw: dict[str, Any] = {"policy": pols}
        else:
            kw = self._steering(scenario, prompts, p1)
        self.llm.reset_prefix_cache()
        first = self.st.generate(prompts, p1, **kw)
        fired: list[int | None] = []
        for out in first:
            tr = getattr(out, "trace", None)
            on = np.flatnonzero(tr.applied_gates() != 0) if tr is not None else []
            fired.append(int(tr.position[on[0]]) if len(on) else None)
        turn2 = [{"prompt_token_ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids) + [11, 12, 13]}
                 for o in first]
        h0, q0 = _counters(self.llm)
        self.st.generate(turn2, p2, **kw)
        h1, q1 = _counters(self.llm)
        expected = 0
        for o, f in zip(first, fired):
            n_prompt, n_all = len(o.prompt_token_ids), len(o.prompt_token_ids) + n1
            if scenario == "decode_static":
                reusable = n_prompt  # turn 1's generated KV was computed under steering
            elif f is not None:
                reusable = f  # every block before the first firing's block
            else:
                reusable = n_all - 1  # turn 1's last token was sampled, never fed back: no KV for it
            expected += reusable // BLOCK * BLOCK
        return dict(hits=h1 - h0, queries=q1 - q0, expected_hits=expected, first_fired=fired,
                    first_fired_planned=fired_expected)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: dynsteer's tiny Llama test checkpoint)")
    ap.add_argument("--out", help="report folder (default benchmarks/results)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prefix-blocks", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--turn1-blocks", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-util", type=float, default=0.3)
    ap.add_argument("--cpu", action="store_true", help="CPU engine even where a GPU is present")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any figure differs from its expected value")
    args = ap.parse_args()
    if args.model is None:
        from dynsteer.testing.tiny_models import tiny_model

        args.model = tiny_model("llama")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.time()
    b = Bench(args)
    rows: dict[str, dict[str, Any]] = {}
    for workload in ("shared_prefix", "multi_turn"):
        for scenario in ("unsteered", "decode_static", "never", "midway"):
            r = getattr(b, workload)(scenario)
            r["hit_rate"] = r["hits"] / r["queries"] if r["queries"] else 0.0
            r["as_expected"] = r["hits"] == r["expected_hits"]
            rows[f"{workload}/{scenario}"] = r
    import torch
    import vllm

    import dynsteer

    device = torch.cuda.get_device_name(0) if b.gpu else (platform.processor() or "cpu")
    report = dict(benchmark="apc_hits", date=dt.date.today().isoformat(), device=device,
                  versions=dict(vllm=vllm.__version__, torch=torch.__version__, dynsteer=dynsteer.__version__,
                                git=os.environ.get("DYNSTEER_GIT_SHA")),
                  async_scheduling=b.async_scheduling, args={k: str(v) for k, v in vars(args).items()},
                  seconds=round(time.time() - t0, 1), results=rows)
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    tag = ("cpu" if not b.gpu else device.replace(" ", "_"))
    path = out / f"apc_hits-{tag}-{report['date']}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"device {device}, async scheduling {'on' if b.async_scheduling else 'off'}\n")
    print("| workload | scenario | hits / queried tokens | hit rate | expected hits | |")
    print("|---|---|---|---|---|---|")
    for key, r in rows.items():
        w, s = key.split("/")
        print(f"| {w} | {s} | {r['hits']} / {r['queries']} | {100 * r['hit_rate']:.1f} % | {r['expected_hits']} | "
              f"{'✓' if r['as_expected'] else '✗'} |")
    print(f"\nwrote {path}")
    bad = [k for k, r in rows.items() if not r["as_expected"]]
    if bad:
        print("not as expected: " + ", ".join(bad), file=sys.stderr)
    return 1 if (bad and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
