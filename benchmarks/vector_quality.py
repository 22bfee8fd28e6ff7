"""Does a CAA vector from ≤64 contrastive pairs steer a concept better than a random direction of the same norm, at
the same fluency? SmolLM2-135M-Instruct on CPU (float32), minutes.

Method: ``dynsteer.make.from_pairs`` on ``examples/data/sentiment_pairs.jsonl`` (64 pairs, chat template; one vector
per ``--positions``: the last prompt token, the mean over all prompt tokens) at ``--layer``; random directions
(``--random-seeds`` of them). Each direction is added at each of ``--norms`` (rescaled to that L2 norm) with sign +
and −, to neutral chat prompts, greedy. Per setting:

* concept: the sentiment word score of the replies (positive − negative sentiment words per 100 words, the word
  lists of ``dynsteer demo``); the swing is score(+) − score(−), which is about 0 for a direction that carries no
  sentiment;
* fluency: the unsteered model's mean log-probability per reply token (higher is more fluent), the same judge for
  every setting.

    python benchmarks/vector_quality.py [--out benchmarks/results/vector_quality-cpu.json]
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
PROMPTS = [
    "Write one sentence about your weekend.", "Describe the weather today.", "What do you think of Mondays?",
    "Tell me about your neighbourhood.", "Describe a meal you had recently.", "How was your last holiday?",
    "Write a sentence about your job.", "What is your morning routine like?", "Describe a park in your town.",
    "Tell me about a film you watched.", "How do you feel about the rain?", "Describe your favourite shop.",
    "Write a sentence about the city at night.", "Tell me about your commute.", "Describe an old friend.",
    "What happened at the market today?",
]


def fluency(llm, prompt_ids: list[list[int]], replies: list[list[int]]) -> float:
    """Mean log-probability per reply token under the unsteered model."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    inputs = [{"prompt_token_ids": p + r} for p, r in zip(prompt_ids, replies) if r]
    outs = llm.generate(inputs, params, use_tqdm=False)
    total, n = 0.0, 0
    for inp, p, out in zip(inputs, [p for p, r in zip(prompt_ids, replies) if r], outs):
        ids = inp["prompt_token_ids"]
        for pos in range(len(p), len(ids)):
            total += out.prompt_logprobs[pos][ids[pos]].logprob
            n += 1
    return total / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--norms", type=float, nargs="+", default=[16.0, 32.0])
    ap.add_argument("--random-seeds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--positions", nargs="+", default=["last", "all"],
                    help="where the pairs are read, one CAA vector each: last, all or K (mean over the last K)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from vllm import LLM, SamplingParams

    import dynsteer
    from dynsteer.cli.demo import sentiment_score
    from dynsteer.make import from_pairs
    from dynsteer.spec import AddVector, SteeringSpec
    from dynsteer.vectors.pairs import read_pairs
    from dynsteer.zoo import smollm2

    t0 = time.time()
    llm = LLM(model=str(smollm2()), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0,
              **dynsteer.DynsteerConfig(capture_sites=("post_block",)).engine_kwargs())
    st = dynsteer.attach(llm)
    pairs = read_pairs(REPO / "examples" / "data" / "sentiment_pairs.jsonl")
    caas: dict[str, np.ndarray] = {}
    for text in args.positions:
        positions = text if text in ("last", "all") else int(text)
        caas[f"caa-{text}"] = from_pairs(st, pairs, layers=[args.layer],
                                         positions=positions).vectors[args.layer].astype(np.float64)
        print(f"CAA from {len(pairs)} pairs at layer {args.layer}, positions {text}: norm "
              f"{np.linalg.norm(caas[f'caa-{text}']):.2f} ({time.time() - t0:.0f} s)", flush=True)
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False) for p in PROMPTS]
    inputs = [{"prompt_token_ids": p} for p in prompt_ids]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def run(vector: np.ndarray | None) -> dict:
        spec = None if vector is None else SteeringSpec(vectors=[AddVector(layer=args.layer, vector=vector)])
        outs = st.generate(inputs, params, steering=spec, use_tqdm=False)
        replies = [list(o.outputs[0].token_ids) for o in outs]
        texts = [o.outputs[0].text for o in outs]
        return {"concept": sentiment_score(texts), "fluency": fluency(llm, prompt_ids, replies), "sample": texts[0]}

    rows = [{"direction": "none", "norm": 0.0, "sign": 0, **run(None)}]
    rng = np.random.default_rng(0)
    directions = [(name, v / np.linalg.norm(v)) for name, v in caas.items()]
    for s in range(args.random_seeds):
        r = rng.standard_normal(st.hidden_size)
        directions.append((f"random{s}", r / np.linalg.norm(r)))
    for name, unit in directions:
        for norm in args.norms:
            for sign in (1, -1):
                rows.append({"direction": name, "norm": norm, "sign": sign, **run(sign * norm * unit)})
                r = rows[-1]
                print(f"{name:10s} {sign * norm:+6.1f}  concept {r['concept']:+6.2f}  fluency {r['fluency']:.3f}  "
                      f"| {r['sample'][:70]!r}", flush=True)
    print("\nswing = concept(+) − concept(−); fluency = mean of the two signs (base "
          f"{rows[0]['fluency']:.3f}, concept {rows[0]['concept']:+.2f})")
    summary = []
    for name, _ in directions:
        for norm in args.norms:
            plus, minus = (next(r for r in rows if r["direction"] == name and r["norm"] == norm and r["sign"] == s)
                           for s in (1, -1))
            summary.append({"direction": name, "norm": norm, "swing": plus["concept"] - minus["concept"],
                            "fluency": (plus["fluency"] + minus["fluency"]) / 2})
            print(f"{name:10s} norm {norm:5.1f}: swing {summary[-1]['swing']:+6.2f}  "
                  f"fluency {summary[-1]['fluency']:.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"layer": args.layer, "n_pairs": len(pairs), "prompts": len(PROMPTS),
                                        "max_tokens": args.max_tokens,
                                        "caa_norms": {k: float(np.linalg.norm(v)) for k, v in caas.items()},
                                        "rows": rows, "summary": summary},
                                       indent=2) + "\n")
        print(f"wrote {args.out}")
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
