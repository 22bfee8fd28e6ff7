"""Probe quality: AUROC, accuracy, recall at a fixed false-positive rate, calibration, and a per-layer sweep.

Thresholds follow one convention everywhere: a sample is flagged positive when ``score > threshold`` (strictly).

Example:
    >>> import numpy as np
    >>> scores, y = np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])
    >>> auroc(y, scores)
    0.75
    >>> calibrate_threshold(scores, y, target_fpr=0.0)
    0.4
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.base import clone
from sklearn.calibration import calibration_curve as _sk_calibration_curve
from sklearn.metrics import accuracy_score, roc_auc_score
from sklearn.model_selection import train_test_split

from dynsteer.probes.collect import Activations


def auroc(y: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for binary labels ``y`` (higher score: more positive)."""
    return float(roc_auc_score(y, scores))


def accuracy(y: np.ndarray, pred: np.ndarray) -> float:
    """Fraction of predictions equal to the labels."""
    return float(accuracy_score(y, pred))


def _positive_mask(y: np.ndarray) -> np.ndarray:
    """Boolean positives: labels are 0/1 or booleans, or any two values with the larger one positive."""
    y = np.asarray(y)
    classes = np.unique(y)
    if len(classes) > 2:
        raise ValueError(f"binary labels expected, got {len(classes)} classes")
    return y == classes[-1]


def calibrate_threshold(scores: np.ndarray, y: np.ndarray, target_fpr: float) -> float:
    """The lowest threshold whose false-positive rate on ``(scores, y)`` is at most ``target_fpr``.

    With ``n_neg`` negatives, at most ``k = floor(target_fpr · n_neg)`` of them may score above the threshold, so the
    threshold is the ``(k+1)``-th highest negative score (``score > threshold`` flags positive). The guarantee holds
    on the data given; on fresh data from the same distribution the FPR is close to, not bounded by, the target
    (use a held-out calibration split, and enough negatives that ``1/n_neg`` is small next to the target).

    Args:
        scores: decision values (or probabilities), ``[n]``.
        y: binary labels, ``[n]``.
        target_fpr: allowed false-positive rate in [0, 1].

    Raises:
        ValueError: no negatives, or ``target_fpr`` outside [0, 1].
    """
    if not 0.0 <= target_fpr <= 1.0:
        raise ValueError(f"target_fpr must be in [0, 1], got {target_fpr}")
    scores = np.asarray(scores, dtype=np.float64)
    neg = np.sort(scores[~_positive_mask(y)])[::-1]
    if len(neg) == 0:
        raise ValueError("calibrate_threshold needs at least one negative sample")
    # Tiny epsilon: floor(0.05 * 20) must be 1, not 0 because 0.05 * 20 == 0.9999999... in floating point.
    k = int(np.floor(target_fpr * len(neg) + 1e-9))
    if k >= len(neg):
        return float(np.nextafter(neg[-1], -np.inf))  # every negative may be flagged
    return float(neg[k])


def fpr_at(scores: np.ndarray, y: np.ndarray, threshold: float) -> float:
    """False-positive rate of ``score > threshold``."""
    neg = np.asarray(scores)[~_positive_mask(y)]
    return float(np.mean(neg > threshold)) if len(neg) else 0.0


def recall_at(scores: np.ndarray, y: np.ndarray, threshold: float) -> float:
    """True-positive rate (recall) of ``score > threshold``."""
    pos = np.asarray(scores)[_positive_mask(y)]
    return float(np.mean(pos > threshold)) if len(pos) else 0.0


def recall_at_fpr(y: np.ndarray, scores: np.ndarray, target_fpr: float = 0.05) -> float:
    """Recall at the threshold calibrated on the same data to ``target_fpr`` (an in-sample operating point)."""
    return recall_at(scores, y, calibrate_threshold(scores, y, target_fpr))


