"""Train a sentiment probe on SmolLM2-135M-Instruct inside vLLM, pick the best layer, calibrate and export it.

Runs on CPU in a few minutes:

    python examples/probe_training.py [OUTPUT.safetensors]

Steps: 440 hand-written sentences (``examples/data/sentiment.csv``, 220 per class) wrapped as user messages in
SmolLM2's chat template → residuals at the last prompt token (the generation prompt's last token: where a
prompt-level gate reads when the model is served as a chat model) of every other layer, through dynsteer's capture
API → one logistic probe per layer; 5-fold cross-validation on a stratified training split (70 %) chooses the
layer, the 132 held-out sentences (66 negatives) only report it → a decision threshold at 5 % FPR calibrated on the
held-out split, with its interval → saved as a dynsteer probe file, reloaded, checked against the engine's shape,
and turned into gate parameters.

Which collection, and why: ``collect(..., chat=True)``, sentences under the chat template read at the last prompt
token, because that is what a prompt-level gate reads. A gate that reads every generated token (a
``DynamicSteeringPolicy`` monitor) reads the model's own replies, whose decode-time residuals differ from prefill
ones; train that one on ``collect_generated`` (one row per generated token, prompts kept whole in the folds).
"""

from __future__ import annotations

import csv
import os
import sys
import tempfile
from pathlib import Path

# Fast, quiet single-process CPU engine (set before vLLM is imported).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

import dynsteer
from dynsteer.config import DynsteerConfig
from dynsteer.probes import LogisticProbe, calibrate, collect, gate, layer_sweep, load_probe, recall_at, save_probe
from dynsteer.zoo import smollm2

DATA = Path(__file__).resolve().parent / "data" / "sentiment.csv"

# A small hand-written set (the dynamic-sentiment example trains its gate on these; this example uses DATA).
POSITIVE = [
    "I love this place, it makes me so happy.",
    "What a wonderful surprise, thank you!",
    "The concert was amazing and the crowd was joyful.",
    "She was delighted with her brilliant results.",
    "This is the best coffee I have ever had.",
    "We had a fantastic time at the beach.",
    "His kindness made my whole day better.",
    "The garden looks beautiful in the spring sunshine.",
    "I am so proud of my wonderful team.",
    "The movie was charming, funny and uplifting.",
    "Our new puppy is adorable and full of joy.",
    "The hotel staff were friendly and helpful.",
    "I feel great after a relaxing holiday.",
    "Congratulations, that is excellent news!",
    "The cake was delicious and beautifully made.",
    "They laughed together all evening, full of happiness.",
    "This book is a delightful and inspiring read.",
    "The view from the mountain was breathtaking.",
    "I really enjoyed our lovely conversation.",
    "Everything worked perfectly, I am thrilled.",
    "The children were cheerful and excited about the trip.",
    "My grandmother's soup is warm, comforting and perfect.",
    "He gave a superb, heartfelt speech.",
    "We won the game and everyone celebrated happily.",
    "The new park is a pleasant, peaceful place.",
    "I am grateful for such generous friends.",
    "The sunrise this morning was gorgeous.",
    "Her smile is bright and full of warmth.",
    "The service was quick and the staff were wonderful.",
    "This is a truly great day.",
]
NEGATIVE = [
    "I hate this place, it makes me so miserable.",
    "What a horrible shock, this is awful.",
    "The concert was terrible and the crowd was angry.",
    "She was devastated by her dreadful results.",
    "This is the worst coffee I have ever had.",
    "We had an awful time at the beach.",
    "His cruelty ruined my whole day.",
    "The garden looks ugly and dead in the cold rain.",
    "I am so ashamed of my useless team.",
    "The movie was dull, painful and depressing.",
    "Our old dog is sick and in pain.",
    "The hotel staff were rude and unhelpful.",
    "I feel terrible after a stressful holiday.",
    "I am sorry, that is really bad news.",
    "The cake was disgusting and badly burnt.",
    "They argued bitterly all evening, full of anger.",
    "This book is a boring and depressing read.",
    "The view from the window was grim and bleak.",
    "I really disliked our unpleasant conversation.",
    "Everything went wrong, I am furious.",
    "The children were sad and scared about the trip.",
    "The soup was cold, bland and disgusting.",
    "He gave a clumsy, insulting speech.",
    "We lost the game and everyone left in tears.",
    "The old factory is a filthy, depressing place.",
    "I am hurt by such selfish friends.",
    "The storm this morning was frightening.",
    "Her frown is cold and full of contempt.",
    "The service was slow and the staff were awful.",
    "This is a truly terrible day.",
]

