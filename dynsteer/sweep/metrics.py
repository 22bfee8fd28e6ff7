"""Per-sample and per-variant metrics of a steering sweep. Every definition is here, in one place.

Per sample (one generated continuation; ``tokens`` are its generated token ids, EOS included when it stopped there):

* ``concept_probe`` — **concept score from a probe file**: the mean, over the generated tokens, of the probe's
  probability of its concept class (``predict_proba[:, concept_class]``) on the residual captured at the probe's
  layer and site in the same run. The capture reads the residual *before* any steering at that same site (earlier
  sites' steering, and every earlier token's steering through attention, are included), at every generated token
  but the last (which is never fed back). ``probe_trace`` keeps the per-token probabilities.
* ``concept_words`` — **concept score from a word list**: the fraction of the output's words (lower-cased runs of
  letters, digits and apostrophes) that are in the list.
* ``perplexity`` — **fluency**: ``exp(−mean log p(token))`` of the generated tokens under the *unsteered* model,
  conditioned on the (unsteered) prompt: the prompt plus output is scored with ``prompt_logprobs`` in the same
  engine, without steering.
* ``repeat_4gram`` — **degeneration**: the fraction of the output's token 4-grams that repeat an earlier 4-gram of
  the same output (``1 − distinct/total``; 0 when it has fewer than 4 tokens).
* ``relevance`` — **prompt relevance** (a lexical proxy, :func:`prompt_overlap`): the share of the prompt's content
  words (their first five letters, stop words left out) that the output uses too.
* ``distinct_1``, ``distinct_2`` — distinct-n: distinct token n-grams / all token n-grams of the output (1 when it
  has fewer than n tokens; higher is more diverse).
* ``identical`` — the output's token ids equal the unsteered run's for the same prompt and sample seed;
  ``changed = not identical``.
* ``steered_tokens`` (policies) — generated tokens at which the policy acted: some rule's applied gate times the
  controller's ``dyn_scale`` was non-zero (from the request's trace); ``fired = steered_tokens > 0``;
  ``gate_rate`` — the fraction of traced tokens whose first slot's gate reached 0.5.
* ``applied_dose`` (policies) — the mean over traced tokens of the relative dose actually applied at each token
  (``dose_trace``: the largest over additive actions of ``|applied gate| · |scale|·‖v‖ / mean‖h‖``, the applied
  gate including the controller's ``dyn_scale``; :func:`dynsteer.dose.applied_dose`).

Per variant and class (rows of ``summary.csv``): the mean of each sample metric over the samples of that class,
``changed_rate`` / ``identical_rate`` (means of the flags), ``fire_rate`` (mean of ``fired``), and across classes:

* ``side_effect_identical_rate`` — **side effects**: over the prompts of the classes the policy should leave alone,
  the fraction of samples byte-identical to the unsteered run (1 is ideal).
* ``target_steered_rate``, ``other_steered_rate``, ``selectivity`` — **selectivity** (CAST-style): the fraction of
  samples whose output changed on the target class, on the other classes, and their difference (1 is ideal: every
  target prompt steered, nothing else touched).

**Steering quality** per variant and class, against the unsteered baseline's row of the same class (in the spirit of
AxBench's concept × fluency × instruction-relevance score, every part computed locally):

* ``concept_gain`` — the concept score (``concept_probe``, or ``concept_words`` without a probe) minus the
  baseline's;
* ``perplexity_ratio`` — mean ``perplexity`` over the baseline's (1: as fluent as the unsteered model);
* ``relevance_ratio`` — mean ``relevance`` over the baseline's (1: the replies stay as close to the prompts as the
  unsteered replies do);
* ``combined`` — ``concept_gain × min(1, 1/perplexity_ratio) × (1 − repeat_4gram) × min(1, relevance_ratio)``
  (:func:`dynsteer.sweep.quality.combined_score`): a gain bought with broken, looping or off-prompt text counts for
  less.

A sweep's **random-direction controls** (``random: ...`` variants, :mod:`dynsteer.sweep.control`) get the same
figures: the same dose in a random direction, so a steered variant's concept gain over its control's is what its
direction contributes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["concept_words", "distinct_n", "mean_or_none", "perplexity", "prompt_overlap", "repeated_ngram_rate",
           "SAMPLE_METRICS", "STOP_WORDS"]

SAMPLE_METRICS = ("concept_probe", "concept_words", "perplexity", "repeat_4gram", "relevance", "distinct_1",
                  "distinct_2")
"""The numeric per-sample metrics, in report order."""

_WORD = re.compile(r"[0-9a-z']+")


def _ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """Distinct n-grams / n-grams of ``tokens``; 1.0 when there are none (too short to repeat anything).

    Example:
        >>> distinct_n([1, 2, 1, 2], 2)   # (1,2), (2,1), (1,2)
        0.6666666666666666
    """
    grams = _ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else 1.0


def repeated_ngram_rate(tokens: Sequence[int], n: int = 4) -> float:
    """The fraction of ``tokens``' n-grams that repeat an earlier one (``1 − distinct-n``); 0 without n-grams.

    Example:
        >>> repeated_ngram_rate([5, 6, 7, 8, 5, 6, 7, 8], 4)   # 5 four-grams, 1 repeats
        0.2
    """
    grams = _ngrams(tokens, n)
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def concept_words(text: str, words: Iterable[str]) -> float | None:
    """The fraction of ``text``'s words in ``words`` (case-insensitive); ``None`` without a list or without words.

    Example:
        >>> concept_words("Great food, GREAT service!", ["great"])
        0.5
    """
    vocab = {w.lower() for w in words}
    if not vocab:
        return None
    found = _WORD.findall(text.lower())
    return sum(w in vocab for w in found) / len(found) if found else None


STOP_WORDS = frozenset("""a about after all also am an and any are as at be been but by can could did do does for
from had has have he her him his how i if in into is it its just me more most my no not of on or our out she so
some than that the their them then there these they this to too up us very was we were what when where which who
why will with would you your""".split())
"""Function words :func:`prompt_overlap` leaves out (they are in every reply, whatever it is about)."""


def _content(text: str) -> set[str]:
    return {w[:5] for w in _WORD.findall(text.lower()) if len(w) > 2 and w not in STOP_WORDS}


def prompt_overlap(prompt: str, reply: str) -> float | None:
    """A cheap prompt-relevance proxy: the share of ``prompt``'s content words that ``reply`` uses too.

    Content words are lower-cased words of three letters or more outside :data:`STOP_WORDS`, compared by their first
    five letters (a crude stem: ``delivery`` matches ``delivered``). A reply that answers the prompt keeps naming
    what it is about (the cold soup, the late delivery); steering that pulls the reply onto the concept's own topic,
    or into loops and noise, drops those words. It needs no model pass and is deterministic. It is lexical, so a
    paraphrase does not count and a good answer may score well below 1: sweeps therefore report it as
    ``relevance_ratio``, relative to the unsteered replies to the same prompts, which cancels how much each prompt's
    answers echo it. (An embedding cosine would see paraphrases, but needs another pass per reply and a sentence
    encoder the engine does not have.)

    Returns ``None`` for a prompt without content words, 0 for a reply without any.

    Example:
        >>> prompt_overlap("My delivery arrived late and the soup was cold.", "Sorry the soup was delivered cold!")
        0.6
    """
    want = _content(prompt)
    if not want:
        return None
    return len(want & _content(reply)) / len(want)


def perplexity(logprobs: Sequence[float]) -> float | None:
    """``exp(−mean(logprobs))``; ``None`` for an empty output.

    Example:
        >>> round(perplexity([math.log(0.5), math.log(0.5)]), 6)
        2.0
    """
    if not len(logprobs):
        return None
    return float(math.exp(-float(np.mean(np.asarray(logprobs, np.float64)))))


def mean_or_none(values: Iterable[Any]) -> float | None:
    """The mean of the values that are not ``None`` (booleans count as 0/1); ``None`` if there are none."""
    vals = [float(v) for v in values if v is not None]
    return float(np.mean(vals)) if vals else None
