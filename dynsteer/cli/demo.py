"""The CPU demo: a contrastive sentiment vector steers SmolLM2 inside an unmodified vLLM engine.

The vector is the difference of mean residuals (after ``layer``) between positive and negative sentences, computed
with a plain transformers forward of the same checkpoint; dynsteer then adds it inside vLLM, per request, in one
batch next to unsteered requests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

POSITIVE = [
    "I love this, it is wonderful and makes me so happy.",
    "What a fantastic day, everything went perfectly.",
    "The movie was brilliant, I enjoyed every minute.",
    "Thank you so much, this is the best gift ever.",
    "I am thrilled and grateful for my amazing friends.",
    "The food was delicious and the service was excellent.",
    "This is great news, I feel fantastic today.",
    "She smiled warmly; it was a beautiful, joyful moment.",
]
NEGATIVE = [
    "I hate this, it is awful and makes me so sad.",
    "What a terrible day, everything went wrong.",
    "The movie was boring, I regretted every minute.",
    "This is the worst gift ever, what a disappointment.",
    "I am miserable and lonely, nobody cares about me.",
    "The food was disgusting and the service was rude.",
    "This is horrible news, I feel awful today.",
    "She frowned bitterly; it was a grim, painful moment.",
]
PROMPTS = [
    "Write one sentence about your weekend.",
    "Describe the weather today.",
    "What do you think of Mondays?",
]
# The score under each column: sentiment words in its outputs, (positive − negative) per 100 words. A word list,
# not a classifier: it is there to show the direction each column moved, on a scale that is easy to check by hand.
POSITIVE_WORDS = frozenset("""
    amazing awesome beautiful best brilliant calm cheerful delicious delight delighted delightful enjoy enjoyed
    enjoying excellent excited exciting fantastic fun glad good grateful great happy happiness hope hopeful joy
    joyful kind love loved lovely lucky nice peaceful perfect pleasant relaxing smile sunny sunshine thank thanks
    thrilled warm wonderful""".split())
NEGATIVE_WORDS = frozenset("""
    angry annoying anxious awful bad bitter boring cold cruel dark depressing disappointed disappointing disgusting
    dreadful dull fear gloomy grim hate hated horrible hurt lonely lost mad miserable nasty pain painful poor rainy
    rude sad sadly scared sick stormy stress stressful terrible tired ugly unhappy upset worse worst wrong""".split())


def sentiment_score(texts: list[str]) -> float:
    """(positive − negative sentiment words) per 100 words over ``texts`` (0 without words)."""
    import re

    words = [w for t in texts for w in re.findall(r"[a-z']+", t.lower())]
    if not words:
        return 0.0
    pos = sum(w in POSITIVE_WORDS for w in words)
    neg = sum(w in NEGATIVE_WORDS for w in words)
    return 100.0 * (pos - neg) / len(words)


def contrastive_vector(model_dir: Path, layer: int) -> np.ndarray:
    """mean(residual | positive) − mean(residual | negative) after decoder layer ``layer`` (mean over tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()

    def mean_residual(texts: list[str]) -> torch.Tensor:
        acc = []
        with torch.no_grad():
            for text in texts:
                ids = tok(text, return_tensors="pt")
                hs = model(**ids, output_hidden_states=True).hidden_states[layer + 1]  # residual after `layer`
                acc.append(hs[0].mean(0))
        return torch.stack(acc).mean(0)

    return (mean_residual(POSITIVE) - mean_residual(NEGATIVE)).numpy().astype(np.float32)


def run_demo(model: Path | None, layer: int, scale: float, max_tokens: int, verbose: bool = False) -> None:
    """Print the before/after table; vLLM's logs go to a file unless ``verbose``."""
    from rich.console import Console

    from dynsteer.cli.logs import quiet_vllm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with quiet_vllm(verbose, "dynsteer-demo") as (log, terminal):
        _demo(Console(file=terminal), model, layer, scale, max_tokens)
    if log is not None:
        Console().print(f"[dim]vLLM's log: {log} (--verbose shows it here)[/dim]")


def _demo(console: Any, model: Path | None, layer: int, scale: float, max_tokens: int) -> None:
    from rich.table import Table

    from dynsteer.cli.progress import Steps

    steps = Steps(console)
    if model is None:
        from dynsteer.zoo import smollm2

        with steps.step("getting SmolLM2-135M-Instruct", "converted once, then cached"):
            model = smollm2()
    with steps.step("computing a contrastive sentiment vector", "a transformers forward of 16 sentences"):
        vec = contrastive_vector(model, layer)
    console.print(f"steering vector at layer {layer}: ‖v‖ = {np.linalg.norm(vec):.1f}")

    from vllm import LLM, SamplingParams

    import dynsteer
    from dynsteer import AddVector, SteeringSpec

    with steps.step("starting vLLM", "first run ~3 min on CPU: it compiles; later runs ~1 min"):
        llm = LLM(model=str(model), dtype="float32", max_model_len=512, max_num_seqs=16, seed=0)
    steerer = dynsteer.attach(llm)
    steerer.register_vector("sentiment", vec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    columns = {"unsteered": None,
               f"+{scale:g}·sentiment": SteeringSpec(vectors=[AddVector(layer=layer, vector="sentiment", scale=scale)]),
               f"−{scale:g}·sentiment": SteeringSpec(vectors=[AddVector(layer=layer, vector="sentiment",
                                                                         scale=-scale)])}
    # All three variants of every prompt run in one continuous batch.
    batch = [conv for conv in conversations for _ in columns]
    specs = [spec for _ in conversations for spec in columns.values()]
    with steps.step(f"generating {len(batch)} replies in one batch", f"{max_tokens} tokens each"):
        outputs = steerer.chat(batch, params, steering=specs, use_tqdm=False)
    table = Table(title=f"SmolLM2-135M-Instruct, steering at layer {layer} (post_block), greedy", show_lines=True,
                  caption="score: sentiment words in the column's outputs, (positive − negative) per 100 words")
    table.add_column("prompt", style="bold")
    for name in columns:
        table.add_column(name)
    texts = [[o.outputs[0].text.strip() for o in outputs[i * len(columns):(i + 1) * len(columns)]]
             for i in range(len(PROMPTS))]
    for prompt, row in zip(PROMPTS, texts):
        table.add_row(prompt, *row)
    scores = [sentiment_score([row[j] for row in texts]) for j in range(len(columns))]
    table.add_row("[italic]score[/italic]", *(f"[bold]{s:+.1f}[/bold]" for s in scores))
    console.print(table)
    unsteered_again = steerer.chat(conversations, params, use_tqdm=False)
    same = [a.outputs[0].text == b.outputs[0].text
            for a, b in zip(unsteered_again, outputs[::len(columns)])]
    console.print(f"unsteered rows identical to an unsteered-only batch: {all(same)}")
    from dynsteer.cli.engine import shutdown_engine

    shutdown_engine(llm)
