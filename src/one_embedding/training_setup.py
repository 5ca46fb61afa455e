"""What ``training.Trainer`` is built from, one ``TrainConfig`` in: the loaders, the store
options (with the feature lifecycle's rules), the model, the LR schedule, the array module of
``--device``, and the split of a global batch and of the machine's cores among the ranks."""
from __future__ import annotations

import os
from dataclasses import asdict

import numpy as np

from .backend import array_namespace, cupy_available, to_numpy
from .config import TrainConfig
from .data import BatchLoader, SyntheticCriteo
from .errors import ConfigError
from .interrupts import iterating
from .metrics import check_labels, log_loss, roc_auc
from .models import DCN, DLRM, DeepFM
from .optim.lr_schedules import LinearWarmup, LRSchedule, WarmupPolynomialDecay
from .options import (
    make_cached_host_mem_store_options,
    make_cached_ssd_store_options,
    make_device_mem_store_options,
    make_lifecycle_options,
)
from .parallel.comm import differing_settings

#: Criteo's integer features I1..I13, every model's dense input here
DENSE_FEATURES = 13
#: Sparse features of a file source (Criteo's C1..C26); the synthetic source says its own
FILE_SPARSE_FEATURES = 26


def lifecycle_options_for(cfg: TrainConfig):
    """The admission / eviction rules of ``cfg`` (None when it stores every id for ever)."""
    # an unset sketch size is the LifecycleOptions default
    sketch = {} if cfg.admit_sketch_mb is None else {"sketch_mb": cfg.admit_sketch_mb}
    options = make_lifecycle_options(cfg.admit_min_count, cfg.steps_to_live, cfg.max_rows,
                                     **sketch, evict_interval=cfg.evict_interval,
                                     frequency_half_life=cfg.frequency_half_life)
    return options if options.active else None


def store_options_for(cfg: TrainConfig, size_factor: int, total_keys: int | None):
    """The store preset ``cfg.store`` asks for, sized for ``total_keys`` unless cfg.capacity."""
    path, capacity = cfg.persistent_path, cfg.capacity or total_keys
    lifecycle = lifecycle_options_for(cfg)
    if cfg.store == "device_mem":
        return make_device_mem_store_options(path, capacity=capacity, size_factor=size_factor,
                                             lifecycle=lifecycle)
    if cfg.store == "cached_host_mem":
        return make_cached_host_mem_store_options(cfg.cache_mb, path, capacity=capacity,
                                                  size_factor=size_factor, lifecycle=lifecycle)
    return make_cached_ssd_store_options(cfg.cache_mb, path, capacity=capacity,
                                         size_factor=size_factor,
                                         host_cache_budget_mb=cfg.host_cache_mb, engine=cfg.engine,
                                         lifecycle=lifecycle)


def make_loaders(cfg: TrainConfig):
    """(train loader, eval loader, number of sparse features, total keys or None)."""
    common = dict(eval_fraction=cfg.eval_fraction, split_seed=cfg.seed, read_ahead=cfg.read_ahead)
    if cfg.data == ("synthetic",):
        # rows are a pure function of (seed, row number): one source serves both splits
        source = SyntheticCriteo(cfg.synthetic_cardinalities, scale=cfg.synthetic_scale,
                                 alpha=cfg.zipf_alpha, seed=cfg.seed, num_rows=cfg.synthetic_rows)
        train = BatchLoader(source, cfg.batch_size, split="train", drop_last=True, **common)
        evaluate = BatchLoader(source, cfg.batch_size, split="eval", **common)
        return train, evaluate, source.num_features, source.total_keys
    paths = list(cfg.data)
    # a TSV reader option; Parquet inputs (told by their content, not their name) ignore it
    opts = dict(on_bad_line=cfg.on_bad_line)
    # Parquet reader options, passed only where given (a TSV input refuses them)
    if cfg.parquet_layout != "auto":
        opts["layout"] = cfg.parquet_layout
    if cfg.parquet_keys != "auto":
        opts["keys"] = cfg.parquet_keys
    train = BatchLoader(paths, cfg.batch_size, split="train", drop_last=True, shuffle=True,
                        seed=cfg.seed, **common, **opts)
    evaluate = BatchLoader(paths, cfg.batch_size, split="eval", **common, **opts)
    return train, evaluate, FILE_SPARSE_FEATURES, None


def build_model(cfg: TrainConfig, num_tables: int, store_options, comm=None):
    """The model ``cfg.model`` names, with its embedding built on ``store_options`` exchanging
    over ``comm`` (None: ``default_comm()``)."""
    shared = dict(num_tables=num_tables, embedding_dim=cfg.embedding_dim,
                  dense_features=DENSE_FEATURES, store_options=store_options, comm=comm,
                  seed=cfg.seed)
    if cfg.model == "dlrm":
        return DLRM(**shared, bottom_mlp=cfg.bottom_mlp, top_mlp=cfg.top_mlp)
    if cfg.model == "dcn":
        return DCN(**shared, cross_layers=cfg.cross_layers, cross=cfg.cross, dnn=cfg.dnn,
                   dropout=cfg.dropout)
    return DeepFM(**shared, dnn=cfg.dnn, dropout=cfg.dropout)


