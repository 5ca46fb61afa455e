"""DeepFM (Guo et al. 2017): first-order + factorization machine + DNN, summed.

Each table row has two columns, [v (E) | w (1)] (a MultiTableMultiColumnEmbedding with
embedding_dim=[E, 1]):

    first  = Σ_f w_f + bias                                     (B,)
    fm     = Σ_d 0.5 * ((Σ_f v_f)² - Σ_f v_f²)                  (B,)   summed over d
    deep   = DNN([v_1 | ... | v_F | dense]) -> 1, last layer linear     (B,)
    logits = first + fm + deep

Reference (Criteo, OneFlow's zoo): 39 fields all categorical (dense_features=0), E = 16,
DNN 1000x5 with dropout 0.2, Adam 1e-3. With dense_features > 0 the dense features join the DNN
input as given (normalize them in the data layer); they take no part in the FM.

Initialization (this library's scheme): DNN Glorot-uniform weights, zero biases; global bias 0;
v columns uniform(+-sqrt(1 / table_sizes[t])) when table_sizes is given, else normal(0, 0.05);
the first-order column w starts at 0, so the linear part starts neutral.
"""
from __future__ import annotations

import numpy as np

from ..backend import array_namespace
from ..nn import MLP, FactorizationMachine, Parameter
from ..nn.linear import _check_dtype
from .base import (CTRModel, build_embedding, check_embedding_args, check_seed, check_table_sizes,
                   layer_sizes, non_negative, positive)


class DeepFM(CTRModel):
    """``logits = model(dense or None, ids (B, num_tables) int64)`` -> (B,) float32.

    embedding: a MultiTableMultiColumnEmbedding with columns [embedding_dim, 1] (output
    (B, F, E + 1)); None builds one (see ``table_sizes``, ``store_options``).
    """

    def __init__(self, *, num_tables: int = 39, embedding_dim: int = 16, dense_features: int = 0,
                 dnn=(1000,) * 5, dropout: float = 0.2, table_sizes=None, embedding=None,
                 store_options=None, comm=None, seed: int = 0, dtype=np.float32):
        self.num_tables = positive("num_tables", num_tables)
        self.embedding_dim = positive("embedding_dim", embedding_dim)
        self.embedding_width = self.embedding_dim + 1
        self.dense_features = non_negative("dense_features", dense_features)
        self.dtype = _check_dtype(dtype)
        dnn = layer_sizes("dnn", dnn)
        seed = check_seed(seed)
        check_embedding_args(embedding, table_sizes, store_options, comm)
        self.table_sizes = check_table_sizes(table_sizes, self.num_tables)
        self.bias = Parameter(np.zeros(1, self.dtype), "bias")
        self.fm = FactorizationMachine()
        self.dnn_input_width = self.num_tables * self.embedding_dim + self.dense_features
        self.dnn = MLP(self.dnn_input_width, tuple(dnn) + (1,), last_relu=False, dropout=dropout,
                       init="glorot", seed=seed, dtype=self.dtype, name="dnn")
        if embedding is None:
            embedding = build_embedding("deepfm_embedding", [self.embedding_dim, 1], self.num_tables,
                                        self.table_sizes, store_options, seed, first_order=True,
                                        comm=comm)
        self._check_embedding(embedding, (self.embedding_dim, 1))
        self.embedding = embedding
        self._batch = None

    def forward_from_embeddings(self, dense, embedded):
        """dense: (B, dense_features) or None; embedded: (B, num_tables, E + 1) -> logits (B,)."""
        dense, embedded = self.as_arrays(dense, embedded, "embeddings")
        batch = embedded.shape[0]
        dense = self.check_dense(dense, batch)
        embedded = self._embedded(embedded, batch)
        xp = array_namespace(embedded)
        e = self.embedding_dim
        v = xp.ascontiguousarray(embedded[:, :, :e])                 # (B, F, E)
        first = embedded[:, :, e].sum(axis=1) + self.bias.data       # (B,)
        fm = self.fm.forward(v)                                      # (B,)
        x = v.reshape(batch, -1)
        if dense is not None:
            x = xp.concatenate([x, dense], axis=1)                   # (B, F*E + dense)
        deep = self.dnn.forward(x).reshape(-1)                       # (B,)
        self._batch = batch
        return first + fm + deep

    def backward_to_embeddings(self, dlogits):
        """dlogits: (B,) -> (ddense or None, dembedded (B, num_tables, E + 1))."""
        d = self._dlogits(dlogits, self._batch)
        return self._backward_from_dnn(d, self.dnn.backward(d.reshape(-1, 1)))

    @property
    def logit_layer(self):
        return self.dnn.layers[-1]

    def _fused_loss_and_backward(self, logits, labels, scale):
        # the DNN's output is a term of the logits: its gradient is the logits' gradient
        loss, d, dx = self.dnn.loss_and_backward(logits, labels, scale)
        return (loss,) + self._backward_from_dnn(d, dx)

    def _backward_from_dnn(self, d, dx):
        """d: (B,) the logits' gradient; dx: (B, F*E + dense) the DNN input's -> (ddense,
        dembedded)."""
        batch, f, e = self._batch, self.num_tables, self.embedding_dim
        xp = array_namespace(d)
        self.bias.grad += d.sum()
        dembedded = xp.empty((batch, f, e + 1), dtype=self.dtype)
        dv = self.fm.backward(d)                                     # (B, F, E)
        dv += dx[:, :f * e].reshape(batch, f, e)
        dembedded[:, :, :e] = dv
        dembedded[:, :, e] = d[:, None]                              # d first / d w_f = 1
        ddense = dx[:, f * e:] if self.dense_features else None
        return ddense, dembedded
