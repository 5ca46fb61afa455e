"""Deep & Cross Network (Wang et al. 2017; v2 matrix cross: Wang et al. 2021).

    x0     = [emb_1 | ... | emb_F | dense]          (B, F*E + dense_features)
    cross  = CrossNet(x0), num_layers of "vector" (v1) or "matrix" (v2)   (B, D0)
    deep   = DNN(x0): ReLU layers with dropout                  (B, dnn[-1])
    logits = Linear([cross | deep]) -> (B,)

Reference (Criteo Kaggle, OneFlow's zoo): 39 fields all categorical (dense_features=0), E = 16,
3 "vector" cross layers, DNN 1000x5 with dropout 0.2, Adam 1e-3. With dense_features > 0 the dense
features enter x0 as given (after the embeddings), as in the DCN paper, which stacks normalized
dense features with the embeddings; normalize them in the data layer (e.g. log(x + 1)).

Initialization (this library's scheme): DNN and output weights Glorot-uniform, biases 0; cross
weights Glorot-normal, biases 0; embedding table t uniform(+-sqrt(1 / table_sizes[t])) when
table_sizes is given, else normal(0, 0.05).
"""
from __future__ import annotations

import numpy as np

from ..backend import array_namespace
from ..errors import ConfigError
from ..nn import MLP, CrossNet, Linear
from ..nn.linear import _check_dtype
from .base import (CTRModel, build_embedding, check_embedding_args, check_seed, check_table_sizes,
                   layer_sizes, non_negative, positive)


class DCN(CTRModel):
    """``logits = model(dense or None, ids (B, num_tables) int64)`` -> (B,) float32."""

    def __init__(self, *, num_tables: int = 39, embedding_dim: int = 16, dense_features: int = 0,
                 cross_layers: int = 3, cross: str = "vector", dnn=(1000,) * 5, dropout: float = 0.2,
                 table_sizes=None, embedding=None, store_options=None, comm=None, seed: int = 0,
                 dtype=np.float32):
        self.num_tables = positive("num_tables", num_tables)
        self.embedding_dim = positive("embedding_dim", embedding_dim)
        self.embedding_width = self.embedding_dim
        self.dense_features = non_negative("dense_features", dense_features)
        self.dtype = _check_dtype(dtype)
        dnn = layer_sizes("dnn", dnn)
        cross_layers = positive("cross_layers", cross_layers)
        seed = check_seed(seed)
        if not dnn:
            raise ConfigError("dnn=() : DCN needs at least one DNN layer next to the cross network")
        check_embedding_args(embedding, table_sizes, store_options, comm)
        self.table_sizes = check_table_sizes(table_sizes, self.num_tables)
        self.input_width = self.num_tables * self.embedding_dim + self.dense_features
        seeds = np.random.SeedSequence(seed).spawn(3)
        self.cross = CrossNet(self.input_width, cross_layers, kind=cross, seed=np.random.default_rng(seeds[0]),
                              dtype=self.dtype, name="cross")
        self.dnn = MLP(self.input_width, dnn, last_relu=True, dropout=dropout, init="glorot",
                       seed=seeds[1], dtype=self.dtype, name="dnn")
        self.output = Linear(self.input_width + dnn[-1], 1, init="glorot", seed=seeds[2],
                             dtype=self.dtype, name="output")
        if embedding is None:
            embedding = build_embedding("dcn_embedding", [self.embedding_dim], self.num_tables,
                                        self.table_sizes, store_options, seed, comm=comm)
        self._check_embedding(embedding, (self.embedding_dim,))
        self.embedding = embedding
        self._batch = None

    def forward_from_embeddings(self, dense, embedded):
        """dense: (B, dense_features) or None; embedded: (B, num_tables, E) -> logits (B,)."""
        dense, embedded = self.as_arrays(dense, embedded, "embeddings")
        batch = embedded.shape[0]
        dense = self.check_dense(dense, batch)
        embedded = self._embedded(embedded, batch)
        xp = array_namespace(embedded)
        x0 = embedded.reshape(batch, -1)                             # (B, F*E)
        if dense is not None:
            x0 = xp.concatenate([x0, dense], axis=1)                 # (B, D0)
        x0 = xp.ascontiguousarray(x0)
        xc = self.cross.forward(x0)                                  # (B, D0)
        xd = self.dnn.forward(x0)                                    # (B, dnn[-1])
        both = xp.concatenate([xc, xd], axis=1)
        self._batch = batch
        return self.output.forward(both).reshape(-1)

    def backward_to_embeddings(self, dlogits):
        """dlogits: (B,) -> (ddense (B, dense_features) or None, dembedded (B, num_tables, E))."""
        dboth = self.output.backward(self._dlogits(dlogits, self._batch).reshape(-1, 1))
        return self._backward_from_output_input(dboth)

    @property
    def logit_layer(self):
        return self.output

    def _fused_loss_and_backward(self, logits, labels, scale):
        loss, _, dboth = self.output.loss_and_backward(logits, labels, scale)
        return (loss,) + self._backward_from_output_input(dboth)

    def _backward_from_output_input(self, dboth):
        """dboth: (B, input_width + dnn[-1]), the gradient of [cross | deep] -> (ddense,
        dembedded)."""
        batch = self._batch
        d0 = self.input_width
        dx0 = self.cross.backward(dboth[:, :d0].copy())
        dx0 += self.dnn.backward(dboth[:, d0:].copy())
        fe = self.num_tables * self.embedding_dim
        dembedded = dx0[:, :fe].reshape(batch, self.num_tables, self.embedding_dim)
        ddense = dx0[:, fe:] if self.dense_features else None
        return ddense, dembedded
