"""Calibrating an EMA latch for a per-token monitor: the ``on`` threshold that separates whole replies.

A per-token probe reads every generated token, and single tokens are noisy: a complaint's reply and a compliment's
both start with the same boilerplate. The sync tier's ``ema_latch`` controller
(:class:`dynsteer.controllers.EMALatch`) aggregates the monitor's score over the reply on the device, ``ema_0 = s_0``,
``ema_t = alpha·s_t + (1 − alpha)·ema_{t−1}``, and engages once ``ema ≥ on``; with ``off`` at the bottom of the range it then stays on for the rest of the reply. A
reply whose EMA never reaches ``on`` is never steered, so it is byte-identical to an unsteered run.

The controller averages the monitor's *score*, which is affine in the logit of the gate probability
(``logit(g) = sharpness·(score − threshold)``), so the calibration here works on logits of the probe's target class
(for a probe file, ``decision_function`` for class 1, its negation for class 0) and returns ``on`` as the gate
probability at that logit: ``SyncControllerSpec(kind="ema_latch", units="probability", on=cal.on, ...)`` maps it back
to the same score exactly.

Calibrate on held-out scores of the training data (out-of-fold predictions with folds split by reply), never on the
data you report on.

Example:
    >>> import numpy as np
    >>> logits = np.array([2.0, 3.0, 2.5, -1.0, 0.5, -2.0])   # two replies of three tokens
    >>> replies = np.array([0, 0, 0, 1, 1, 1])
    >>> cal = calibrate_ema_latch(logits, replies, targeted=np.array([1, 1, 1, 0, 0, 0]), alpha=0.5)
    >>> cal.recall, cal.specificity
    (1.0, 1.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LatchCalibration", "calibrate_ema_latch", "ema_peaks"]


@dataclass(frozen=True)
class LatchCalibration:
    """An EMA latch's operating point on the calibration replies.

    Attributes:
        on: engage threshold as the gate probability (``SyncControllerSpec(units="probability", on=...)``).
        on_logit: the same threshold as a logit of the target class.
        alpha: the EMA weight it was calibrated for.
        recall: share of targeted replies whose EMA reaches ``on``.
        specificity: share of the other replies whose EMA stays below ``on`` (never steered).
        n_targeted, n_other: replies of each kind.
    """

    on: float
    on_logit: float
    alpha: float
    recall: float
    specificity: float
    n_targeted: int
    n_other: int


def ema_peaks(logits: np.ndarray, groups: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """The largest EMA each reply reaches: ``(reply ids, peaks)``, ids sorted.

    Args:
        logits: one score per token (rows of a reply in generation order).
        groups: the reply of each row.
        alpha: the EMA weight of the newest score, in ``(0, 1]``.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha: {alpha} is not in (0, 1]")
    logits, groups = np.asarray(logits, np.float64), np.asarray(groups)
    if logits.shape != groups.shape or logits.ndim != 1:
        raise ValueError(f"logits and groups: one value each per token, got shapes {logits.shape} and "
                         f"{groups.shape}")
    ids = np.unique(groups)
    peaks = np.empty(len(ids))
    for k, g in enumerate(ids):
        ema, peak = None, -np.inf
        for s in logits[groups == g]:  # stable order: rows of one reply keep their generation order
            ema = s if ema is None else alpha * s + (1.0 - alpha) * ema
            peak = max(peak, ema)
        peaks[k] = peak
    return ids, peaks


def calibrate_ema_latch(logits: np.ndarray, groups: np.ndarray, targeted: np.ndarray, *,
                        alpha: float) -> LatchCalibration:
    """The ``on`` threshold that best separates targeted replies (EMA reaches it) from the others (EMA stays below).

    Among thresholds halfway between consecutive reply peaks, the one with the largest ``min(recall, specificity)``,
    then the largest ``recall + specificity``; ties go to the middle of the tied range (the widest margin).

    Args:
        logits: per-token logits of the monitor's target class (out-of-fold on the training replies).
        groups: the reply of each token.
        targeted: per token, whether its reply should be steered (constant within a reply).
        alpha: the EMA weight the controller will use.
    """
    targeted = np.asarray(targeted).astype(bool)
    ids, peaks = ema_peaks(logits, groups, alpha)
    groups = np.asarray(groups)
    want = np.array([bool(targeted[groups == g][0]) for g in ids])
    if any(np.any(targeted[groups == g] != w) for g, w in zip(ids, want)):
        raise ValueError("targeted: must be constant within each reply")
    if want.all() or not want.any():
        raise ValueError("targeted: need replies of both kinds to calibrate a threshold")
    edges = np.unique(peaks)
    cands = np.concatenate([[edges[0] - 1.0], (edges[:-1] + edges[1:]) / 2.0, [edges[-1] + 1.0]])
    rec = np.array([np.mean(peaks[want] >= t) for t in cands])
    spec = np.array([np.mean(peaks[~want] < t) for t in cands])
    worst, total = np.minimum(rec, spec), rec + spec
    best = np.flatnonzero(np.isclose(worst, worst.max()))
    best = best[np.isclose(total[best], total[best].max())]
    i = int(best[len(best) // 2])
    on_logit = float(cands[i])
    return LatchCalibration(on=float(1.0 / (1.0 + np.exp(-on_logit))), on_logit=on_logit, alpha=float(alpha),
                            recall=float(rec[i]), specificity=float(spec[i]), n_targeted=int(want.sum()),
                            n_other=int((~want).sum()))
