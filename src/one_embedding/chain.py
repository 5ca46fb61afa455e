"""The tier chain: cache levels over a bottom store, built from store options.

This is the one module that knows every tier kind (OneEmbedding's presets, REFERENCE.md "Store
presets"). A lookup falls through on a miss and never fills; a put writes into the top level and
every line a level evicts is written, whole, into the level below. Writes flow only downwards,
so a copy at a higher level is always newer than one below it and a lookup takes the first copy
it finds (REFERENCE.md "Cache behaviour").

The chain is the only place rows cross between tiers, and it counts every crossing once per
level (``TierCounters``): hits and misses of ``find``, writes and evictions of
``insert_or_assign``.

Threads: every public method takes the chain's lock, so any of them may be called from any
thread; calls on one chain run one at a time, in the order they take the lock. The tier kernels
release the GIL, so a ``lookup`` on a background thread runs beside numpy / BLAS work on the
main thread (this is what the prefetch pipeline does).

Device tiers (``cache.device``, on a GPU): the tiers whose ``on_device`` is true sit on top and
hold keys and lines in device memory; the chain is then the one place rows cross between device
and host. A lookup's keys and result are device arrays: the keys a device tier misses are copied
to the host, looked up in the host tiers into a host staging buffer (page-locked on a GPU), and
what was found is copied into the device result. A put writes device lines into the top tier, and
the lines a device tier evicts (or a flush writes down) are copied to the host for the tier
below. ``transfers`` counts every byte that crossed either way (``stats()`` shows them on the
lowest device tier). Calls made from several threads, each on its own CUDA stream, also run in
lock order on the device: each chain call's work waits for an event recorded at the end of the
previous call's.
"""
from __future__ import annotations

import contextlib
import tempfile
import threading
from dataclasses import asdict, dataclass

import numpy as np

from .cache.set_associative import SetAssociativeCache
from .errors import ConfigError, InputError, SnapshotError
from .kernels import device_ops
from .store.memory import MemoryStore
from .store.rocksdb_store import RocksDBStore
from .store.slot_file import SlotFileStore
from .store.snapshots import lease
from .tiers import ClosedTier, StoreTier, Tier, TierCounters


