"""What DLRM, DCN and DeepFM share: input checks, the embedding they own, the two-stage step.

Contract: ``logits = model(dense, ids)`` -> (B,); ``model.backward(dlogits)`` accumulates every
dense parameter's grad and passes d(embeddings) (B, F, E) to ``model.embedding.backward``.
The dense part alone is ``forward_from_embeddings(dense, embedded)`` /
``backward_to_embeddings(dlogits) -> (ddense, dembedded)``, for benchmarks and parity tests;
the training step's ``loss_and_backward_to_embeddings(logits, labels, ...) -> (loss, ddense,
dembedded)`` adds the loss, fused with the last layer's backward on the device;
``embed(state, precision)`` gives what ``forward_from_embeddings`` reads from a prepared step
(the trainer's path: DLRM's interaction input on the device).

Ids must already be unique across tables (one key space, REFERENCE.md): the data layer offsets
or hashes each column; column j of ``ids`` is looked up with table j's initializer.
"""
from __future__ import annotations

import functools
import inspect
import math

import numpy as np

from .. import host_sync
from ..backend import array_namespace, as_array
from ..errors import ConfigError, InputError
from ..nn.module import Module
from ..step import StepState
from ..options import (
    whole_number,
    make_column_options,
    make_constant_initializer,
    make_device_mem_store_options,
    make_normal_initializer,
    make_table_options,
    make_uniform_initializer,
)

#: Embedding initializer of DCN / DeepFM tables when no table_sizes are given (OneEmbedding's
#: own default for tables=None).
DEFAULT_STD = 0.05


def table_initializer(table_size):
    """DLRM's per-table scheme: uniform(+-sqrt(1 / table_size)); normal(0, 0.05) without a size."""
    if table_size is None:
        return make_normal_initializer(0.0, DEFAULT_STD)
    if not whole_number(table_size) or table_size <= 0:
        raise ConfigError(f"table size {table_size!r} must be a positive integer (rows of that table)")
    bound = math.sqrt(1.0 / float(table_size))
    return make_uniform_initializer(-bound, bound)


def check_embedding_args(embedding, table_sizes, store_options, comm=None):
    """table_sizes, store_options and comm configure the embedding a model builds; with the
    caller's own ``embedding`` they would be silently ignored, so that combination is refused."""
    if embedding is not None and (table_sizes is not None or store_options is not None
                                  or comm is not None):
        given = ("table_sizes" if table_sizes is not None else
                 "store_options" if store_options is not None else "comm")
        raise ConfigError(
            f"{given} was given together with embedding=...: it only configures the embedding the "
            "model builds itself; set the initializers, store options and communicator on your "
            "embedding instead"
        )


def check_table_sizes(table_sizes, num_tables):
    if table_sizes is None:
        return None
    sizes = list(table_sizes)
    if len(sizes) != num_tables:
        raise ConfigError(f"table_sizes has {len(sizes)} entries but the model has num_tables={num_tables}")
    for i, s in enumerate(sizes):
        if s is None:
            raise ConfigError(f"table_sizes[{i}] is None: give every table's number of rows "
                              "(or table_sizes=None for none)")
        table_initializer(s)
    return tuple(int(s) for s in sizes)


def build_embedding(name, column_dims, num_tables, table_sizes, store_options, seed, first_order=False,
                    comm=None):
    """A default embedding: MultiTableEmbedding (one column) or, with ``first_order``, a
    MultiTableMultiColumnEmbedding with columns [E, 1] whose 1-wide column starts at 0.

    store_options None: device memory, no persistence, size_factor 1 (plain SGD). Pass
    ``make_*_store_options(..., size_factor=3)`` for Adam, 2 for Adagrad or momentum. comm:
    the embedding's communicator (None: ``default_comm()``).
    """
    from ..embedding import MultiTableEmbedding, MultiTableMultiColumnEmbedding

    if store_options is None:
        store_options = make_device_mem_store_options(persistent_path=None, capacity=None)
    sizes = table_sizes if table_sizes is not None else (None,) * num_tables
    if first_order:
        tables = [make_table_options([make_column_options(table_initializer(s)),
                                      make_column_options(make_constant_initializer(0.0))])
                  for s in sizes]
        return MultiTableMultiColumnEmbedding(name, list(column_dims), np.float32, np.int64, tables,
                                              store_options, seed=seed, comm=comm)
    tables = [make_table_options(table_initializer(s)) for s in sizes]
    return MultiTableEmbedding(name, int(column_dims[0]), np.float32, np.int64, tables, store_options,
                               seed=seed, comm=comm)


