"""TorchRec DLRM peer: ``torchrec.models.dlrm.DLRM`` with FBGEMM's fused embedding tables, on CPU.

Two ways to run it, both on the same kernel: the 26 tables live in one FBGEMM table-batched
embedding (TBE) on the host, and SGD is fused into its backward (``EmbOptimType.EXACT_SGD``):
the backward sums each looked-up row's gradient and writes ``w -= lr * g`` in place, so no
embedding gradient tensor is ever materialised.

- ``mode="dmp"`` (default; how TorchRec is meant to be used): an ``EmbeddingBagCollection``
  built on the meta device, ``apply_optimizer_in_backward(SGD)`` on its parameters, then
  ``DistributedModelParallel`` on a one-rank gloo group, which plans table-wise sharding with
  the "fused" compute kernel. Dense arches are wrapped in DDP and trained by ``SGD`` through a
  ``KeyedOptimizerWrapper``, as in TorchRec's DLRM example.
- ``mode="fused"``: the unsharded ``FusedEmbeddingBagCollection`` (same TBE, no
  input/output distribution, no DDP) and ``torch.optim.SGD`` on the arches.

Slower alternatives, measured and left out: ``EmbeddingBagCollection`` + ``torch.optim.SGD``
(its ``nn.EmbeddingBag`` modules have dense gradients, so every step writes and applies a
26 x 100k x 64 gradient: 2.3k samples/s here against about 15k fused).

TorchRec's interaction keeps the upper triangle of Z (i < j) where torch_dlrm keeps the lower
one: the same 351 numbers in another order, which only permutes the first top-MLP layer's
input columns.
Run ``python -m benchmarks.peers.torchrec_dlrm [--mode fused]`` for a short self-test.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.peers import DLRMConfig, check_batches, self_test, time_steps
from one_embedding.errors import ConfigError

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm, which TorchRec calls)
    from torchrec.distributed import DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
except ImportError as error:  # pragma: no cover - depends on the optional peer install
    raise ImportError(
        f"the TorchRec peer needs torchrec and fbgemm-gpu-cpu ({error}); "
        "run `bash benchmarks/install_peers.sh`"
    ) from error

MODES = ("dmp", "fused")


def feature_names(config: DLRMConfig) -> list[str]:
    return [f"C{t + 1}" for t in range(config.num_tables)]


def table_configs(config: DLRMConfig) -> list[EmbeddingBagConfig]:
    """One sum-pooled table per feature; TorchRec initialises each uniform(±sqrt(1/rows))."""
    return [
        EmbeddingBagConfig(
            name=f"table_{name}",
            embedding_dim=config.embedding_dim,
            num_embeddings=config.rows_per_table,
            feature_names=[name],
            pooling=PoolingType.SUM,
        )
        for name in feature_names(config)
    ]


def _dlrm(config: DLRMConfig, embeddings: nn.Module) -> DLRM:
    return DLRM(
        embedding_bag_collection=embeddings,
        dense_in_features=config.num_dense,
        dense_arch_layer_sizes=list(config.bottom_mlp),
        over_arch_layer_sizes=list(config.top_mlp),
        dense_device=torch.device("cpu"),
    )


def build_model(config: DLRMConfig) -> DLRM:
    """Unsharded DLRM whose tables are one host TBE with SGD fused into the backward."""
    embeddings = FusedEmbeddingBagCollection(
        tables=table_configs(config),
        optimizer_type=torch.optim.SGD,
        optimizer_kwargs={"lr": config.lr},
        device=torch.device("cpu"),
    )
    return _dlrm(config, embeddings)


def build_sharded_model(
    config: DLRMConfig,
) -> tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """DMP-wrapped DLRM on the current one-rank process group, and the optimizer of its dense part.

    The tables are declared on the meta device so that DMP allocates them once, as its sharded
    TBE, instead of after a full-size unsharded copy.
    """
    tables = EmbeddingBagCollection(table_configs(config), device=torch.device("meta"))
    model = _dlrm(config, tables)
    apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": config.lr})
    sharded = DistributedModelParallel(module=model, device=torch.device("cpu"))
    dense = dict(in_backward_optimizer_filter(sharded.named_parameters()))
    optimizer = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=config.lr))
    return sharded, optimizer


def prepare(
    batch: dict, config: DLRMConfig
) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """numpy batch -> (dense (B, 13) float32, KJT of T features x B bags of 1 id, labels (B,)).

    A KJT stores values feature-major: all B ids of feature 0, then feature 1, ... so the
    (B, T) id matrix is transposed. Every bag has length 1.
    """
    B, T = config.batch_size, config.num_tables
    values = torch.from_numpy(np.ascontiguousarray(batch["ids"].T).reshape(-1))  # (T * B,)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=feature_names(config),
        values=values,
        lengths=torch.ones(T * B, dtype=torch.int32),
    )
    return torch.from_numpy(batch["dense"]), sparse, torch.from_numpy(batch["labels"])


def _one_rank_group() -> bool:
    """Make sure a one-rank process group exists; True when this call created it.

    An in-memory HashStore needs no address, port or environment variables.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConfigError(
                f"a process group of world size {dist.get_world_size()} is active; the TorchRec "
                "peer measures one process: run it without mpiexec/torchrun or use mode='fused'"
            )
        return False
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def run(batches: Sequence[dict], steps: int, warmup: int, config: DLRMConfig = DLRMConfig(),
        seed: int = 0, mode: str = "dmp") -> dict:
    """Train ``warmup`` untimed then ``steps`` timed steps, cycling through ``batches``.

    batches: dicts {dense (B, 13) float32, ids (B, T) int64 local row ids, labels (B,) float32}.
    mode: "dmp" (DistributedModelParallel, one gloo rank) or "fused" (FusedEmbeddingBagCollection).
    Building the KeyedJaggedTensors happens once, before the clock starts (a TorchRec input
    pipeline builds them in its data loader).
    Returns {samples_per_s, seconds, final_loss, steps, warmup, mode}.
    """
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} is not one of {MODES}")
    check_batches(batches, config)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(seed)
    created_group = _one_rank_group() if mode == "dmp" else False
    try:
        if mode == "dmp":
            model, dense_opt = build_sharded_model(config)
        else:
            model = build_model(config)
            # The table weights show up in named_parameters() as views of the TBE buffer but
            # never get a .grad (the fused backward consumes it): give SGD only the arches.
            dense_opt = torch.optim.SGD(
                [p for name, p in model.named_parameters() if not name.startswith("sparse_arch.")],
                lr=config.lr,
            )
        loss_fn = nn.BCEWithLogitsLoss()
        inputs = [prepare(batch, config) for batch in batches]

        def step(inp: tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]) -> torch.Tensor:
            dense, sparse, labels = inp
            dense_opt.zero_grad(set_to_none=True)
            logits = model(torch.log1p(dense), sparse).squeeze(1)  # (B,)
            loss = loss_fn(logits, labels)
            loss.backward()  # also updates the embedding rows (fused SGD)
            dense_opt.step()
            return loss.detach()

        result = time_steps(step, inputs, steps, warmup, config.batch_size)
    finally:
        if created_group:
            dist.destroy_process_group()
    return {**result, "mode": mode}


if __name__ == "__main__":
    self_test("torchrec_dlrm", run, modes=MODES)
