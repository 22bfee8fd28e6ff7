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

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from sklearn.base import clone
from sklearn.calibration import calibration_curve as _sk_calibration_curve
from sklearn.metrics import accuracy_score, roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold, train_test_split

from dynsteer._deprecated import renamed
from dynsteer.probes.collect import Activations

if TYPE_CHECKING:
    from dynsteer.probefile.fileformat import Calibration


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


class CalibrationWarning(UserWarning):
    """A threshold or a layer choice rests on too little data to mean what it says."""


def fpr_interval(false_positives: int, negatives: int, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson (exact binomial) interval of a false-positive rate seen as ``false_positives`` of
    ``negatives``: what the rate on fresh data from the same distribution plausibly is."""
    from scipy.stats import beta

    if negatives <= 0:
        return 0.0, 1.0
    a = (1.0 - confidence) / 2
    lo = 0.0 if false_positives == 0 else float(beta.ppf(a, false_positives, negatives - false_positives + 1))
    hi = 1.0 if false_positives == negatives else float(beta.ppf(1 - a, false_positives + 1,
                                                                 negatives - false_positives))
    return lo, hi


def calibrate_threshold(scores: np.ndarray, y: np.ndarray, target_fpr: float, *, min_negatives: int = 50,
                        strict: bool = False) -> float:
    """The lowest threshold whose false-positive rate on ``(scores, y)`` is at most ``target_fpr``.

    With ``n_neg`` negatives, at most ``k = floor(target_fpr · n_neg)`` of them may score above the threshold, so the
    threshold is the ``(k+1)``-th highest negative score (``score > threshold`` flags positive). The guarantee holds
    on the data given; on fresh data from the same distribution the FPR is close to, not bounded by, the target
    (use a held-out calibration split, and enough negatives that ``1/n_neg`` is small next to the target).

    Args:
        scores: decision values (or probabilities), ``[n]``.
        y: binary labels, ``[n]``.
        target_fpr: allowed false-positive rate in [0, 1].
        min_negatives: fewer negatives than this warn (:class:`CalibrationWarning`): with 9 negatives a "5 % FPR"
            threshold is the highest negative score, and its rate on fresh data can be far higher (see
            :func:`fpr_interval`, and :func:`calibrate`, which records both).
        strict: refuse (``ValueError``) instead of warning.

    Raises:
        ValueError: no negatives, ``target_fpr`` outside [0, 1], or too few negatives when ``strict``.
    """
    if not 0.0 <= target_fpr <= 1.0:
        raise ValueError(f"target_fpr must be in [0, 1], got {target_fpr}")
    scores = np.asarray(scores, dtype=np.float64)
    neg = np.sort(scores[~_positive_mask(y)])[::-1]
    if len(neg) == 0:
        raise ValueError("calibrate_threshold needs at least one negative sample")
    if len(neg) < min_negatives:
        msg = (f"calibrate_threshold: {len(neg)} negatives (< min_negatives={min_negatives}): the threshold's "
               f"false-positive rate on fresh data is uncertain; calibrate on more negatives")
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, CalibrationWarning, stacklevel=2)
    # Tiny epsilon: floor(0.05 * 20) must be 1, not 0 because 0.05 * 20 == 0.9999999... in floating point.
    k = int(np.floor(target_fpr * len(neg) + 1e-9))
    if k >= len(neg):
        return float(np.nextafter(neg[-1], -np.inf))  # every negative may be flagged
    return float(neg[k])


def calibrate(scores: np.ndarray, y: np.ndarray, target_fpr: float, *, min_negatives: int = 50,
              strict: bool = False, confidence: float = 0.95) -> "Calibration":
    """A :class:`~dynsteer.probefile.fileformat.Calibration` at ``target_fpr`` that records what it rests on: the
    threshold (as :func:`calibrate_threshold`, with its warning or refusal below ``min_negatives``), the number of
    negatives, the false-positive rate it has on these scores and its ``confidence`` interval, and the AUROC."""
    from dynsteer.probefile.fileformat import Calibration

    threshold = calibrate_threshold(scores, y, target_fpr, min_negatives=min_negatives, strict=strict)
    neg = np.asarray(scores, np.float64)[~_positive_mask(y)]
    fp = int(np.sum(neg > threshold))
    lo, hi = fpr_interval(fp, len(neg), confidence)
    has_both = len(np.unique(np.asarray(y))) == 2
    return Calibration(threshold=threshold, target_fpr=target_fpr, auroc=auroc(y, scores) if has_both else None,
                       n=int(len(np.asarray(y))), n_negatives=len(neg),
                       fpr=fp / len(neg), fpr_interval=(lo, hi), confidence=confidence)


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
    return recall_at(scores, y, calibrate_threshold(scores, y, target_fpr, min_negatives=0))


def calibration_curve(y: np.ndarray, proba: np.ndarray, n_bins: int = 10, strategy: str = "uniform"
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``(fraction_positive, mean_predicted)`` per probability bin (scikit-learn's ``calibration_curve``)."""
    return _sk_calibration_curve(_positive_mask(y).astype(int), proba, n_bins=n_bins, strategy=strategy)


@dataclass
class LayerScore:
    """One layer's probe: cross-validated on the training split (what selects the layer) and scored once on the
    held-out split (what the chosen layer is reported with; never used to choose)."""

    layer: int
    auroc: float  # held-out
    accuracy: float  # held-out
    recall_at_5pct_fpr: float  # held-out, threshold set on the same held-out scores (an in-sample operating point)
    cv_auroc_mean: float = float("nan")
    cv_auroc_std: float = float("nan")
    cv_folds: int = 0


@dataclass
class LayerSweepResult:
    """Result of :func:`layer_sweep`.

    Attributes:
        scores: ``{layer: LayerScore}``.
        estimators: ``{layer: fitted estimator}`` (fitted on the whole training split).
        train_idx: indices of the training samples (the same split for every layer).
        test_idx: indices of the held-out samples.
        separable: ``False`` when the cross-validation could not tell the best layer from the runner-up (their
            mean AUROCs differ by less than the larger spread); a :class:`CalibrationWarning` said so.
        fold_idx: the samples of each cross-validation fold's validation part (indices into the activations, all
            in ``train_idx``; the same folds for every layer).
        groups: the group of each sample when the splits kept groups whole, else ``None``.
    """

    scores: dict[int, LayerScore]
    estimators: dict[int, Any]
    train_idx: np.ndarray
    test_idx: np.ndarray
    test_scores: dict[int, np.ndarray] = field(default_factory=dict)
    separable: bool = True
    fold_idx: list[np.ndarray] = field(default_factory=list)
    groups: np.ndarray | None = None

    @property
    def auroc(self) -> dict[int, float]:
        """``{layer: held-out AUROC}``."""
        return {layer: s.auroc for layer, s in self.scores.items()}

    def ranking(self) -> list[int]:
        """Layers best first: by cross-validated mean AUROC, then the smaller spread across folds, then the earlier
        layer (cheaper to monitor). The held-out split plays no part."""
        return sorted(self.scores, key=lambda layer: (-self.scores[layer].cv_auroc_mean,
                                                      self.scores[layer].cv_auroc_std, layer))

    @property
    def best_layer(self) -> int:
        return self.ranking()[0]

    @property
    def best_auroc(self) -> float:
        """The chosen layer's held-out AUROC (an unbiased figure: the held-out split did not choose it)."""
        return self.scores[self.best_layer].auroc

    def table(self) -> str:
        """A plain-text table, one row per layer, the chosen one marked."""
        lines = ["layer  cv auroc (mean ± sd)  held-out auroc  acc     recall@5%fpr"]
        best = self.best_layer
        for layer in sorted(self.scores):
            s = self.scores[layer]
            mark = "  <- chosen" if layer == best else ""
            lines.append(f"{layer:>5}  {s.cv_auroc_mean:.4f} ± {s.cv_auroc_std:.4f}      {s.auroc:.4f}          "
                         f"{s.accuracy:.4f}  {s.recall_at_5pct_fpr:.4f}{mark}")
        return "\n".join(lines)


def _sweep_groups(acts: Activations, groups: Any, n: int) -> np.ndarray | None:
    if groups is False:
        return None
    if groups is None or groups is True:
        g = getattr(acts, "groups", None)
        if g is None and groups is True:
            raise ValueError("layer_sweep: groups=True, but the activations carry no groups")
    else:
        g = groups
    if g is None:
        return None
    g = np.asarray(g)
    if len(g) != n:
        raise ValueError(f"layer_sweep: groups has {len(g)} entries for {n} samples")
    return g


def _group_split(y: np.ndarray, g: np.ndarray, test_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Held-out split of whole groups, stratified by each group's most common label (when every label leads at
    least two groups), as ``train_test_split`` does for samples."""
    names, inverse = np.unique(g, return_inverse=True)
    classes, y_code = np.unique(y, return_inverse=True)
    counts = np.zeros((len(names), len(classes)), np.int64)
    np.add.at(counts, (inverse, y_code), 1)
    lead = counts.argmax(1)
    if len(names) < 2:
        raise ValueError(f"layer_sweep: {len(names)} group; a grouped held-out split needs at least 2")
    stratify = lead if np.min(np.bincount(lead, minlength=len(classes))) >= 2 else None
    train_g, test_g = train_test_split(np.arange(len(names)), test_size=test_size, random_state=seed,
                                       stratify=stratify)
    idx = np.arange(len(y))
    return idx[np.isin(inverse, train_g)], idx[np.isin(inverse, test_g)]


def layer_sweep(acts: Activations, estimator_factory: Callable[[], Any] | Any, test_size: float = 0.3,
                seed: int = 0, cv: int = 5, groups: np.ndarray | Sequence[Any] | bool | None = None
                ) -> LayerSweepResult:
    """Choose a layer by stratified ``cv``-fold cross-validation on a training split; report every layer on the
    held-out rest.

    Per layer: ``cv`` probes fitted on the folds of the training split give a mean and a spread of AUROC (the
    ranking, :meth:`LayerSweepResult.ranking`); one probe fitted on the whole training split is scored on the held-out
    split. When the best layer's mean AUROC is within the larger of its and the runner-up's spread of the
    runner-up's, the data cannot separate them: a :class:`CalibrationWarning` says so (collect more, or harder,
    samples) and ``separable`` is False.

    Args:
        acts: labelled activations (``acts.y`` must be set).
        estimator_factory: a callable returning a fresh estimator (e.g. ``LogisticProbe``), or an estimator instance
            (cloned per fit).
        test_size: held-out fraction.
        seed: split seed (the same splits are used for every layer, so layers are compared on the same samples).
        cv: folds (reduced to the smaller class's count in the training split when that is lower; at least 2).
        groups: a group per sample (e.g. the prompt a generated token came from), kept whole: the held-out split
            takes whole groups (stratified by each group's most common label) and the folds are
            ``StratifiedGroupKFold``, so no group's samples sit on both sides of a split (one reply's tokens are
            near-duplicates; split apart, they leak and inflate the scores). ``None`` (the default): ``acts.groups``
            when the activations carry them (:func:`~dynsteer.probes.collect_generated`), else per-sample splits;
            ``False``: per-sample splits even so. With groups, ``cv`` is also reduced to the number of groups
            holding the rarer class in the training split.
    """
    if acts.y is None:
        raise ValueError("layer_sweep needs labelled activations (collect(..., labels=...))")
    y = np.asarray(acts.y)
    idx = np.arange(len(y))
    g = _sweep_groups(acts, groups, len(y))
    if g is None:
        train_idx, test_idx = train_test_split(idx, test_size=test_size, random_state=seed, stratify=y)
    else:
        train_idx, test_idx = _group_split(y, g, test_size, seed)
    # An estimator class is itself a factory; an estimator instance is cloned so the caller's object stays unfitted.
    is_instance = hasattr(estimator_factory, "get_params") and not isinstance(estimator_factory, type)
    make = (lambda: clone(estimator_factory)) if is_instance else estimator_factory
    y_train = y[train_idx]
    if g is None:
        folds = min(cv, int(np.min(np.unique(y_train, return_counts=True)[1])))
        if folds < 2:
            raise ValueError(f"layer_sweep: the training split has {folds} sample(s) of a class; cross-validation "
                             f"needs at least 2 per class")
        splits = list(StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed).split(train_idx, y_train))
    else:
        g_train = g[train_idx]
        folds = min(cv, min(len(np.unique(g_train[y_train == c])) for c in np.unique(y)))
        if folds < 2:
            raise ValueError(f"layer_sweep: the training split has {folds} group(s) holding a class; grouped "
                             f"cross-validation needs at least 2 per class")
        splits = list(StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed)
                      .split(train_idx, y_train, g_train))
    scores: dict[int, LayerScore] = {}
    estimators: dict[int, Any] = {}
    test_scores: dict[int, np.ndarray] = {}
    for layer in sorted(acts.X):
        X = acts.X[layer]
        Xtr = X[train_idx]
        cv_auc = []
        for fit_i, val_i in splits:
            est = make().fit(Xtr[fit_i], y_train[fit_i])
            cv_auc.append(auroc(y_train[val_i], est.decision_function(Xtr[val_i])))
        est = make().fit(Xtr, y_train)
        s = est.decision_function(X[test_idx])
        yt = y[test_idx]
        scores[layer] = LayerScore(layer=layer, auroc=auroc(yt, s), accuracy=accuracy(yt, est.predict(X[test_idx])),
                                   recall_at_5pct_fpr=recall_at(s, yt, calibrate_threshold(s, yt, 0.05,
                                                                                           min_negatives=0)),
                                   cv_auroc_mean=float(np.mean(cv_auc)), cv_auroc_std=float(np.std(cv_auc)),
                                   cv_folds=folds)
        estimators[layer] = est
        test_scores[layer] = s
    result = LayerSweepResult(scores=scores, estimators=estimators, train_idx=train_idx, test_idx=test_idx,
                         test_scores=test_scores, fold_idx=[train_idx[val_i] for _, val_i in splits], groups=g)
    rank = result.ranking()
    if len(rank) > 1:
        a, b = scores[rank[0]], scores[rank[1]]
        if a.cv_auroc_mean - b.cv_auroc_mean <= max(a.cv_auroc_std, b.cv_auroc_std):
            result.separable = False
            warnings.warn(f"layer_sweep: layer {a.layer} (cv AUROC {a.cv_auroc_mean:.4f} ± {a.cv_auroc_std:.4f}) "
                          f"is not separable from layer {b.layer} ({b.cv_auroc_mean:.4f} ± {b.cv_auroc_std:.4f}) "
                          f"on {len(train_idx)} training samples; the choice among them is arbitrary",
                          CalibrationWarning, stacklevel=2)
    return result


__all__ = ["CalibrationWarning", "LayerScore", "LayerSweepResult", "accuracy", "auroc", "calibrate",
           "calibrate_threshold",
           "calibration_curve", "fpr_at", "fpr_interval", "layer_sweep", "recall_at", "recall_at_fpr"]

# Old name kept for one release (``dynsteer.sweep.SweepResult`` is a sweep run's result).
__getattr__ = renamed(__name__, {"SweepResult": ("LayerSweepResult", LayerSweepResult)})