@dataclass
class TransferCounters:
    """Bytes a chain copied between device and host memory, and the copies that moved them."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    h2d_copies: int = 0

    def to_host(self, nbytes: int, copies: int = 1) -> None:
        self.d2h_bytes += int(nbytes)
        self.d2h_copies += copies

    def to_device(self, nbytes: int, copies: int = 1) -> None:
        self.h2d_bytes += int(nbytes)
        self.h2d_copies += copies

    def as_dict(self) -> dict:
        return asdict(self)


class TierChain:
    """tiers: cache levels top first, then one ``StoreTier`` at the bottom. Device tiers
    (``on_device``), if any, come first; ``launch`` is theirs and ``xp`` the module of the keys
    and lines that ``lookup`` / ``put`` take and return (numpy without device tiers)."""

    def __init__(self, tiers: list[Tier]):
        if not tiers:
            raise ConfigError("a store needs at least one tier")
        if not isinstance(tiers[-1], StoreTier):
            raise ConfigError(f"the bottom tier {tiers[-1].name!r} is not a store; it would lose rows")
        if any(isinstance(t, StoreTier) for t in tiers[:-1]):
            raise ConfigError("only the bottom tier of a chain may be a store")
        self.tiers = list(tiers)
        self.counters = [TierCounters() for _ in self.tiers]
        self.line_size = tiers[0].line_size
        self._lock = threading.RLock()
        self._on_device = [bool(getattr(t, "on_device", False)) for t in self.tiers]
        self.n_device = sum(self._on_device)
        if self._on_device != [True] * self.n_device + [False] * (len(tiers) - self.n_device):
            raise ConfigError("device tiers must sit above every host tier: "
                              f"{[t.name for t in self.tiers]}")
        #: the device tiers' launcher (None: a host chain, the numpy path)
        self.launch = tiers[0].launch if self.n_device else None
        self.xp = self.launch.xp if self.launch is not None else np
        #: device <-> host copies (None on a host chain)
        self.transfers = TransferCounters() if self.n_device else None
        # the end of the previous call's device work; at first the tiers' construction (their
        # buffers filled on the building thread's stream), so that the first call, whichever
        # stream makes it (a prefetch thread's, which does not wait for the null stream),
        # reads them filled
        self._last_event = self.launch.record() if self.launch is not None else None
        self._staged = None         # the end of the last copy out of a staging buffer
        self._buffers: dict = {}    # name -> host staging bytes, grown on demand
        # a put's evictions from a device cache not taken yet: (level, ev_keys (n,), ev_lines
        # (n, line_size), leaving (n,) bool) device arrays (``DeviceCache.insert_pending``).
        # Reading how many lines left would stall the step's thread; the next call takes them
        # first (under the lock, before anything else can look for them), the next lookup in
        # the same read as its misses
        self._pending = None
        # what a call let go of while another stream's queued work may still read it (the
        # pending evictions, made on the put's stream, are taken on the lookup's)
        self._held = None if self.launch is None else device_ops.HeldUntil(self.launch)

    @property
    def bottom(self) -> StoreTier:
        return self.tiers[-1]

    @property
    def takes_live_counts(self) -> bool:
        """True when ``lookup`` and ``put`` take fixed-capacity batches (``live``): every line in
        one device store (the device_mem preset on a GPU)."""
        return self.launch is not None and len(self.tiers) == 1 and \
            hasattr(self.tiers[0], "find_found")

    def lookup(self, keys: np.ndarray, out: np.ndarray | None = None,
               live=None) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) uint64 unique -> (lines (n, line_size) float32, found (n,) bool), arrays of
        ``xp``.

        ``out`` (n, line_size) float32 may be given as the buffer to fill. Lines of keys found
        nowhere are left as they were; the caller initialises them. live: where
        ``takes_live_counts``, the (1,) int64 device count of a fixed-capacity batch
        (``device_unique.unique_ids_fixed``): keys from ``live`` on are not looked up and come
        back found, their lines untouched.
        """
        if live is not None and not self.takes_live_counts:
            raise InputError("a fixed-capacity lookup (live count) needs a chain of one device "
                             "store (device_mem on a GPU)")
        if self.launch is not None:
            return self._lookup_device(keys, out, live)
        keys = np.ascontiguousarray(keys, np.uint64)
        n = keys.shape[0]
        lines = np.empty((n, self.line_size), np.float32) if out is None else out
        rows = np.arange(n, dtype=np.int64)  # rows of `lines` still missing
        with self._lock:
            for tier, counters in zip(self.tiers, self.counters):
                if rows.shape[0] == 0:
                    break
                missing = tier.find(keys, lines, rows)
                counters.record_find(keys.shape[0], missing.shape[0])
                keys, rows = keys[missing], rows[missing]
        found = np.ones(n, np.bool_)
        found[rows] = False
        return lines, found

    def lookup_deduped(self, passes):
        """A fixed-capacity batch's dedup finished and looked up in one kernel (where
        ``takes_live_counts``): passes, ``device_unique.dedup_passes_fixed``'s of n ids ->
        (``device_unique.FixedUnique``, lines (n, line_size) float32, found (n,) bool): what
        ``unique_ids_fixed`` then ``lookup(fixed.keys, live=fixed.count)`` give, the same
        counters recorded. Under the chain's lock, so no put grows or rehashes the store's index
        between the probe and its use of the table."""
        if not self.takes_live_counts:
            raise InputError("a lookup fused with the dedup needs a chain of one device store "
                             "(device_mem on a GPU)")
        xp = self.xp
        lines = xp.empty((passes.keys.shape[0], self.line_size), dtype=xp.float32)
        with self._lock, self._ordered():
            fixed, found = self.tiers[0].dedup_find_found(passes, lines)
            self.counters[0].record_find(fixed.count.reshape(()),
                                         xp.asarray(xp.count_nonzero(~found)))
        return fixed, lines, found

    def put(self, keys: np.ndarray, lines: np.ndarray, live=None) -> None:
        """keys: (n,) uint64 unique, lines: (n, line_size) float32 (arrays of ``xp``) -> written
        to the top level. live: as ``lookup``'s, only the first ``live`` are written."""
        if live is not None:
            if not self.takes_live_counts:
                raise InputError("a fixed-capacity put (live count) needs a chain of one device "
                                 "store (device_mem on a GPU)")
            with self._lock, self._device_order():
                self.tiers[0].insert_or_assign(keys, lines, live)
                self.counters[0].record_write(live.reshape(()), 0)
            return
        with self._lock, self._device_order():
            if self.launch is not None:
                self._write_device(0, keys, lines, on_device=True, defer=True)
            else:
                self._write_from(0, keys, lines)

    def flush(self) -> None:
        """Write every cache level down, top first, so the bottom store holds the newest lines.
        A level that tracks dirty lines (``flush_batches``) writes only those, then holds them
        clean; the others write every line they hold."""
        with self._lock, self._device_order():
            for level in range(len(self.tiers) - 1):
                tier = self.tiers[level]
                batches = getattr(tier, "flush_batches", tier.export_batches)
                for keys, lines in batches():
                    self._write_from(level + 1, keys, lines, self._on_device[level])

    def _write_from(self, level: int, keys, lines, on_device: bool = False) -> None:
        """Write into tier ``level``; whatever a tier evicts goes on to the next one. on_device:
        keys and lines are device arrays (copied across where a tier on the other side takes
        them)."""
        if self.launch is not None:
            return self._write_device(level, keys, lines, on_device)
        for tier, counters in zip(self.tiers[level:], self.counters[level:]):
            ev_keys, ev_lines = tier.insert_or_assign(keys, lines)
            counters.record_write(keys.shape[0], ev_keys.shape[0])
            if ev_keys.shape[0] == 0:
                return
            keys, lines = ev_keys, ev_lines
        raise AssertionError("unreachable: the bottom tier is a store and never evicts")

    # ---------------------------------------------------------------- the device <-> host crossing

    def _device_order(self):
        """Inside the lock: order this call's device work after the previous call's, whichever
        thread (and CUDA stream) issued it. Nothing to order on a host chain."""
        if self.launch is None:
            return contextlib.nullcontext()
        return self._ordered()

    @contextlib.contextmanager
    def _ordered(self, settle: bool = True):
        """Orders the call's device work after the previous call's; ``settle``: first writes
        down the lines the last put evicted (``_pending``), if not taken yet."""
        self.launch.wait(self._last_event)
        try:
            if settle:
                self._settle()
            yield
        finally:
            self._last_event = self.launch.record()

    def _settle(self) -> None:
        """Writes the last put's evicted lines down (one read: how many left)."""
        if self._pending is not None:
            self._write_down(device_ops.count_true(self.xp, self._pending[3],
                                                   "cache evictions to host tier"))

    def _write_down(self, count: int) -> None:
        """Takes ``_pending``, whose ``count`` evicted lines (known on the host) go down to the
        level below the cache that evicted them."""
        down = self._take_pending(count)
        if down is not None:
            self._write_device(down[0], down[1], down[2], on_device=True)

    def _take_pending(self, count: int):
        """Takes ``_pending``, whose ``count`` evicted lines are known on the host -> (the level
        they go down to, keys (count,) uint64, lines (count, line_size) float32) device arrays,
        to be written there before that level is searched; None when none left."""
        level, ev_keys, ev_lines, leaving = self._pending
        self._pending = None
        self.counters[level].record_write(0, count)
        down = None
        if count:
            taken = device_ops.positions_of(self.xp, leaving, count)
            down = level + 1, ev_keys[taken], ev_lines[taken]
        # made on the put's stream: CuPy's pool would hand their memory back to it at once,
        # while this stream's reads of them may still be queued
        self._held.hold((ev_keys, ev_lines, leaving), self.launch.record())
        return down

    def _host_buffer(self, name: str, shape: tuple, dtype) -> np.ndarray:
        """A host staging array (page-locked on a GPU), reused from call to call; the caller has
        waited for every copy out of it (``_staged``)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self.launch.host_empty(max(nbytes, 2 * (0 if buf is None else buf.nbytes), 64),
                                         np.uint8)
            self._buffers[name] = buf
        return buf[:nbytes].view(dtype).reshape(shape)

    def _to_host(self, a, name: str | None = None,
                 reason: str = "lines down to host tier") -> np.ndarray:
        """A host copy of device array ``a``: into staging buffer ``name``, or a new array."""
        out = None if name is None else self._host_buffer(name, tuple(a.shape), a.dtype)
        out = self.launch.to_host(a, out, reason=reason)
        self.transfers.to_host(out.nbytes)
        return out

    def _to_host_all(self, arrays, reason: str) -> list[np.ndarray]:
        """Host copies of device arrays ``arrays`` ((array, staging buffer name) pairs), queued
        together into their staging buffers and waited for once: one read for them all. The
        caller has waited for every copy out of the buffers (``_staged``)."""
        outs = []
        for a, name in arrays:
            out = self._host_buffer(name, tuple(a.shape), a.dtype)
            self.launch.to_host_async(self.xp.ascontiguousarray(a), out)
            self.transfers.to_host(out.nbytes)
            outs.append(out)
        self.launch.wait_for_copies(reason)
        return outs

    def _to_device(self, a: np.ndarray):
        self.transfers.to_device(a.nbytes)
        return self.launch.to_device(a)

    def _lookup_device(self, keys, out, live=None):
        xp = self.xp
        keys = xp.ascontiguousarray(keys, dtype=xp.uint64)
        n = keys.shape[0]
        lines = xp.empty((n, self.line_size), dtype=xp.float32) if out is None else out
        if self.takes_live_counts:
            # every line in one device store: found is a mask, and nothing is read back
            with self._lock, self._ordered():
                found = self.tiers[0].find_found(keys, lines, live)
                # past ``live`` every key comes back found: the misses are the real ones
                self.counters[0].record_find(n if live is None else live.reshape(()),
                                             xp.asarray(xp.count_nonzero(~found)))
            return lines, found
        rows = xp.arange(n, dtype=xp.int64)  # rows of `lines` still missing
        down = None     # evicted lines bound for the first host tier, not written there yet
        with self._lock, self._ordered(settle=False):
            for tier, counters in zip(self.tiers[:self.n_device], self.counters[:self.n_device]):
                if rows.shape[0] == 0:
                    break
                if self._pending is not None and hasattr(tier, "find_missing"):
                    # the misses and the last put's evictions counted in one read; the evicted
                    # lines go down before any tier below is searched: a device tier's at
                    # once, the first host tier's with the miss keys' copy (one wait for both)
                    miss = tier.find_missing(keys, lines, rows)
                    m, evicted = device_ops.count_each(
                        xp, (miss, self._pending[3]), "miss keys and evictions to host tier")
                    down = self._take_pending(evicted)
                    if down is not None and self._on_device[down[0]]:
                        self._write_device(*down, on_device=True)
                        down = None
                    missing = device_ops.positions_of(xp, miss, m)
                else:
                    self._settle()
                    missing = tier.find(keys, lines, rows)
                counters.record_find(keys.shape[0], missing.shape[0])
                keys, rows = keys[missing], rows[missing]
            self._settle()
            if rows.shape[0] and self.n_device < len(self.tiers):
                rows = self._lookup_host(keys, lines, rows, down)
            elif down is not None:
                self._write_device(*down, on_device=True)
        found = xp.ones(n, dtype=xp.bool_)
        found[rows] = False
        return lines, found

    def _lookup_host(self, keys, lines, rows, down=None):
        """The host tiers' part of a lookup. keys: (m,) uint64 the device tiers missed; lines:
        the device result; rows: (m,) int64 their rows in it -> the rows still missing. down:
        ``_take_pending``'s evicted lines for the first host tier, written there first (their
        copy and the keys' share one wait)."""
        xp, launch = self.xp, self.launch
        m = keys.shape[0]
        if not launch.done(self._staged):     # the staging buffers are free again (the
            launch.synchronize(self._staged)  # read of the counts before has mostly seen to it)
        if down is None:
            (host_keys,) = self._to_host_all(((keys, "keys"),), "miss keys to host tier")
        else:
            level, down_keys, down_lines = down
            down_keys, down_lines, host_keys = self._to_host_all(
                ((down_keys, "down_keys"), (down_lines, "down_lines"), (keys, "keys")),
                "evicted lines and miss keys to host tier")
            self._write_device(level, down_keys, down_lines, on_device=False)
        staging = self._host_buffer("lines", (m, self.line_size), np.float32)
        remaining = np.arange(m, dtype=np.int64)
        for tier, counters in zip(self.tiers[self.n_device:], self.counters[self.n_device:]):
            if remaining.shape[0] == 0:
                break
            missing = tier.find(host_keys, staging, remaining)
            counters.record_find(host_keys.shape[0], missing.shape[0])
            host_keys, remaining = host_keys[missing], remaining[missing]
        if remaining.shape[0] == m:
            return rows                       # found nowhere below: nothing to copy up
        found = self._host_buffer("found", (m,), np.bool_)
        found[:] = True
        found[remaining] = False
        # every staged line goes up in one copy (the rows of keys found nowhere too: one
        # contiguous copy costs less than compacting on the host first)
        staged_lines, staged_found = self._to_device(staging), self._to_device(found)
        self._staged = launch.record()
        n_missing = remaining.shape[0]        # known on the host: no size read back
        hit = device_ops.positions_of(xp, staged_found, m - n_missing)
        lines[rows[hit]] = staged_lines[hit]
        return rows[device_ops.positions_of(xp, ~staged_found, n_missing)]

    def _write_device(self, level: int, keys, lines, on_device: bool, defer: bool = False) -> None:
        """``_write_from`` of a device chain. defer: a device cache with a level below keeps its
        evictions on the device, to be taken by the next call (``_pending``); the caller
        settled the last ones."""
        for i in range(level, len(self.tiers)):
            if on_device and not self._on_device[i]:        # device lines go down to the host
                keys, lines = self._to_host_all(((keys, "down_keys"), (lines, "down_lines")),
                                                "lines down to host tier")
                on_device = False
            elif self._on_device[i] and not on_device:      # host lines restored into a device tier
                keys, lines = self._to_device(keys), self._to_device(lines)
                on_device = True
            if defer and on_device and i + 1 < len(self.tiers) and \
                    hasattr(self.tiers[i], "insert_pending"):
                self._pending = (i, *self.tiers[i].insert_pending(keys, lines))
                self.counters[i].record_write(keys.shape[0], 0)
                return
            ev_keys, ev_lines = self.tiers[i].insert_or_assign(keys, lines)
            self.counters[i].record_write(keys.shape[0], ev_keys.shape[0])
            if ev_keys.shape[0] == 0:
                return
            keys, lines = ev_keys, ev_lines
        raise AssertionError("unreachable: the bottom tier is a store and never evicts")

    def erase(self, keys: np.ndarray) -> int:
        """Remove keys (n,) uint64 (host) from every tier, caches and store alike (an evicted
        feature); returns how many the bottom store held. Nothing is written down: a dirty
        cached line of an erased key is dropped."""
        keys = np.ascontiguousarray(keys, np.uint64)
        with self._lock, self._device_order():
            device_keys = None
            held = 0
            for tier, on_device in zip(self.tiers, self._on_device):
                if on_device and device_keys is None:
                    device_keys = self._to_device(keys)
                held = tier.erase(device_keys if on_device else keys)
            return int(held)

    def clear_caches(self) -> None:
        with self._lock, self._device_order():
            for tier in self.tiers[:-1]:
                tier.clear()

    def save_snapshot(self, directory: str) -> dict | None:
        """Flush, then write the bottom store's whole state into ``directory``."""
        with self._lock:
            self.flush()
            return self.save_bottom(directory)

    def save_bottom(self, directory: str) -> dict | None:
        """Write the bottom store's whole state into ``directory`` as it is (no flush); a device
        store's copy to the host is counted. Returns the store's shared-file checksums."""
        with self._lock, self._device_order():
            shared = self.bottom.save_snapshot(directory)
            if self._on_device[-1]:
                self.transfers.to_host(self._bottom_bytes(), copies=2)
            return shared

    def collect_garbage(self) -> int:
        """The bottom store's garbage collection (files no snapshot and no live row needs)."""
        with self._lock:
            return self.bottom.collect_garbage()

    def load_snapshot(self, directory: str) -> None:
        """Drop every cached line and restore the bottom store from ``directory``."""
        with self._lock, self._device_order():
            self.clear_caches()
            self.bottom.load_snapshot(directory)
            if self._on_device[-1]:
                self.transfers.to_device(self._bottom_bytes(), copies=2)

    def _bottom_bytes(self) -> int:
        """Bytes of every key and line of the bottom store: what a device store's snapshot moves
        between device memory and the (host) snapshot files."""
        return len(self.bottom) * (8 + 4 * self.line_size)

    def clear(self) -> None:
        """Drop every line of every tier."""
        with self._lock, self._device_order():
            for tier in self.tiers:
                tier.clear()

    def restore(self, keys: np.ndarray, lines: np.ndarray) -> None:
        """Write host lines (keys (n,) uint64, lines (n, line_size) float32, numpy) straight into
        the bottom store (loading rows from elsewhere: the caches must hold none of these keys,
        e.g. after ``clear``)."""
        with self._lock, self._device_order():
            self._write_from(len(self.tiers) - 1, keys, lines)

    def export_batches(self):
        """Every stored (keys (k,) uint64, lines (k, line_size) float32) after a flush, as host
        (numpy) arrays."""
        with self._lock:
            self.flush()
            for keys, lines in self.bottom.export_batches():
                if self._on_device[-1]:
                    with self._device_order():
                        keys, lines = self._to_host(keys), self._to_host(lines)
                yield keys, lines

    def __len__(self) -> int:
        """Distinct keys stored (flushes first: a new key may so far live only in a cache)."""
        with self._lock:
            self.flush()
            return len(self.bottom)

    def stats(self) -> list[dict]:
        """Per tier, top first: tier, rows, memory_bytes, disk_bytes, hits, misses, evictions,
        writes; with device tiers, the lowest one also shows the bytes and copies that crossed
        between device and host memory (``d2h_bytes``, ``h2d_bytes``, ``d2h_copies``,
        ``h2d_copies``)."""
        with self._lock, self._device_order():   # the reads follow every call's device work
            stats = [{**t.describe(), **c.as_dict()} for t, c in zip(self.tiers, self.counters)]
            if self.transfers is not None:
                stats[self.n_device - 1].update(self.transfers.as_dict())
            return stats

    def close(self) -> None:
        with self._lock, self._device_order():
            for t in self.tiers:
                t.close()
            self._buffers.clear()
            self.tiers = [ClosedTier(t.name) for t in self.tiers]  # a waiting call: ClosedError


