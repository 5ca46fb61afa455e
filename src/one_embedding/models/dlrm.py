"""DLRM (Naumov et al. 2019), as trained on Criteo 1TB by OneFlow's model zoo.

    z      = bottom_mlp(dense)                                  (B, E)   ReLU on every layer
    X      = [z, emb_1, ..., emb_F]                             (B, F+1, E)
    inter  = [z | <X_r, X_c> for c < r | 0-padding to a multiple of 8]   (B, 480) in the reference
    logits = top_mlp(inter)                                     (B,)     last layer linear

Reference configuration (the defaults): dense 13, E = 128, 26 tables, bottom 512-256-128,
top 1024-1024-512-256-1; 128 + 27*26/2 = 479 columns padded to 480. The data layer applies
log(x + 1) to the dense features; the model takes them as given.

Initialization as facebookresearch/dlrm: MLP weights N(0, sqrt(2 / (fan_in + fan_out))), biases
N(0, sqrt(1 / fan_out)); embedding table t uniform(+-sqrt(1 / table_sizes[t])).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError, InputError
from ..nn import MLP, DotInteraction, padding_to_multiple
from ..nn.interaction import num_pairs
from ..nn.linear import _check_dtype
from ..optim.checks import check_bool
from .base import (CTRModel, build_embedding, check_embedding_args, check_seed,
                   check_table_sizes, layer_sizes, positive)

#: Criteo 1TB cardinalities C1..C26 of MLPerf v1 / OneFlow's defaults (REFERENCE.md).
CRITEO_1TB_TABLE_SIZES = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
    11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)


class DLRM(CTRModel):
    """``logits = model(dense (B, 13) float32, ids (B, 26) int64)`` -> (B,) float32.

    embedding: a ``MultiTableEmbedding`` with ``embedding_dim`` = bottom_mlp[-1], built by the
    caller with their store options; None builds one (``table_sizes`` picks each table's
    initializer; default: the Criteo 1TB sizes when num_tables == 26; ``store_options`` None:
    device memory, size_factor 1; ``comm``: its communicator, None for ``default_comm()``).
    """

    embedding_dim_must_equal = "the model's embedding_dim and the bottom MLP output"

    def __init__(self, *, num_tables: int = 26, embedding_dim: int = 128, dense_features: int = 13,
                 bottom_mlp=(512, 256, 128), top_mlp=(1024, 1024, 512, 256, 1),
                 self_interaction: bool = False, pad_to_multiple: int = 8, table_sizes=None,
                 embedding=None, store_options=None, comm=None, seed: int = 0, dtype=np.float32):
        self.num_tables = positive("num_tables", num_tables)
        self.embedding_dim = positive("embedding_dim", embedding_dim)
        self.embedding_width = self.embedding_dim
        self.dense_features = positive("dense_features", dense_features)
        self.dtype = _check_dtype(dtype)
        bottom_mlp, top_mlp = layer_sizes("bottom_mlp", bottom_mlp), layer_sizes("top_mlp", top_mlp)
        self_interaction = check_bool("DLRM", "self_interaction", self_interaction)
        pad_to_multiple = positive("pad_to_multiple", pad_to_multiple)
        seed = check_seed(seed)
        if not bottom_mlp or bottom_mlp[-1] != self.embedding_dim:
            raise ConfigError(
                f"bottom_mlp={bottom_mlp} ends in {bottom_mlp[-1] if bottom_mlp else None} but "
                f"embedding_dim={self.embedding_dim}: the bottom output interacts with the embeddings, "
                "so its last size must equal embedding_dim"
            )
        if not top_mlp or top_mlp[-1] != 1:
            raise ConfigError(f"top_mlp={top_mlp} must end in 1 (one logit per sample)")
        check_embedding_args(embedding, table_sizes, store_options, comm)
        if table_sizes is None and embedding is None and self.num_tables == len(CRITEO_1TB_TABLE_SIZES):
            table_sizes = CRITEO_1TB_TABLE_SIZES
        self.table_sizes = check_table_sizes(table_sizes, self.num_tables)
        seeds = np.random.SeedSequence(seed).spawn(2)
        self.bottom_mlp = MLP(self.dense_features, bottom_mlp, last_relu=True, init="dlrm",
                              seed=seeds[0], dtype=self.dtype, name="bottom_mlp")
        width = self.embedding_dim + num_pairs(self.num_tables + 1, self_interaction)
        self.interaction = DotInteraction(self_interaction=self_interaction,
                                          output_padding=padding_to_multiple(width, pad_to_multiple))
        self.interaction_width = width + self.interaction.output_padding
        self.top_mlp = MLP(self.interaction_width, top_mlp, last_relu=False, init="dlrm",
                           seed=seeds[1], dtype=self.dtype, name="top_mlp")
        if embedding is None:
            embedding = build_embedding("dlrm_embedding", [self.embedding_dim], self.num_tables,
                                        self.table_sizes, store_options, seed, comm=comm)
        self._check_embedding(embedding, (self.embedding_dim,))
        self.embedding = embedding
        self._batch = None

    #: ``embed`` on the device path gathers the rows straight into the interaction's input
    #: (False: ``embedding.embed`` and the interaction's own stacking, the path before it)
    gather_into_interaction = True

    def embed(self, state, precision: str = "off", xp=np):
        """The embeddings of a prepared step for a forward under ``precision``: on the device
        path (a device embedding, float32 model) a ``kernels.layout_ops.InteractionInput`` of
        (B, num_tables + 1, E), the rows gathered into slots 1.. in the interaction's storage
        (float32, or fp16 / bf16 patterns) and slot 0 left for z, which ``forward_from_embeddings``
        writes; elsewhere (the CPU path, ``gather_into_interaction`` False) the (B, F, E)
        float32 array of ``CTRModel.embed``. Both give the same logits and gradients, bit for bit."""
        from ..kernels import layout_ops

        emb = self.embedding
        launch = getattr(emb, "launch", None)
        shape = state.ids_shape
        if (not self.gather_into_interaction or launch is None or self.dtype != np.float32
                or len(shape) != 2 or shape[1] != self.num_tables):
            return super().embed(state, precision, xp)
        target = layout_ops.empty_input(launch.xp, shape[0], self.num_tables + 1,
                                        self.embedding_dim, precision, first_slot=1, launch=launch)
        emb.embed_into(state, target, first_slot=1)                 # slots 1..F
        return target

    def forward_from_embeddings(self, dense, embedded):
        """dense: (B, dense_features); embedded: (B, num_tables, E), or the interaction input
        that ``embed`` returned (then z is written into its slot 0) -> logits (B,)."""
        from ..kernels import layout_ops

        if not isinstance(embedded, layout_ops.InteractionInput):
            dense, embedded = self.as_arrays(dense, embedded, "embeddings")
        if isinstance(embedded, layout_ops.InteractionInput):
            dense = self.check_dense(dense, embedded.shape[0])
            want = (dense.shape[0], self.num_tables + 1, self.embedding_dim)
            if embedded.shape != want or embedded.first_slot != 1:
                raise InputError(f"the interaction input has shape {embedded.shape} and first "
                                 f"slot {embedded.first_slot}; expected {want} and 1: build it "
                                 "with this model's embed")
            z = self.bottom_mlp.forward(dense)                       # (B, E)
            layout_ops.write_slot(z, embedded, 0, embedded.launch)   # X[:, 0] = z
            # (B, 480); under fp16 / bf16 on CuPy only its 16-bit patterns (out_bits)
            inter = self.interaction.forward_packed(embedded, z, fp32_output=self._inter_fp32())
            logits = self.top_mlp.forward(inter, self.interaction.out_bits)   # (B, 1)
            self._batch = dense.shape[0]
            return logits.reshape(-1)
        dense = self.check_dense(dense, embedded.shape[0])
        embedded = self._embedded(embedded, dense.shape[0])
        z = self.bottom_mlp.forward(dense)                           # (B, E)
        inter = self.interaction.forward([z, embedded], z, fp32_output=self._inter_fp32())
        logits = self.top_mlp.forward(inter, self.interaction.out_bits)       # (B, 1)
        self._batch = dense.shape[0]
        return logits.reshape(-1)

    def _inter_fp32(self) -> bool:
        """Whether the interaction's output is needed in fp32, not only as the 16-bit patterns
        the top MLP's first product reads (``MLP.takes_input_bits``)."""
        return not self.top_mlp.takes_input_bits()

    def backward_to_embeddings(self, dlogits):
        """dlogits: (B,) -> (ddense (B, dense_features), dembedded (B, num_tables, E))."""
        d = self._dlogits(dlogits, self._batch).reshape(-1, 1)
        return self._backward_from_interaction(self.top_mlp.backward(d))

    @property
    def logit_layer(self):
        return self.top_mlp.layers[-1]

    def _fused_loss_and_backward(self, logits, labels, scale):
        loss, _, dinter = self.top_mlp.loss_and_backward(logits, labels, scale)
        return (loss,) + self._backward_from_interaction(dinter)

    def _backward_from_interaction(self, dinter):
        """dinter: (B, interaction_width) -> (ddense, dembedded)."""
        (dz, dembedded), dconcat = self.interaction.backward(dinter)
        dz = dz + dconcat                                            # z is a feature and the concat
        ddense = self.bottom_mlp.backward(dz)
        return ddense, dembedded
