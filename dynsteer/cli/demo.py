"""The CPU demo: a contrastive sentiment vector steers SmolLM2 inside an unmodified vLLM engine.

The vector is the difference of mean residuals (after ``layer``) between positive and negative sentences, computed
with a plain transformers forward of the same checkpoint; dynsteer then adds it inside vLLM, per request, in one
batch next to unsteered requests.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def run_demo(model: Path | None, layer: int, scale: float, max_tokens: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if model is None:
        from dynsteer.zoo import smollm2

        model = smollm2()
    with console.status("computing a contrastive sentiment vector"):
        vec = contrastive_vector(model, layer)
    console.print(f"steering vector at layer {layer}: ‖v‖ = {np.linalg.norm(vec):.1f}")

    from vllm import LLM, SamplingParams

    import dynsteer
    from dynsteer import AddVector, SteeringSpec

    with console.status("starting vLLM"):
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
    outputs = steerer.chat(batch, params, steering=specs)
    table = Table(title=f"SmolLM2-135M-Instruct, steering at layer {layer} (post_block), greedy", show_lines=True)
    table.add_column("prompt", style="bold")
    for name in columns:
        table.add_column(name)
    for i, prompt in enumerate(PROMPTS):
        row = outputs[i * len(columns):(i + 1) * len(columns)]
        table.add_row(prompt, *(o.outputs[0].text.strip() for o in row))
    console.print(table)
    unsteered_again = steerer.chat(conversations, params)
    same = [a.outputs[0].text == b.outputs[0].text
            for a, b in zip(unsteered_again, outputs[::len(columns)])]
    console.print(f"unsteered rows identical to an unsteered-only batch: {all(same)}")
