"""What one stored line holds (``LineLayout``) and what one step in flight holds (``StepState``).

A line is ``[column_0 | column_1 | ... | state_1 | state_2 | ... | unused]`` in float32: the
embedding columns (``E = sum(column_dims)`` floats) followed by the row optimizer's states, one
block of E floats each (REFERENCE.md "Line = embedding + optimizer state"). ``line_size`` comes
from the store options: ``size_factor * E``, or ``storage_dim`` when given. ``LineLayout`` is the
one place that derives and checks it. With eviction on (``store_options.lifecycle``), the tiers
hold ``stored_size = line_size + 2`` floats: the lifecycle's last-seen step and frequency follow
the line (``lifecycle.py``).

A ``StepState`` is created by the front end's ``prepare`` (ID shuffle + owner lookup), read by
``embed`` (rows out), ``backward`` (gradients in) and the optimizer step (row update + put).
Several may be alive at once: a prefetch prepares step i+1 while step i computes.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError


@dataclass(frozen=True)
class LineLayout:
    """column_dims: embedding columns (E = their sum); line_size: floats per stored line;
    setting: the store option that fixed line_size, e.g. "size_factor=2", for messages."""

    column_dims: tuple[int, ...]
    line_size: int
    setting: str
    #: floats stored behind the line for the feature lifecycle (``lifecycle.META_COLUMNS``
    #: when rows can be evicted, else 0): tiers and snapshots hold ``stored_size`` floats
    meta_size: int = 0

    @classmethod
    def from_store_options(cls, column_dims, store_options) -> "LineLayout":
        dims = tuple(int(d) for d in column_dims)
        e = sum(dims)
        if store_options.storage_dim != -1:
            line_size, setting = int(store_options.storage_dim), f"storage_dim={store_options.storage_dim}"
            if line_size < e:
                raise ConfigError(
                    f"storage_dim={store_options.storage_dim} is smaller than embedding_dim={e}: "
                    "use storage_dim=-1 and size_factor instead"
                )
        else:
            line_size = int(store_options.size_factor) * e
            setting = f"size_factor={store_options.size_factor}"
        lifecycle = getattr(store_options, "lifecycle", None)
        return cls(dims, line_size, setting, 2 if lifecycle is not None and lifecycle.evicts else 0)

    @property
    def stored_size(self) -> int:
        """Floats per line as the tiers hold it: the line, then the lifecycle's columns."""
        return self.line_size + self.meta_size

    @property
    def embedding_dim(self) -> int:
        return sum(self.column_dims)

    @property
    def columns(self) -> tuple[tuple[int, int], ...]:
        """(offset, dim) of each embedding column within the line."""
        offsets = np.cumsum((0,) + self.column_dims[:-1])
        return tuple((int(o), d) for o, d in zip(offsets, self.column_dims))

    def embedding(self, lines: np.ndarray) -> np.ndarray:
        """lines: (n, line_size) -> the embedding columns, a (n, E) view."""
        return lines[:, : self.embedding_dim]

    def states(self, lines: np.ndarray, n_states: int) -> list[np.ndarray]:
        """lines: (n, line_size) -> ``n_states`` (n, E) views, in line order."""
        e = self.embedding_dim
        return [lines[:, e * (i + 1): e * (i + 2)] for i in range(n_states)]

    def require(self, optimizer) -> None:
        """Raise ConfigError when the line cannot hold the optimizer's state (OneFlow only
        catches this deep inside a kernel)."""
        need = optimizer.required_storage_dim(self.embedding_dim)
        if self.line_size >= need:
            return
        name = type(optimizer).__name__
        if optimizer.row_columns:
            per_row = ", ".join(optimizer.row_columns)
            raise ConfigError(
                f"{self.setting} gives line_size={self.line_size} but {name} stores "
                f"{optimizer.n_states} state(s) per element and its {per_row} per row (an "
                f"aligned int64): use storage_dim={need} (OneFlow's line)")
        raise ConfigError(
            f"{self.setting} gives line_size={self.line_size} but {name} stores "
            f"{optimizer.n_states} state(s) per element: use size_factor="
            f"{optimizer.required_size_factor()} (line_size >= {need})")

    def row_column(self, lines: np.ndarray, optimizer, index: int = 0) -> np.ndarray | None:
        """lines: (n, line_size) -> the (n, 2) float32 view of the optimizer's per-row int64
        column ``index`` (its two little-endian words), or None when it keeps none."""
        if index >= len(optimizer.row_columns):
            return None
        start = optimizer.row_column_offset(self.embedding_dim) + 2 * index
        return lines[:, start:start + 2]

    def reset_states(self, lines: np.ndarray, rows: np.ndarray, optimizer) -> None:
        """State columns of ``lines[rows]`` (rows: (m,) bool or int64) to the optimizer's initial
        values, and its per-row columns to 0 (a key's state starts there the first time the
        optimizer updates it)."""
        for state, value in zip(self.states(lines, optimizer.n_states), optimizer.initial_state()):
            state[rows] = value
        for index in range(len(optimizer.row_columns)):
            self.row_column(lines, optimizer, index)[rows] = 0

    def reset_states_where(self, xp, lines, missing, optimizer) -> None:
        """``reset_states`` of the rows where ``missing`` ((m,) bool) is True, by a select on
        every state column (no index compaction: nothing is read back on a device); the other
        rows keep their bits."""
        keep = ~missing[:, None]
        for state, value in zip(self.states(lines, optimizer.n_states), optimizer.initial_state()):
            state[...] = xp.where(keep, state, state.dtype.type(value))
        for index in range(len(optimizer.row_columns)):
            column = self.row_column(lines, optimizer, index)
            column[...] = xp.where(keep.reshape(keep.shape[:1] + (1,) * (column.ndim - 1)),
                                   column, column.dtype.type(0))

    def state_blocks(self, optimizer) -> list[tuple[int, int, float]]:
        """(start column, width, initial value) of each block ``reset_states`` sets: the
        optimizer's states, then its per-row columns (0)."""
        e = self.embedding_dim
        blocks = [(e * (i + 1), e, float(value))
                  for i, value in enumerate(optimizer.initial_state()[:optimizer.n_states])]
        return blocks + [(optimizer.row_column_offset(e) + 2 * index, 2, 0.0)
                         for index in range(len(optimizer.row_columns))]

    def manifest_fields(self) -> dict:
        return {"embedding_dims": list(self.column_dims), "line_size": self.line_size}


