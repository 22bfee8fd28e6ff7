"""Linear probes as scikit-learn estimators, each reducible to one ``(w, b)`` on the raw residual.

All follow scikit-learn's conventions (hyperparameters stored unchanged by ``__init__``, learned state in attributes
ending in ``_``, ``fit`` returns ``self``), so they work with ``clone``, ``Pipeline``, ``GridSearchCV`` and
``cross_val_score``. They are binary classifiers: ``classes_[1]`` is the positive class.

Every probe exposes :meth:`LinearProbe.linear_form` → ``(w, b)`` in the ORIGINAL input space with any
standardisation folded in, so ``decision_function(X) == X @ w + b``; that pair is what the probe file stores and what
the in-graph gate uses (:mod:`dynsteer.probefile.gate`).

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((200, 8)); y = (X[:, 0] > 0).astype(int)
    >>> w, b = LogisticProbe(cv=3).fit(X, y).linear_form()
    >>> bool(np.allclose(LogisticProbe(cv=3).fit(X, y).decision_function(X), X @ w + b))
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.special import expit
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.linear_model import LogisticRegressionCV
from sklearn.preprocessing import StandardScaler
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data


class LinearProbe(ClassifierMixin, BaseEstimator):
    """Shared behaviour: subclasses implement ``_fit_linear(X, y01) -> (w, b)`` in the raw input space.

    Fitted attributes (all subclasses):
        classes_: the two class labels; ``classes_[1]`` is positive.
        coef_: ``w`` as ``[1, n_features]`` (scikit-learn's linear-model shape).
        intercept_: ``b`` as ``[1]``.
        n_features_in_: number of input features.
    """

    def fit(self, X: np.ndarray, y: np.ndarray) -> "LinearProbe":
        """Fit on ``X [n_samples, n_features]`` and binary labels ``y``.

        Raises:
            ValueError: ``y`` does not have exactly two classes.
        """
        X, y = validate_data(self, X, y, dtype=np.float64, y_numeric=False)
        check_classification_targets(y)
        self.classes_, y01 = np.unique(y, return_inverse=True)
        if len(self.classes_) != 2:
            raise ValueError(f"{type(self).__name__} is a binary probe; got {len(self.classes_)} classes "
                             f"({self.classes_.tolist()})")
        w, b = self._fit_linear(X, y01.astype(np.int64))
        self.coef_ = np.asarray(w, dtype=np.float64).reshape(1, -1)
        self.intercept_ = np.array([float(b)])
        return self

    def _fit_linear(self, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        raise NotImplementedError

    def linear_form(self) -> tuple[np.ndarray, float]:
        """``(w [n_features] float64, b)`` with ``decision_function(x) == x·w + b`` on raw (unstandardised) inputs."""
        check_is_fitted(self, "coef_")
        return self.coef_[0].copy(), float(self.intercept_[0])

    def decision_function(self, X: np.ndarray) -> np.ndarray:
        """Signed score ``X @ w + b`` (> 0: positive class), shape ``[n_samples]``."""
        check_is_fitted(self, "coef_")
        X = validate_data(self, X, dtype=np.float64, reset=False)
        return X @ self.coef_[0] + self.intercept_[0]

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """``[n_samples, 2]``: ``[1 − σ(d), σ(d)]`` with ``d = decision_function(X)``."""
        p = expit(self.decision_function(X))
        return np.stack([1.0 - p, p], axis=1)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Class labels: ``classes_[1]`` where the decision is > 0."""
        return self.classes_[(self.decision_function(X) > 0).astype(np.int64)]


def _fold(w_std: np.ndarray, b_std: float, scaler: StandardScaler | None) -> tuple[np.ndarray, float]:
    """Express ``((x − mean)/scale)·w + b`` as ``x·w' + b'`` so the probe runs on raw residuals."""
    if scaler is None:
        return w_std, b_std
    w = w_std / scaler.scale_
    return w, float(b_std - scaler.mean_ @ w)


class LogisticProbe(LinearProbe):
    """L2-regularised logistic regression, the strength chosen by cross-validation (wraps ``LogisticRegressionCV``).

    ``predict_proba`` is the logistic model's own probability; the probe is exactly the gate
    ``σ(x·w + b)`` (architecture §4).

    Args:
        Cs: inverse regularisation strengths to try (an int: that many on a log grid from 1e-4 to 1e4).
        cv: cross-validation folds used to pick ``C``.
        standardize: z-score the features before fitting (helps the solver and makes one ``C`` grid fit every layer's
            scale); folded back into ``(w, b)`` afterwards.
        scoring: scikit-learn scorer for choosing ``C``; log-loss prefers calibrated probabilities, which matter when
            the probe becomes a gate.
        max_iter: solver iterations per fit.

    Fitted attributes (besides :class:`LinearProbe`'s):
        C_: the chosen inverse regularisation strength.
        scaler_: the fitted ``StandardScaler`` (``None`` without standardisation).
        model_: the fitted ``LogisticRegressionCV`` (on standardised inputs when ``standardize``).
    """

    def __init__(self, Cs: int | Sequence[float] = 10, cv: int = 5, standardize: bool = True,
                 scoring: str | None = "neg_log_loss", max_iter: int = 1000) -> None:
        self.Cs = Cs
        self.cv = cv
        self.standardize = standardize
        self.scoring = scoring
        self.max_iter = max_iter

    def _fit_linear(self, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        self.scaler_ = StandardScaler().fit(X) if self.standardize else None
        Z = self.scaler_.transform(X) if self.scaler_ is not None else X
        # Explicit l1_ratios/scoring/use_legacy_attributes: scikit-learn 1.8+ warns about changing defaults otherwise.
        self.model_ = LogisticRegressionCV(Cs=self.Cs, cv=self.cv, l1_ratios=(0.0,), scoring=self.scoring,
                                           max_iter=self.max_iter, use_legacy_attributes=False).fit(Z, y)
        self.C_ = float(self.model_.C_)
        return _fold(self.model_.coef_[0], float(self.model_.intercept_[0]), self.scaler_)


class DiffMeanProbe(LinearProbe):
    """Difference of class means: ``w = mean_pos − mean_neg``, ``b = −w·(mean_pos + mean_neg)/2``.

    The decision is positive on the positive side of the hyperplane half-way between the two class means.
    ``predict_proba`` is ``σ(decision)`` by convention only: the scale of ``w`` is whatever the mean difference is, so
    these are scores squashed to (0, 1), not calibrated probabilities (calibrate a threshold with
    :func:`dynsteer.probes.metrics.calibrate_threshold`, or prefer :class:`LogisticProbe` when probabilities matter).

    Args:
        standardize: take the means of z-scored features (a diagonal whitening), folded back into ``(w, b)``.

    Fitted attributes (besides :class:`LinearProbe`'s):
        mean_pos_: mean of the positive class (raw space), ``mean_neg_``: of the negative class.
        scaler_: the fitted ``StandardScaler`` or ``None``.
    """

    def __init__(self, standardize: bool = False) -> None:
        self.standardize = standardize

    def _fit_linear(self, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        self.mean_pos_, self.mean_neg_ = X[y == 1].mean(0), X[y == 0].mean(0)
        self.scaler_ = StandardScaler().fit(X) if self.standardize else None
        Z = self.scaler_.transform(X) if self.scaler_ is not None else X
        mu_pos, mu_neg = Z[y == 1].mean(0), Z[y == 0].mean(0)
        w = mu_pos - mu_neg
        return _fold(w, float(-w @ (mu_pos + mu_neg) / 2), self.scaler_)


class LDAProbe(LinearProbe):
    """Linear discriminant analysis with covariance shrinkage (wraps ``LinearDiscriminantAnalysis``).

    ``decision_function`` is the LDA log-odds and ``predict_proba`` equals LDA's own binary ``predict_proba``
    (``σ(log-odds)``). Shrinkage keeps the covariance invertible when ``n_samples`` < hidden size, the usual case
    for residual-stream probes.

    Args:
        shrinkage: ``"auto"`` (Ledoit-Wolf), a float in [0, 1], or ``None``.
        solver: ``"lsqr"`` or ``"eigen"`` (the LDA solvers that support shrinkage).

    Fitted attributes (besides :class:`LinearProbe`'s):
        model_: the fitted ``LinearDiscriminantAnalysis``.
    """

    def __init__(self, shrinkage: str | float | None = "auto", solver: str = "lsqr") -> None:
        self.shrinkage = shrinkage
        self.solver = solver

    def _fit_linear(self, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        self.model_ = LinearDiscriminantAnalysis(solver=self.solver, shrinkage=self.shrinkage).fit(X, y)
        return self.model_.coef_[0], float(self.model_.intercept_[0])


__all__ = ["DiffMeanProbe", "LDAProbe", "LinearProbe", "LogisticProbe"]
