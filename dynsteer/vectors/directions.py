"""Directions from activations: difference of means and the first principal component of pair differences.

Both take the residuals of the positive and the negative examples at one layer, ``[n, hidden]`` each (row ``i`` of
both from pair ``i``), and compute in float64.

* :func:`mean_difference`: ``mean(positive) − mean(negative)`` (contrastive activation addition).
* :func:`pca_direction`: the first principal component of the pair differences ``positive_i − negative_i``, taken
  about zero (the same component as PCA on differences in a random order, without the randomness), signed so that
  positives project higher on average, and scaled to the mean difference's length along it. Where pairs differ in
  more than the concept, it keeps the direction most pairs agree on.

Example:
    >>> import numpy as np
    >>> pos, neg = np.array([[2.0, 1.0], [4.0, 1.0]]), np.array([[0.0, 1.0], [0.0, 1.0]])
    >>> mean_difference(pos, neg).tolist()
    [3.0, 0.0]
    >>> pca_direction(pos, neg).round(6).tolist()
    [3.0, 0.0]
"""

from __future__ import annotations

import numpy as np


def _pair_arrays(positive: np.ndarray, negative: np.ndarray, paired: bool) -> tuple[np.ndarray, np.ndarray]:
    pos, neg = np.asarray(positive, np.float64), np.asarray(negative, np.float64)
    if pos.ndim != 2 or neg.ndim != 2 or pos.shape[1] != neg.shape[1]:
        raise ValueError(f"positive and negative must be [n, hidden] with one hidden size, got {pos.shape} and "
                         f"{neg.shape}")
    if not len(pos) or not len(neg):
        raise ValueError("positive and negative need at least one row each")
    if paired and pos.shape != neg.shape:
        raise ValueError(f"pairs: {len(pos)} positives and {len(neg)} negatives; PCA needs them paired")
    return pos, neg


def mean_difference(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """``mean(positive) − mean(negative)`` over rows, float32 ``[hidden]``."""
    pos, neg = _pair_arrays(positive, negative, paired=False)
    return (pos.mean(0) - neg.mean(0)).astype(np.float32)


def pca_direction(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """First principal component of the pair differences, signed so that ``mean(positive·v) > mean(negative·v)``,
    with length ``mean((positive − negative)·u)`` for its unit direction ``u``; float32 ``[hidden]``.

    Raises:
        ValueError: shapes differ, or the differences are all zero (no direction).
    """
    pos, neg = _pair_arrays(positive, negative, paired=True)
    diffs = pos - neg
    _, s, vt = np.linalg.svd(diffs, full_matrices=False)
    if not s.size or s[0] == 0.0:
        raise ValueError("pairs: every positive equals its negative at this layer; there is no direction")
    u = vt[0]
    along = float((diffs @ u).mean())
    if along < 0:
        u, along = -u, -along
    return (u * along).astype(np.float32)


def rescale(vector: np.ndarray, norm: float | None, where: str = "vector") -> np.ndarray:
    """``vector`` with L2 norm ``norm`` (``None``: unchanged). ``ValueError`` for a zero vector or a norm ≤ 0."""
    v = np.asarray(vector, np.float64)
    if norm is None:
        return v.astype(np.float32)
    if not norm > 0 or not np.isfinite(norm):
        raise ValueError(f"norm: {norm}; give a finite number > 0")
    length = float(np.linalg.norm(v))
    if length == 0.0:
        raise ValueError(f"{where}: zero vector, it cannot be rescaled to norm {norm}")
    return (v * (norm / length)).astype(np.float32)


__all__ = ["mean_difference", "pca_direction", "rescale"]
