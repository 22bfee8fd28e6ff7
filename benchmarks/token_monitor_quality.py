"""What the per-token monitor of ``examples/dynamic_sentiment.py`` part one does to the replies it steers.

Trains the part-one monitor (or reads ``--probe``, a file ``train_token_monitor`` wrote), then on the held-out
complaint requests of ``examples/data/sentiment_requests.jsonl`` generates unsteered replies, replies under the
part-one policy, and replies under its random-direction control (the same policy with the steering vector replaced
by a seeded random direction of the same norm: same latch, gate and dose). Per arm: the demo's sentiment word score
((positive − negative words) per 100 words), mean perplexity of the replies under the unsteered model (its ratio to
the unsteered replies'), and the share of repeated 4-grams. Praise requests are not measured: the policy leaves them
byte-identical (tested in ``tests/test_smollm2.py``).

    python benchmarks/token_monitor_quality.py --out benchmarks/results/token_monitor_quality-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import numpy as np  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", type=Path, help="a probe file from train_token_monitor (default: train one)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int, default=0, help="the random control's seed")
    args = ap.parse_args()

    import dynamic_sentiment as ds
    from vllm import SamplingParams

    import dynsteer
    from dynsteer.cli.demo import sentiment_score
    from dynsteer.probes import LatchCalibration
    from dynsteer.sweep import metrics as M
    from dynsteer.sweep.control import random_control
    from dynsteer.sweep.quality import perplexities, prompt_ids
    from dynsteer.zoo import smollm2

    llm = ds.make_engine(smollm2(), layers=(ds.TOKEN_LAYER,), max_num_seqs=64)
    try:
        st = dynsteer.attach(llm)
        probe = args.probe
        if probe is None:
            probe = Path(tempfile.mkdtemp()) / "tokens.safetensors"
            ds.train_token_monitor(st, probe)
        cal = LatchCalibration(**json.loads(probe.with_suffix(".latch.json").read_text()))
        policy = ds.token_policy(st, probe, cal)
        prompts, labels = ds.load_requests("held_out")
        prompts = [p for p, y in zip(prompts, labels) if y == 0]
        convs = [[{"role": "user", "content": p}] for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=ds.REPLY_TOKENS)
        ids = prompt_ids(st, prompts)
        arms = {"unsteered": None, "steered": policy, "random control": random_control(policy, seed=args.seed)}
        report: dict[str, dict[str, float]] = {}
        unsteered: list[list[int]] = []
        for name, pol in arms.items():  # "unsteered" first: the others' replies are compared with its
            outs = st.chat(convs, params, policy=pol, use_tqdm=False)
            toks = [list(o.outputs[0].token_ids) for o in outs]
            unsteered = unsteered or toks
            ppl = [p for p in perplexities(st, list(zip(ids, toks)), SamplingParams) if p is not None]
            report[name] = {"word_score": sentiment_score([o.outputs[0].text for o in outs]),
                            "perplexity": float(np.mean(ppl)),
                            "repeat_4gram": float(np.mean([M.repeated_ngram_rate(t, 4) for t in toks])),
                            "changed": float(np.mean([t != u for t, u in zip(toks, unsteered)]))}
    finally:
        llm.llm_engine.engine_core.shutdown()
    base = report["unsteered"]["perplexity"]
    for arm in report.values():
        arm["perplexity_ratio"] = arm["perplexity"] / base
    result = {"requests": len(prompts), "layer": ds.TOKEN_LAYER, "dose": ds.TOKEN_DOSE, "alpha": ds.TOKEN_ALPHA,
              "on": cal.on, "arms": report}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
