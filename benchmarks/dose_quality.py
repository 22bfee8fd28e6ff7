"""The recommended dose of SmolLM2-135M-Instruct's sentiment vectors (the demo's, the examples', a CAA vector from
pairs): concept gain, perplexity ratio, repeated 4-grams and a random control of equal norm. CPU (float32), minutes.

Method (:func:`dynsteer.sweep.dose_search.recommend_dose`): 16 neutral chat prompts
(``benchmarks/vector_quality.py``'s), the even-numbered 8 the tuning split and the odd-numbered 8 held out (or,
``--prompts negative``, negative sentences of the data set's two splits); greedy replies of ``--max-tokens`` tokens.
The concept score is a sentiment probe's P(positive) on the reply (a logistic probe on the last prompt token at layer
22, trained on the 308-sentence training split of ``examples/data/sentiment.csv`` under the chat template, as
``examples/dynamic_sentiment.py``'s part two trains it; the reply is read back as a user message). Bounds: mean
perplexity ≤ 1.5× unsteered, repeated 4-grams ≤ 5 %.

    python benchmarks/dose_quality.py [--out benchmarks/results/dose_quality-cpu.json] [--vectors demo example2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))
PROBE_LAYER = 22


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--vectors", nargs="+", default=["example2", "demo", "example1", "caa"])
    ap.add_argument("--prompts", choices=["neutral", "negative"], default="neutral",
                    help="neutral: 16 neutral prompts, even/odd split; negative: 8 negative sentences of the "
                         "training split to tune, 8 of the held-out split to report")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dose_quality-cpu.json")
    args = ap.parse_args()
    from vllm import LLM

    import dynamic_sentiment as ds
    import dynsteer
    from dynsteer.cli.demo import contrastive_vector
    from dynsteer.probes import LogisticProbe, collect
    from dynsteer.sweep.dose_search import recommend_dose
    from dynsteer.sweep.quality import probe_concept
    from dynsteer.zoo import smollm2
    from vector_quality import PROMPTS

    t0 = time.time()
    model = smollm2()
    layers = (15, ds.LAYER, PROBE_LAYER)
    cfg = dynsteer.DynsteerConfig(capture_sites=("post_block",), capture_layers=layers)
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0,
              **cfg.engine_kwargs())
    st = dynsteer.attach(llm)
    train_x, train_y, test_x, test_y = ds.held_out_split()
    if args.prompts == "neutral":
        tune, held = PROMPTS[0::2], PROMPTS[1::2]
    else:  # the prompts dynamic_sentiment.py's part two steers: negative sentences, never the probe's test data
        tune = [t for t, y in zip(train_x, train_y) if y == 0][:8]
        held = [t for t, y in zip(test_x, test_y) if y == 0][:8]
    acts = collect(st, train_x, train_y, layers=[PROBE_LAYER], site="post_block", positions="last_prompt", chat=True,
                   progress=False)
    X = acts.X[PROBE_LAYER]
    probe = LogisticProbe().fit(X, train_y)
    concept = probe_concept(st, probe, layer=PROBE_LAYER, target_class=1)
    print(f"probe trained on {len(train_x)} sentences ({time.time() - t0:.0f} s)", flush=True)

    def vector(name: str) -> tuple[np.ndarray, int, str]:
        if name == "example2":  # dynamic_sentiment.py part two: class-mean difference at layer 22
            diff = X[train_y == 1].mean(0) - X[train_y == 0].mean(0)
            return diff, PROBE_LAYER, "multiples of the class-mean difference"
        if name == "demo":  # dynsteer demo: contrastive vector of 16 sentences at layer 15
            return contrastive_vector(model, 15).astype(np.float64), 15, "multiples of the contrastive vector"
        if name == "example1":  # dynamic_sentiment.py part one: minus the negative-class probe direction at layer 20
            from dynsteer.probes import collect as coll
            from probe_training import NEGATIVE, POSITIVE

            y = np.array([1] * len(POSITIVE) + [0] * len(NEGATIVE))
            a = coll(st, POSITIVE + NEGATIVE, y, layers=[ds.LAYER], site="post_block", progress=False)
            p = LogisticProbe().fit(a.X[ds.LAYER], y)
            return np.asarray(p.coef_, np.float64).reshape(-1), ds.LAYER, "multiples of the probe's weight vector"
        if name == "caa":
            from dynsteer.make import from_pairs
            from dynsteer.vectors.pairs import read_pairs

            pairs = read_pairs(REPO / "examples" / "data" / "sentiment_pairs.jsonl")
            v = from_pairs(st, pairs, layers=[15], positions="last").vectors[15]
            return np.asarray(v, np.float64), 15, f"multiples of the CAA vector of {len(pairs)} pairs"
        raise SystemExit(f"--vectors: unknown {name!r}")

    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    for name in args.vectors:
        vec, layer, unit = vector(name)
        rec = recommend_dose(st, vec, layer=layer, tune_prompts=tune, held_prompts=held,
                             concept=concept, max_tokens=args.max_tokens)
        print(f"\n== {name} ({unit}) ==\n{rec.summary()}\n({time.time() - t0:.0f} s)", flush=True)
        results[f"{name}@{args.prompts}"] = {"prompts": args.prompts, "unit": unit, "max_tokens": args.max_tokens,
                                             "probe_layer": PROBE_LAYER, "probe_train_sentences": len(train_x),
                                             **json.loads(rec.model_dump_json())}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    llm.llm_engine.engine_core.shutdown()
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