@dataclass
class OwnerRows:
    """The owner's side of a step: the keys this rank owns and their lines.

    keys: (v,) uint64 unique; table_ids: (v,) int32; lines: (v, line_size) float32, as found
    or freshly initialised; found: (v,) bool, the key was stored when read; version: the shard's
    write count the lines are current with (a put after it may have to be patched in); generation:
    the shard's load count (a snapshot load after the lookup invalidates the lines).
    """

    keys: np.ndarray
    table_ids: np.ndarray
    lines: np.ndarray
    found: np.ndarray
    version: int
    generation: int
    #: None, or the (1,) int64 device count of a fixed-capacity batch: the arrays hold more
    #: entries (placeholders from ``live`` on, found, never updated or stored)
    live: object = None
    _finalizer: object = field(default=None, repr=False, compare=False)

    def on_release(self, callback, *args) -> None:
        """Run ``callback(*args)`` once, when ``release`` is called or the rows are collected."""
        self._finalizer = weakref.finalize(self, callback, *args)

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    @property
    def holds_log(self) -> bool:
        """True until released: the shard keeps every put made since this lookup."""
        return self._finalizer is not None and self._finalizer.alive


@dataclass
class StepState:
    """One step in flight, from its ids to its row update.

    ids_shape: the shape of the ids as given; keep: (n,) bool non-padding positions, or None when
    there is no padding; exchange: the step's ``parallel.IdExchange``; owner: this rank's
    ``OwnerRows``; grads: (v, E) float32 per owned key after the gradient shuffle (set by
    backward); on_gpu: the ids came as a CuPy array (the output goes back as one).
    """

    ids_shape: tuple
    keep: np.ndarray | None
    exchange: object
    owner: OwnerRows
    grads: np.ndarray | None = None
    on_gpu: bool = False