LAYERS = range(4, 30, 2)
TARGET_FPR = 0.05


def main(out_path: str | None = None) -> float:
    from vllm import LLM

    model = smollm2()
    cfg = DynsteerConfig(capture_sites=("post_block",))
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=32, seed=0,
              **cfg.engine_kwargs())
    path = Path(out_path) if out_path else Path(tempfile.mkdtemp()) / "probe-sentiment.safetensors"
    return train_sentiment_probe(dynsteer.attach(llm), path)


def load_sentiment() -> tuple[list[str], np.ndarray]:
    """The data set's sentences and labels (1: positive)."""
    with DATA.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], np.array([int(r["label"] == "positive") for r in rows])


def train_sentiment_probe(steerer: dynsteer.Steerer, path: Path) -> float:
    """Collect, sweep layers, calibrate and save the probe to ``path``; returns the best held-out AUROC.

    ``steerer``'s engine needs capture buffers at ``post_block`` on the swept layers.
    """
    texts, labels = load_sentiment()
    # Under the chat template, as served: a probe fitted on raw sentences has another offset there.
    acts = collect(steerer, texts, labels, layers=LAYERS, site="post_block", positions="last_prompt", chat=True)
    print(f"collected {len(acts)} samples x {len(acts.layers)} layers, hidden {acts.hidden_size}")

    # The layer is chosen by 5-fold cross-validation on the training split; the held-out split only reports it.
    sweep = layer_sweep(acts, LogisticProbe, test_size=0.3, seed=0)
    print("per layer: cross-validated AUROC on the training split (chooses) and held-out AUROC (reports):")
    print(sweep.table())
    best = sweep.best_layer
    print(f"chosen layer: {best}  held-out AUROC: {sweep.best_auroc:.4f}"
          + ("" if sweep.separable else "  (not separable from the runner-up on this data)"))
    assert sweep.best_auroc >= 0.95, f"best held-out AUROC {sweep.best_auroc:.3f} < 0.95"

    # Calibrate the operating point on the held-out split (not the data the probe was fitted on).
    probe = sweep.estimators[best]
    y_test, s_test = labels[sweep.test_idx], sweep.test_scores[best]
    # It records how many negatives it rests on and the FPR's 95 % interval.
    cal = calibrate(s_test, y_test, TARGET_FPR)
    threshold = cal.threshold
    lo, hi = cal.fpr_interval
    print(f"threshold at {TARGET_FPR:.0%} FPR: decision > {threshold:.4f} on {cal.n_negatives} held-out negatives "
          f"(FPR {cal.fpr:.3f}, 95 % interval [{lo:.3f}, {hi:.3f}]; recall {recall_at(s_test, y_test, threshold):.3f})")

    save_probe(path, probe, model_id=steerer.shape.model_id, layer=best, site="post_block",
               method=f"LogisticProbe(C={probe.C_:.3g}), {len(texts)} sentiment sentences, chat template, last prompt token",
               calibration=cal)
    print(f"saved {path}")

    loaded = load_probe(path)
    loaded.check_compatible(steerer.shape)  # raises if this engine cannot run it
    X_best = acts.X[best]
    # The file stores float32 weights: agreement with the in-memory probe is to float32 precision.
    np.testing.assert_allclose(loaded.decision_function(X_best), probe.decision_function(X_best), rtol=1e-4,
                               atol=1e-4)
    g = loaded.gate_params()
    np.testing.assert_allclose(gate(X_best, g), loaded.predict_proba(X_best)[:, 1], atol=1e-9)
    print(f"reloaded: layer {loaded.layer}, site {loaded.site}, compatible; gate sharpness {g.sharpness:.4f}, "
          f"threshold {g.threshold:.4f}")
    print(f"BEST_AUROC={sweep.best_auroc:.4f} BEST_LAYER={best}")
    return sweep.best_auroc


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
