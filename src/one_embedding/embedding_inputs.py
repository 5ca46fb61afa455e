"""The embedding front end's checks of what a user passes: key types, table options, padding,
ids and table ids, each refused with a message that names the value and the fix.

``EmbeddingInputs`` is a mixin of ``embedding.MultiTableMultiColumnEmbedding``: its methods read
the embedding's ``key_type`` (numpy dtype), ``tables``, ``column_dims`` and work on numpy or
CuPy arrays (``xp``); on the device path a range check is one counted host read
(``host_sync``), none where the ids' dtype fits the key type.
"""
from __future__ import annotations

import numpy as np

from . import host_sync
from .backend import as_array, to_numpy
from .errors import ConfigError, InputError
from .options import (DEFAULT_INITIALIZER, TableOptions, check_initializer, make_table_options,
                      whole_number)

_KEY_TYPES = {
    "int32": np.int32, "int64": np.int64, "uint32": np.uint32, "uint64": np.uint64,
}


def dtype_name(dtype) -> str:
    """The name of a dtype: numpy dtypes, strings, and framework dtypes such as torch.float32."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).rsplit(".", 1)[-1]


def resolve_key_type(key_type) -> np.dtype:
    """The numpy dtype of a key type (int32, int64, uint32, uint64; any spelling dtype_name
    reads), or ConfigError."""
    name = dtype_name(key_type)
    if name not in _KEY_TYPES:
        raise ConfigError(f"key_type={key_type!r} is not supported: use one of {sorted(_KEY_TYPES)}")
    return np.dtype(_KEY_TYPES[name])


def keys_as_uint64(ids: np.ndarray, key_type: np.dtype) -> np.ndarray:
    """Internal key: the raw id's bits as uint64; 32-bit keys are zero-extended."""
    ids = ids.astype(key_type, copy=False)
    if key_type.itemsize == 4:
        return ids.view(np.uint32).astype(np.uint64)
    return ids.view(np.uint64)


