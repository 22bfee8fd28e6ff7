"""Dynamic steering on SmolLM2-135M-Instruct: a sentiment probe decides, token by token, when to steer.

Runs on CPU in a few minutes:

    python examples/dynamic_sentiment.py

1. Train the sentiment probe of ``probe_training.py`` (60 sentences, residual at the last prompt token, logistic
   regression) at layer 20 and export it as a dynsteer probe file.
2. Load it as an in-graph monitor whose gate is the probe's ``predict_proba`` of the *negative* class, computed on
   every generated token inside the forward pass.
3. Rule: add a positive-sentiment vector at the monitor's layer, gated by the monitor, for the same token. A sync
   controller (EMA latch on the probe score) switches the rule on one step after the smoothed score crosses ``on``,
   so single stray tokens never steer.
4. One continuous batch of complaints (the targeted class) and praise (the other class): complaints are steered, the
   praise outputs are byte-identical to an unsteered run, and the in-graph gate equals the probe file's
   ``predict_proba`` on the captured residuals.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

import dynsteer
from dynsteer import (Action, CaptureSpec, DynamicSteeringPolicy, DynsteerConfig, Monitor, Rule,
                      SyncControllerSpec)
from dynsteer.probes import LogisticProbe, align, collect, load_probe, save_probe
from dynsteer.zoo import smollm2
from probe_training import NEGATIVE, POSITIVE

LAYER = 20
TOPICS = ["the hotel room", "the restaurant", "the train service", "the weather"]
COMPLAINTS = [f"Write two sentences complaining angrily about {t}." for t in ["the airline", *TOPICS]]
PRAISE = [f"Write two sentences praising {t} enthusiastically." for t in ["the new phone", *TOPICS]]
STEER_SCALE = 40.0


@dataclass
class DemoResult:
    prompts: list[str]
    targeted: list[bool]
    baseline: list[list[int]]
    steered: list[list[int]]
    texts: list[tuple[str, str]]
    fired: list[int]  # tokens with dyn_scale > 0, per prompt
    gate_error: float  # max |in-graph gate − probe predict_proba| over every traced token
    probe_path: Path | None = None  # the probe file the run used
    scales: list[list[float]] | None = None  # the controller's scale at every traced token, per prompt


def make_engine(model: Path, sync_tier: str = "device"):
    from vllm import LLM

    cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=(LAYER,), max_gates=2, sync_tier=sync_tier)
    return LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0,
               **cfg.engine_kwargs())


def train_probe(steerer: dynsteer.Steerer, path: Path) -> None:
    texts = POSITIVE + NEGATIVE
    labels = np.array([1] * len(POSITIVE) + [0] * len(NEGATIVE))
    acts = collect(steerer, texts, labels, layers=[LAYER], site="post_block", positions="last_prompt")
    probe = LogisticProbe().fit(acts.X[LAYER], labels)
    save_probe(path, probe, model_id=steerer.shape.model_id, layer=LAYER, site="post_block",
               method=f"LogisticProbe, {len(texts)} sentiment sentences, last prompt token")


def sentiment_policy(probe_path: Path) -> DynamicSteeringPolicy:
    monitor = Monitor.from_probe_file(probe_path, name="negative", target_class=0)
    towards_positive = -np.asarray(monitor.direction, np.float32) * STEER_SCALE
    return DynamicSteeringPolicy(
        monitors=[monitor],
        rules=[Rule(monitor="negative", actions=[Action(kind="add", layer=LAYER, vector=towards_positive)])],
        controller=SyncControllerSpec(kind="ema_latch", alpha=0.3, on=2.0, off=0.0, scale=1.0))


def run(max_tokens: int = 40, sync_tier: str = "device", probe_path: Path | None = None) -> DemoResult:
    """Train the probe (unless ``probe_path`` names one already trained) and compare gated steering with the
    baseline. ``sync_tier``: where the EMA-latch controller runs (``"device"``, the default, or ``"host"``)."""
    from vllm import SamplingParams

    llm = make_engine(smollm2(), sync_tier)
    try:
        steerer = dynsteer.attach(llm)
        if probe_path is None:
            probe_path = Path(tempfile.mkdtemp()) / "sentiment-L20.safetensors"
            train_probe(steerer, probe_path)
        policy = sentiment_policy(probe_path)

        prompts = COMPLAINTS + PRAISE
        convs = [[{"role": "user", "content": p}] for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        baseline = llm.chat(convs, params)
        steered = steerer.chat(convs, params, policy=policy,
                               capture=CaptureSpec(sites=["post_block"], layers=[LAYER], positions="all_generated"))
    finally:
        llm.llm_engine.engine_core.shutdown()

    probe = load_probe(probe_path)
    gate_error = 0.0
    for out in steered:
        x, at = align(out.capture, out.trace, (LAYER, "post_block"))  # the traced positions' residuals
        want = probe.predict_proba(x)[:, 0]  # P(negative): the negative class opens the gate
        gate_error = max(gate_error, float(np.abs(out.trace.gates("negative")[at] - want).max()))
    return DemoResult(
        prompts=prompts, targeted=[True] * len(COMPLAINTS) + [False] * len(PRAISE),
        baseline=[list(o.outputs[0].token_ids) for o in baseline],
        steered=[list(o.outputs[0].token_ids) for o in steered],
        texts=[(b.outputs[0].text, s.outputs[0].text) for b, s in zip(baseline, steered)],
        fired=[int(np.count_nonzero(o.trace.scale)) for o in steered], gate_error=gate_error,
        probe_path=probe_path, scales=[list(o.trace.scale) for o in steered])


def main() -> DemoResult:
    from rich.console import Console
    from rich.table import Table

    res = run()
    table = Table(title=f"SmolLM2-135M, sentiment monitor at layer {LAYER}, EMA-latched positive steering",
                  show_lines=True)
    for col in ("prompt", "steered tokens", "unsteered", "dynamic"):
        table.add_column(col, overflow="fold")
    for prompt, fired, (before, after) in zip(res.prompts, res.fired, res.texts):
        table.add_row(prompt, str(fired), before, after if after != before else "(identical)")
    Console().print(table)
    print(f"max |in-graph gate - probe predict_proba| = {res.gate_error:.2e}")
    return res


if __name__ == "__main__":
    main()
