"""PyTorch interop: ``TorchEmbedding``, a ``torch.nn.Module`` over a one_embedding embedding.

    lookup = TorchEmbedding(emb)                     # emb: a MultiTableEmbedding
    row_opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    dense_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = lookup(ids)                                # (B, F) LongTensor -> (B, F, E) float32
    loss = f(out, ...); loss.backward()              # the rows' gradient goes to emb.backward
    row_opt.step(); dense_opt.step()                 # rows updated in the store; dense by torch
    row_opt.zero_grad(); dense_opt.zero_grad()

The rows live in the embedding's store, not in torch parameters: ``model.parameters()`` and
``state_dict()`` do not hold them (save them with ``emb.save_snapshot``). The row optimizer is
one_embedding's (its state lives in the stored line); dense parameters take any ``torch.optim``.

Memory: on CPU nothing is copied between the frameworks. The ids reach the embedding as a numpy
view of the tensor (``Tensor.numpy()``), the rows come back as a tensor over the array the
embedding returned (``torch.from_numpy``), and the gradient reaches ``emb.backward`` as a view of
torch's gradient tensor. Only ``_to_array`` / ``_to_tensor`` below know how tensors and arrays
convert.
On a GPU (an embedding built with ``device="cuda"``) the same happens through DLPack:
``cupy.from_dlpack(tensor)`` in and ``torch.from_dlpack(array)`` out, zero-copy on the device.

Each output keeps its own lookup (``StepState``) and hands its gradient to
``emb.backward(grad, state=...)``, so several lookups may feed one loss, an output may be used
twice (its gradients add), and gradient accumulation (forward, backward, forward, backward, then
one step) works.

``import one_embedding`` never imports torch; only this module does.
"""
from __future__ import annotations

try:
    import torch
except ImportError as e:  # torch is an optional extra
    raise ImportError(
        f"one_embedding.torch needs PyTorch ({e}): pip install 'one_embedding[torch]' "
        "(or any torch build for your platform)"
    ) from e

import numpy as np

from .errors import ConfigError, InputError
from .step import StepState

__all__ = ["TorchEmbedding"]


# How tensors and the embedding's arrays convert, both ways without a copy: CPU tensors are numpy
# views (``Tensor.numpy()`` / ``torch.from_numpy``); CUDA tensors and CuPy arrays (an embedding
# built with ``device="cuda"``) go through DLPack, zero-copy on the device. Both libraries work on
# their current stream; with the defaults (the legacy default stream on both sides) their kernels
# run in call order.
def _to_array(tensor: torch.Tensor):
    """A numpy view of a CPU tensor, a CuPy view of a CUDA tensor (any dtype, any strides)."""
    if tensor.device.type == "cpu":
        return tensor.detach().numpy()
    import cupy

    return cupy.from_dlpack(tensor.detach())


def _to_tensor(array) -> torch.Tensor:
    """A tensor over ``array``'s memory, on the array's device."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def _check_device(tensor: torch.Tensor, embedding, what: str) -> None:
    """CPU tensors suit every embedding (a device embedding copies host ids up once); CUDA
    tensors need the rows on the GPU too."""
    if tensor.device.type == "cpu":
        return
    if tensor.device.type == "cuda" and getattr(embedding, "launch", None) is not None:
        return
    raise InputError(
        f"{what} are on device {tensor.device} but the embedding keeps its rows on the CPU: pass "
        f"{what}.cpu(), or build the embedding with device='cuda' to keep ids, rows and "
        "gradients on the GPU"
    )


class _Lookup(torch.autograd.Function):
    """The rows of one lookup as an autograd node: backward hands the output's gradient to
    ``embedding.backward`` (which sums it per key and keeps it for ``Optimizer.step``)."""

    @staticmethod
    def forward(ctx, anchor, embedding, state):
        # anchor: an empty tensor that requires grad, so autograd records this node (the rows
        # depend on no torch tensor); state: the prepared lookup whose rows this node returns
        ctx.embedding, ctx.state = embedding, state
        return _to_tensor(embedding.embed(state))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        # (…, E), a view of torch's gradient; several lookups may feed one loss, each with its
        # own state, and a second backward through one lookup adds to its gradient
        ctx.embedding.backward(_to_array(grad), state=ctx.state)
        return None, None, None


class TorchEmbedding(torch.nn.Module):
    """``forward(ids, table_ids=None)``: ids (…) integer tensor, e.g. a (B, F) LongTensor ->
    (…, E) float32 tensor whose gradient, after ``loss.backward()``, waits in the embedding for
    ``one_embedding.Optimizer.step()``.

    embedding: a ``MultiTableEmbedding`` / ``MultiTableMultiColumnEmbedding`` (any store).
    table_ids: as in ``MultiTableEmbedding.forward`` (tensor, array or None: column j of (B, T)
    ids is table j). ``ids`` may instead be the ``StepState`` that ``embedding.prepare(ids)``
    returned (e.g. from a ``one_embedding.pipeline.Prefetcher``); the rows are then those of the
    prepared step, current as of now. Under ``torch.no_grad()`` the output needs no backward.

    >>> import numpy as np, torch, one_embedding as oe
    >>> from one_embedding.torch import TorchEmbedding
    >>> emb = oe.MultiTableEmbedding("e", 2, np.float32, np.int64, [oe.make_table_options(
    ...     oe.make_constant_initializer(0.5))], oe.make_device_mem_store_options(None, 100))
    >>> lookup, opt = TorchEmbedding(emb), oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    >>> out = lookup(torch.tensor([[1, 2], [1, 3]]))       # (2, 2, 2)
    >>> out.sum().backward(); opt.step()                   # key 1 got gradient 2 per element
    >>> lookup(torch.tensor([1, 2])).tolist()
    [[0.30000001192092896, 0.30000001192092896], [0.4000000059604645, 0.4000000059604645]]
    """

    def __init__(self, embedding):
        super().__init__()
        for method in ("forward", "embed", "backward", "prepare"):
            if not callable(getattr(embedding, method, None)):
                raise ConfigError(
                    f"embedding={embedding!r} has no {method}(): wrap a "
                    "one_embedding.MultiTableEmbedding or MultiTableMultiColumnEmbedding"
                )
        self.embedding = embedding

    @property
    def embedding_dim(self) -> int:
        return self.embedding.embedding_dim

    def forward(self, ids, table_ids=None) -> torch.Tensor:
        embedding = self.embedding
        if isinstance(ids, StepState):
            state = ids
            if table_ids is not None:
                raise InputError("table_ids were given with a prepared StepState: they were "
                                 "fixed by embedding.prepare(ids, table_ids); pass None")
        else:
            if isinstance(ids, torch.Tensor):
                _check_device(ids, embedding, "ids")
                ids = _to_array(ids)
            if isinstance(table_ids, torch.Tensor):
                _check_device(table_ids, embedding, "table_ids")
                table_ids = _to_array(table_ids)
            # on the main communicator, apart from a Prefetcher's, in the same order on every rank
            state = embedding.prepare(ids, table_ids, background=False)
        if not torch.is_grad_enabled():
            return _to_tensor(embedding.embed(state))
        anchor = torch.empty(0, requires_grad=True)
        return _Lookup.apply(anchor, embedding, state)

    def extra_repr(self) -> str:
        e = self.embedding
        return (f"name={getattr(e, 'name', '?')!r}, embedding_dim={getattr(e, 'embedding_dim', '?')}, "
                f"store={getattr(getattr(e, 'store_options', None), 'kind', '?')}")
