"""Dose recommendation: the strongest relative dose of a steering vector that keeps replies fluent, with a random
control and a held-out check.

:func:`recommend_dose` takes a vector, a place ``(layer, site)``, a concept scorer (:mod:`dynsteer.sweep.quality`)
and two disjoint prompt lists:

1. **Tuning split.** The unsteered replies give the baseline perplexity. The dose then steps up through
   ``doses`` (relative doses, :mod:`dynsteer.dose`: ``scale = dose · mean‖h‖ / ‖v‖``); at each step the steered
   replies are measured, and so are those of a **random direction of the vector's norm** at the same scale (so the
   same dose): the control says how much of the concept gain, and of the fluency loss, any push of that size
   gives. A step is **admissible** when its mean perplexity is at most ``max_perplexity_ratio`` × the unsteered one
   and its mean repeated-4-gram rate at most ``max_repeat_4gram``. The search stops at the first step that is not;
   the recommendation is the last admissible step (``None`` when even the first is not).
2. **Held-out split.** Unsteered, steered at the recommended dose and the random control at that dose are measured
   on the held-out prompts only: the figures to report, never used to choose.

The result (:class:`DoseRecommendation`) is JSON-serialisable (``model_dump_json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from dynsteer.dose import residual_norms
from dynsteer.sweep.quality import Concept, QualityPoint, measure

__all__ = ["DEFAULT_DOSES", "DoseRecommendation", "DoseStep", "recommend_dose"]

DEFAULT_DOSES = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8)
"""Relative doses tried, in order (a tenth of a typical residual's norm is 0.1)."""


class DoseStep(BaseModel):
    """One dose on the tuning split: the steered point, the random control beside it, and whether it is admissible
    (``reasons`` says which bound it broke)."""

    model_config = ConfigDict(frozen=True)

    steered: QualityPoint
    random: QualityPoint
    admissible: bool
    reasons: list[str]


class DoseRecommendation(BaseModel):
    """What :func:`recommend_dose` found.

    Attributes:
        layer, site: where the vector is added.
        vector_norm: ``‖v‖``; mean_norm: ``mean‖h‖`` at ``(layer, site)``.
        max_perplexity_ratio, max_repeat_4gram: the bounds.
        tune_unsteered: the unsteered point on the tuning split.
        steps: every dose tried, in order.
        dose, scale: the recommendation (``None``: no dose tried was admissible).
        held_unsteered, held_steered, held_random: the held-out split at the recommended dose (``None`` without one).
    """

    model_config = ConfigDict(frozen=True)

    layer: int
    site: str
    vector_norm: float
    mean_norm: float
    max_perplexity_ratio: float
    max_repeat_4gram: float
    tune_unsteered: QualityPoint
    steps: list[DoseStep]
    dose: Optional[float] = None
    scale: Optional[float] = None
    held_unsteered: Optional[QualityPoint] = None
    held_steered: Optional[QualityPoint] = None
    held_random: Optional[QualityPoint] = None

    def summary(self) -> str:
        """A few lines for a terminal."""
        base = self.tune_unsteered
        lines = [f"layer {self.layer} {self.site}: ‖v‖ {self.vector_norm:.3g}, mean‖h‖ {self.mean_norm:.4g}; "
                 f"bounds: perplexity ≤ {self.max_perplexity_ratio:g}× unsteered ({base.perplexity:.3g}), "
                 f"repeated 4-grams ≤ {self.max_repeat_4gram:.0%}",
                 f"tuning split ({len(base.prompts)} prompts), unsteered concept {base.concept:.3f}:"]
        for s in self.steps:
            st, rd = s.steered.relative_to(base), s.random.relative_to(base)
            lines.append(f"  dose {s.steered.dose:5.3f} (scale {s.steered.scale:7.3g}): concept "
                         f"{s.steered.concept:.3f} (random {s.random.concept:.3f}), perplexity "
                         f"×{st['perplexity_ratio']:.2f} (random ×{rd['perplexity_ratio']:.2f}), repeated 4-grams "
                         f"{s.steered.repeat_4gram:.0%} (random {s.random.repeat_4gram:.0%}) {'ok' if s.admissible else '✗ ' + ', '.join(s.reasons)}")
        if self.dose is None:
            lines.append("no dose tried keeps within the bounds")
            return "\n".join(lines)
        hu, hs, hr = self.held_unsteered, self.held_steered, self.held_random
        assert hu is not None and hs is not None and hr is not None
        rs, rr = hs.relative_to(hu), hr.relative_to(hu)
        lines.append(f"recommended: dose {self.dose:.3g} = scale {self.scale:.4g}")
        lines.append(f"held-out split ({len(hu.prompts)} prompts): concept {hu.concept:.3f} → {hs.concept:.3f} "
                     f"(random {hr.concept:.3f}); perplexity {hu.perplexity:.3g} → {hs.perplexity:.3g} "
                     f"(×{rs['perplexity_ratio']:.2f}; random ×{rr['perplexity_ratio']:.2f}); repeated 4-grams "
                     f"{hu.repeat_4gram:.0%} → {hs.repeat_4gram:.0%} (random {hr.repeat_4gram:.0%}); combined "
                     f"{rs['combined']:+.3f} (random {rr['combined']:+.3f})")
        return "\n".join(lines)


def recommend_dose(steerer: Any, vector: np.ndarray, *, layer: int, site: str = "post_block",
                   tune_prompts: Sequence[str], held_prompts: Sequence[str], concept: Concept,
                   doses: Sequence[float] = DEFAULT_DOSES, max_perplexity_ratio: float = 1.5,
                   max_repeat_4gram: float = 0.05, max_tokens: int = 32, seed: int = 0, chat: bool = True,
                   mean_norm: Optional[float] = None) -> DoseRecommendation:
    """Step the dose up on ``tune_prompts``, keep the strongest admissible one, and measure it on ``held_prompts``.

    Args:
        steerer: the engine's :class:`dynsteer.Steerer`.
        vector: the steering direction (the sign that moves towards the concept).
        layer, site: where it is added.
        tune_prompts, held_prompts: the two splits (disjoint; the held-out one is used only after choosing).
        concept: a concept scorer (:func:`dynsteer.sweep.quality.probe_concept`, :func:`~.word_concept`).
        doses: relative doses to try, increasing.
        max_perplexity_ratio: admissible when mean perplexity ≤ this × the unsteered mean.
        max_repeat_4gram: admissible when the mean repeated-4-gram rate ≤ this.
        max_tokens: greedy tokens per reply.
        seed: the random control's seed.
        chat: prompts are user messages under the chat template.
        mean_norm: ``mean‖h‖`` at the place (default: :func:`dynsteer.dose.residual_norms`, cached per model).

    Raises:
        ValueError: empty or overlapping splits, doses not increasing and positive, a zero vector.
    """
    vec = np.asarray(vector, np.float64).reshape(-1)
    norm = float(np.linalg.norm(vec))
    if not tune_prompts or not held_prompts:
        raise ValueError("tune_prompts and held_prompts: both splits need at least one prompt")
    overlap = set(tune_prompts) & set(held_prompts)
    if overlap:
        raise ValueError(f"held_prompts: {len(overlap)} prompt(s) also in tune_prompts, e.g. {next(iter(overlap))!r}")
    if not len(doses) or any(d <= 0 for d in doses) or any(b <= a for a, b in zip(doses, doses[1:])):
        raise ValueError(f"doses: must be positive and increasing, got {list(doses)}")
    if not norm > 0:
        raise ValueError("vector: zero vector")
    if mean_norm is None:
        mean_norm = residual_norms(steerer, [(layer, site)])[(layer, site)]
    rng = np.random.default_rng(seed)
    rand = rng.standard_normal(vec.shape[0])
    rand *= norm / np.linalg.norm(rand)  # equal norm: at the same scale, the same dose
    common = dict(layer=layer, site=site, max_tokens=max_tokens, chat=chat)

    base = measure(steerer, tune_prompts, concept, **common)
    steps: list[DoseStep] = []
    chosen: Optional[DoseStep] = None
    for d in doses:
        scale = float(d) * mean_norm / norm
        st = measure(steerer, tune_prompts, concept, label="steered", vector=vec, scale=scale, dose=d, **common)
        rd = measure(steerer, tune_prompts, concept, label="random", vector=rand, scale=scale, dose=d, **common)
        reasons = []
        if not st.perplexity <= max_perplexity_ratio * base.perplexity:
            reasons.append(f"perplexity ×{st.perplexity / base.perplexity:.2f} > ×{max_perplexity_ratio:g}")
        if not st.repeat_4gram <= max_repeat_4gram:
            reasons.append(f"repeated 4-grams {st.repeat_4gram:.1%} > {max_repeat_4gram:.0%}")
        steps.append(DoseStep(steered=st, random=rd, admissible=not reasons, reasons=reasons))
        if reasons:
            break
        chosen = steps[-1]
    out = dict(layer=layer, site=site, vector_norm=norm, mean_norm=float(mean_norm),
               max_perplexity_ratio=max_perplexity_ratio, max_repeat_4gram=max_repeat_4gram, tune_unsteered=base,
               steps=steps)
    if chosen is None:
        return DoseRecommendation(**out)
    scale = chosen.steered.scale
    return DoseRecommendation(
        **out, dose=chosen.steered.dose, scale=scale,
        held_unsteered=measure(steerer, held_prompts, concept, **common),
        held_steered=measure(steerer, held_prompts, concept, label="steered", vector=vec, scale=scale,
                             dose=chosen.steered.dose, **common),
        held_random=measure(steerer, held_prompts, concept, label="random", vector=rand, scale=scale,
                            dose=chosen.steered.dose, **common))
