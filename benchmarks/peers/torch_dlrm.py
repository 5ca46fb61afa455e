"""Plain PyTorch DLRM peer: one ``nn.EmbeddingBag(sparse=True)`` per table, SGD on everything.

    x0 = ReLU-MLP_bottom(log(dense + 1))                       # (B, D)
    X  = [x0, e_1, ..., e_T]                                   # (B, F, D), F = T + 1
    Z  = X Xᵀ                                                  # (B, F, F)
    h  = [x0, Z[r, c] for r in 1..F-1, c < r]                  # (B, D + F(F-1)/2)
    y  = MLP_top(h) (no ReLU after the last layer)             # (B,) logits
    loss = mean BCE-with-logits(y, labels)

The embedding gradients are sparse (only the rows of the batch), and ``torch.optim.SGD`` applies
them as a sparse update, so a step never touches the 26 x 100k rows it did not look up.
Run ``python -m benchmarks.peers.torch_dlrm`` for a short self-test.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from benchmarks.peers import DLRMConfig, check_batches, self_test, time_steps


def _mlp(in_features: int, sizes: Sequence[int], relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, out_features in enumerate(sizes):
        layers.append(nn.Linear(in_features, out_features))
        if relu_last or index < len(sizes) - 1:
            layers.append(nn.ReLU())
        in_features = out_features
    return nn.Sequential(*layers)


class PlainDLRM(nn.Module):
    """DLRM over T separate embedding bags; ``forward(dense, ids_by_table) -> logits (B,)``."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        rows, dim = config.rows_per_table, config.embedding_dim
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(config.num_tables)
        )
        # TorchRec's default init, so both peers start from the same distribution.
        bound = math.sqrt(1.0 / rows)
        for table in self.embeddings:
            nn.init.uniform_(table.weight, -bound, bound)
        self.bottom = _mlp(config.num_dense, config.bottom_mlp, relu_last=True)
        self.top = _mlp(config.interaction_width, config.top_mlp, relu_last=False)
        features = 1 + config.num_tables
        # Row-major lower triangle: (1,0), (2,0), (2,1), (3,0), ... built once, not per step.
        lower = torch.tril_indices(features, features, offset=-1)
        self.register_buffer("pair_rows", lower[0], persistent=False)
        self.register_buffer("pair_cols", lower[1], persistent=False)

    def forward(self, dense: torch.Tensor, ids_by_table: torch.Tensor) -> torch.Tensor:
        """dense: (B, 13) float32 raw counts; ids_by_table: (T, B) int64. Returns (B,) float32."""
        bottom = self.bottom(torch.log1p(dense))  # (B, D)
        # A (B, 1) input makes every sample its own bag of one id; no offsets tensor needed.
        pooled = [table(ids.unsqueeze(1)) for table, ids in zip(self.embeddings, ids_by_table)]
        features = torch.stack([bottom, *pooled], dim=1)  # (B, F, D)
        gram = torch.bmm(features, features.transpose(1, 2))  # (B, F, F)
        pairs = gram[:, self.pair_rows, self.pair_cols]  # (B, F(F-1)/2)
        return self.top(torch.cat([bottom, pairs], dim=1)).squeeze(1)  # (B,)


def prepare(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """numpy batch -> (dense (B, 13) float32, ids (T, B) int64 contiguous, labels (B,) float32)."""
    ids_by_table = torch.from_numpy(np.ascontiguousarray(batch["ids"].T))
    return torch.from_numpy(batch["dense"]), ids_by_table, torch.from_numpy(batch["labels"])


def run(batches: Sequence[dict], steps: int, warmup: int, config: DLRMConfig = DLRMConfig(),
        seed: int = 0) -> dict:
    """Train ``warmup`` untimed then ``steps`` timed SGD steps, cycling through ``batches``.

    batches: dicts {dense (B, 13) float32, ids (B, T) int64 local row ids, labels (B,) float32}.
    Converting batches to tensors happens once, before the clock starts.
    Returns {samples_per_s, seconds, final_loss, steps, warmup}.
    """
    check_batches(batches, config)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(seed)
    model = PlainDLRM(config)
    sparse_params = list(model.embeddings.parameters())
    dense_params = list(model.bottom.parameters()) + list(model.top.parameters())
    # SGD applies sparse gradients directly (w.index_add_ of -lr * g over the looked-up rows);
    # one optimizer each keeps the dense one on its fast foreach path.
    sparse_opt = torch.optim.SGD(sparse_params, lr=config.lr)
    dense_opt = torch.optim.SGD(dense_params, lr=config.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    inputs = [prepare(batch) for batch in batches]

    def step(inp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dense, ids_by_table, labels = inp
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(dense, ids_by_table), labels)
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        return loss.detach()

    return time_steps(step, inputs, steps, warmup, config.batch_size)


if __name__ == "__main__":
    self_test("torch_dlrm", run)