# ---------------------------------------------------------------- presets


def _per_rank(capacity: int | None, world: int) -> int | None:
    """``capacity`` is the total over all ranks; each rank sizes its tables for its share."""
    return None if capacity is None else -(-int(capacity) // world)


def _cache_level(cache_options, line_size: int, capacity: int | None, launch=None) -> Tier:
    """One cache level from its ``CacheOptions``; named ``<location>.<policy>``. With a device
    ``launch``, a "device" level is a ``DeviceCache`` in device memory."""
    name = f"{cache_options.location}.{cache_options.policy}"
    if cache_options.policy == "full":
        raise ConfigError(f"a 'full' {cache_options.location} cache holds every key: it is a "
                          "store, the bottom of a chain, not a level above one")
    if launch is not None and cache_options.location == "device":
        from .cache.device import DeviceCache

        return DeviceCache.from_options(cache_options, line_size, name, launch)
    return SetAssociativeCache.from_options(cache_options, line_size, name)


def _ssd_store(engine: str, line_size: int, path: str, physical_block_size: int,
               capacity: int | None, threads: int = 2) -> StoreTier:
    if engine == "slots":
        return SlotFileStore(line_size, path, physical_block_size, expected_keys=capacity or 0,
                             threads=threads)
    if engine == "rocksdb":
        return RocksDBStore(line_size, path, threads=threads)
    raise ConfigError(f"engine={engine!r} must be 'slots' or 'rocksdb'")


def preset_tiers(options, line_size: int, path: str | None, world: int,
                 launch=None) -> list[Tier]:
    """The tiers of ``options.kind``, top first.

    device_mem: one "full" store in device memory (RAM on CPU) that holds every key.
    cached_host_mem: an LRU (or LFU) cache in device memory over a "full" store in host memory.
    cached_ssd: a device cache [over a host cache] over the SSD table of ``options.engine`` in
    ``<path>/slots`` or ``<path>/rocksdb`` (``path`` is this rank's folder).

    launch: a device launcher (``kernels.device_ops``) puts the "device" tiers on the GPU:
    ``DeviceFullStore`` for device_mem, ``DeviceCache`` for the device cache levels; None (the
    CPU) keeps every tier in host memory.
    """
    capacity = _per_rank(options.capacity, world)
    if options.kind == "device_mem":
        if launch is not None:
            from .cache.device import DeviceFullStore

            return [DeviceFullStore(line_size, capacity, name="device.full", launch=launch)]
        return [MemoryStore(line_size, capacity, name="device.full")]
    if options.kind == "cached_host_mem":
        return [_cache_level(options.caches[0], line_size, capacity, launch),
                MemoryStore(line_size, capacity, name="host.full")]
    if options.kind == "cached_ssd":
        if not path:
            raise ConfigError("cached_ssd needs a persistent_path: the directory of the SSD table")
        levels = [_cache_level(c, line_size, capacity, launch) for c in options.caches]
        return levels + [_ssd_store(options.engine, line_size, path, options.physical_block_size,
                                    capacity)]
    raise ConfigError(f"store kind {options.kind!r} has no implementation")


def build_chain(options, line_size: int, embedding_dim: int, path: str | None, world: int,
                launch=None) -> TierChain:
    """The chain of ``options`` (a ``StoreOptions``) for lines of ``line_size`` floats, with its
    device tiers on ``launch``'s device (None: all in host memory)."""
    return TierChain(preset_tiers(options, line_size, path, world, launch))


def open_store_for_snapshot(engine: str, line_size: int, scratch: str,
                            physical_block_size: int = 4096) -> StoreTier:
    """A private store of the kind a snapshot manifest names (its ``engine``), in ``scratch``,
    to read that snapshot back (``one-embedding inspect``)."""
    if engine.endswith(".full"):
        return MemoryStore(line_size, name=engine)
    if engine in ("ssd.slots", "ssd.rocksdb"):
        return _ssd_store(engine.split(".")[1], line_size, scratch, physical_block_size, None,
                          threads=1)
    raise SnapshotError(f"unknown engine {engine!r} in the manifest")


def read_snapshot_rows(folder: str, engine: str, line_size: int, batch_rows: int = 1 << 16):
    """Every (keys (k,) uint64, lines (k, line_size) float32) of the snapshot in ``folder``,
    written by a store of kind ``engine``, read back through a private store of that kind. A
    lease keeps the snapshot's files on disk while it is read, even if the process that owns
    the path deletes the snapshot meanwhile."""
    with lease(folder), tempfile.TemporaryDirectory(prefix="one_embedding_snapshot_") as scratch:
        store = open_store_for_snapshot(engine, line_size, scratch)
        try:
            store.load_snapshot(folder)
            yield from store.export_batches(batch_rows)
        finally:
            store.close()
