"""``one-embedding plan``: RAM per tier and disk of a table before it exists.

    one-embedding plan --rows 1e9 --embedding-dim 128 --optimizer adam --store cached_ssd \\
        --cache-mb 8192 --keep-snapshots 3 [--device cuda]

Every figure comes from the constants and formulas the stores themselves use (imported, not
copied): the line layout (``size_factor`` from the optimizer's states), the cache's reserved bytes
(``SetAssociativeCache.bytes_for``), the slot engine's block packing, key files, block checksums,
directory (``CompactIndex``: 5-byte entries at 0.80-0.92 load) and staging buffers, its garbage
bound (``GARBAGE_RATIO``) and compaction target; RocksDB's blob records, key SSTs, bloom filters,
block cache and write buffers, and the space amplification at which a save reclaims garbage.

``device="cuda"`` plans the tiers training with ``--device cuda`` builds (``chain.preset_tiers``):
the "device" tiers in GPU memory (``DeviceCache.bytes_for``: no row number or used flag per way,
as the CPU cache keeps; ``DeviceFullStore``: the rows and a hash index as ``MemoryStore``'s), the
others in host RAM, each total apart. On "cpu" every tier is in RAM, the "device" ones included.

Disk is given three ways: the live table right after a snapshot with no garbage; the steady state
the garbage bound allows; and the peak with ``keep_snapshots`` retained snapshots, each taken after
``changed_per_snapshot`` of the rows changed (retained snapshots pin the old copies of the rows
compaction moved while they were current). ``tests/unit/test_plan.py`` checks the plan against
measured stores.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field

from .cache.device import DeviceCache
from .cache.set_associative import SetAssociativeCache
from .config import DEVICES
from .errors import ConfigError
from .lifecycle import META_COLUMNS, CountMinSketch
from .options import PHYSICAL_BLOCK_SIZES, whole_number
from .store import rocksdb_store as rdb
from .store import slot_file
from .store.direct_io import MAX_RUN_BYTES  # noqa: F401  (the I/O unit, shown in docs)
from .store.segments import block_layout, default_segment_rows
from .tiers.compact_index import GROWTH, MAX_LOAD, MAX_LOCATION

#: row optimizer -> states per element (a line is 1 + states blocks of E floats)
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2, "ftrl": 2}
#: bytes of a CompactIndex entry (8-bit tag + 32-bit location)
INDEX_ENTRY_BYTES = 5
#: the directory's mean load: it grows by GROWTH when it reaches MAX_LOAD
INDEX_MEAN_LOAD = (MAX_LOAD + MAX_LOAD / GROWTH) / 2
#: HashIndex (host memory stores): 16 bytes a bucket, at most 0.7 full, a power of two
HASH_BUCKET_BYTES, HASH_MAX_LOAD = 16, 0.7
#: RocksDB table readers per key: the keys family's 10-bit bloom filter + index entries of the
#: key SST blocks of both families (measured 1.43 at 200 k keys, 1.23 at 2 M)
ROCKSDB_TABLE_READER_BYTES = 1.25 + 0.15
#: measured (tests/unit/test_store_scale.py, bench_scale): a garbage reclaim relocates up to
#: this share of the table, which snapshots taken before it keep pinned until deleted
ROCKSDB_RECLAIM_SHARE = 0.45


#: where a tier's bytes live: host RAM or the GPU's memory
MEMORIES = ("host", "device")


@dataclass
class TierPlan:
    """One tier per rank: ``ram_bytes`` are in ``memory`` (host RAM, or GPU memory)."""
    tier: str
    rows: int
    ram_bytes: int
    disk_bytes: int = 0
    note: str = ""
    memory: str = "host"


@dataclass
class CapacityPlan:
    rows: int
    rows_per_rank: int
    line_size: int
    line_bytes: int
    tiers: list = field(default_factory=list)
    ram_bytes: int = 0            # host RAM per rank
    device_bytes: int = 0         # GPU memory per rank (device="cuda")
    device: str = "cpu"
    disk_live_bytes: int = 0
    disk_steady_bytes: int = 0
    disk_peak_bytes: int = 0
    keep_snapshots: int = 0
    changed_per_snapshot: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _cache(name: str, budget_mb: float, line_size: int, rows: int, ways: int = 32,
           setting: str = "cache_mb", on_device: bool = False) -> TierPlan:
    cache_rows = int(budget_mb * 2**20 // (4 * line_size))
    if cache_rows < 1:
        flag = "--" + setting.replace("_", "-")
        raise ConfigError(f"{setting}={budget_mb:g} ({flag}, the {name} cache per rank): {budget_mb:g} "
                          f"MB holds no line of {4 * line_size} bytes: give {flag} MB, e.g. "
                          f"{flag} 64")
    held = min(cache_rows, rows)
    if on_device:
        return TierPlan(name, held, DeviceCache.bytes_for(cache_rows, ways, line_size),
                        note=f"{cache_rows:,} lines reserved", memory="device")
    return TierPlan(name, held, SetAssociativeCache.bytes_for(cache_rows, ways, line_size),
                    note=f"{cache_rows:,} lines reserved")


def _memory_store(name: str, rows: int, line_size: int, on_device: bool = False) -> TierPlan:
    """MemoryStore, or DeviceFullStore ``on_device``: the rows, and a hash index of 16-byte
    buckets at most 0.7 full (both sized for ``rows``, training's capacity)."""
    buckets = 16
    while buckets * HASH_MAX_LOAD < rows:
        buckets *= 2
    return TierPlan(name, rows, rows * 4 * line_size + buckets * HASH_BUCKET_BYTES,
                    memory="device" if on_device else "host")


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_slot_locations(rows: int, per_rank: int, world: int) -> None:
    """ConfigError when a rank's slot table would outgrow the directory's 32-bit locations:
    its rows with the garbage at its bound (GARBAGE_RATIO of the slots) must fit in them, as
    the store refuses to grow past them (a StoreError in the middle of training)."""
    slots = MAX_LOCATION + 1
    usable = int(slots * (1 - slot_file.GARBAGE_RATIO))
    if per_rank > usable:
        need = -(-rows // usable)
        raise ConfigError(
            f"{per_rank:,} rows per rank on the slot engine need up to "
            f"{per_rank / (1 - slot_file.GARBAGE_RATIO):,.0f} slots with garbage at its bound, "
            f"beyond the directory's {slots:,} 32-bit locations: spread the table over at least "
            f"{need} ranks (--world {need}; {world} now) or use --engine rocksdb")


def _slots(rows: int, line_size: int, physical_block_size: int) -> tuple[TierPlan, int]:
    rpb, block_bytes = block_layout(line_size, physical_block_size)
    blocks = -(-rows // rpb)
    live = blocks * block_bytes + rows * 8 + blocks * 8  # rows, key files, block checksums
    index = rows * INDEX_ENTRY_BYTES / INDEX_MEAN_LOAD
    # the active segment's block checksums, two staging buffers
    fixed = 2 * slot_file.IO_CHUNK_BYTES + default_segment_rows(line_size) // rpb * 8
    return TierPlan("ssd.slots", rows, int(index + fixed), live,
                    note=f"directory {INDEX_ENTRY_BYTES / INDEX_MEAN_LOAD:.1f} B/key"), live


def _rocksdb(rows: int, line_size: int) -> tuple[TierPlan, int]:
    live = rows * (4 * line_size + rdb.BLOB_RECORD_OVERHEAD + rdb.KEY_SST_BYTES)
    fixed = (rdb.BLOCK_CACHE_MB + 3 * 64) << 20  # block cache, up to 3 write buffers of 64 MB
    return TierPlan("ssd.rocksdb", rows, int(rows * ROCKSDB_TABLE_READER_BYTES + fixed), live,
                    note=f"table readers {ROCKSDB_TABLE_READER_BYTES:.1f} B/key"), live


def plan_capacity(rows: int, embedding_dim: int, optimizer: str = "sgd",
                  store: str = "cached_ssd", cache_mb: float = 0.0, host_cache_mb: float = 0.0,
                  engine: str = "slots", keep_snapshots: int = 0,
                  changed_per_snapshot: float = 0.01, world: int = 1,
                  physical_block_size: int = 4096, eviction: bool = False,
                  admit_sketch_mb: float = 0.0, device: str = "cpu") -> CapacityPlan:
    """RAM per tier and disk of a table of ``rows`` keys (over all ranks; figures are per rank).

    eviction: rows carry the feature lifecycle's two columns (last-seen step, frequency: 8
    bytes more a line); admit_sketch_mb: the admission sketch per rank (0: no admission);
    device: "cpu" (every tier in RAM) or "cuda" (the "device" tiers in GPU memory)."""
    if device not in DEVICES:
        raise ConfigError(f"device={device!r}: choose one of {DEVICES}")
    gpu = device == "cuda"
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"optimizer={optimizer!r}: choose one of {sorted(OPTIMIZER_STATES)}")
    for name, value in (("rows", rows), ("embedding_dim", embedding_dim), ("world", world)):
        if not whole_number(value) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    rows, embedding_dim, world = int(rows), int(embedding_dim), int(world)
    if not _real(changed_per_snapshot) or not 0.0 <= changed_per_snapshot <= 1.0:
        raise ConfigError(f"changed_per_snapshot={changed_per_snapshot!r} must be in [0, 1]")
    if not whole_number(keep_snapshots) or keep_snapshots < 0:
        raise ConfigError(f"keep_snapshots={keep_snapshots!r} must be a whole number >= 0")
    keep_snapshots = int(keep_snapshots)
    for name, value in (("admit_sketch_mb", admit_sketch_mb), ("cache_mb", cache_mb),
                        ("host_cache_mb", host_cache_mb)):
        if not _real(value) or not 0 <= value < math.inf:
            raise ConfigError(f"{name}={value!r} (--{name.replace('_', '-')}) must be a finite "
                              "number of MB >= 0")
    if isinstance(physical_block_size, bool) or physical_block_size not in PHYSICAL_BLOCK_SIZES:
        raise ConfigError(f"physical_block_size={physical_block_size!r} (--physical-block-size) "
                          "must be a power of two in 512..65536, as the store takes it")
    line_size = (1 + OPTIMIZER_STATES[optimizer]) * embedding_dim + (META_COLUMNS if eviction else 0)
    per_rank = -(-rows // world)
    out = CapacityPlan(rows, per_rank, line_size, 4 * line_size, keep_snapshots=keep_snapshots,
                       changed_per_snapshot=changed_per_snapshot, device=device)
    k, f = keep_snapshots, changed_per_snapshot
    if store in ("device_mem", "cached_host_mem"):
        if store == "cached_host_mem":
            out.tiers.append(_cache("device.lru", cache_mb, line_size, per_rank, on_device=gpu))
            bottom = _memory_store("host.full", per_rank, line_size)
        else:
            bottom = _memory_store("device.full", per_rank, line_size, on_device=gpu)
        out.tiers.append(bottom)
        snapshot = per_rank * (8 + 4 * line_size)  # keys.npy + lines.npy: a copy each
        out.disk_live_bytes = out.disk_steady_bytes = snapshot
        out.disk_peak_bytes = max(1, k) * snapshot
    elif store == "cached_ssd":
        out.tiers.append(_cache("device.lru", cache_mb, line_size, per_rank, on_device=gpu))
        if host_cache_mb:
            out.tiers.append(_cache("host.lru", host_cache_mb, line_size, per_rank,
                                    setting="host_cache_mb"))
        if engine == "slots":
            _check_slot_locations(rows, per_rank, world)
            tier, live = _slots(per_rank, line_size, physical_block_size)
            steady = live / (1 - slot_file.GARBAGE_RATIO)
            # each interval's compaction retires about f / GARBAGE_RATIO of the table (victims
            # hold ~GARBAGE_RATIO garbage); the k retained snapshots keep what it retired
            pinned = k * live * min(1.0, f / slot_file.GARBAGE_RATIO)
        elif engine == "rocksdb":
            tier, live = _rocksdb(per_rank, line_size)
            steady = live * rdb.COMPACT_ABOVE
            pinned = live * (k * f + (ROCKSDB_RECLAIM_SHARE if k else 0.0))
        else:
            raise ConfigError(f"engine={engine!r} must be 'slots' or 'rocksdb'")
        out.tiers.append(tier)
        out.disk_live_bytes, out.disk_steady_bytes = int(live), int(steady)
        out.disk_peak_bytes = int(steady + pinned)
    else:
        raise ConfigError(f"store={store!r} must be device_mem, cached_host_mem or cached_ssd")
    if admit_sketch_mb:
        width = CountMinSketch.width_for(admit_sketch_mb, 4)
        out.tiers.append(TierPlan("admission sketch", 0, 4 * width * 2,
                                  note=f"4 x {width:,} 16-bit counters"))
    out.ram_bytes = sum(t.ram_bytes for t in out.tiers if t.memory == "host")
    out.device_bytes = sum(t.ram_bytes for t in out.tiers if t.memory == "device")
    for t in out.tiers:
        t.disk_bytes = int(t.disk_bytes)
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return str(n)


def format_plan(p: CapacityPlan) -> str:
    """The plan as a markdown table and a few lines of totals (on "cuda" RAM and GPU memory in
    columns of their own)."""
    gpu = p.device == "cuda"
    head = "| tier | rows | RAM | GPU memory | disk | note |" if gpu else \
        "| tier | rows | RAM | disk | note |"
    lines = [f"{p.rows:,} rows ({p.rows_per_rank:,} per rank), lines of {p.line_size} floats "
             f"({p.line_bytes} B), training on {p.device}. Per rank:", "",
             head, "|---" * head.count(" | ") + "|---|"]
    for t in p.tiers:
        size = _size(t.ram_bytes)
        memory = (f"{size if t.memory == 'host' else '-'} | {size if t.memory == 'device' else '-'}"
                  if gpu else size)
        lines.append(f"| {t.tier} | {t.rows:,} | {memory} | "
                     f"{_size(t.disk_bytes) if t.disk_bytes else '-'} | {t.note} |")
    lines += ["", f"RAM in all: {_size(p.ram_bytes)}"]
    if gpu:
        lines.append(f"GPU memory in all: {_size(p.device_bytes)} (the tables' tiers; the dense "
                     "model, its batches and the step's buffers come on top)")
    lines += [f"disk, live table after a snapshot: {_size(p.disk_live_bytes)}",
              f"disk, steady state (garbage at its bound): {_size(p.disk_steady_bytes)}",
              f"disk, peak with {p.keep_snapshots} retained snapshot(s) of "
              f"{p.changed_per_snapshot:.1%} changed rows each: {_size(p.disk_peak_bytes)} "
              f"({p.disk_peak_bytes / max(1, p.disk_live_bytes):.2f}x the live table)"]
    return "\n".join(lines)


def plan_json(p: CapacityPlan) -> str:
    return json.dumps(p.as_dict())
