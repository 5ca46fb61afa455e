"""Evaluation metrics for click prediction: ROC AUC and log loss."""
from __future__ import annotations

import numpy as np

from .errors import InputError


def roc_auc(labels, scores) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties).

    labels: (n,) in {0, 1}; scores: (n,) any monotone score (logits or probabilities).
    """
    y = np.asarray(labels, np.float64).reshape(-1)
    s = np.asarray(scores, np.float64).reshape(-1)
    if y.shape != s.shape:
        raise InputError(f"labels {y.shape} and scores {s.shape} differ in shape")
    n_pos = float((y > 0.5).sum())
    n_neg = float(y.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    ranks = np.empty(y.size, np.float64)
    # average rank within runs of equal scores
    boundaries = np.flatnonzero(np.diff(sorted_s)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [y.size]])
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each run
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y > 0.5].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def log_loss(labels, logits) -> float:
    """Mean binary cross-entropy of ``logits`` (n,) against ``labels`` (n,), numerically stable."""
    y = np.asarray(labels, np.float64).reshape(-1)
    z = np.asarray(logits, np.float64).reshape(-1)
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))


def check_labels(labels, where: str) -> None:
    """InputError naming ``where`` for a label outside [0, 1] or NaN in ``labels`` (n,), as the
    training loss refuses one: AUC and log loss over such labels look like figures and mean
    nothing."""
    y = np.asarray(labels)
    bad = ~((y >= 0) & (y <= 1))
    if bad.any():
        at = int(np.argmax(bad))
        raise InputError(f"{where}: labels[{at}] is {y[at]}: labels must lie in [0, 1] (click = "
                         "1, no click = 0)")

