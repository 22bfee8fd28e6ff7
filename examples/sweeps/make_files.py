"""Write the data files the sweep examples read, for SmolLM2-135M-Instruct (a few minutes on CPU):

* ``sentiment-probe.safetensors`` — a sentiment probe (logistic regression on the layer-20 residual at the last
  prompt token, the 60 sentences of ``examples/probe_training.py``), as ``examples/dynamic_sentiment.py`` trains it;
* ``positive.npy`` — the unit vector towards positive sentiment (the probe's direction);
* ``positive.safetensors`` — the same vector as a steering-vector file (:func:`dynsteer.vectors.save_vector`) for
  layer 20.

    python examples/sweeps/make_files.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402

import dynamic_sentiment as ds  # noqa: E402  (sets vLLM's CPU defaults before vLLM is imported)
import dynsteer  # noqa: E402
from dynsteer import ProbeGate  # noqa: E402
from dynsteer.vectors import save_vector  # noqa: E402
from dynsteer.zoo import smollm2  # noqa: E402


def main(out: Path = HERE) -> None:
    llm = ds.make_engine(smollm2())
    steerer = dynsteer.attach(llm)
    probe = out / "sentiment-probe.safetensors"
    ds.train_probe(steerer, probe)
    direction = np.asarray(ProbeGate.from_probe_file(probe, name="positive").direction, np.float64)
    positive = (direction / np.linalg.norm(direction)).astype(np.float32)
    np.save(out / "positive.npy", positive)
    save_vector(out / "positive.safetensors", {ds.LAYER: positive}, site="post_block",
                model_id=steerer.shape.model_id, method="unit direction of the sentiment probe (positive class)")
    print(f"wrote {probe.name}, positive.npy, positive.safetensors in {out}")


if __name__ == "__main__":
    main()
