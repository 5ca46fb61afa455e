"""The owner of one rank's rows: tier chain, lookup with init on miss, row update + put,
snapshots (``shard_snapshots``), the path LOCK.

The front end reaches a shard only through the shuffles: it hands over the keys this rank owns
(de-duplicated) and gets their lines back; after backward it hands over one gradient per key.

Reads that run ahead of writes (prefetch): ``lookup`` may run on a background thread while the
main thread still computes, and updates, an earlier step. Such a read can miss a put that comes
after it, so every lookup records the shard's write ``version``; ``refresh`` (called by the
front end right before the rows are used) patches in every line put since, newest last, from a
short write log. The log only holds puts that an outstanding lookup has not seen, so a serial
loop (lookup, use, put, lookup, ...) logs nothing. The rows a step uses are therefore exactly
those a lookup made at that moment would return: prefetching changes no result.

On a GPU (``launch``, a device launcher of ``kernels.device_ops``) the chain's top tiers live in
device memory and keys, lines, gradients and the write log are device arrays; initial values,
the row update and the log patch run as device kernels (``device_ops``: init, fused optimizer;
the patch through a device hash index of each put's keys, ``write_log``). The chain is the
only place rows cross to the host tiers. Results equal the numpy path's (initial values within 1
float32 ulp).
"""
from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np

from .chain import build_chain
from .errors import ConfigError, InputError
from .initializers import fill_initial_values
from . import host_sync
from .kernels import device_init, device_ops, device_unique, fused_update, live_rows
from .lifecycle import Lifecycle, StepPlan, check_step
from .options import LifecycleOptions
from .parallel.unique import first_occurrence, segment_sum, unique_ids
from .step import LineLayout, OwnerRows
from .store.lock import PathLock
from .shard_snapshots import ShardSnapshots
from .store.snapshots import SnapshotDirectory
from .write_log import patch_rows as _patch
from .write_log import RetiredEntries
from .write_log import patch_rows_on_device as _patch_on_device

#: Lines kept in the write log before the oldest entries are dropped; a lookup older than the
#: log is read again in full by ``refresh`` (slower, never stale).
MAX_LOGGED_LINES = 1 << 22


def rank_path(path, rank: int, world: int, kind: str) -> str | None:
    """This rank's folder: ``<path>/<rank zero-padded to len(str(world))>-<world>`` (OneFlow's
    layout), or ``path[rank]`` when ``path`` lists one folder per rank."""
    if path is None or path == "":
        if kind == "cached_ssd":
            raise ConfigError("cached_ssd needs a persistent_path")
        return None
    if isinstance(path, (list, tuple)):
        if len(path) != world:
            raise ConfigError(f"persistent_path lists {len(path)} paths for world={world}")
        return os.fspath(path[rank])
    width = len(str(world))
    return os.path.join(os.fspath(path), f"{rank:0{width}d}-{world}")