def calibration_curve(y: np.ndarray, proba: np.ndarray, n_bins: int = 10, strategy: str = "uniform"
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``(fraction_positive, mean_predicted)`` per probability bin (scikit-learn's ``calibration_curve``)."""
    return _sk_calibration_curve(_positive_mask(y).astype(int), proba, n_bins=n_bins, strategy=strategy)


@dataclass
class LayerScore:
    """Held-out quality of one layer's probe."""

    layer: int
    auroc: float
    accuracy: float
    recall_at_5pct_fpr: float


@dataclass
class SweepResult:
    """Result of :func:`layer_sweep`.

    Attributes:
        scores: ``{layer: LayerScore}`` on the held-out split.
        estimators: ``{layer: fitted estimator}`` (fitted on the training split).
        train_idx: indices of the training samples (the same split for every layer).
        test_idx: indices of the held-out samples.
    """

    scores: dict[int, LayerScore]
    estimators: dict[int, Any]
    train_idx: np.ndarray
    test_idx: np.ndarray
    test_scores: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def auroc(self) -> dict[int, float]:
        """``{layer: held-out AUROC}``."""
        return {layer: s.auroc for layer, s in self.scores.items()}

    @property
    def best_layer(self) -> int:
        """The layer with the highest held-out AUROC.

        Small held-out sets saturate AUROC at 1.0 on many layers, so ties go to the higher held-out accuracy (a
        better default threshold), then to the earliest layer (cheaper to monitor, earlier signal).
        """
        return max(self.scores, key=lambda layer: (self.scores[layer].auroc, self.scores[layer].accuracy, -layer))

    @property
    def best_auroc(self) -> float:
        return self.scores[self.best_layer].auroc

    def table(self) -> str:
        """A plain-text table, one row per layer, the best one marked."""
        lines = ["layer  auroc   acc     recall@5%fpr"]
        for layer in sorted(self.scores):
            s = self.scores[layer]
            mark = "  <- best" if layer == self.best_layer else ""
            lines.append(f"{layer:>5}  {s.auroc:.4f}  {s.accuracy:.4f}  {s.recall_at_5pct_fpr:.4f}{mark}")
        return "\n".join(lines)


def layer_sweep(acts: Activations, estimator_factory: Callable[[], Any] | Any, test_size: float = 0.3,
                seed: int = 0) -> SweepResult:
    """Fit one probe per layer on a stratified training split and score it on the held-out rest.

    Args:
        acts: labelled activations (``acts.y`` must be set).
        estimator_factory: a callable returning a fresh estimator (e.g. ``LogisticProbe``), or an estimator instance
            (cloned per layer).
        test_size: held-out fraction.
        seed: split seed (the same split is used for every layer, so layers are compared on the same samples).
    """
    if acts.y is None:
        raise ValueError("layer_sweep needs labelled activations (collect(..., labels=...))")
    y = np.asarray(acts.y)
    idx = np.arange(len(y))
    train_idx, test_idx = train_test_split(idx, test_size=test_size, random_state=seed, stratify=y)
    # An estimator class is itself a factory; an estimator instance is cloned so the caller's object stays unfitted.
    is_instance = hasattr(estimator_factory, "get_params") and not isinstance(estimator_factory, type)
    make = (lambda: clone(estimator_factory)) if is_instance else estimator_factory
    scores: dict[int, LayerScore] = {}
    estimators: dict[int, Any] = {}
    test_scores: dict[int, np.ndarray] = {}
    for layer in sorted(acts.X):
        X = acts.X[layer]
        est = make().fit(X[train_idx], y[train_idx])
        s = est.decision_function(X[test_idx])
        yt = y[test_idx]
        scores[layer] = LayerScore(layer=layer, auroc=auroc(yt, s), accuracy=accuracy(yt, est.predict(X[test_idx])),
                                   recall_at_5pct_fpr=recall_at_fpr(yt, s, 0.05))
        estimators[layer] = est
        test_scores[layer] = s
    return SweepResult(scores=scores, estimators=estimators, train_idx=train_idx, test_idx=test_idx,
                       test_scores=test_scores)


__all__ = ["LayerScore", "SweepResult", "accuracy", "auroc", "calibrate_threshold", "calibration_curve", "fpr_at",
           "layer_sweep", "recall_at", "recall_at_fpr"]
