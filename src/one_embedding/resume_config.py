"""What a resumed run trains with: the checkpoint's settings where the command left them unset,
and a refusal naming every setting that differs in what changes results."""
from __future__ import annotations

from dataclasses import asdict, replace

from .checkpoint import config_differences
from .config import TrainConfig
from .errors import ConfigError

#: what a setting added later was, in effect, before it existed: a checkpoint whose config lacks
#: it resumes with this value (Ftrl computed only TensorFlow's convention before issue 23)
LEGACY_CONFIG = {"ftrl_convention": "tensorflow"}

#: config fields a resumed run may change: they change how long it runs, what it reports, and how
#: fast, never its results (every store and cache size trains bit-identically)
RESUME_MAY_CHANGE = {"steps", "epochs", "log_interval", "eval_interval", "eval_batches",
                     "snapshot_interval", "snapshot_name", "keep_snapshots", "prefetch_depth",
                     "read_ahead", "cache_mb", "host_cache_mb", "capacity", "resume", "overwrite",
                     "persistent_path", "cuda_graph", "comm", "blas_threads"}


def resumed_config(cfg: TrainConfig, saved: dict | None, name: str) -> TrainConfig:
    """``cfg`` (the command's) completed from checkpoint ``name``'s config ``saved`` (None: a
    checkpoint without one) and resolved; ConfigError listing every field that changes results
    and differs."""
    # a field the checkpoint's version did not have yet had its default value then, or
    # the value LEGACY_CONFIG gives for what the code did before the field existed
    saved = {**asdict(TrainConfig()), **LEGACY_CONFIG, **(saved or {})}
    if cfg.optimizer is None:  # unset: continue as the checkpoint's run did
        cfg = replace(cfg, optimizer=saved["optimizer"])
    if cfg.lr is None:
        lr = saved["lr"] if cfg.optimizer == saved["optimizer"] else None
        cfg = replace(cfg, lr=lr)
    cfg = cfg.with_model_defaults()
    if cfg.ftrl_convention is None:  # unset: continue as the checkpoint's run did
        cfg = replace(cfg, ftrl_convention=saved["ftrl_convention"])
    if cfg.admit_sketch_mb is None and cfg.admit_min_count > 1:  # the same
        cfg = replace(cfg, admit_sketch_mb=saved["admit_sketch_mb"])
    # compared as the runs used them, not as they were spelled: None is the sketch's default
    # size, and the exchange's dtype OneFlow's environment switch picks (a checkpoint from
    # before the dtype was recorded resolved it unseen: not compared)
    cfg = cfg.resolved()
    if saved.get("admit_sketch_mb") is None and cfg.admit_min_count > 1:
        saved["admit_sketch_mb"] = cfg.admit_sketch_mb
    if saved.get("exchange_dtype") is None:
        saved["exchange_dtype"] = cfg.exchange_dtype
    free = RESUME_MAY_CHANGE | ({"ftrl_convention"} if cfg.optimizer != "ftrl" else set())
    if cfg.admit_min_count <= 1:  # no sketch: its size changes nothing (before issue
        free = free | {"admit_sketch_mb"}  # 29 a config held 32 even without admission)
    diffs = config_differences(saved, asdict(cfg), free)
    if diffs:
        raise ConfigError(
            f"--resume: the configuration differs from checkpoint {name!r}'s in what "
            f"changes results: {'; '.join(diffs)}. Use the checkpoint's values, or "
            "--overwrite to start a new run")
    return cfg
