"""The one training configuration behind ``train``, ``bench`` and ``one-embedding train | bench``.

Every default, help text, choice and bound lives in a field of ``TrainConfig``; the command line
is generated from the fields (field ``cache_mb`` is flag ``--cache-mb``), so the Python API and the
CLI cannot drift apart. A config is frozen and validated once, when it is built::

    >>> cfg = TrainConfig(model="dcn", steps=50)
    >>> cfg.bottom_mlp                      # not given: (64, 32, embedding_dim)
    (64, 32, 16)
    >>> TrainConfig(optimizer="adamw")      # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    one_embedding.errors.ConfigError: optimizer='adamw' (--optimizer): choose one of ...

Defaults are the command line's: where the old ``TrainConfig`` dataclass and the CLI disagreed,
the CLI won (``steps=None``: one pass over the data per epoch; ``bottom_mlp=None``: 64,32,E).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import re
import typing
from dataclasses import dataclass, field

from . import optim
from .errors import ConfigError, OneEmbeddingError
from .nn.amp import PRECISIONS
from .parallel.codec import EXCHANGE_DTYPES
from .data.schema import CRITEO_CARDINALITIES
from .procstats import physical_memory_mb

MODELS = ("dlrm", "dcn", "deepfm")
#: --optimizer name -> row optimizer class (the same update for embedding rows and dense weights)
OPTIMIZERS = {"sgd": optim.SGD, "adagrad": optim.Adagrad, "adam": optim.Adam, "ftrl": optim.Ftrl}
STORES = ("device_mem", "cached_host_mem", "cached_ssd")
ENGINES = ("slots", "rocksdb")
CROSS_KINDS = ("vector", "matrix")
ON_BAD_LINE = ("error", "skip")
PARQUET_LAYOUTS = ("auto", "one_embedding", "oneflow")
PARQUET_KEYS = ("auto", "global", "per_column")
DEVICES = ("cpu", "cuda")
COMMS = ("auto", "mpi", "nccl")
#: --optimizer left unset: each model's reference optimizer (the models' docstrings: OneFlow's zoo
#: trains DCN and DeepFM with Adam 1e-3). Adagrad's first update of a weight is lr * sign(g)
#: whatever the size of g (its accumulator starts at 0), so at lr 0.05 every unit of a wide DNN
#: moves by 0.05 * sum(abs(x)) at once: DCN's and DeepFM's 429-wide input (26 embeddings and 13
#: log(x+1) dense features) gave losses of 15-19 at steps 2-3 (issue 31)
MODEL_OPTIMIZERS = {"dlrm": "adagrad", "dcn": "adam", "deepfm": "adam"}
#: --lr left unset: the optimizer's (Adam's is OneFlow's and PyTorch's default)
DEFAULT_LRS = {"adagrad": 0.05, "adam": 0.001, "ftrl": 0.05, "sgd": 0.05}

#: the range of every integer setting: they reach numpy as int64
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

#: argparse groups, in the order --help shows them
GROUPS = ("model", "data", "store", "lifecycle", "training", "checkpoints")


def option(default=dataclasses.MISSING, *, group: str, help: str = "", choices=None,
           at_least=None, above=None, at_most=None, default_factory=dataclasses.MISSING):
    """A config field: its default, --help text, choices and numeric bounds in one place.

    at_least / above / at_most: bounds of a number, or of each entry of a list of layer sizes.
    """
    meta = {"group": group, "help": help, "choices": choices, "at_least": at_least,
            "above": above, "at_most": at_most}
    return field(default=default, default_factory=default_factory, metadata=meta)


@dataclass(frozen=True)
class TrainConfig:
    """What to train, on which data, through which store, for how long. See ``--help``."""

    model: str = option("dlrm", group="model", choices=MODELS,
                        help="the model: DLRM, Deep & Cross Network or DeepFM")
    data: tuple[str, ...] = option(group="data", default_factory=lambda: ("synthetic",),
                                   help="'synthetic', or Criteo TSV / Parquet files, "
                                        "folders of them or quoted patterns ('DIR/*.parquet')")
    synthetic_cardinalities: str = option(
        "kaggle", group="data", choices=tuple(sorted(CRITEO_CARDINALITIES)),
        help="--data synthetic: the per-column cardinalities of C1..C26: kaggle (Criteo Kaggle's "
             "train.txt), mlperf_v1 (Criteo 1TB as MLPerf v1 and OneFlow's DLRM count it), "
             "mlperf40m (Criteo 1TB, every column capped at 40M)")
    synthetic_scale: float = option(0.01, group="data", above=0.0,
                                    help="multiplies every cardinality (1.0 = the real sizes)")
    synthetic_rows: int = option(2_000_000, group="data", at_least=1,
                                 help="--data synthetic: rows in the source (train and eval "
                                      "splits together)")
    zipf_alpha: float = option(1.05, group="data",
                               help="--data synthetic: the Zipf exponent of the ids' frequencies")
    store: str = option("device_mem", group="store", choices=STORES,
                        help="where the embedding rows live: the whole table in device memory, "
                             "a device cache over a host-memory table, or a device cache over "
                             "an SSD table (needs --persistent-path)")
    engine: str = option("slots", group="store", choices=ENGINES,
                         help="the SSD table's engine under cached_ssd: this library's slot "
                              "files or RocksDB")
    cache_mb: float = option(64.0, group="store", at_least=0.0, help="device cache budget per rank")
    host_cache_mb: float = option(0.0, group="store", at_least=0.0, help="host LRU under cached_ssd")
    capacity: int | None = option(None, group="store", at_least=1,
                                  help="rows the store is sized for (a hint; default: the "
                                       "synthetic source's key count, for files none)")
    persistent_path: str | None = option(None, group="store",
                                         help="table directory (snapshots go to "
                                              "<path>/<rank>-<world>/snapshots)")
    embedding_dim: int = option(16, group="model", at_least=1, help="floats per embedding")
    bottom_mlp: tuple[int, ...] | None = option(
        None, group="model", at_least=1,
        help="DLRM bottom MLP sizes, ending in the embedding dim (default 64,32,E)")
    top_mlp: tuple[int, ...] = option((64, 32, 1), group="model", at_least=1,
                                      help="DLRM top MLP, ending in 1")
    dnn: tuple[int, ...] = option((256, 128), group="model", at_least=1,
                                  help="DCN / DeepFM DNN sizes")
    cross_layers: int = option(3, group="model", at_least=1, help="DCN cross layers")
    cross: str = option("vector", group="model", choices=CROSS_KINDS,
                        help="DCN cross layer: vector (v1) or matrix (v2)")
    dropout: float = option(0.0, group="model", at_least=0.0, help="DCN / DeepFM DNN dropout")
    batch_size: int = option(1024, group="training", at_least=1,
                             help="samples per step, over all ranks (the global batch)")
    steps: int | None = option(None, group="training", at_least=1,
                               help="stop after this many steps")
    epochs: int = option(1, group="training", at_least=1,
                         help="passes over the data when --steps is not given")
    optimizer: str | None = option(
        None, group="training", choices=tuple(sorted(OPTIMIZERS)),
        help="row optimizer of the embeddings and the dense weights (default: the model's, "
             "adagrad for dlrm, adam for dcn and deepfm; with --resume the checkpoint's)")
    lr: float | None = option(
        None, group="training", at_least=0.0,
        help="learning rate (default: the optimizer's, 0.05 for adagrad, sgd and ftrl, 0.001 for "
             "adam; with --resume the checkpoint's)")
    ftrl_convention: str | None = option(
        None, group="training", choices=optim.FTRL_CONVENTIONS,
        help="--optimizer ftrl: 'oneflow' (OneFlow's formula, accumulator ** lr_power; a new "
             "run's default) or 'tensorflow' (FTRL-Proximal, accumulator ** -lr_power). With "
             "--resume the default is the checkpoint's ('tensorflow' for one written before "
             "this option existed)")
    warmup_steps: int = option(0, group="training", at_least=0,
                               help="linear warmup, OneFlow's LinearLR from 0: update t uses "
                                    "lr * min(1, (t - 1) / warmup_steps), so the first update "
                                    "has lr 0")
    log_interval: int = option(10, group="training", at_least=1,
                               help="read the losses back and write a train record every N "
                                    "steps (and at step 1 and the end); between reads the "
                                    "step leaves its loss on the device")
    eval_interval: int = option(0, group="training", at_least=0,
                                help="evaluate every N steps (0: only at the end)")
    eval_batches: int = option(20, group="training", at_least=0,
                               help="batches per evaluation (0: the whole eval split)")
    eval_fraction: float = option(0.05, group="data", at_least=0.0, at_most=1.0,
                                  help="share of the rows held out for evaluation, between 0 "
                                       "and 1 (both excluded)")
    snapshot_interval: int = option(0, group="checkpoints", at_least=0,
                                    help="checkpoint 'step-N' every N steps (needs "
                                         "--persistent-path; 0: only the final one)")
    snapshot_name: str = option("final", group="checkpoints",
                                help="name of the final checkpoint")
    seed: int = option(0, group="training", at_least=0,
                       help="seeds the weights, the rows' initial values, the split and the "
                            "synthetic data")
    on_bad_line: str = option("error", group="data", choices=ON_BAD_LINE,
                              help="a malformed line of a TSV file: stop naming it (error) or "
                                   "skip and count it (skip)")
    parquet_layout: str = option(
        "auto", group="data", choices=PARQUET_LAYOUTS,
        help="Parquet files' dense columns: auto (this library's metadata decides; a file "
             "without it is OneFlow's raw + 1), one_embedding (used as stored: already "
             "log(x+1), or transformed by another tool), oneflow (raw + 1, the log taken here)")
    parquet_keys: str = option(
        "auto", group="data", choices=PARQUET_KEYS,
        help="Parquet files' C1..C26: global (keys as stored), per_column (ids numbered within "
             "each column, as NVTabular / HugeCTR write them: key = id + column * 2**32), auto "
             "(global; a file without this library's metadata whose columns' id ranges overlap "
             "is refused, naming both)")
    read_ahead: int = option(4, group="data", at_least=0,
                             help="batches the loader's thread reads ahead (0: no thread)")
    decay_start: int = option(0, group="training", at_least=0,
                              help="polynomial LR decay (power 2, to 0) after this many "
                                   "updates, as OneFlow's DLRM schedule: update decay_start + 1 "
                                   "still has lr, the next one the first decayed rate")
    decay_steps: int = option(0, group="training", at_least=0,
                              help="length of the LR decay in updates (0: no decay)")
    device: str = option("cpu", group="training", choices=DEVICES,
                         help="where the model and loss run: cpu (numpy) or cuda (CuPy on a GPU)")
    amp: str = option("off", group="training", choices=PRECISIONS,
                      help="mixed precision: the dense model's matrix products on tensor "
                           "cores in tf32, fp16 (with a dynamic loss scale) or bf16, master "
                           "weights and rows in fp32; on CPU it gives a GPU run's numerics, not "
                           "its speed")
    comm: str = option("auto", group="training", choices=COMMS,
                       help="how ranks exchange rows, gradients and dense gradients: mpi "
                            "(mpi4py; device arrays staged through host memory), nccl (NCCL on "
                            "the GPUs, --device cuda, one GPU per rank) or auto: nccl for "
                            "several ranks on --device cuda with a GPU each, else mpi")
    cuda_graph: bool = option(True, group="training",
                              help="--device cuda: capture the step's dense part (forward, loss, "
                                   "backward; fixed shapes) once as a CUDA graph and replay it "
                                   "(same results, bit for bit); --no-cuda-graph launches every "
                                   "kernel each step. Nothing changes on the CPU")
    blas_threads: int = option(0, group="training", at_least=0,
                               help="BLAS threads per rank for the dense layers (0: half of the "
                                    "rank's share of the cores, at least 1; the other half runs "
                                    "the prefetch, the loader and the synthetic generator)")
    prefetch_depth: int = option(1, group="training", at_least=0,
                                 help="batches whose ID shuffle and row lookups run ahead on a "
                                      "background thread while the current batch computes "
                                      "(0: off); results are the same for every depth")
    keep_snapshots: int = option(3, group="checkpoints", at_least=0,
                                 help="interval checkpoints kept (the newest; the final one is "
                                      "always kept; 0: keep all)")
    resume: bool = option(False, group="checkpoints",
                          help="continue from the newest complete checkpoint under "
                               "--persistent-path (--steps counts the whole run)")
    overwrite: bool = option(False, group="checkpoints",
                             help="start over on a --persistent-path that holds checkpoints, "
                                  "deleting them")
    admit_min_count: int = option(1, group="lifecycle", at_least=1, at_most=0xFFFF,
                                  help="an id gets a stored row once it has appeared in this many "
                                       "training steps (1: at first sight); before that its lookup "
                                       "gives the initializer's value and its gradient is dropped")
    admit_sketch_mb: float | None = option(
        None, group="lifecycle", above=0.0,
        help="MiB per rank of the count-min sketch that counts ids not admitted yet (4 rows of "
             "16-bit counters, halved each time it has counted half a row's width of ids); "
             "only with --admit-min-count > 1 (default 32)")
    steps_to_live: int = option(0, group="lifecycle", at_least=0,
                                help="evict a row not looked up in training for this many steps "
                                     "(0: never)")
    max_rows: int = option(0, group="lifecycle", at_least=0,
                           help="rows over all ranks; past it the least frequently used rows "
                                "(frequency with decay) are evicted down to 90%% of it (0: no "
                                "limit)")
    evict_interval: int = option(0, group="lifecycle", at_least=0,
                                 help="steps between time-to-live sweeps, with --steps-to-live "
                                      "(0: steps_to_live / 4)")
    frequency_half_life: int = option(1000, group="lifecycle", at_least=0,
                                      help="steps over which a row's use frequency halves, for "
                                           "--max-rows (0: no decay)")
    exchange_dtype: str | None = option(None, group="store", choices=EXCHANGE_DTYPES,
                                        help="how rows and gradients cross ranks (default fp32; "
                                             "int8 when ONEFLOW_ONE_EMBEDDING_ENABLE_QUANTIZED_"
                                             "COMM=1)")

    def __post_init__(self):
        # Frozen: normalised values are written once, here, through object.__setattr__.
        for f, kinds in _field_kinds(type(self)):
            object.__setattr__(self, f.name, _checked(f, kinds, getattr(self, f.name)))
        if self.bottom_mlp is None:
            object.__setattr__(self, "bottom_mlp", (64, 32, self.embedding_dim))
        self._check_combinations()

    def validate(self) -> "TrainConfig":
        """Already done when the config was built; kept for callers that ask explicitly."""
        self._check_combinations()
        return self

    def _check_combinations(self) -> None:
        if self.model == "dlrm" and self.bottom_mlp[-1] != self.embedding_dim:
            raise ConfigError(
                f"bottom_mlp={list(self.bottom_mlp)} must end in embedding_dim={self.embedding_dim}: "
                f"change --bottom-mlp to end in {self.embedding_dim} or leave it unset"
            )
        if self.store == "cached_ssd" and not self.persistent_path:
            raise ConfigError("store='cached_ssd' needs --persistent-path (persistent_path=, the "
                              "SSD table's directory)")
        if self.comm == "nccl" and self.device != "cuda":
            raise ConfigError("comm='nccl' (--comm nccl) exchanges device arrays between GPUs: "
                              "add --device cuda, or use --comm mpi")
        if self.resume and self.overwrite:
            raise ConfigError("resume=True and overwrite=True (--resume --overwrite): choose one: "
                              "--resume continues the run, --overwrite deletes it and starts over")
        if (self.resume or self.overwrite) and not self.persistent_path:
            flag = "--resume" if self.resume else "--overwrite"
            raise ConfigError(f"{flag} needs --persistent-path: the folder of the run's "
                              "checkpoints")
        # a setting that only acts together with another one is refused alone, not ignored
        if self.admit_sketch_mb is not None and self.admit_min_count <= 1:
            raise ConfigError(
                f"admit_sketch_mb={self.admit_sketch_mb:g} (--admit-sketch-mb) sizes the "
                "admission sketch, which only --admit-min-count > 1 uses (admit_min_count="
                f"{self.admit_min_count} stores every id at first sight): add --admit-min-count "
                "N (N >= 2) or drop --admit-sketch-mb")
        if self.evict_interval and not self.steps_to_live:
            raise ConfigError(
                f"evict_interval={self.evict_interval} (--evict-interval) spaces the "
                "time-to-live sweeps, which only --steps-to-live > 0 runs (--max-rows sweeps "
                "whenever the table is over its limit): add --steps-to-live N or drop "
                "--evict-interval")
        if self.with_model_defaults().optimizer == "ftrl" and self.decay_steps:
            raise ConfigError(f"decay_steps={self.decay_steps} with optimizer='ftrl': the decay "
                              "ends at lr 0, which FTRL cannot take (it divides by lr; the run "
                              "stopped there): use --decay-steps 0 with ftrl")
        if self.with_model_defaults().optimizer == "ftrl" and self.warmup_steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps} with optimizer='ftrl': the "
                              "warmup gives the first update lr 0 (OneFlow's schedule), which "
                              "FTRL cannot take (it divides by lr): use --warmup-steps 0 with "
                              "ftrl")
        if self.decay_steps and self.decay_start < self.warmup_steps:
            raise ConfigError(f"decay_start={self.decay_start} is before the end of the warmup "
                              f"(warmup_steps={self.warmup_steps}): use --decay-start >= "
                              f"{self.warmup_steps}")
        self._check_run_settings()

    def check_flags_act(self) -> None:
        """The CLI's check of flags that act only with another one, refused alone (they were
        silently ignored: found by a fault campaign); a value equal to the default is taken as
        not given. Not made for every TrainConfig: a program may build one config for several
        models, stores or sources and leave the others' settings in it."""
        default = TrainConfig.__dataclass_fields__
        given = lambda name: getattr(self, name) != default[name].default  # noqa: E731
        synthetic = tuple(self.data) == ("synthetic",)
        idle = [
            ("engine", self.engine != "slots" and self.store != "cached_ssd",
             f"picks the SSD engine of --store cached_ssd; --store {self.store} has none: use "
             "--store cached_ssd or drop --engine"),
            ("cache_mb", given("cache_mb") and self.store == "device_mem",
             "sizes the device cache of the cached stores; --store device_mem keeps the whole "
             "table in device memory: drop --cache-mb or use --store cached_host_mem / "
             "cached_ssd"),
            ("host_cache_mb", self.host_cache_mb > 0 and self.store != "cached_ssd",
             f"sizes the RAM cache between the device cache and the SSD of --store cached_ssd; "
             f"--store {self.store} has none: use --store cached_ssd or drop --host-cache-mb"),
            ("synthetic_scale", given("synthetic_scale") and not synthetic,
             "scales the synthetic source's tables; --data names files: drop it"),
            ("zipf_alpha", given("zipf_alpha") and not synthetic,
             "shapes the synthetic source's ids; --data names files: drop it"),
            ("synthetic_rows", given("synthetic_rows") and not synthetic,
             "sizes the synthetic source; --data names files: drop it"),
            ("parquet_layout", given("parquet_layout") and synthetic,
             "reads Parquet files' dense columns; --data synthetic has none: drop it"),
            ("parquet_keys", given("parquet_keys") and synthetic,
             "reads Parquet files' ids; --data synthetic has none: drop it"),
            ("synthetic_cardinalities", given("synthetic_cardinalities") and not synthetic,
             "picks the synthetic source's tables; --data names files (their ids say their "
             "tables): drop it"),
            ("dnn", given("dnn") and self.model == "dlrm",
             "is the DCN / DeepFM deep part; --model dlrm has --bottom-mlp and --top-mlp"),
            ("dropout", given("dropout") and self.model == "dlrm",
             "drops units of the DCN / DeepFM deep part; --model dlrm has none: drop it"),
            ("top_mlp", given("top_mlp") and self.model != "dlrm",
             f"is DLRM's top MLP; --model {self.model} has --dnn"),
            ("bottom_mlp", self.model != "dlrm" and
             tuple(self.bottom_mlp) != (64, 32, self.embedding_dim),
             f"is DLRM's bottom MLP; --model {self.model} has --dnn"),
            ("cross_layers", given("cross_layers") and self.model != "dcn",
             f"counts DCN's cross layers; --model {self.model} has none: drop it"),
            ("cross", given("cross") and self.model != "dcn",
             f"picks DCN's cross layer; --model {self.model} has none: drop it"),
            ("ftrl_convention", self.ftrl_convention is not None and
             self.optimizer not in (None, "ftrl") or
             self.ftrl_convention is not None and self.optimizer is None and not self.resume,
             "picks Ftrl's formula; the run's optimizer is not ftrl: add --optimizer ftrl or "
             "drop it"),
            ("frequency_half_life", given("frequency_half_life") and not self.max_rows,
             "decays the use frequency that --max-rows evicts by, and there is no --max-rows: "
             "add --max-rows N or drop it"),
            ("decay_start", given("decay_start") and not self.decay_steps,
             "starts the decay, which only --decay-steps N > 0 runs: add it or drop "
             "--decay-start"),
            ("keep_snapshots", given("keep_snapshots") and not self.persistent_path,
             "counts the checkpoints kept in the run's folder, and there is none: add "
             "--persistent-path DIR or drop it"),
            ("snapshot_name", given("snapshot_name") and not self.persistent_path,
             "names the final checkpoint in the run's folder, and there is none: add "
             "--persistent-path DIR or drop it"),
        ]
        for name, idle_here, why in idle:
            if idle_here:
                value = getattr(self, name)
                value = list(value) if isinstance(value, tuple) else value
                raise ConfigError(f"{name}={value!r} (--{name.replace('_', '-')}) {why}")

    def _check_run_settings(self) -> None:
        """Settings that would otherwise fail only after training (snapshot name), fail while
        allocating (a cache beyond RAM) or give a meaningless result (no evaluation split)."""
        from .store.snapshots import check_snapshot_name

        if self.eval_fraction in (0.0, 1.0):
            what = ("holds out no rows, so there is nothing to evaluate (no AUC)"
                    if self.eval_fraction == 0.0
                    else "holds out every row, leaving none to train on")
            raise ConfigError(f"eval_fraction={self.eval_fraction} (--eval-fraction) {what}: use "
                              "a fraction between 0 and 1, e.g. 0.05")
        try:
            check_snapshot_name(self.snapshot_name)
        except OneEmbeddingError as e:
            raise ConfigError(f"--snapshot-name: {e}") from None
        if re.fullmatch(r"step-[0-9]+", self.snapshot_name):
            raise ConfigError(f"snapshot_name={self.snapshot_name!r} (--snapshot-name) is the "
                              "name of an interval checkpoint (--snapshot-interval writes "
                              "step-N), which it would replace: choose another, e.g. 'final'")
        ram_mb = physical_memory_mb()
        if ram_mb is not None and self.admit_sketch_mb is not None \
                and self.admit_sketch_mb > ram_mb:
            raise ConfigError(
                f"admit_sketch_mb={self.admit_sketch_mb:g} (--admit-sketch-mb, MiB per rank) is "
                f"more than this machine's {ram_mb:,.0f} MB of RAM: use a sketch that fits, e.g. "
                "--admit-sketch-mb 32 (the default; each MiB counts ~131,000 ids)")
        cache_mb = self.cache_mb + self.host_cache_mb
        if ram_mb is not None and cache_mb > ram_mb:
            flags = "--cache-mb" + (" + --host-cache-mb" if self.host_cache_mb else "")
            raise ConfigError(
                f"cache_mb={self.cache_mb:g}, host_cache_mb={self.host_cache_mb:g} ({flags} = "
                f"{cache_mb:g} MB) is more than this machine's {ram_mb:,.0f} MB of RAM, where the "
                f"caches live on CPU: use budgets that add up to less (e.g. --cache-mb "
                f"{max(1, int(ram_mb) // 8)})"
            )

    def with_model_defaults(self) -> "TrainConfig":
        """This config with ``optimizer`` and ``lr`` filled in where unset: the model's optimizer
        (``MODEL_OPTIMIZERS``) and its learning rate (``DEFAULT_LRS``)."""
        optimizer = self.optimizer or MODEL_OPTIMIZERS[self.model]
        lr = DEFAULT_LRS[optimizer] if self.lr is None else self.lr
        if (optimizer, lr) == (self.optimizer, self.lr):
            return self
        return dataclasses.replace(self, optimizer=optimizer, lr=lr)

    def resolved(self) -> "TrainConfig":
        """This config with what None stands for spelled out, as a checkpoint records it (and
        a resume compares it): the exchange's dtype (OneFlow's environment switch picks int8,
        else fp32) and, with admission, the sketch's size."""
        from .options import LifecycleOptions
        from .parallel.codec import resolve_exchange_dtype

        sketch = self.admit_sketch_mb
        if sketch is None and self.admit_min_count > 1:
            sketch = LifecycleOptions.sketch_mb
        return dataclasses.replace(self, exchange_dtype=resolve_exchange_dtype(self.exchange_dtype),
                                   admit_sketch_mb=sketch)

    # --- the command line, generated from the fields ---------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, hidden=()) -> None:
        """One ``--flag`` per field, in argument groups (``GROUPS``); default, choices and help
        come from the field. Values are checked when ``from_args`` builds the config. Fields
        in ``hidden`` are parsed but left out of ``--help`` (a command that sets them itself
        refuses them with its own message)."""
        groups = {name: parser.add_argument_group(name) for name in GROUPS}
        for f, (kind, item, _) in _field_kinds(cls):
            default = _default(f)
            kwargs = {"dest": f.name, "default": default, "help": _help(f.metadata["help"], default)}
            if f.name in hidden:
                kwargs["help"] = argparse.SUPPRESS
            if f.metadata["choices"]:
                kwargs["choices"] = f.metadata["choices"]
            flag = _flag(f.name)
            shown = kwargs["help"] if f.name in hidden else f.metadata["help"]
            if kind is bool and default is True:      # on by default: --no-cuda-graph
                flag = _flag("no_" + f.name)
                kwargs.update(action="store_false", help=shown)
            elif kind is bool:
                kwargs.update(action="store_true", help=shown)  # --resume
            elif kind is tuple and item is str:
                kwargs.update(nargs="+", default=list(kwargs["default"]))   # --data a.tsv b.tsv
            elif kind is tuple:
                kwargs["type"] = _int_list                                    # --dnn 256,128
            else:
                kwargs["type"] = kind
            groups[f.metadata["group"]].add_argument(flag, **kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        """The config from a namespace parsed by a parser that ``add_arguments`` built."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help(text: str, default) -> str:
    if default is None:  # the help says what "unset" means
        return text or None
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
    return f"{text} (default: {shown})" if text else f"default: {shown}"


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _field_kinds(cls):
    """[(field, (kind, item kind, optional))]: kind int | float | str | tuple from the field's
    annotation, the element type of a tuple (else None), and whether None ("unset") is allowed."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint, optional = hints[f.name], False
        args = typing.get_args(hint)
        if type(None) in args:
            (hint,) = [a for a in args if a is not type(None)]
            optional = True
        kind = typing.get_origin(hint) or hint
        item = typing.get_args(hint)[0] if kind is tuple else None
        out.append((f, (kind, item, optional)))
    return out


def _int_list(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers") from None


def _checked(f: dataclasses.Field, kinds, value):
    """The value of field f, type- and range-checked; tuples, paths and numbers normalised to
    plain tuple / str / int / float (the config is written out as JSON). Raises ConfigError."""
    kind, item, optional = kinds
    name = f"{f.name}={value!r} ({_flag(f.name)})"
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name}: this setting cannot be unset; its default is {_default(f)!r}")
    if kind is tuple:
        return _checked_tuple(f, item, value, name)
    if f.metadata["choices"] and value not in f.metadata["choices"]:
        raise ConfigError(f"{name}: choose one of {f.metadata['choices']}")
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: pass True or False")
        return value
    if kind is str:
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"{name}: pass a string")
        return os.fspath(value)
    if kind is int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ConfigError(f"{name}: pass an integer")
    if kind is int and not INT64_MIN <= value <= INT64_MAX:
        # every integer setting reaches numpy as an int64 (seeds, sizes, step counts)
        bound = f"<= {INT64_MAX}" if value > 0 else f">= {INT64_MIN}"
        raise ConfigError(f"{name}: use a value {bound} (it must fit in a signed 64-bit integer)")
    if kind is float and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                          or not math.isfinite(value)):
        raise ConfigError(f"{name}: pass a finite number")
    _check_bounds(f, value, name)
    return kind(value)


