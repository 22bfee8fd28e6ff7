"""Steering quality on a set of prompts: what a steered reply gains in the concept and what it loses in fluency.

Every measure is computed locally, by the same engine, on greedy replies to a list of prompts:

* **concept score** — a callable ``concept(replies) -> [score per reply]``. Two are provided:
  :func:`probe_concept` (a probe's ``P(target)`` on the reply: the reply is sent back as a user message under the
  chat template, unsteered, and the probe reads the residual at its last prompt token at the probe's layer and site,
  where a probe trained by ``collect(..., chat=True)`` reads its training sentences) and :func:`word_concept`
  (``(target − opposite words) / words`` of the reply). The **concept gain** is the steered mean minus the unsteered
  mean on the same prompts.
* **fluency** — the *unsteered* model's perplexity of the reply given its (unsteered) prompt,
  ``exp(−mean log p(token))`` (:func:`dynsteer.sweep.metrics.perplexity`); per set, the mean over replies. The
  **perplexity ratio** is the steered mean over the unsteered mean (1 = as fluent as the model on its own).
* **repetition** — the fraction of a reply's token 4-grams that repeat an earlier 4-gram of the same reply
  (:func:`dynsteer.sweep.metrics.repeated_ngram_rate`); per set, the mean over replies. Looping replies score high.
* **prompt relevance** (sweeps) — the share of the prompt's content words the reply uses
  (:func:`dynsteer.sweep.metrics.prompt_overlap`), as a ratio to the unsteered replies' (``relevance_ratio``).
* **combined score** — ``concept gain × fluency penalty × relevance penalty`` with ``fluency penalty = min(1,
  1 / perplexity ratio) × (1 − repetition)`` and ``relevance penalty = min(1, relevance ratio)`` (1 where it is
  not measured): a gain bought with broken or off-prompt text counts for less (:func:`combined_score`).

:class:`QualityPoint` holds one setting's figures; :func:`measure` computes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from dynsteer.sweep import metrics as M

__all__ = ["Concept", "QualityPoint", "combined_score", "measure", "pareto_front", "perplexities", "probe_concept",
           "prompt_ids", "word_concept"]

Concept = Callable[[list[str]], list[float]]
"""A concept scorer: one score per reply text (higher = more of the concept)."""

_WORD = re.compile(r"[0-9a-z']+")


class QualityPoint(BaseModel):
    """One setting's quality on one prompt set.

    Attributes:
        label: ``unsteered``, ``steered`` or ``random`` (a random direction of the steering vector's norm).
        dose: the relative dose (:mod:`dynsteer.dose`; 0 unsteered).
        scale: the multiple of the steering vector added.
        concept: mean concept score of the replies.
        perplexity: mean unsteered-model perplexity of the replies.
        repeat_4gram: mean fraction of repeated token 4-grams.
        prompts: the prompts the replies answer (in order).
        replies: the reply texts.
    """

    model_config = ConfigDict(frozen=True)

    label: str
    dose: float
    scale: float
    concept: float
    perplexity: float
    repeat_4gram: float
    prompts: list[str]
    replies: list[str]

    def relative_to(self, base: "QualityPoint") -> dict[str, float]:
        """``concept_gain``, ``perplexity_ratio`` and ``combined`` against the unsteered point of the same prompts."""
        ratio = self.perplexity / base.perplexity if base.perplexity > 0 else float("inf")
        return {"concept_gain": self.concept - base.concept, "perplexity_ratio": ratio,
                "combined": combined_score(self.concept - base.concept, ratio, self.repeat_4gram)}


def combined_score(concept_gain: float, perplexity_ratio: float, repeat_4gram: float,
                   relevance_ratio: float | None = None) -> float:
    """``concept_gain × min(1, 1/perplexity_ratio) × (1 − repeat_4gram) × min(1, relevance_ratio)`` (the last factor
    1 when ``relevance_ratio`` is ``None``).

    Example:
        >>> combined_score(0.2, 2.0, 0.5)   # half the gain for doubled perplexity, half again for 50 % repeats
        0.05
        >>> combined_score(0.2, 1.0, 0.0, relevance_ratio=0.5)   # half the prompt's words kept: half the gain
        0.1
    """
    penalty = min(1.0, 1.0 / perplexity_ratio) if perplexity_ratio > 0 else 1.0
    relevance = 1.0 if relevance_ratio is None else min(1.0, max(0.0, relevance_ratio))
    return float(concept_gain * penalty * (1.0 - repeat_4gram) * relevance) + 0.0  # + 0.0: no "-0" in tables


def pareto_front(cost: Sequence[float], gain: Sequence[float]) -> list[int]:
    """Indices of the points no other point beats (lower or equal ``cost`` and higher or equal ``gain``, one of them
    strictly), by increasing cost: the concept-vs-fluency trade-off curve.

    Example:
        >>> pareto_front([1.0, 1.2, 1.1, 2.0], [0.0, 0.3, 0.1, 0.25])   # (2.0, 0.25) is beaten by (1.2, 0.3)
        [0, 2, 1]
    """
    pts = sorted(range(len(cost)), key=lambda i: (cost[i], -gain[i]))
    front: list[int] = []
    for i in pts:
        if not front or gain[i] > gain[front[-1]]:
            front.append(i)
    return front


def word_concept(target: Sequence[str], opposite: Sequence[str] = ()) -> Concept:
    """A concept scorer: ``(target words − opposite words) / words`` of each reply (0 for a reply without words).

    Example:
        >>> word_concept(["good"], ["bad"])(["good good bad day", ""])
        [0.25, 0.0]
    """
    pos, neg = {w.lower() for w in target}, {w.lower() for w in opposite}

    def score(texts: list[str]) -> list[float]:
        out = []
        for t in texts:
            words = _WORD.findall(t.lower())
            out.append((sum(w in pos for w in words) - sum(w in neg for w in words)) / len(words) if words else 0.0)
        return out

    return score


def probe_concept(steerer: Any, probe: Any, *, layer: int, site: str = "post_block", target_class: int = 1,
                  chat: bool = True) -> Concept:
    """A concept scorer: ``probe.predict_proba(residual)[:, target_class]`` of each reply, read unsteered.

    Args:
        steerer: the engine's :class:`dynsteer.Steerer`, with capture buffers at ``(layer, site)``.
        probe: a fitted estimator with ``predict_proba`` (e.g. :func:`dynsteer.probes.load_probe`'s).
        layer, site: where the probe reads.
        target_class: the column of ``predict_proba`` that is the concept.
        chat: the reply is a user message under the chat template (as ``collect(..., chat=True)`` reads); ``False``:
            plain text.
    """
    from vllm import SamplingParams

    from dynsteer.capture.spec import CaptureSpec

    def score(texts: list[str]) -> list[float]:
        todo = [t if t.strip() else "." for t in texts]  # an empty reply still gets a (neutral-ish) reading
        ids = prompt_ids(steerer, todo, chat=chat)
        spec = CaptureSpec(layers=[layer], sites=[site], positions="last_prompt")
        outs = steerer.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=1, temperature=0.0),
                                capture=spec, use_tqdm=False)
        X = np.stack([np.asarray(o.capture[(layer, site)], np.float64)[-1] for o in outs])
        return [float(p) for p in probe.predict_proba(X)[:, target_class]]

    return score


def prompt_ids(steerer: Any, prompts: Sequence[str], *, chat: bool = True) -> list[list[int]]:
    """Token ids of ``prompts``: user messages under the model's chat template (generation prompt appended), or plain
    text without ``chat``."""
    tok = steerer.llm.get_tokenizer()
    if chat:
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False) for p in prompts]
    return [tok.encode(p) for p in prompts]


def perplexities(steerer: Any, pairs: list[tuple[list[int], list[int]]], SamplingParams: Any) -> list[float | None]:
    """Unsteered perplexity of each output given its prompt: one batch of prompt-logprob requests (each distinct
    prompt + output scored once)."""
    todo = sorted({(tuple(p), tuple(o)) for p, o in pairs if o})
    if not todo:
        return [None] * len(pairs)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = steerer.llm.generate([{"prompt_token_ids": list(p + o)} for p, o in todo], params, use_tqdm=False)
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], float | None] = {}
    for (p, o), out in zip(todo, outs):
        lps = []
        for pos, tok in enumerate(o, start=len(p)):
            entry = out.prompt_logprobs[pos]
            lps.append(float(entry[tok].logprob))
        found[(p, o)] = M.perplexity(lps)
    return [found.get((tuple(p), tuple(o))) if o else None for p, o in pairs]


def measure(steerer: Any, prompts: Sequence[str], concept: Concept, *, label: str = "unsteered",
            vector: Optional[np.ndarray] = None, layer: int = 0, site: str = "post_block", scale: float = 0.0,
            dose: float = 0.0, max_tokens: int = 32, chat: bool = True) -> QualityPoint:
    """Greedy replies to ``prompts`` with ``scale · vector`` added at ``(layer, site)`` (nothing without ``vector``)
    and their :class:`QualityPoint`. The replies' perplexity is scored by the same engine, unsteered."""
    from vllm import SamplingParams

    from dynsteer.spec import AddVector, SteeringSpec

    ids = prompt_ids(steerer, prompts, chat=chat)
    spec = None
    if vector is not None and scale != 0.0:
        spec = SteeringSpec(vectors=[AddVector(layer=layer, site=site, vector=np.asarray(vector, np.float32),
                                               scale=float(scale))])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = steerer.generate([{"prompt_token_ids": p} for p in ids], params, steering=spec, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    texts = [o.outputs[0].text for o in outs]
    ppl = [p for p in perplexities(steerer, list(zip(ids, tokens)), SamplingParams) if p is not None]
    scores = concept(texts)
    return QualityPoint(label=label, dose=float(dose), scale=float(scale),
                        concept=float(np.mean(scores)) if len(scores) else 0.0,
                        perplexity=float(np.mean(ppl)) if ppl else float("nan"),
                        repeat_4gram=float(np.mean([M.repeated_ngram_rate(t, 4) for t in tokens])),
                        prompts=list(prompts), replies=texts)