class EmbeddingInputs:
    """The checks of ``MultiTableMultiColumnEmbedding``'s configuration and inputs."""

    # ---------------------------------------------------------------- configuration checks
    def _check_tables(self, tables, default_initializer) -> tuple[TableOptions, ...]:
        if tables is None:
            init = check_initializer(default_initializer or DEFAULT_INITIALIZER, "default_initializer")
            tables = [make_table_options([init] * len(self.column_dims))]
        if isinstance(tables, TableOptions) or not hasattr(tables, "__iter__"):
            raise ConfigError(
                f"tables={tables!r} is not a list of tables: pass a list with one "
                "make_table_options(...) per table, e.g. tables=[make_table_options(init)]"
            )
        tables = tuple(tables)
        if not tables:
            raise ConfigError("tables is empty: give at least one make_table_options(...)")
        n_columns = len(self.column_dims)
        for i, t in enumerate(tables):
            if not isinstance(t, TableOptions):
                raise ConfigError(f"tables[{i}]={t!r}: build tables with make_table_options(...)")
        # a table of one initializer initialises every column with it, as OneFlow's does
        tables = tuple(make_table_options([t.columns[0].initializer] * n_columns)
                       if len(t.columns) == 1 and n_columns > 1 else t for t in tables)
        for i, t in enumerate(tables):
            if len(t.columns) != n_columns:
                raise ConfigError(
                    f"tables[{i}] has {len(t.columns)} column(s) but embedding_dim="
                    f"{list(self.column_dims)} has {len(self.column_dims)}: give one "
                    "make_column_options per column"
                )
        return tables

    def _check_padding(self, padding_idx) -> int:
        info = np.iinfo(self.key_type)
        if not whole_number(padding_idx) or not info.min <= padding_idx <= info.max:
            raise ConfigError(f"padding_idx={padding_idx!r} is not a valid {self.key_type.name} key: "
                              f"pass an integer in [{info.min}, {info.max}] (or None)")
        return int(padding_idx)

    # ---------------------------------------------------------------- input validation
    def _check_finite_grad(self, grad, keep) -> None:
        """InputError naming the first inf / NaN of ``grad`` ((n, E) float32, the kept rows of a
        backward's grad_out; keep: (rows,) bool of the non-padding rows, or None): read at once
        (the table unchanged), or on the device path at the next metrics read, before any
        checkpoint is written. The row named is grad_out's own, padding rows counted."""
        if grad.size == 0:   # no row (an all-padding batch): nothing to check, and no argmax
            return
        xp = self.xp
        bad = ~xp.isfinite(grad)
        width = self.embedding_dim

        def first_bad():
            at = xp.argmax(bad.ravel())
            return at, grad.ravel()[at]

        def row(at) -> int:   # read only when the check failed
            kept = int(at) // width
            return kept if keep is None else int(np.flatnonzero(to_numpy(keep))[kept])

        after = "the table is unchanged" if host_sync.deferred_checks() is None else \
            "the run stops before its next checkpoint"
        host_sync.check(bad.any(), lambda at, value: (
            f"grad_out holds a non-finite value ({value}) at row {row(at)}: {after}; "
            "check the loss (e.g. lower the learning rate)"),
            "embedding: gradient check", details=first_bad)

    def _validate_ids(self, ids, xp=np) -> np.ndarray:
        ids = as_array(xp, ids, "ids")
        if ids.dtype.kind not in "iu":
            raise InputError(
                f"ids have dtype {ids.dtype}; ids must be integers: cast them to {self.key_type.name}"
            )
        if ids.ndim == 0:
            raise InputError("ids is a scalar: pass an array of ids, e.g. shape (B,) or (B, F)")
        if ids.size and not np.can_cast(ids.dtype, self.key_type, "safe"):
            # the dtype may hold ids the key type cannot: two reads (none for fitting dtypes)
            lo = int(host_sync.scalar(ids.min(), "embedding: id range check"))
            hi = int(host_sync.scalar(ids.max(), "embedding: id range check"))
            info = np.iinfo(self.key_type)
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                hint = ("negative ids need a signed key_type" if bad < 0 and info.min == 0
                        else "use a wider key_type")
                raise InputError(
                    f"id {bad} does not fit key_type={self.key_type.name} "
                    f"[{info.min}, {info.max}]: {hint}"
                )
        return ids

    def _resolve_table_ids(self, ids: np.ndarray, table_ids, xp=np) -> np.ndarray:
        n_tables = len(self.tables)
        if table_ids is None:
            if n_tables == 1:
                return xp.zeros(ids.shape, xp.int32)
            if ids.ndim >= 1 and ids.shape[-1] == n_tables:
                return xp.broadcast_to(xp.arange(n_tables, dtype=xp.int32), ids.shape)
            raise InputError(
                f"ids of shape {ids.shape} with {n_tables} tables and no table_ids: give ids of "
                f"shape (..., {n_tables}) (column j = table j) or pass table_ids"
            )
        table_ids = (to_numpy(table_ids, "table_ids") if xp is np
                     else as_array(xp, table_ids, "table_ids"))
        if table_ids.dtype.kind not in "iu":
            raise InputError(f"table_ids have dtype {table_ids.dtype}; they must be integers")
        try:
            table_ids = xp.broadcast_to(table_ids, ids.shape)
        except ValueError:
            raise InputError(
                f"table_ids of shape {table_ids.shape} do not broadcast to ids of shape {ids.shape}"
            ) from None
        if table_ids.size and host_sync.flag((table_ids.min() < 0) | (table_ids.max() >= n_tables),
                                             "embedding: table id range check"):
            bad = int(table_ids.max()) if table_ids.max() >= n_tables else int(table_ids.min())
            raise InputError(
                f"table id {bad} is out of range: this embedding has {n_tables} tables "
                f"(valid ids 0..{n_tables - 1})"
            )
        return table_ids.astype(np.int32, copy=False)