def make_lr_schedule(cfg: TrainConfig, optimizer) -> LRSchedule:
    """OneFlow's DLRM schedule: a linear warmup from 0 over cfg.warmup_steps updates (none when
    0; update t has lr * (t - 1) / warmup_steps), then, with cfg.decay_steps, the polynomial
    decay (power 2, to 0) once cfg.decay_start updates are done."""
    cfg = cfg.with_model_defaults()
    if cfg.decay_steps:
        return WarmupPolynomialDecay(optimizer, cfg.lr, warmup_steps=cfg.warmup_steps,
                                     decay_start=cfg.decay_start, decay_steps=cfg.decay_steps)
    return LinearWarmup(optimizer, cfg.lr, warmup_steps=cfg.warmup_steps, start_factor=0.0)


def device_namespace(device: str):
    """numpy for "cpu"; CuPy for "cuda", or a ConfigError saying there is no GPU."""
    if device == "cpu":
        return np
    if not cupy_available():
        raise ConfigError("--device cuda: no CUDA device is visible to CuPy (not installed, no "
                          "driver, or no GPU): install one_embedding[gpu] on a GPU machine, or "
                          "use --device cpu")
    import cupy

    return cupy


def blas_threads_for(local_ranks: int, blas_threads: int = 0) -> int:
    """BLAS threads per rank: ``blas_threads`` when given, else half of the rank's share of the
    machine's cores (at least 1). The other half runs what overlaps the step: the prefetch
    thread's lookups, the loader's decode threads, the synthetic generator's pool. OpenBLAS's
    idle workers spin: on the 2-core VM two BLAS threads beside those took twice the CPU per
    step of one (39 ms against 19 at the README's shapes, 42.7-64k against 58-71k samples/s),
    and 7-9x the time on a busy machine (fault campaign of 2026-12-07)."""
    if blas_threads:
        return int(blas_threads)
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks) // 2)


def share_cores(local_ranks: int, blas_threads: int = 0):
    """Limit this process's BLAS threads to ``blas_threads_for(local_ranks, blas_threads)``
    (ranks on one machine share its cores: P ranks do not run P x (all cores) threads against
    each other). Returns the limiter: a context manager whose exit (or
    ``restore_original_limits()``) undoes it."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(blas_threads_for(local_ranks, blas_threads), user_api="blas")


def rank_block(batch, rank: int, world: int):
    """This rank's contiguous block of a global batch's rows (np.array_split's blocks)."""
    if world == 1:
        return batch
    n = batch.labels.shape[0]
    lo, hi = (rank * n) // world, ((rank + 1) * n) // world
    return type(batch)(batch.dense[lo:hi], batch.ids[lo:hi], batch.labels[lo:hi])


#: settings ranks may hold apart: a program may give each rank a folder of its own (a machine's
#: local disk); the rank folders under it keep their names either way
PER_RANK_FIELDS = ("persistent_path",)


def check_same_config(cfg: TrainConfig, comm) -> None:
    """ConfigError on every rank, naming the fields, when the ranks were started with different
    settings (``mpiexec -n 1 A : -n 1 B``, or an environment variable set on one machine only):
    compared as the runs would use them, before any rank exchanges a row. Unchecked, different
    steps or batch sizes hung the job, a different lr trained silently otherwise, and different
    row widths ended in an MPI error naming nothing."""
    if comm.world == 1:
        return
    fields = asdict(cfg.with_model_defaults().resolved())
    for name in PER_RANK_FIELDS:
        fields.pop(name, None)
    shown = differing_settings(comm, fields)
    if shown is not None:
        raise ConfigError(f"the ranks were started with different settings ({shown}): start "
                          "every rank with the same flags and environment (mpiexec -n P "
                          "one-embedding train ...)")


def evaluate(model, loader, max_batches: int, comm=None) -> dict:
    """AUC and log loss of ``model`` over ``loader`` (at most ``max_batches``; 0: all).

    With several ranks each scores its block of every batch and the predictions are gathered,
    so every rank returns the metrics of the whole evaluation set."""
    rank, world = (comm.rank, comm.world) if comm is not None else (0, 1)
    model.eval()
    labels, logits = [], []
    with iterating(loader) as batches:
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            batch = rank_block(batch, rank, world)
            check_labels(to_numpy(batch.labels), f"evaluation batch {i}")
            dense = array_namespace(next(model.parameters()).data).asarray(batch.dense)
            logits.append(to_numpy(model(dense, batch.ids)).astype(np.float64))
            labels.append(batch.labels)
    model.train()
    if world > 1:
        labels = [comm.allgather(np.concatenate(labels) if labels else np.empty(0, np.float32))]
        logits = [comm.allgather(np.concatenate(logits) if logits else np.empty(0, np.float64))]
    if not labels or not labels[0].size:
        return {"auc": float("nan"), "logloss": float("nan"), "eval_samples": 0}
    y, z = np.concatenate(labels), np.concatenate(logits)
    return {"auc": roc_auc(y, z), "logloss": log_loss(y, z), "eval_samples": int(y.size)}