def positive(name, value) -> int:
    if not whole_number(value) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return int(value)


def non_negative(name, value) -> int:
    if not whole_number(value) or value < 0:
        raise ConfigError(f"{name}={value!r} must be an integer >= 0")
    return int(value)


def check_seed(seed):
    """A model's seed: an integer >= 0 (or a numpy SeedSequence), named where numpy would
    raise its own error deep in the constructor."""
    if isinstance(seed, np.random.SeedSequence):
        return seed
    if not whole_number(seed) or seed < 0:
        raise ConfigError(f"seed={seed!r} must be an integer >= 0 (the dense weights' and the "
                          "embedding's seed), e.g. seed=0")
    return int(seed)


def layer_sizes(name, sizes) -> tuple:
    """An MLP's layer sizes given as a sequence -> a tuple (the sizes are checked by the MLP)."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ConfigError(f"{name}={sizes!r} must be a sequence of layer sizes, e.g. "
                          "(512, 256, 128)")
    return tuple(sizes)



class CTRModel(Module):
    """Base of the click-through-rate models. Sub-classes set ``num_tables``,
    ``dense_features``, ``embedding_width`` (E, or E + 1 for DeepFM), ``embedding``, ``dtype``.

    Every model takes its arguments by keyword only, the shared ones under the same names
    (``SHARED_ARGUMENTS``, in that order), so that a positional call fails instead of silently
    building a model of other sizes.
    """

    SHARED_ARGUMENTS = ("num_tables", "embedding_dim", "dense_features", "table_sizes",
                        "embedding", "store_options", "comm", "seed", "dtype")

    num_tables: int
    dense_features: int
    embedding_width: int

    def __init_subclass__(cls, **kwargs):
        """A model takes keyword arguments only; a positional call gets a TypeError that names
        the keyword each value would be (Python's own message names none)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        names = [p.name for p in inspect.signature(init).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY]

        @functools.wraps(init)
        def keyword_only(self, *args, **kw):
            if args:
                shown = ", ".join(f"{n}={a!r}" for n, a in zip(names, args))
                raise TypeError(
                    f"{cls.__name__} takes keyword arguments only, got {len(args)} positional "
                    f"value(s): write {cls.__name__}({shown}"
                    f"{', ...' if len(args) > len(names) else ''}) (its keywords, in order: "
                    f"{', '.join(names)})")
            return init(self, **kw)

        cls.__init__ = keyword_only
    #: what the embedding's embedding_dim must match, for the error message of a mismatch
    embedding_dim_must_equal = "the model's embedding_dim"

    def _check_embedding(self, embedding, column_dims):
        dims = tuple(getattr(embedding, "column_dims", (getattr(embedding, "embedding_dim", None),)))
        if dims != tuple(column_dims):
            raise ConfigError(
                f"the embedding has columns {dims} but {type(self).__name__} needs {tuple(column_dims)}"
                f" (embedding_dim must equal {self.embedding_dim_must_equal}): "
                "build both with the same size"
            )
        n = len(getattr(embedding, "tables", ()))
        if n not in (1, self.num_tables):
            raise ConfigError(
                f"the embedding declares {n} tables but the model reads num_tables={self.num_tables} "
                "columns of ids: declare one table per column"
            )

    def check_inputs(self, dense, ids):
        """dense: (B, dense_features) float or None when dense_features == 0; ids: (B, num_tables).
        -> dense in the model's dtype (or None). Raises InputError on shape, dtype or NaN."""
        if getattr(ids, "ndim", None) != 2 or ids.shape[1] != self.num_tables:
            raise InputError(
                f"ids have shape {tuple(getattr(ids, 'shape', ()))}; {type(self).__name__} expects "
                f"(B, {self.num_tables}): one column per categorical feature"
            )
        if getattr(ids.dtype, "kind", "") not in "iu":
            raise InputError(f"ids have dtype {ids.dtype}; pass integer ids (int64)")
        return self.check_dense(dense, ids.shape[0])

    def check_dense(self, dense, batch):
        if self.dense_features == 0:
            if dense is not None and getattr(dense, "size", 0) != 0:
                raise InputError(
                    f"dense has shape {tuple(dense.shape)} but the model was built with "
                    "dense_features=0: pass dense=None or build it with dense_features=N"
                )
            return None
        if dense is None or getattr(dense, "ndim", None) != 2 or dense.shape != (batch, self.dense_features):
            got = None if dense is None else tuple(getattr(dense, "shape", ()))
            raise InputError(
                f"dense has shape {got}; {type(self).__name__} expects ({batch}, {self.dense_features}) "
                "(batch from ids, dense_features from the constructor)"
            )
        if dense.dtype.kind != "f":
            raise InputError(f"dense has dtype {dense.dtype}; pass floating-point features")
        xp = array_namespace(dense)
        bad = ~xp.isfinite(dense)

        def first_bad():
            at = xp.argmax(bad.ravel())
            return at, dense.ravel()[at]

        width = self.dense_features
        host_sync.check(bad.any(), lambda at, value: (
            f"dense[{int(at) // width}, {int(at) % width}] is {value}: the dense input must be "
            "finite (fill missing values in the data layer, e.g. log(x + 1) with missing -> 0)"),
            "model: input check", details=first_bad)
        return dense.astype(self.dtype, copy=False)

    @staticmethod
    def as_arrays(dense, other, what: str):
        """``dense`` and ``other`` (the ids or the embeddings, named ``what``) given as lists or
        other array-likes -> numpy arrays (numpy and CuPy arrays are kept), so that their checks
        see their real shapes; a ragged list is an InputError naming it."""
        if dense is not None and not hasattr(dense, "shape"):
            dense = as_array(np, dense, "dense")
        if not hasattr(other, "shape"):
            other = as_array(np, other, what)
        return dense, other

    def _embedded(self, embedded, batch):
        want = (batch, self.num_tables, self.embedding_width)
        if tuple(getattr(embedded, "shape", ())) != want:
            raise InputError(
                f"embeddings have shape {tuple(getattr(embedded, 'shape', ()))}, expected {want}"
            )
        return embedded.astype(self.dtype, copy=False)

    def embed(self, state: StepState, precision: str = "off", xp=np):
        """The embeddings of a prepared step in the form ``forward_from_embeddings`` reads, for a
        forward under ``precision`` (``nn.amp``): here ``embedding.embed(state)`` as an array of
        ``xp`` (B, num_tables, width) float32. DLRM overrides it on the device path with its
        interaction input, the rows gathered straight into it (``kernels.layout_ops``)."""
        return xp.asarray(self.embedding.embed(state))

    def forward(self, dense, ids):
        """dense: (B, dense_features) float (None with dense_features=0); ids: (B, num_tables) int,
        or the ``StepState`` that ``embedding.prepare(ids)`` returned (a ``Prefetcher`` yields
        them) -> logits (B,)."""
        if isinstance(ids, StepState):
            shape = ids.ids_shape
            if len(shape) != 2 or shape[1] != self.num_tables:
                raise InputError(f"the prepared ids have shape {shape}; {type(self).__name__} "
                                 f"expects (B, {self.num_tables})")
            dense = self.check_dense(dense, shape[0])
            embedded = self.embedding.embed(ids)
        else:
            dense, ids = self.as_arrays(dense, ids, "ids")
            dense = self.check_inputs(dense, ids)
            embedded = self.embedding(ids)
        return self.forward_from_embeddings(dense, embedded)

    def backward(self, dlogits):
        """dlogits: (B,) -> the embedding gradient (B, F, width), also handed to
        ``embedding.backward``; dense parameter grads accumulate."""
        _, dembedded = self.backward_to_embeddings(dlogits)
        self.embedding.backward(dembedded.astype(np.float32, copy=False))
        return dembedded

    def loss_and_backward_to_embeddings(self, logits, labels, *, share: float = 1.0,
                                        loss_scale: float = 1.0, fused: bool | None = None):
        """The mean BCE-with-logits loss of ``forward_from_embeddings``'s logits and the dense
        part's backward for the gradient of ``loss * share * loss_scale``.

        logits: (B,) the model's dtype; labels: (B,) in [0, 1]; share: this rank's share of the
        global batch (the gradient of the global mean; 1 on one rank); loss_scale: fp16's loss
        scale (the optimizer unscales) -> (loss: the unscaled mean, a 0-d float64 array left on
        the device (a float on numpy), ddense (B, dense_features) or None, dembedded
        (B, num_tables, width)). Dense parameter grads accumulate, as ``backward_to_embeddings``.

        ``fused`` (None: on CuPy arrays): the loss, its gradient and the backward of the model's
        last layer (``logit_layer``, one output) run as one kernel
        (``Linear.loss_and_backward``), the rest of the model's backward as before. The gradient
        is scaled once, by float32(share) * float32(loss_scale), where the unfused path
        multiplies the loss's gradient by each in turn: the same bits whenever one of them is a
        power of two (a dynamic loss scale always is, one rank's share is 1). The batch sums
        (weight and bias gradients of the last layer, the loss) are the kernel's blocked sums:
        equal to the unfused path within float32 rounding of the sums, not bit for bit; so the
        numpy path (fused False) keeps the unfused passes and its numerics."""
        from ..nn.loss import BCEWithLogits

        if fused is None:
            fused = array_namespace(logits) is not np
        if fused and self.logit_layer is not None:
            scale = float(np.float32(share) * np.float32(loss_scale))
            return self._fused_loss_and_backward(logits, labels, scale)
        loss_fn = BCEWithLogits()
        loss = loss_fn(logits, labels)
        dlogits = loss_fn.backward()
        if share != 1:  # the gradient of this rank's share of the global mean
            dlogits = dlogits * np.float32(share)
        if loss_scale != 1:  # unscaled by Optimizer.step, which skips an overflowed step
            dlogits = dlogits * np.float32(loss_scale)
        ddense, dembedded = self.backward_to_embeddings(dlogits)
        return loss, ddense, dembedded

    @property
    def logit_layer(self):
        """The one-output ``Linear`` the logits come out of (or, in DeepFM, its DNN term), whose
        backward the loss fuses with; None where the model has none (then ``fused`` is ignored)."""
        return None

    def _fused_loss_and_backward(self, logits, labels, scale: float):
        """-> (loss, ddense, dembedded) with the loss fused with ``logit_layer``'s backward."""
        raise NotImplementedError(f"{type(self).__name__} has no fused loss path")

    def _dlogits(self, dlogits, batch):
        """dlogits (batch,) -> in the model's dtype; InputError for a backward without a
        forward or a wrong shape. An inf / NaN is not refused here: under a loss scale it is an
        overflow, whose step the optimizer skips (PyTorch's GradScaler rule); without one the
        embedding's gradient check refuses it, and the optimizer then refuses the dense
        gradients it reached, updating nothing."""
        if batch is None:
            raise InputError(f"{type(self).__name__}.backward() without a forward(): run "
                             "forward first")
        if tuple(getattr(dlogits, "shape", ())) != (batch,):
            raise InputError(f"dlogits have shape {tuple(getattr(dlogits, 'shape', ()))}, expected ({batch},)")
        return dlogits.astype(self.dtype, copy=False)
