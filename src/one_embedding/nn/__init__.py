"""Layers with explicit forward and backward (no autograd engine, by design).

``forward`` keeps what ``backward`` needs; ``backward`` returns input gradients and accumulates
parameter gradients into ``Parameter.grad``. Layers take the array namespace from their inputs
and run ``kernels.ops_for(xp)``: the numpy reference on numpy arrays, CUDA kernels on cupy arrays.
``nn.amp.autocast("fp16" | "bf16")`` runs the matrix products in half precision (mixed precision).

    >>> import numpy as np
    >>> from one_embedding import nn
    >>> mlp = nn.MLP(13, [8, 1], last_relu=False, seed=0)
    >>> y = mlp(np.ones((4, 13), np.float32)); y.shape
    (4, 1)
    >>> dx = mlp.backward(np.ones_like(y)); dx.shape, mlp.layers[0].weight.grad.shape
    ((4, 13), (8, 13))
"""
from . import amp
from .cross import CrossNet
from .fm import FactorizationMachine
from .interaction import DotInteraction, num_pairs, padding_to_multiple
from .linear import MLP, Dropout, Linear
from .loss import BCEWithLogits
from .module import Module, Parameter, inference, keeps_activations

FM = FactorizationMachine

__all__ = [
    "inference", "keeps_activations",
    "Parameter", "Module", "Linear", "MLP", "Dropout", "DotInteraction", "CrossNet",
    "FactorizationMachine", "FM", "BCEWithLogits", "num_pairs", "padding_to_multiple", "amp",
]
