"""Binary cross-entropy with logits, mean over the batch."""
from __future__ import annotations

from ..backend import array_namespace, as_array
from ..errors import InputError
from ..kernels import ops_for
from .module import Module
from .. import host_sync


def checked_labels(logits, labels):
    """logits: (B,) float; labels: (B,) -> (logits, labels in the logits' dtype) (a list or
    other array-like becomes an array of the logits' namespace). InputError on a shape mismatch,
    integer logits (their gradient would be truncated to integers) and an empty batch (its mean
    loss is undefined, as the fused device kernel says too); a label outside [0, 1] or NaN
    raises through ``host_sync.check`` (deferred on the device path: no host read here). Shared
    by ``BCEWithLogits`` and the loss fused with the last layer (``Linear.loss_and_backward``)."""
    xp = array_namespace(logits, labels)
    logits, labels = as_array(xp, logits, "logits"), as_array(xp, labels, "labels")
    if logits.ndim != 1:
        raise InputError(f"logits must have shape (B,), got {tuple(logits.shape)}")
    if logits.dtype.kind != "f":
        raise InputError(f"logits.dtype={logits.dtype}: the loss takes floating-point logits "
                         "(the model's output), e.g. logits.astype(np.float32)")
    if logits.shape[0] == 0:
        raise InputError("logits is empty: the mean loss of an empty batch is undefined")
    if tuple(labels.shape) != tuple(logits.shape):
        raise InputError(
            f"labels have shape {tuple(labels.shape)} but logits have {tuple(logits.shape)}: "
            "pass one label per sample"
        )
    labels = labels.astype(logits.dtype, copy=False)
    bad = (labels < 0) | (labels > 1) | xp.isnan(labels)

    def first_bad():
        at = xp.argmax(bad)
        return at, labels[at]

    host_sync.check(bad.any(), lambda at, value: (
        f"labels[{int(at)}] is {value}: labels must lie in [0, 1] (click = 1, no click = 0)"),
        "loss: labels outside [0, 1]", details=first_bad)
    return logits, labels


class BCEWithLogits(Module):
    """``loss = mean_b [max(z,0) - z*y + log(1 + exp(-|z|))]``; ``backward()`` -> dlogits (B,).

    logits: (B,) float; labels: (B,) with values in [0, 1] (cast to the logits' dtype).
    """

    def __init__(self):
        self._saved = None

    def forward(self, logits, labels):
        logits, labels = checked_labels(logits, labels)
        self._saved = (logits, labels)
        return ops_for(array_namespace(logits)).bce_with_logits_forward(logits, labels)

    def backward(self):
        """-> dlogits (B,) = (sigmoid(logits) - labels) / B."""
        if self._saved is None:
            raise InputError("BCEWithLogits.backward() without a forward(): compute the loss first")
        logits, labels = self._saved
        self._saved = None
        return ops_for(array_namespace(logits)).bce_with_logits_backward(logits, labels)
