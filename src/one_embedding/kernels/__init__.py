"""Fused operators: a numpy reference (the spec) and CUDA kernels with the same function names.

``ops_for(xp)`` picks the module for an array namespace, so a layer written once runs the numpy
reference on numpy arrays and the CUDA kernels on cupy arrays::

    >>> import numpy as np
    >>> from one_embedding.kernels import ops_for
    >>> ops_for(np).__name__
    'one_embedding.kernels.reference'
"""
from __future__ import annotations

import numpy as np

from . import reference

#: The functions every backend module provides, with identical signatures (KERNEL_API).
OPS = (
    "bias_act_forward", "bias_act_backward",
    "dropout_forward", "dropout_backward",
    "dot_interaction_forward", "dot_interaction_backward",
    "cross_vector_forward", "cross_vector_backward",
    "cross_matrix_forward", "cross_matrix_backward",
    "fm_forward", "fm_backward",
    "bce_with_logits_forward", "bce_with_logits_backward",
)


def ops_for(xp):
    """The kernel module for namespace ``xp``: ``reference`` for numpy, ``cuda_ops`` for cupy."""
    if xp is np:
        return reference
    if getattr(xp, "__name__", "") == "cupy":
        # imported lazily: cuda_ops needs cupy, which importing one_embedding must never load
        from . import cuda_ops

        return cuda_ops
    raise TypeError(f"no kernels for array namespace {xp!r}: use numpy or cupy arrays")


__all__ = ["OPS", "ops_for", "reference"]