class EmbeddingShard(ShardSnapshots):
    """The keys rank ``rank`` of ``world`` owns, in the tier chain of ``store_options``.

    layout: the ``LineLayout``; tables: one ``TableOptions`` per table (their column
    initializers give a new key its first value); seed: the initializer seed.
    """

    def __init__(self, name: str, layout: LineLayout, tables, seed: int, store_options,
                 rank: int = 0, world: int = 1, launch=None):
        self.name = name
        #: the device launcher (None: the numpy path) and the module of keys and lines
        self.launch = launch
        self.xp = launch.xp if launch is not None else np
        self.layout = layout
        self.tables = tuple(tables)
        self.seed = int(seed)
        self.store_options = store_options
        self.rank, self.world = int(rank), int(world)
        self.path = rank_path(store_options.persistent_path, rank, world, store_options.kind)
        self._lock = PathLock(self.path) if self.path else None
        self._snapshots = None
        self._chain = None
        self._init_spec = None  # the tables' initializers on the device (built at first use)
        self._new_rows_on_device = None  # 0-d count of rows stored since the last settle
        if self.path:
            self._snapshots = SnapshotDirectory(self.path)
            self._snapshots.recover()
        self._chain = build_chain(store_options, layout.stored_size, layout.embedding_dim,
                                  self.path, world, launch)
        #: admission, eviction and their counters (the defaults: every key stored at first
        #: sight, kept for ever)
        self._lifecycle = Lifecycle(store_options.lifecycle or LifecycleOptions(),
                                    layout.line_size, world)
        self._rows = len(self._chain)  # rows stored, kept by the puts and sweeps
        self._state = threading.Lock()  # version, generation, log, outstanding
        self._version = 0  # puts so far
        self._generation = 0  # snapshot loads so far
        # (version, keys, lines or None: erased, live count of a fixed-capacity put or None)
        self._log: list[tuple] = []
        self._log_floor = 0  # puts at or below this version may be missing from the log
        # entries dropped from the log while the device may still read them (GPU streams)
        self._retired = RetiredEntries(self.launch)
        self._outstanding: Counter = Counter()  # version -> lookups not yet refreshed
        self._optimizer: dict | None = None  # the row optimizer whose state the lines hold
        self._loaded_optimizer: dict | None = None  # ... as the last loaded snapshot records it

    # ---------------------------------------------------------------- reads
    @property
    def takes_live_counts(self) -> bool:
        """True when ``lookup`` takes fixed-capacity batches (``live``): one device store holds
        every line (device_mem on a GPU) and no admission rule needs the keys on the host."""
        return self._chain.takes_live_counts and self._lifecycle.sketch is None

    def lookup(self, keys: np.ndarray, table_ids: np.ndarray, live=None) -> OwnerRows:
        """keys: (v,) uint64 unique owned by this rank; table_ids: (v,) int32 -> their lines.

        A key stored nowhere gets its deterministic initial value (nothing is stored: a key is
        created by the first optimizer step that updates it). Safe to call from a background
        thread; ``refresh`` the result before using it if puts may have happened since.
        live: where ``takes_live_counts``, the (1,) int64 device count of a fixed-capacity batch
        (``device_unique.unique_ids_fixed``): only the first ``live`` keys are real, the others
        come back found (never initialised, updated or stored) and the rows carry the count.
        """
        with self._state:
            version, generation = self._version, self._generation
            self._outstanding[version] += 1
        # outside the state lock, so that a prefetched lookup's disk reads do not hold up the
        # main thread's refresh: the chain's own lock makes the lookup atomic against a put, and
        # every put after ``version`` is logged, so refresh patches in whatever it missed
        # (re-applying a put it already saw changes nothing)
        lines, found = self._chain.lookup(keys) if live is None else \
            self._chain.lookup(keys, live=live)
        if self.launch is not None:         # no read: a masked init kernel
            self._initialize_on_device(lines, ~found, keys, table_ids)
        elif not found.all():
            self._initialize(lines, ~found, keys, table_ids)
        rows = OwnerRows(keys, table_ids, lines, found, version, generation, live=live)
        rows.on_release(self._release, version)
        return rows

    def lookup_ids(self, keys, table_ids):
        """The one-rank device_mem lookup with the dedup fused in (where ``takes_live_counts``):
        keys: (n,) uint64 with repeats, table_ids: (n,) int32, device arrays -> (``FixedUnique``
        of the keys, unique table ids (n,) int32, ``OwnerRows`` of the unique keys with their
        count as ``live``): what ``device_unique.unique_ids_fixed`` and then ``lookup(fixed.keys,
        table_ids[fixed.first], live=fixed.count)`` give, bit for bit.

        The dedup's passes that read no store run first, outside every lock; its output pass,
        which probes the store's index for each unique key as it writes it, runs after this
        lookup's write version is recorded and under the chain's lock. So a put that grows or
        rehashes the index comes either before the probe (which then reads the new table) or
        after the recorded version (logged, and patched in by ``refresh``), never in between:
        the rows are those a ``lookup`` at that moment would return, as with prefetch today."""
        passes = device_unique.dedup_passes_fixed(keys, self.launch)
        with self._state:
            version, generation = self._version, self._generation
            self._outstanding[version] += 1
        fixed, lines, found = self._chain.lookup_deduped(passes)
        table_ids = table_ids[fixed.first].astype(self.xp.int32)
        self._initialize_on_device(lines, ~found, fixed.keys, table_ids)
        rows = OwnerRows(fixed.keys, table_ids, lines, found, version, generation,
                         live=fixed.count)
        rows.on_release(self._release, version)
        return fixed, table_ids, rows

    def refresh(self, rows: OwnerRows) -> None:
        """Make ``rows`` current: patch in every line put since the lookup (in put order), or read
        everything again when the log no longer reaches back that far or a snapshot was loaded.
        Releases the rows' hold on the write log."""
        with self._state:
            stale = (rows.generation != self._generation or rows.version < self._log_floor
                     or not rows.holds_log)
            if stale:
                lines, found = self._chain.lookup(rows.keys) if rows.live is None else \
                    self._chain.lookup(rows.keys, live=rows.live)
                rows.lines[...] = lines
                rows.found[...] = found
                missing = ~found
            else:
                missing = None
                newer = [(k, v, live) for version, k, v, live in self._log
                         if version > rows.version]
                if newer and self.launch is not None:
                    missing = _patch_on_device(self.xp, rows, newer, self.launch)
                    self._retired.read()    # the patch's reads of the entries are queued
                elif newer:
                    missing = _patch(rows, [(k, v) for k, v, _ in newer])
            rows.version, rows.generation = self._version, self._generation
        if missing is not None and (self.launch is not None or missing.any()):
            self._initialize(rows.lines, missing, rows.keys, rows.table_ids)
        rows.release()

    def _release(self, version: int) -> None:
        with self._state:
            self._outstanding[version] -= 1
            if self._outstanding[version] <= 0:
                del self._outstanding[version]
            self._trim_log()

    def _trim_log(self) -> None:
        """Drop log entries every outstanding lookup has seen (caller holds ``_state``)."""
        oldest = min(self._outstanding, default=self._version)
        self._retired.retire([e for e in self._log if e[0] <= oldest])
        self._log = [e for e in self._log if e[0] > oldest]

    def _initialize(self, lines, missing, keys, table_ids) -> None:
        """Initial embedding values into ``lines[missing]``; state (and lifecycle) columns start
        at 0 and get the optimizer's initial values when the optimizer first updates the row."""
        if self.launch is not None:
            return self._initialize_on_device(lines, missing, keys, table_ids)
        idx = np.flatnonzero(missing)
        e = self.layout.embedding_dim
        lines[idx, e:] = 0.0
        miss_tables = table_ids[idx]
        for t in np.unique(miss_tables):
            rows = idx[miss_tables == t]
            for (offset, dim), col_opt in zip(self.layout.columns, self.tables[t].columns):
                fill_initial_values(lines, rows, keys[rows], col_opt.initializer, self.seed,
                                    offset, dim, offset)

    def _initialize_on_device(self, lines, missing, keys, table_ids) -> None:
        """``_initialize`` on device arrays, in one launch and without a read: every row where
        ``missing`` is True gets its table's initial values (``device_init.init_missing``). The
        values depend on the key only (the counter hash), so they equal the CPU path's bit for
        bit."""
        if keys.shape[0] == 0:
            return
        if self._init_spec is None:
            self._init_spec = device_init.init_spec(
                self.layout.columns, [[c.initializer for c in t.columns] for t in self.tables],
                self.launch)
        device_init.init_missing(lines, missing, table_ids, keys, self._init_spec, self.seed,
                                self.launch)

    # ---------------------------------------------------------------- writes
    def update(self, keys: np.ndarray, lines: np.ndarray, found: np.ndarray, grads: np.ndarray,
               optimizer, step: int) -> int:
        """``stage_update`` then ``put``; returns the number of rows updated."""
        return self.put(*self.stage_update(keys, lines, found, grads, optimizer, step))

    def stage_update(self, keys: np.ndarray, lines: np.ndarray, found: np.ndarray,
                     grads: np.ndarray, optimizer, step: int, live=None):
        """Apply the row optimizer to ``lines``, nothing stored yet. keys: (v,) uint64 unique;
        lines: (v, stored_size) float32, current (refreshed); found: (v,) bool (a new key's state
        starts at the optimizer's initial values); grads: (v, E) float32, or on the device a
        ``fused_update.SummedGradients`` of v keys (summed inside the update kernel).

        With admission, the rows of keys not admitted yet are left out (their gradient is
        dropped); with eviction, the lifecycle columns record ``step``. Returns (keys, lines,
        plan) for ``put`` (the lines updated in place when no row was left out). Raises
        InputError, storing nothing, when the update made a line non-finite.

        live: the (1,) int64 device count of a fixed-capacity batch (``lookup``'s): rows from
        ``live`` on are neither updated nor checked, and ``put`` stores only the first ``live``
        (the plan carries the count)."""
        if live is not None and not self.takes_live_counts:
            raise InputError("a fixed-capacity update (live count) needs device_mem on a GPU "
                             "without admission")
        keys, lines, found, grads, plan = self._admit(keys, lines, found, grads, step)
        plan.live = live
        if self.launch is not None:
            self._stage_on_device(keys, lines, found, grads, optimizer, step, live)
        else:
            self._stage(keys, lines, found, grads, optimizer, step)
        self._lifecycle.touch(self.xp, lines, step)
        return keys, lines, plan

    def _admit(self, keys, lines, found, grads, step: int):
        """The admission rule on a step's rows -> (keys, lines, found, grads) of the rows to
        update, and the step's ``StepPlan``."""
        xp, lifecycle = self.xp, self._lifecycle
        if lifecycle.sketch is None:  # every key admitted: only the new rows are counted
            if lifecycle.meta is not None:
                check_step(step)
            # on the device a 0-d count, read when the rows are counted (``_settle_rows``)
            new_rows = xp.asarray(xp.count_nonzero(~found)) if self.launch is not None \
                else int(np.count_nonzero(~found))
            return keys, lines, found, grads, StepPlan(step, new_rows)
        to_host = self.launch.to_host if self.launch is not None else np.asarray
        keep, plan = lifecycle.admit(to_host(keys), to_host(~found), step)
        grads = fused_update.materialized(grads)   # rows left out index the sums
        if not keep.all():
            idx = np.flatnonzero(keep)
            if self.launch is not None:
                idx = self.launch.to_device(idx)
            keys, lines, found, grads = keys[idx], lines[idx], found[idx], grads[idx]
        return keys, lines, found, grads, plan

    def _stage(self, keys, lines, found, grads, optimizer, step: int) -> None:
        grads = fused_update.materialized(grads)
        if not found.all():
            self.layout.reset_states(lines, ~found, optimizer)
        layout = self.layout
        optimizer.update(layout.embedding(lines), layout.states(lines, optimizer.n_states), grads,
                         step, last_step=layout.row_column(lines, optimizer))
        _check_finite_rows(np, keys, lines, grads, optimizer, step)

    def _stage_on_device(self, keys, lines, found, grads, optimizer, step: int, live=None):
        """``stage_update`` on device arrays: one fused optimizer kernel over the whole lines
        (bit-identical to the numpy update; see ``device_ops.update_lines``), which sums the
        backward's rows per key itself when ``grads`` is a ``SummedGradients`` (and then skips
        the rows from ``live`` on)."""
        xp = self.xp
        if live is None:   # no read: a select
            self.layout.reset_states_where(xp, lines, ~found, optimizer)
        else:              # no read, and the rows past ``live`` not even read
            live_rows.fill_missing(lines, found, live, self.layout.state_blocks(optimizer),
                                   self.launch)
        if isinstance(grads, fused_update.SummedGradients):
            bad = fused_update.update_lines_summed(optimizer, lines, grads, step, live)
        else:
            bad = device_ops.update_lines(optimizer, lines, grads, step, self.launch, live)
        _check_finite_rows(xp, keys, lines, grads, optimizer, step, bad)

    def put(self, keys: np.ndarray, lines: np.ndarray, plan: StepPlan | None = None) -> int:
        """Store updated lines (v, stored_size) of keys (v,) uint64; returns v. ``plan`` (from
        ``stage_update``): the step's lifecycle decisions, recorded now, and the eviction sweep
        when one is due after this step. With a fixed-capacity batch (the plan's ``live``
        count) only the first ``live`` lines are stored and the count returned stays on the
        device ((1,) int64)."""
        live = getattr(plan, "live", None)
        self._put(keys, lines, live)
        if plan is not None:
            if not isinstance(plan.new_rows, (int, np.integer)):   # a device count
                pending = self._new_rows_on_device
                self._new_rows_on_device = plan.new_rows if pending is None else \
                    pending + plan.new_rows
                plan.new_rows = 0
                if self._lifecycle.max_rows:  # the row limit needs the count now
                    self._settle_rows()
            self._lifecycle.commit(plan)
            self._rows += plan.new_rows
            if self._lifecycle.sweep_due(plan.step, self._rows):
                self._sweep(plan.step)
        return keys.shape[0] if live is None else live

    def _settle_rows(self) -> None:
        """Add the new rows counted on the device since the last settle to the row count and the
        lifecycle's counters (one read, counted); nothing to do on the numpy path."""
        pending, self._new_rows_on_device = self._new_rows_on_device, None
        if pending is not None:
            new_rows = int(host_sync.scalar(pending, "update: new row count"))
            self._lifecycle.counters.admitted_rows += new_rows
            self._rows += new_rows

    def _sweep(self, step: int) -> None:
        """Evict what the lifecycle's rules select at ``step`` from every tier, then reclaim the
        disk no snapshot needs. Lookups made before (prefetched) see the rows gone at refresh."""
        self._settle_rows()
        lifecycle = self._lifecycle
        meta = slice(lifecycle.meta, lifecycle.meta + 2)

        def read():
            for keys, lines in self._chain.export_batches():
                yield keys, lines[:, meta]

        with self._state:
            keys, by_ttl, by_rows, total = lifecycle.select(read, step)
            lifecycle.record_sweep(by_ttl, by_rows)
            self._rows = total
            if keys.shape[0]:
                self._version += 1
                if self._outstanding and min(self._outstanding) < self._version:
                    self._log.append((self._version, keys, None, None))  # None: erased
                self._rows -= self._chain.erase(keys)
                self._chain.collect_garbage()

    def _put(self, keys: np.ndarray, lines: np.ndarray, live=None) -> None:
        with self._state:
            self._version += 1
            if self._outstanding and min(self._outstanding) < self._version:
                # a fixed-capacity put logs its n entries (a bound of the live ones)
                self._log.append((self._version, keys, lines, live))
                logged = sum(e[1].shape[0] for e in self._log)
                while logged > MAX_LOGGED_LINES and len(self._log) > 1:
                    dropped = self._log.pop(0)
                    self._retired.retire([dropped])
                    logged -= dropped[1].shape[0]
                    self._log_floor = dropped[0]  # lookups older than this read everything again
            if live is None:
                self._chain.put(keys, lines)
            else:
                self._chain.put(keys, lines, live=live)

    def merge(self, parts: list[tuple[OwnerRows, np.ndarray]]) -> tuple[np.ndarray, np.ndarray,
                                                                      np.ndarray, np.ndarray]:
        """Several backward calls before one step: (keys, lines, found, grads) with the gradients
        of the same key summed (in call order) and its first lines."""
        xp, launch = self.xp, self.launch
        parts = [_live_part(r, g) for r, g in parts]
        keys = xp.concatenate([r.keys for r, _ in parts])
        uniq, inverse = unique_ids(keys, launch)
        first = first_occurrence(inverse, uniq.shape[0], launch)
        lines = xp.concatenate([r.lines for r, _ in parts])[first]
        found = xp.concatenate([r.found for r, _ in parts])[first]
        grads = segment_sum(xp.concatenate([g for _, g in parts]), inverse, uniq.shape[0], launch)
        return uniq, lines, found, grads

    # ---------------------------------------------------------------- inspection / lifetime
    def stats(self) -> list[dict]:
        """The chain's per-tier stats; the bottom tier's entry (the table) also holds the
        lifecycle's ``admitted_rows``, ``not_admitted_lookups`` and ``evicted_rows``."""
        self._settle_rows()
        stats = self._chain.stats()
        stats[-1].update(self._lifecycle.stats())
        return stats

    def __len__(self) -> int:
        return len(self._chain)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored (keys (n,) uint64 sorted, lines (n, stored_size) float32), after a flush."""
        parts = list(self._chain.export_batches())
        if not parts:
            return np.empty(0, np.uint64), np.empty((0, self.layout.stored_size), np.float32)
        keys = np.concatenate([k for k, _ in parts])
        lines = np.concatenate([v for _, v in parts])
        order = np.argsort(keys, kind="stable")
        return keys[order], lines[order]

    def close(self) -> None:
        if self._chain is not None:
            # the closed chain stays: a call of another thread that already holds this shard
            # (a prefetch lookup) meets its closed tiers' ClosedError, not None
            self._chain.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _live_part(rows: OwnerRows, grads):
    """(rows, grads) of one backward for ``merge``: a fixed-capacity batch cut to its live
    count (one counted read: merging several backwards is off the steady-state path)."""
    if rows.live is None:
        return rows, grads
    count = int(host_sync.scalar(rows.live, "fixed capacity: merge of several backwards"))
    cut = OwnerRows(rows.keys[:count], rows.table_ids[:count], rows.lines[:count],
                    rows.found[:count], rows.version, rows.generation)
    return cut, grads[:count]


def _check_finite_rows(xp, keys, lines, grads, optimizer, step: int, bad=None) -> None:
    """InputError naming the first row the update made non-finite, before anything is stored:
    read at once, or on the trainer's device path (``host_sync.deferring``) at its next metrics
    read, before any checkpoint is written. keys: (v,) uint64; lines: (v, L); grads: (v, E), or
    a ``fused_update.SummedGradients`` of v keys; bad: (v,) bool, the rows the device's update
    kernel noted as it stored an inf or NaN (``device_ops.run_update``; a fixed-capacity
    batch's rows from its live count on never), else found here from ``lines``."""
    if keys.shape[0] == 0:   # nothing updated (admission let no key in): nothing to check, and
        return               # the check's details (an argmax) cannot be taken of no rows
    if bad is None:
        bad = ~xp.isfinite(lines).all(axis=1)

    def first_bad():
        at = xp.argmax(bad)
        row = grads.row(at) if isinstance(grads, fused_update.SummedGradients) else grads[at]
        return at, keys[at], xp.abs(row).max()

    after = "nothing was stored" if host_sync.deferred_checks() is None else \
        "the run stops before its next checkpoint"
    host_sync.check(bad.any(), lambda at, key, g_max: (
        f"the {type(optimizer).__name__} update of step {step} makes the row of key "
        f"{_shown_key(int(key))} non-finite (gradient max |g| = {g_max}): {after}; lower the "
        "learning rate or check the loss"), "update: finite rows check", details=first_bad)


def _shown_key(key: int) -> str:
    """A stored key (its uint64 form) as a user wrote it: a negative signed id is stored as its
    two's complement (64-bit; an int32 one in 32 bits), so it is shown with its signed value."""
    if key >= 2**63:
        return f"{key} (id {key - 2**64} as a signed key)"
    if 2**31 <= key < 2**32:
        return f"{key} (id {key - 2**32} if the key type is int32)"
    return str(key)