def _checked_tuple(f, item, value, name):
    if isinstance(value, (str, os.PathLike)):
        value = (value,)  # one path given alone
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"{name}: pass a list") from None
    if not items:
        raise ConfigError(f"{name}: give at least one entry")
    if item is str:
        if not all(isinstance(x, (str, os.PathLike)) for x in items):
            raise ConfigError(f"{name}: pass a list of paths (or 'synthetic')")
        return tuple(os.fspath(x) for x in items)
    for x in items:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise ConfigError(f"{name}: pass a list of integers (layer sizes)")
        _check_bounds(f, x, name, "every entry")
    return tuple(int(x) for x in items)


def _check_bounds(f, value, name, what="use a value") -> None:
    low, above, high = f.metadata["at_least"], f.metadata["above"], f.metadata["at_most"]
    unset = ", or leave it unset" if f.default is None else ""
    if low is not None and value < low:
        raise ConfigError(f"{name}: {what} >= {low}{unset}")
    if above is not None and value <= above:
        raise ConfigError(f"{name}: {what} > {above}{unset}")
    if high is not None and value > high:
        raise ConfigError(f"{name}: {what} <= {high}")


def make_row_optimizer(cfg: TrainConfig):
    """The row optimizer ``cfg`` names, at ``cfg.lr`` with the algorithm's defaults (the model's
    optimizer and the optimizer's lr where unset); Ftrl by ``cfg.ftrl_convention`` (OneFlow's
    formula when unset)."""
    cfg = cfg.with_model_defaults()
    if cfg.optimizer == "ftrl":
        return optim.Ftrl(lr=cfg.lr, convention=cfg.ftrl_convention or "oneflow")
    return OPTIMIZERS[cfg.optimizer](lr=cfg.lr)
