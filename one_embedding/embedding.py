"""MultiTableEmbedding / MultiTableMultiColumnEmbedding: the front end.

One key space for all tables; a table only picks the initializer of a key seen for the first time
(REFERENCE.md "Semantics"). A step, as data flows::

    ids (…) ──validate──> keys (n,) uint64 ──ID shuffle──> unique_keys (u,), inverse (n,)
        ──chain.lookup──> lines (u, line_size) [misses: deterministic init] ──gather──> out (…, E)
    grad (…, E) ──segment-sum by inverse──> (u, E) ──pending until Optimizer.step──>
        row optimizer on lines ──chain.put──> top tier (evictions written down)

Nothing is stored by a lookup: a key is created by the first optimizer step that updates it, so
evaluation lookups change nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import store as _store  # noqa: F401  (registers the store presets)
from .backend import is_cupy_array, to_numpy
from .errors import ConfigError, InputError, SnapshotError
from .initializers import fill_initial_values
from .options import (
    DEFAULT_INITIALIZER,
    StoreOptions,
    TableOptions,
    check_initializer,
    make_table_options,
)
from .parallel.id_shuffle import first_occurrence, segment_sum, shuffle_ids, unique_ids
from .store.chain import build_chain
from .store.lock import PathLock
from .store.snapshots import SnapshotDirectory

_KEY_TYPES = {
    "int32": np.int32, "int64": np.int64, "uint32": np.uint32, "uint64": np.uint64,
}


def _dtype_name(dtype) -> str:
    """Accept numpy dtypes, strings, and framework dtypes such as torch.float32 by name."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).rsplit(".", 1)[-1]


def _resolve_key_type(key_type) -> np.dtype:
    name = _dtype_name(key_type)
    if name not in _KEY_TYPES:
        raise ConfigError(f"key_type={key_type!r} is not supported: use one of {sorted(_KEY_TYPES)}")
    return np.dtype(_KEY_TYPES[name])


def keys_as_uint64(ids: np.ndarray, key_type: np.dtype) -> np.ndarray:
    """Internal key: the raw id's bits as uint64; 32-bit keys are zero-extended (REFERENCE.md)."""
    ids = ids.astype(key_type, copy=False)
    if key_type.itemsize == 4:
        return ids.view(np.uint32).astype(np.uint64)
    return ids.view(np.uint64)


@dataclass
class _Lookup:
    """What a forward keeps for its backward and the optimizer step."""

    shape: tuple
    unique_keys: np.ndarray  # (u,) uint64
    inverse: np.ndarray  # (m,) int64, one per non-padding id
    keep: np.ndarray | None  # (n,) bool non-padding positions, None when there is no padding
    lines: np.ndarray  # (u, line_size) float32, as found or freshly initialised
    found: np.ndarray  # (u,) bool: the key was stored before this lookup


