"""The training loop behind ``one-embedding train`` and ``bench``: data -> model -> metrics.

One step: ``logits = model(dense, ids)`` -> BCE with logits -> ``model.backward`` -> one
``Optimizer.step()`` for the dense parameters and the embedding rows. Samples/s counts training
steps only (evaluation and snapshots are excluded); the final record's ``samples_per_s`` is the
steady state, leaving out the first 10% of steps (kernel loading, first touches of memory), and
``samples_per_s_all`` counts every step.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from . import optim
from .data import BatchLoader, SyntheticCriteo
from .errors import ConfigError
from .metrics import log_loss, roc_auc
from .models import DCN, DLRM, DeepFM
from .nn.loss import BCEWithLogits
from .optimizer import Optimizer
from .options import (
    make_cached_host_mem_store_options,
    make_cached_ssd_store_options,
    make_device_mem_store_options,
)

MODELS = ("dlrm", "dcn", "deepfm")
OPTIMIZERS = {"sgd": optim.SGD, "adagrad": optim.Adagrad, "adam": optim.Adam, "ftrl": optim.Ftrl}
STORES = ("device_mem", "cached_host_mem", "cached_ssd")


@dataclass
class TrainConfig:
    model: str = "dlrm"
    data: list = field(default_factory=lambda: ["synthetic"])
    synthetic_cardinalities: str = "kaggle"
    synthetic_scale: float = 0.01
    synthetic_rows: int = 2_000_000
    zipf_alpha: float = 1.05
    store: str = "device_mem"
    engine: str = "slots"
    cache_mb: float = 64.0
    host_cache_mb: float = 0.0
    capacity: int | None = None
    persistent_path: str | None = None
    embedding_dim: int = 16
    bottom_mlp: tuple = (64, 32, 16)
    top_mlp: tuple = (64, 32, 1)
    dnn: tuple = (256, 128)
    cross_layers: int = 3
    cross: str = "vector"
    dropout: float = 0.0
    batch_size: int = 1024
    steps: int | None = 200
    epochs: int = 1
    optimizer: str = "adagrad"
    lr: float = 0.05
    warmup_steps: int = 0
    eval_interval: int = 0
    eval_batches: int = 20
    eval_fraction: float = 0.05
    snapshot_interval: int = 0
    snapshot_name: str = "final"
    seed: int = 0
    on_bad_line: str = "error"
    read_ahead: int = 4

    def validate(self) -> "TrainConfig":
        if self.model not in MODELS:
            raise ConfigError(f"model={self.model!r}: choose one of {MODELS}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}: choose one of {sorted(OPTIMIZERS)}")
        if self.store not in STORES:
            raise ConfigError(f"store={self.store!r}: choose one of {STORES}")
        if self.steps is not None and self.steps <= 0:
            raise ConfigError(f"steps={self.steps}: give a positive number of steps, or omit it")
        if self.model == "dlrm" and self.bottom_mlp[-1] != self.embedding_dim:
            raise ConfigError(
                f"bottom_mlp={list(self.bottom_mlp)} must end in embedding_dim={self.embedding_dim}"
            )
        return self


def store_options_for(cfg: TrainConfig, size_factor: int, total_keys: int | None):
    path = cfg.persistent_path
    if cfg.store == "device_mem":
        return make_device_mem_store_options(path, capacity=cfg.capacity or total_keys,
                                             size_factor=size_factor)
    if cfg.store == "cached_host_mem":
        return make_cached_host_mem_store_options(cfg.cache_mb, path, capacity=cfg.capacity or total_keys,
                                                  size_factor=size_factor)
    if not path:
        raise ConfigError("--store cached_ssd needs --persistent-path (the SSD table's directory)")
    return make_cached_ssd_store_options(cfg.cache_mb, path, capacity=cfg.capacity or total_keys,
                                         size_factor=size_factor, host_cache_budget_mb=cfg.host_cache_mb,
                                         engine=cfg.engine)


def make_loaders(cfg: TrainConfig):
    """(train loader, eval loader, number of sparse features, total keys or None)."""
    common = dict(eval_fraction=cfg.eval_fraction, split_seed=cfg.seed, read_ahead=cfg.read_ahead)
    if cfg.data == ["synthetic"]:
        # rows are a pure function of (seed, row number): one source serves both splits
        source = SyntheticCriteo(cfg.synthetic_cardinalities, scale=cfg.synthetic_scale,
                                 alpha=cfg.zipf_alpha, seed=cfg.seed, num_rows=cfg.synthetic_rows)
        train = BatchLoader(source, cfg.batch_size, split="train", drop_last=True, **common)
        evaluate = BatchLoader(source, cfg.batch_size, split="eval", **common)
        return train, evaluate, source.num_features, source.total_keys
    opts = dict(on_bad_line=cfg.on_bad_line) if any(
        not str(p).endswith(".parquet") and not os.path.isdir(p) for p in cfg.data) else {}
    train = BatchLoader(cfg.data, cfg.batch_size, split="train", drop_last=True, shuffle=True,
                        seed=cfg.seed, **common, **opts)
    evaluate = BatchLoader(cfg.data, cfg.batch_size, split="eval", **common, **opts)
    return train, evaluate, 26, None


def build_model(cfg: TrainConfig, num_tables: int, store_options):
    if cfg.model == "dlrm":
        return DLRM(13, cfg.embedding_dim, num_tables, cfg.bottom_mlp, cfg.top_mlp,
                    store_options=store_options, seed=cfg.seed)
    if cfg.model == "dcn":
        return DCN(num_tables, cfg.embedding_dim, 13, cfg.cross_layers, cfg.cross, cfg.dnn,
                   cfg.dropout, store_options=store_options, seed=cfg.seed)
    return DeepFM(num_tables, cfg.embedding_dim, 13, cfg.dnn, cfg.dropout,
                  store_options=store_options, seed=cfg.seed)


def evaluate(model, loader, max_batches: int) -> dict:
    model.eval()
    labels, logits = [], []
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        logits.append(np.asarray(model(batch.dense, batch.ids), np.float64))
        labels.append(batch.labels)
    model.train()
    if not labels:
        return {"auc": float("nan"), "logloss": float("nan"), "eval_samples": 0}
    y, z = np.concatenate(labels), np.concatenate(logits)
    return {"auc": roc_auc(y, z), "logloss": log_loss(y, z), "eval_samples": int(y.size)}


class MetricsWriter:
    """JSON lines: to a file when given, else to stdout."""

    def __init__(self, path: str | None):
        self._file = open(path, "a") if path else None

    def write(self, record: dict) -> None:
        line = json.dumps(record, default=float)
        if self._file:
            self._file.write(line + "\n")
            self._file.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()


def train(cfg: TrainConfig, metrics_path: str | None = None, progress: bool = True) -> dict:
    """Run a training as configured; returns the final record (also written as JSON)."""
    cfg.validate()
    row_opt = OPTIMIZERS[cfg.optimizer](lr=cfg.lr)
    train_loader, eval_loader, num_tables, total_keys = make_loaders(cfg)
    store = store_options_for(cfg, row_opt.required_size_factor(), total_keys)
    model = build_model(cfg, num_tables, store)
    opt = Optimizer(row_opt, embeddings=[model.embedding], parameters=list(model.parameters()))
    loss_fn = BCEWithLogits()
    writer = MetricsWriter(metrics_path)
    writer.write({"event": "config", **asdict(cfg)})

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, unit="step", file=sys.stderr, dynamic_ncols=True)
    step, train_seconds, samples, losses = 0, 0.0, 0, []
    skip = max(1, cfg.steps // 10) if cfg.steps else 0  # steps left out of the steady state
    steady_seconds, steady_samples = 0.0, 0
    try:
        for epoch in range(cfg.epochs if cfg.steps is None else 10**9):
            train_loader.set_epoch(epoch)
            t0 = time.perf_counter()
            for batch in train_loader:
                if cfg.warmup_steps:
                    opt.lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)
                logits = model(batch.dense, batch.ids)
                loss = float(loss_fn(logits, batch.labels))
                model.backward(loss_fn.backward())
                opt.step()
                opt.zero_grad()
                step += 1
                samples += batch.labels.shape[0]
                losses.append(loss)
                elapsed = time.perf_counter() - t0
                train_seconds += elapsed
                if step > skip:
                    steady_seconds += elapsed
                    steady_samples += batch.labels.shape[0]
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}",
                                    samples_s=f"{samples / train_seconds:,.0f}")
                if step % 10 == 0 or step == 1:
                    writer.write({"event": "train", "step": step, "loss": loss,
                                  "samples_per_s": samples / train_seconds})
                if cfg.eval_interval and step % cfg.eval_interval == 0:
                    writer.write({"event": "eval", "step": step,
                                  **evaluate(model, eval_loader, cfg.eval_batches)})
                if cfg.snapshot_interval and step % cfg.snapshot_interval == 0 and cfg.persistent_path:
                    model.embedding.save_snapshot(f"step-{step}")
                if cfg.steps is not None and step >= cfg.steps:
                    break
                t0 = time.perf_counter()
            if cfg.steps is not None and step >= cfg.steps:
                break
            if cfg.steps is not None and step == 0:
                raise ConfigError("the training split produced no full batch: lower --batch-size")
    finally:
        if bar is not None:
            bar.close()
    final = evaluate(model, eval_loader, cfg.eval_batches)
    if cfg.persistent_path:
        model.embedding.save_snapshot(cfg.snapshot_name)
    head = float(np.mean(losses[: max(1, len(losses) // 10)]))
    tail = float(np.mean(losses[-max(1, len(losses) // 10):]))
    stats = model.embedding.store_stats()
    top = stats[0]
    lookups = top["hits"] + top["misses"]
    record = {
        "event": "final", "model": cfg.model, "store": cfg.store,
        "engine": cfg.engine if cfg.store == "cached_ssd" else None,
        "steps": step, "samples": samples, "train_seconds": train_seconds,
        "samples_per_s": (steady_samples / steady_seconds if steady_seconds
                          else samples / train_seconds if train_seconds else float("nan")),
        "samples_per_s_all": samples / train_seconds if train_seconds else float("nan"),
        "loss_first_10pct": head, "loss_last_10pct": tail, **final,
        "top_tier_hit_rate": top["hits"] / lookups if lookups else float("nan"),
        "rows_stored": len(model.embedding), "store_stats": stats,
        "skipped_lines": train_loader.skipped,
    }
    writer.write(record)
    writer.close()
    model.embedding.close()
    return record
