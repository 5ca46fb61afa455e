"""Feature lifecycle: which ids get a stored row (admission) and which rows go (eviction).

The owner shard runs these rules on the keys it owns (``LifecycleOptions`` says which), in the
optimizer step, on the main thread, in step order; prefetched lookups never change them. So
every store preset, engine, cache size and prefetch depth stores exactly the same rows.

Admission (``admit_min_count`` N > 1): a key that is not stored is counted once per training step
it appears in, in a ``CountMinSketch``; its update is dropped (nothing stored, the lookup keeps
returning the initializer's value) until its count reaches N, and the step that reaches N stores
the row the initializer's value plus that step's update makes. Counts are over-estimated only
when every counter of a key collides; they are halved each time the sketch has counted half its
width of keys (aging, so that a long stream cannot fill every counter), so N occurrences must
fall within roughly that many counted ids.

Eviction: a row carries two more float32 behind its line (``META_COLUMNS``): the optimizer step
that last updated it (int32 bits) and its frequency, ``f <- f * 2**-(halvings since last seen) + 1``
with a halving every ``frequency_half_life`` steps (exact in float32: powers of two). Both travel
with the row through every tier and every snapshot, so no extra RAM per key and a resumed run
carries on exactly. A *sweep* reads every stored row (two or more passes through the chain's
export), removes the rows not updated in the last ``steps_to_live`` steps, and, when more rows
than ``max_rows`` remain, the least frequent ones down to ``low_water * max_rows``: lowest
decayed frequency first, then oldest last-seen step, then smallest key. Sweeps run after the put
of every step ``t`` with ``t % sweep_interval == 0`` (time-to-live) and of every step that leaves
more than ``max_rows`` rows. A sweep's RAM is bounded: a 65,536-bin histogram per pass and at
most ``SELECT_CANDIDATES`` candidate rows, plus the keys it evicts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError, InputError, SnapshotError
from .hashing import mix64
from .procstats import physical_memory_mb
from .store.durable import read_array, write_array

#: floats behind the line: last-seen step (int32 bits), frequency
META_COLUMNS = 2
COUNTER_MAX = 0xFFFF
SKETCH_FILE = "admission_sketch.npy"
#: rows of one histogram bin collected and sorted at once by the eviction selection
SELECT_CANDIDATES = 1 << 22
#: per-row seeds of the sketch's hash (odd 64-bit constants)
_ROW_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                       0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53,
                       0x27D4EB2F165667C5, 0x94D049BB133111EB], np.uint64)
MAX_STEP = (1 << 31) - 1


def check_step(step: int) -> None:
    """The lifecycle records steps as int32: 1..MAX_STEP."""
    if not 0 < step <= MAX_STEP:
        raise InputError(f"step {step} is outside 1..{MAX_STEP}: the feature lifecycle records "
                         "optimizer steps as int32")


class CountMinSketch:
    """``depth`` rows of ``width`` (a power of two) saturating uint16 counters.

    ``counts_after(keys)`` is each key's estimate after one more occurrence (min over its cells,
    plus one); ``add`` raises each cell to the estimate of the keys in it (conservative update:
    a cell only grows as far as its smallest key needs). Both are order-free, so a batch gives
    the same counts however its keys are ordered.

    Aging keeps the load bounded however long the stream (TinyLFU's reset): once ``width / 2``
    keys have been counted since the last halving, every counter is halved. Without it, a table
    that sees more distinct ids than counters would find every cell set, and admit everything.
    So an id is admitted when it recurs N times within roughly the last ``width / 2`` ids
    counted (those not admitted yet) on its rank; ``halvings`` counts the resets.
    """

    def __init__(self, width: int, depth: int):
        if width < 1 or width & (width - 1) or not 1 <= depth <= len(_ROW_SEEDS):
            raise ValueError(f"sketch width {width} must be a power of two, depth 1..{len(_ROW_SEEDS)}")
        self.width, self.depth = int(width), int(depth)
        self.counts = np.zeros((self.depth, self.width), np.uint16)
        self.counted = 0   # keys counted since the last halving
        self.halvings = 0

    @staticmethod
    def width_for(megabytes: float, depth: int) -> int:
        """The widest power of two whose ``depth`` rows of counters fit ``megabytes`` MiB."""
        cells = max(1, int(megabytes * 2**20) // (2 * depth))
        return 1 << (cells.bit_length() - 1)

    @classmethod
    def sized(cls, megabytes: float, depth: int) -> "CountMinSketch":
        """The widest power-of-two sketch of ``depth`` rows within ``megabytes`` MiB; a
        ConfigError, before anything is allocated, when that is more than the machine's RAM."""
        width = cls.width_for(megabytes, depth)
        sketch_mb = width * depth * np.dtype(np.uint16).itemsize / 2**20
        ram_mb = physical_memory_mb()
        if ram_mb is not None and sketch_mb > ram_mb:
            raise ConfigError(
                f"sketch_mb={megabytes:g} (--admit-sketch-mb) asks for an admission sketch of "
                f"{sketch_mb:,.0f} MB ({depth} x {width:,} counters), more than this machine's "
                f"{ram_mb:,.0f} MB of RAM: use a smaller one, e.g. sketch_mb=32 (the default)")
        return cls(width, depth)

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes

    def _cells(self, keys: np.ndarray) -> np.ndarray:
        """keys (n,) uint64 -> (depth, n) int64 cell of each key in each row."""
        mask = np.uint64(self.width - 1)
        return np.stack([(mix64(np, keys ^ seed) & mask).astype(np.int64)
                         for seed in _ROW_SEEDS[:self.depth]])

    def counts_after(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys (n,) uint64 unique -> (counts (n,) int64 after one more occurrence, cells)."""
        cells = self._cells(np.ascontiguousarray(keys, np.uint64))
        rows = np.arange(self.depth)[:, None]
        est = self.counts[rows, cells].min(axis=0).astype(np.int64)
        return np.minimum(est + 1, COUNTER_MAX), cells

    def add(self, cells: np.ndarray, counts: np.ndarray) -> None:
        """Record the occurrences ``counts_after`` returned (cells (depth, n), counts (n,)),
        then halve every counter once for each ``width / 2`` keys counted since the last halving."""
        value = counts.astype(np.uint16)
        for r in range(self.depth):
            np.maximum.at(self.counts[r], cells[r], value)
        self.counted += int(counts.shape[0])
        half = self.width // 2
        if self.counted >= half:
            # once per half-width counted, also where one call counted several: a step of more
            # new ids than that halved only once, and the excess was dropped from the count
            times = self.counted // half
            self.counts >>= min(times, 16)   # uint16: 16 halvings clear every counter
            self.counted -= times * half
            self.halvings += times

    def merge(self, other: "CountMinSketch") -> None:
        """Add ``other``'s counts (saturating): every key counted in either is counted here."""
        total = self.counts.astype(np.uint32) + other.counts
        self.counts = np.minimum(total, COUNTER_MAX).astype(np.uint16)
        self.counted = min(self.width // 2 - 1, self.counted + other.counted)
        self.halvings = max(self.halvings, other.halvings)


@dataclass
class StepPlan:
    """What the lifecycle decided for one step's update, applied when the update is stored.

    step: the optimizer step; new_rows: keys admitted now (stored for the first time);
    cells / counts: the sketch update of the keys counted this step (None without admission);
    rejected: lookups whose gradient was dropped (not admitted yet); live: the (1,) int64
    device count of a fixed-capacity batch (only that many of its rows are stored), or None."""

    step: int
    new_rows: int
    rejected: int = 0
    cells: np.ndarray | None = None
    counts: np.ndarray | None = None
    live: object = None


@dataclass
class LifecycleCounters:
    """Since the table was created (carried by snapshots)."""

    admitted_rows: int = 0         # rows stored for the first time (again, after an eviction)
    not_admitted_lookups: int = 0  # training lookups of keys not admitted yet (gradient dropped)
    evicted_rows: int = 0          # rows removed by the time-to-live or the row limit
    evicted_by_ttl: int = 0
    evicted_by_max_rows: int = 0
    sweeps: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Lifecycle:
    """One shard's admission sketch, counters and eviction rules.

    options: the ``LifecycleOptions``; line_size: floats of a line (the meta columns follow it);
    world: ranks (``max_rows`` is split evenly over them)."""

    options: object
    line_size: int
    world: int = 1
    counters: LifecycleCounters = field(default_factory=LifecycleCounters)

    def __post_init__(self):
        o = self.options
        self.sketch = None if o.admits_all else CountMinSketch.sized(o.sketch_mb, o.sketch_depth)
        self.max_rows = -(-o.max_rows // self.world) if o.max_rows else 0
        self.meta = self.line_size if o.evicts else None

    # ---------------------------------------------------------------- admission
    def admit(self, keys_host: np.ndarray, new: np.ndarray, step: int) -> tuple[np.ndarray, StepPlan]:
        """keys_host (v,) uint64 of a step's update, new (v,) bool: not stored -> (keep (v,)
        bool: the rows to update and store, the plan to apply once they are stored)."""
        check_step(step)
        keep = np.ones(new.shape[0], np.bool_)
        plan = StepPlan(step, int(new.sum()))
        if self.sketch is None or plan.new_rows == 0:
            return keep, plan
        idx = np.flatnonzero(new)
        counts, cells = self.sketch.counts_after(keys_host[idx])
        admitted = counts >= self.options.admit_min_count
        keep[idx[~admitted]] = False
        plan.new_rows = int(admitted.sum())
        plan.rejected = int(idx.shape[0] - plan.new_rows)
        plan.cells, plan.counts = cells, counts
        return keep, plan

    def touch(self, xp, lines, step: int) -> None:
        """Record step ``step`` in the meta columns of ``lines`` (v, line_size + 2) float32, in
        place: last-seen step, and the frequency decayed to ``step`` plus one."""
        if self.meta is None or lines.shape[0] == 0:
            return
        last = lines[:, self.meta].view(xp.int32)
        lines[:, self.meta + 1] = self._decayed(xp, lines[:, self.meta + 1], last, step) + \
            xp.float32(1.0)
        last[...] = np.int32(step)

    def _decayed(self, xp, freq, last, step: int):
        """Frequencies (k,) float32 last updated at steps ``last`` (k,) int32, decayed to
        ``step``: halved once per ``frequency_half_life`` boundary crossed (exact: a power of
        two)."""
        half_life = self.options.frequency_half_life
        if not half_life:
            return freq
        halvings = np.int32(step // half_life) - last // np.int32(half_life)
        # the lines of a fixed-capacity batch past its device count hold stale bits (never
        # stored): numpy, standing in for CuPy on the dry run, would warn on their overflow
        with np.errstate(over="ignore"):
            return xp.ldexp(freq, -halvings).astype(xp.float32)

    def commit(self, plan: StepPlan) -> None:
        """The step's rows are stored: record its counts."""
        if plan.cells is not None:
            self.sketch.add(plan.cells, plan.counts)
        self.counters.admitted_rows += plan.new_rows
        self.counters.not_admitted_lookups += plan.rejected

    # ---------------------------------------------------------------- eviction
    def sweep_due(self, step: int, rows: int) -> bool:
        interval = self.options.sweep_interval
        return bool(interval and step % interval == 0) or bool(self.max_rows and rows > self.max_rows)

    def record_sweep(self, by_ttl: int, by_rows: int) -> None:
        c = self.counters
        c.sweeps += 1
        c.evicted_by_ttl += by_ttl
        c.evicted_by_max_rows += by_rows
        c.evicted_rows += by_ttl + by_rows

    def select(self, read, step: int) -> tuple[np.ndarray, int, int, int]:
        """The keys a sweep at step ``step`` evicts -> (keys (m,) uint64, how many by
        time-to-live, how many by the row limit, rows read).

        read: a callable returning a fresh iterator of (keys (k,) uint64, meta (k, 2) float32)
        over every stored row (it is called once per pass)."""
        ttl = self.options.steps_to_live
        stale_keys, live, hist = [], 0, np.zeros(1 << 16, np.int64)
        for keys, meta in read():
            last = np.ascontiguousarray(meta[:, 0]).view(np.int32)
            stale = (last <= step - ttl) if ttl else np.zeros(keys.shape[0], np.bool_)
            stale_keys.append(keys[stale])
            comp = self._order(meta[~stale], last[~stale], step)
            live += comp.shape[0]
            hist += np.bincount((comp >> np.uint64(48)).astype(np.int64), minlength=1 << 16)
        stale_keys = np.concatenate(stale_keys) if stale_keys else np.empty(0, np.uint64)
        need = 0
        if self.max_rows and live > self.max_rows:
            need = live - int(self.options.low_water * self.max_rows)
        lfu = self._lowest(read, step, need, hist) if need else np.empty(0, np.uint64)
        n_stale = int(stale_keys.shape[0])
        return np.concatenate([stale_keys, lfu]), n_stale, int(lfu.shape[0]), n_stale + live

    def _order(self, meta: np.ndarray, last: np.ndarray, step: int) -> np.ndarray:
        """(k,) uint64 eviction order of live rows: decayed frequency's float32 bits (positive
        floats order as their bits) over the last-seen step."""
        freq = self._decayed(np, np.ascontiguousarray(meta[:, 1]), last, step)
        return (freq.view(np.uint32).astype(np.uint64) << np.uint64(32)) | \
            last.astype(np.uint32).astype(np.uint64)

    def _lowest(self, read, step: int, need: int, hist: np.ndarray) -> np.ndarray:
        """The ``need`` live rows lowest in (order, key), by radix selection over the 64-bit
        order, 16 bits per pass: rows below the boundary bin are taken whole, the boundary bin
        is refined until it holds at most SELECT_CANDIDATES rows, then sorted."""
        ttl = self.options.steps_to_live
        taken, prefix, bits = [], 0, 0          # rows whose order starts with `prefix` (`bits`)
        while True:
            cum = np.cumsum(hist)
            b = int(np.searchsorted(cum, need))  # the bin where the need is met
            below = int(cum[b - 1]) if b else 0
            level_bits, shift = bits + 16, np.uint64(64 - bits - 16)
            final = hist[b] <= SELECT_CANDIDATES or level_bits == 64
            cand_order, cand_keys = [], []
            next_hist = np.zeros(1 << 16, np.int64)
            for keys, meta in read():
                last = np.ascontiguousarray(meta[:, 0]).view(np.int32)
                live = ~(last <= step - ttl) if ttl else np.ones(keys.shape[0], np.bool_)
                comp, keys = self._order(meta[live], last[live], step), keys[live]
                if bits:
                    in_prefix = (comp >> np.uint64(64 - bits)) == np.uint64(prefix)
                    comp, keys = comp[in_prefix], keys[in_prefix]
                digit = (comp >> shift) & np.uint64(0xFFFF)
                taken.append(keys[digit < b])
                in_bin = digit == b
                if final:
                    cand_order.append(comp[in_bin])
                    cand_keys.append(keys[in_bin])
                elif level_bits < 64:
                    sub = (comp[in_bin] >> np.uint64(64 - level_bits - 16)) & np.uint64(0xFFFF)
                    next_hist += np.bincount(sub.astype(np.int64), minlength=1 << 16)
            need -= below
            if final:
                order = np.concatenate(cand_order) if cand_order else np.empty(0, np.uint64)
                keys = np.concatenate(cand_keys) if cand_keys else np.empty(0, np.uint64)
                pick = np.lexsort((keys, order))[:need]
                taken.append(keys[pick])
                return np.concatenate(taken)
            prefix, bits, hist = (prefix << 16) | b, level_bits, next_hist

    # ---------------------------------------------------------------- snapshots
    def manifest(self) -> dict:
        """What a snapshot records: the rules, the sketch's shape, the counters."""
        o = self.options
        out = {"admit_min_count": o.admit_min_count, "steps_to_live": o.steps_to_live,
               "max_rows": o.max_rows, "counters": self.counters.as_dict()}
        if self.sketch is not None:
            out["sketch"] = {"width": self.sketch.width, "depth": self.sketch.depth,
                             "counted": self.sketch.counted, "halvings": self.sketch.halvings,
                             "file": SKETCH_FILE}
        return out

    def save(self, folder: str) -> None:
        """The sketch into ``folder`` (a snapshot being written)."""
        if self.sketch is not None:
            write_array(os.path.join(folder, SKETCH_FILE), self.sketch.counts)

    def load(self, sources: list[tuple[str, dict]], resharded: bool,
             takes_counters: bool = True) -> None:
        """Restore from snapshot folders and manifests (several: the old ranks of a snapshot
        of another world size, whose sketches add up; each key was counted by one of them).
        A snapshot without a sketch leaves an empty one. Counters: the snapshot's; resharded,
        the old ranks' summed on the new rank that ``takes_counters`` (rank 0), zeros on the
        others, so that the run's totals (summed over the ranks) go on from where they were."""
        self.counters = LifecycleCounters()
        if takes_counters or not resharded:
            for _, manifest in sources if resharded else sources[:1]:
                saved = (manifest.get("lifecycle") or {}).get("counters") or {}
                for name, value in saved.items():
                    if hasattr(self.counters, name):
                        setattr(self.counters, name, getattr(self.counters, name) + int(value))
        if self.sketch is None:
            return
        fresh = CountMinSketch(self.sketch.width, self.sketch.depth)
        for folder, manifest in sources:
            info = (manifest.get("lifecycle") or {}).get("sketch")
            if not info:
                continue
            if (info["width"], info["depth"]) != (fresh.width, fresh.depth):
                raise SnapshotError(
                    f"snapshot in {folder!r} holds an admission sketch of {info['depth']} x "
                    f"{info['width']} counters but this embedding's is {fresh.depth} x "
                    f"{fresh.width}: use the sketch_mb / sketch_depth it was saved with")
            part = CountMinSketch(fresh.width, fresh.depth)
            part.counts = read_array(os.path.join(folder, info["file"]))
            part.counted, part.halvings = int(info.get("counted", 0)), int(info.get("halvings", 0))
            fresh.merge(part)
        self.sketch = fresh

    def stats(self) -> dict:
        """The counters, for ``store_stats`` (with admission, the sketch's halvings too)."""
        c = self.counters
        out = {"admitted_rows": c.admitted_rows, "not_admitted_lookups": c.not_admitted_lookups,
               "evicted_rows": c.evicted_rows}
        if self.sketch is not None:
            out["admission_sketch_halvings"] = self.sketch.halvings
        return out