class MultiTableMultiColumnEmbedding:
    """Many tables in one key space; each row is several columns stored in one line.

    ``embedding_dim`` is an int (one column) or a list of column dims; the output concatenates the
    columns: ``ids.shape + (sum(embedding_dim),)``. ``tables`` lists ``make_table_options`` results
    (each with one column option per column); ``None`` means one table initialised with
    ``default_initializer`` (normal(0, 0.05) when not given).
    """

    def __init__(
        self,
        name: str,
        embedding_dim: int | Sequence[int],
        dtype,
        key_type,
        tables: Sequence[TableOptions] | None,
        store_options: StoreOptions,
        default_initializer=None,
        padding_idx: int | None = None,
        seed: int = 0,
        *,
        rank: int = 0,
        world: int = 1,
    ):
        self.name = str(name)
        dims = [embedding_dim] if isinstance(embedding_dim, (int, np.integer)) else list(embedding_dim)
        if not dims or any(int(d) != d or d <= 0 for d in dims):
            raise ConfigError(f"embedding_dim={embedding_dim!r} must be a positive int or a list of them")
        self.column_dims = tuple(int(d) for d in dims)
        self.embedding_dim = sum(self.column_dims)
        if _dtype_name(dtype) != "float32":
            raise ConfigError(f"dtype={dtype!r}: rows are stored and returned as float32; pass np.float32")
        self.dtype = np.dtype(np.float32)
        self.key_type = _resolve_key_type(key_type)
        self.seed = int(seed)
        if not isinstance(store_options, StoreOptions):
            raise ConfigError(
                f"store_options={store_options!r}: build it with make_device_mem_store_options, "
                "make_cached_host_mem_store_options or make_cached_ssd_store_options"
            )
        self.store_options = store_options
        self.tables = self._check_tables(tables, default_initializer)
        self.padding_idx = None if padding_idx is None else self._check_padding(padding_idx)
        if world != 1 or rank != 0:
            raise ConfigError(
                f"rank={rank}, world={world}: this build trains on one rank; multi-rank exchange "
                "is not available yet"
            )
        self.rank, self.world = rank, world
        self.line_size = store_options.line_size(self.embedding_dim)
        if self.line_size < self.embedding_dim:
            raise ConfigError(
                f"storage_dim={store_options.storage_dim} is smaller than embedding_dim="
                f"{self.embedding_dim}: use storage_dim=-1 and size_factor instead"
            )
        self._path = self._rank_path(store_options.persistent_path)
        self._lock = PathLock(self._path) if self._path else None
        self._snapshots = None
        if self._path:
            self._snapshots = SnapshotDirectory(self._path)
            self._snapshots.recover()
        self._chain = build_chain(store_options, self.line_size, self.embedding_dim, self._path, world)
        self._last: _Lookup | None = None
        self._pending: list[tuple[_Lookup, np.ndarray]] = []
        self._columns = [
            (offset, np.arange(offset, offset + d, dtype=np.uint64))
            for offset, d in zip(np.cumsum((0,) + self.column_dims[:-1]), self.column_dims)
        ]

    # ---------------------------------------------------------------- configuration checks
    def _check_tables(self, tables, default_initializer) -> tuple[TableOptions, ...]:
        if tables is None:
            init = check_initializer(default_initializer or DEFAULT_INITIALIZER, "default_initializer")
            tables = [make_table_options([init] * len(self.column_dims))]
        tables = tuple(tables)
        if not tables:
            raise ConfigError("tables is empty: give at least one make_table_options(...)")
        for i, t in enumerate(tables):
            if not isinstance(t, TableOptions):
                raise ConfigError(f"tables[{i}]={t!r}: build tables with make_table_options(...)")
            if len(t.columns) != len(self.column_dims):
                raise ConfigError(
                    f"tables[{i}] has {len(t.columns)} column(s) but embedding_dim="
                    f"{list(self.column_dims)} has {len(self.column_dims)}: give one "
                    "make_column_options per column"
                )
        return tables

    def _check_padding(self, padding_idx) -> int:
        info = np.iinfo(self.key_type)
        if int(padding_idx) != padding_idx or not info.min <= padding_idx <= info.max:
            raise ConfigError(f"padding_idx={padding_idx!r} is not a valid {self.key_type.name} key")
        return int(padding_idx)

    def _rank_path(self, path) -> str | None:
        if path is None or path == "":
            if self.store_options.kind == "cached_ssd":
                raise ConfigError("cached_ssd needs a persistent_path")
            return None
        if isinstance(path, (list, tuple)):
            if len(path) != self.world:
                raise ConfigError(f"persistent_path lists {len(path)} paths for world={self.world}")
            return os.fspath(path[self.rank])
        width = len(str(self.world))
        return os.path.join(os.fspath(path), f"{self.rank:0{width}d}-{self.world}")

    # ---------------------------------------------------------------- input validation
    def _validate_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise InputError(
                f"ids have dtype {ids.dtype}; ids must be integers: cast them to {self.key_type.name}"
            )
        if ids.ndim == 0:
            raise InputError("ids is a scalar: pass an array of ids, e.g. shape (B,) or (B, F)")
        if ids.size:
            lo, hi = ids.min(), ids.max()
            info = np.iinfo(self.key_type)
            if int(lo) < info.min or int(hi) > info.max:
                bad = int(lo) if int(lo) < info.min else int(hi)
                hint = "negative ids need a signed key_type" if bad < 0 else "use a wider key_type"
                raise InputError(
                    f"id {bad} does not fit key_type={self.key_type.name} "
                    f"[{info.min}, {info.max}]: {hint}"
                )
        return ids

    def _resolve_table_ids(self, ids: np.ndarray, table_ids) -> np.ndarray:
        n_tables = len(self.tables)
        if table_ids is None:
            if n_tables == 1:
                return np.zeros(ids.shape, np.int32)
            if ids.ndim >= 1 and ids.shape[-1] == n_tables:
                return np.broadcast_to(np.arange(n_tables, dtype=np.int32), ids.shape)
            raise InputError(
                f"ids of shape {ids.shape} with {n_tables} tables and no table_ids: give ids of "
                f"shape (..., {n_tables}) (column j = table j) or pass table_ids"
            )
        table_ids = np.asarray(to_numpy(table_ids))
        if table_ids.dtype.kind not in "iu":
            raise InputError(f"table_ids have dtype {table_ids.dtype}; they must be integers")
        try:
            table_ids = np.broadcast_to(table_ids, ids.shape)
        except ValueError:
            raise InputError(
                f"table_ids of shape {table_ids.shape} do not broadcast to ids of shape {ids.shape}"
            ) from None
        if table_ids.size and (table_ids.min() < 0 or table_ids.max() >= n_tables):
            bad = int(table_ids.max()) if table_ids.max() >= n_tables else int(table_ids.min())
            raise InputError(
                f"table id {bad} is out of range: this embedding has {n_tables} tables "
                f"(valid ids 0..{n_tables - 1})"
            )
        return table_ids.astype(np.int32, copy=False)

    # ---------------------------------------------------------------- forward / backward
    def forward(self, ids, table_ids=None):
        """ids: (...) integers -> (..., embedding_dim) float32. Keeps what backward needs."""
        on_gpu = is_cupy_array(ids)
        ids = self._validate_ids(to_numpy(ids))
        tables = self._resolve_table_ids(ids, table_ids).reshape(-1)
        keys = keys_as_uint64(ids.reshape(-1), self.key_type)
        keep = None
        if self.padding_idx is not None:
            pad_key = keys_as_uint64(np.array([self.padding_idx]), self.key_type)[0]
            is_pad = keys == pad_key
            if is_pad.any():
                keep = ~is_pad
                keys, tables = keys[keep], tables[keep]
        shuffled = shuffle_ids(keys, tables, self.world)
        lines, found = self._chain.lookup(shuffled.unique_keys)
        if not found.all():
            self._initialize(lines, ~found, shuffled.unique_keys, shuffled.unique_table_ids)
        rows = lines[shuffled.inverse, : self.embedding_dim]
        if keep is not None:
            out = np.zeros((ids.size, self.embedding_dim), np.float32)
            out[keep] = rows
        else:
            out = rows
        self._last = _Lookup(ids.shape, shuffled.unique_keys, shuffled.inverse, keep, lines, found)
        out = out.reshape(ids.shape + (self.embedding_dim,))
        if on_gpu:
            import cupy

            return cupy.asarray(out)
        return out

    __call__ = forward

    def _initialize(self, lines, missing, keys, table_ids) -> None:
        """Write initial embedding values into ``lines[missing]``; state columns start at 0 and
        get the optimizer's initial values when the optimizer first updates the row."""
        idx = np.flatnonzero(missing)
        lines[idx, self.embedding_dim :] = 0.0
        miss_tables = table_ids[idx]
        for t in np.unique(miss_tables):
            rows = idx[miss_tables == t]
            for (offset, cols), col_opt in zip(self._columns, self.tables[t].columns):
                fill_initial_values(lines, rows, keys[rows], col_opt.initializer, self.seed,
                                    offset, cols.shape[0], offset)

    def backward(self, grad_out) -> None:
        """grad_out: (..., embedding_dim) float32, the gradient of the last forward's output.

        Sums the gradient per unique key (duplicates summed, padding ignored) and keeps it for the
        next ``Optimizer.step``.
        """
        last = self._last
        if last is None:
            raise InputError("backward() without a forward(): look the ids up first")
        grad = np.asarray(to_numpy(grad_out))
        want = last.shape + (self.embedding_dim,)
        if grad.shape != want:
            raise InputError(f"grad_out has shape {grad.shape}; the last forward returned {want}")
        if grad.dtype.kind != "f":
            raise InputError(f"grad_out has dtype {grad.dtype}; pass float32 gradients")
        grad = grad.reshape(-1, self.embedding_dim).astype(np.float32, copy=False)
        if last.keep is not None:
            grad = grad[last.keep]
        if not np.isfinite(grad).all():
            bad = np.argwhere(~np.isfinite(grad))[0]
            raise InputError(
                f"grad_out holds a non-finite value ({grad[tuple(bad)]}) at row {int(bad[0])}: "
                "the table is unchanged; check the loss (e.g. lower the learning rate)"
            )
        summed = segment_sum(grad, last.inverse, last.unique_keys.shape[0])
        self._pending.append((last, summed))
        self._last = None

    def zero_grad(self) -> None:
        self._pending.clear()

    # ---------------------------------------------------------------- optimizer step
    def check_optimizer(self, optimizer) -> None:
        """Raise ConfigError when the line cannot hold the optimizer's state (OneFlow only
        catches this deep inside a kernel)."""
        need = optimizer.required_size_factor() * self.embedding_dim
        if self.line_size < need:
            so = self.store_options
            setting = (
                f"storage_dim={so.storage_dim}" if so.storage_dim != -1 else f"size_factor={so.size_factor}"
            )
            raise ConfigError(
                f"{setting} gives line_size={self.line_size} but {type(optimizer).__name__} stores "
                f"{optimizer.n_states} state(s) per element: use size_factor="
                f"{optimizer.required_size_factor()} (line_size >= {need})"
            )

    def apply_gradients(self, optimizer, step: int) -> int:
        """Update every row that received a gradient since the last step; returns rows updated."""
        if not self._pending:
            return 0
        if len(self._pending) == 1:
            lookup, grads = self._pending[0]
            keys, lines, found = lookup.unique_keys, lookup.lines, lookup.found
        else:
            keys, lines, found, grads = self._merge_pending()
        self._pending.clear()
        e = self.embedding_dim
        states = [lines[:, e * (i + 1) : e * (i + 2)] for i in range(optimizer.n_states)]
        if not found.all():
            new = ~found
            for s, init in zip(states, optimizer.initial_state()):
                s[new] = init
        optimizer.update(lines[:, :e], states, grads, step)
        self._chain.put(keys, lines)
        return keys.shape[0]

    def _merge_pending(self):
        """Several backward calls before one step: sum gradients of the same key."""
        keys = np.concatenate([lk.unique_keys for lk, _ in self._pending])
        uniq, inverse = unique_ids(keys)
        first = first_occurrence(inverse, uniq.shape[0])
        lines = np.concatenate([lk.lines for lk, _ in self._pending])[first]
        found = np.concatenate([lk.found for lk, _ in self._pending])[first]
        grads = segment_sum(np.concatenate([g for _, g in self._pending]), inverse, uniq.shape[0])
        return uniq, lines, found, grads

    # ---------------------------------------------------------------- snapshots
    def _manifest_fields(self) -> dict:
        return {
            "key_type": self.key_type.name,
            "embedding_dims": list(self.column_dims),
            "line_size": self.line_size,
            "engine": self._chain.bottom.name,
        }

    def _require_path(self, what: str) -> SnapshotDirectory:
        if self._snapshots is None:
            raise SnapshotError(f"{what} needs a persistent_path in the store options")
        return self._snapshots

    def save_snapshot(self, name: str) -> None:
        """Flush every cache level down, then record the table under snapshots/<name>/.

        Durable when it returns; a crash midway leaves the previous snapshot of that name.
        """
        snaps = self._require_path("save_snapshot")
        self._chain.flush()
        fields = {**self._manifest_fields(), "embedding_name": self.name,
                  "row_count": len(self._chain.bottom), "store_kind": self.store_options.kind,
                  "store_stats": self._chain.stats()}
        snaps.save(name, self._chain.bottom.save_snapshot, fields)

    def load_snapshot(self, name: str) -> None:
        """Clear the caches and restore exactly the state saved under ``name``."""
        snaps = self._require_path("load_snapshot")
        folder, _ = snaps.open(name, self._manifest_fields())
        self._pending.clear()
        self._last = None
        self._chain.clear_caches()
        self._chain.bottom.load_snapshot(folder)

    def snapshot_names(self) -> list[str]:
        return self._require_path("snapshot_names").names()

    # ---------------------------------------------------------------- inspection / lifetime
    def store_stats(self) -> list[dict]:
        """Per tier, top first: rows, hits, misses, evictions, writes, memory and disk bytes."""
        return self._chain.stats()

    def __len__(self) -> int:
        """Keys stored. Flushes the cache levels first: a new key may so far live only in a cache."""
        self._chain.flush()
        return len(self._chain)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored (keys (n,) uint64 sorted, lines (n, line_size) float32), after a flush."""
        self._chain.flush()
        parts = list(self._chain.bottom.export_batches())
        if not parts:
            return np.empty(0, np.uint64), np.empty((0, self.line_size), np.float32)
        keys = np.concatenate([k for k, _ in parts])
        lines = np.concatenate([v for _, v in parts])
        order = np.argsort(keys, kind="stable")
        return keys[order], lines[order]

    def close(self) -> None:
        if getattr(self, "_chain", None) is not None:
            self._chain.close()
            self._chain = None
        if getattr(self, "_lock", None) is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class MultiTableEmbedding(MultiTableMultiColumnEmbedding):
    """Many tables, one key space, one column: ``embedding_dim`` is an int."""

    def __init__(self, name, embedding_dim: int, dtype, key_type, tables, store_options,
                 default_initializer=None, padding_idx=None, seed=0, **kwargs):
        if not isinstance(embedding_dim, (int, np.integer)):
            raise ConfigError(
                f"MultiTableEmbedding takes one embedding_dim, got {embedding_dim!r}: "
                "use MultiTableMultiColumnEmbedding for several columns"
            )
        super().__init__(name, embedding_dim, dtype, key_type, tables, store_options,
                         default_initializer, padding_idx, seed, **kwargs)
