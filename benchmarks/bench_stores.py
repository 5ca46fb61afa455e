"""Tiered stores: lookup + update throughput and hit rates per preset and SSD engine.

    python -m benchmarks.bench_stores [--keys 10000000] [--dim 64] [--batches 12] [--warmup 8]

Each step takes a Zipf(1.05) batch of 26 x 4096 ids over ``--keys`` keys, de-duplicates it, looks
the unique keys up through the tier chain (misses get fresh rows), adds a constant to every line
(standing in for the optimizer) and puts the lines back, as the training front end does. Lines
carry Adagrad's state (line_size = 2 * dim). Reported: unique rows per second of lookup + put,
and the top cache's hit rate, over the timed steps after ``--warmup`` steps; ``stored_keys``,
the distinct keys the table holds at the end, in any tier (``len`` of the chain; the bottom
tier's rows alone, 0 while every key sat in a cache, are ``bottom_tier_rows`` in the JSON), and
``disk_MB``, the bottom tier's bytes on disk as the timed steps left it.

Baselines, measured in the same run on the same rows:
- slot engine read with buffered I/O (index probe + block reads + row copies, from the page
  cache) next to a plain ``np.memmap`` gather of the same slots (goal >= 0.8x);
- slot engine read with O_DIRECT (its default: every block from the disk), blocks read per second
  next to the disk's raw random 4 KiB O_DIRECT reads/s at 16 threads on the same file;
- RocksDB engine read next to ``rocksdict`` multi-get alone on pre-encoded keys.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

import numpy as np

import one_embedding as oe
from one_embedding.chain import build_chain
from one_embedding.store.rocksdb_store import RocksDBStore, encode_keys
from one_embedding.store.slot_file import SlotFileStore

from .bench_ssd import raw_random_reads
from .common import markdown_table, print_header, run_folder, save_result, zipf_ids

BATCH = (4096, 26)
CHUNK = 1 << 16


def store_configs(args, root):
    mb, host_mb = args.cache_mb, args.host_cache_mb
    sf = 2
    return {
        "device_mem": oe.make_device_mem_store_options(None, capacity=args.keys, size_factor=sf),
        f"cached_host_mem lru {mb}MB": oe.make_cached_host_mem_store_options(
            mb, None, args.keys, size_factor=sf),
        f"cached_ssd slots {mb}MB": oe.make_cached_ssd_store_options(mb, os.path.join(root, "s"),
                                                                      size_factor=sf, engine="slots"),
        f"cached_ssd slots {mb}MB+host {host_mb}MB": oe.make_cached_ssd_store_options(
            mb, os.path.join(root, "sh"), size_factor=sf, engine="slots", host_cache_budget_mb=host_mb),
        f"cached_ssd rocksdb {mb}MB": oe.make_cached_ssd_store_options(
            mb, os.path.join(root, "r"), size_factor=sf, engine="rocksdb"),
    }


def run_chain(name, options, batches, warmup, line_size):
    path = options.persistent_path
    chain = build_chain(options, line_size, line_size // 2, path, 1)
    top = chain.counters[0]
    seconds = 0.0
    hits0 = misses0 = rows = 0
    for i, ids in enumerate(batches):
        if i == warmup:
            hits0, misses0 = top.hits, top.misses
        keys = np.unique(ids).astype(np.uint64)
        t = time.perf_counter()
        lines, found = chain.lookup(keys)
        lines[~found] = 0.0
        lines += 0.001
        chain.put(keys, lines)
        if i >= warmup:
            seconds += time.perf_counter() - t
            rows += keys.size
    hits, misses = top.hits - hits0, top.misses - misses0
    stats = chain.stats()      # as the timed steps left the tiers: disk_MB before any flush
    stored = len(chain)        # every key the table holds, whichever tier (flushes, untimed)
    chain.close()
    return {
        "store": name,
        "rows_per_s": rows / seconds,
        "top_hit_rate": hits / max(1, hits + misses),
        "unique_rows_per_step": rows / max(1, len(batches) - warmup),
        "stored_keys": stored,
        "bottom_tier_rows": stats[-1]["rows"],
        "disk_MB": stats[-1]["disk_bytes"] / 2**20,
    }


def find_all(store, keys):
    """The lines of ``keys`` (n,) uint64 through ``store.find`` -> (found (n,) bool, lines (n, L))."""
    out = np.empty((keys.shape[0], store.line_size), np.float32)
    missing = store.find(keys, out, np.arange(keys.shape[0], dtype=np.int64))
    found = np.ones(keys.shape[0], np.bool_)
    found[missing] = False
    return found, out


def best_of(fn, repeats=3):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def engine_reads(args, root, line_size):
    """Random reads of ``--read-batch`` stored keys: engine vs raw baseline, rows/s."""
    rng = np.random.default_rng(1)
    n = args.read_rows
    keys = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    lines = rng.standard_normal((n, line_size)).astype(np.float32)
    out = []

    # Buffered I/O: the engine's own code path (index probe, block reads, row copies) against a
    # plain memmap gather of the same slots, both served by the page cache.
    slots = SlotFileStore(line_size, os.path.join(root, "read_s"), expected_keys=n,
                          direct_io=False)
    for s in range(0, n, 1 << 16):
        slots.insert_or_assign(keys[s:s + CHUNK], lines[s:s + CHUNK])
    probe = rng.choice(keys, size=args.read_batch, replace=False)
    seg_of, slot_of = slots._split(slots._index.find(probe, slots._keys_of))
    rpb, bb = slots.rows_per_block, slots.block_bytes
    views = {}  # segment index -> (blocks, rows_per_block, line_size) view of its rows file
    for index, seg in slots._segments.items():
        path = slots.pool.path(seg.id, "rows")
        views[index] = np.ndarray((os.path.getsize(path) // bb, rpb, line_size), np.float32,
                                  buffer=np.memmap(path, np.float32, "r"),
                                  strides=(bb, 4 * line_size, 4))
    groups = [(np.flatnonzero(seg_of == i), views[int(i)]) for i in np.unique(seg_of)]

    def memmap_gather():
        out = np.empty((probe.shape[0], line_size), np.float32)
        for rows, view in groups:
            out[rows] = view[slot_of[rows] // rpb, slot_of[rows] % rpb]
        return out

    found, got = find_all(slots, probe)
    assert found.all() and np.array_equal(got, memmap_gather())
    base = best_of(memmap_gather)
    for io_threads in (1, 16):
        slots.io_threads = io_threads
        eng = best_of(lambda: find_all(slots, probe))
        out.append({"read": f"slots find, buffered, {io_threads} I/O thread(s)",
                    "rows_per_s": args.read_batch / eng,
                    "baseline": "np.memmap gather (page cache, 1 thread)",
                    "baseline_rows_per_s": args.read_batch / base, "ratio": base / eng})
    slots.close()

    # O_DIRECT (the default): every block comes from the disk; the baseline is the disk itself,
    # random 4 KiB O_DIRECT reads with 16 threads on the same file, measured right after.
    slots = SlotFileStore(line_size, os.path.join(root, "read_d"), expected_keys=n)
    if slots.direct_io:  # a file system that refuses O_DIRECT (tmpfs) has no disk to measure
        for s in range(0, n, 1 << 16):
            slots.insert_or_assign(keys[s:s + CHUNK], lines[s:s + CHUNK])
        before = slots.io_counts["read_blocks"]
        t = time.perf_counter()
        found, got = find_all(slots, probe)
        eng = time.perf_counter() - t
        assert found.all() and np.array_equal(got, memmap_gather())
        blocks = slots.io_counts["read_blocks"] - before
        biggest = max(slots._segments.values(), key=lambda seg: seg.n_slots)
        raw = raw_random_reads(slots.pool.path(biggest.id, "rows"), 16, 3.0)
        out.append({"read": "slots find, O_DIRECT, 16 I/O threads",
                    "rows_per_s": args.read_batch / eng, "blocks_per_s": blocks / eng,
                    "baseline": "raw 4 KiB O_DIRECT reads/s, 16 threads",
                    "baseline_rows_per_s": raw, "ratio": blocks / eng / raw})
    slots.close()

    rdb = RocksDBStore(line_size, os.path.join(root, "read_r"))
    for s in range(0, n, 1 << 16):
        rdb.insert_or_assign(keys[s:s + CHUNK], lines[s:s + CHUNK])
    rdb._db.flush()
    encoded = encode_keys(probe)
    found, got = find_all(rdb, probe)
    order = np.argsort(keys)
    assert found.all() and np.array_equal(got, lines[order[np.searchsorted(keys[order], probe)]])
    pool = rdb._pool
    half = len(encoded) // 2
    raw = {1: lambda: rdb._db.get(encoded),
           2: lambda: list(pool.map(rdb._db.get, [encoded[:half], encoded[half:]]))}
    for threads in (1, 2):
        base = best_of(raw[threads])
        rdb.threads, rdb._pool = threads, (pool if threads > 1 else None)
        eng = best_of(lambda: find_all(rdb, probe))
        out.append({"read": f"rocksdb find, {threads} thread(s)", "rows_per_s": args.read_batch / eng,
                    "baseline": f"rocksdict multi-get alone, {threads} thread(s)",
                    "baseline_rows_per_s": args.read_batch / base, "ratio": base / eng})
    rdb._pool = pool
    rdb.close()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batches", type=int, default=12, help="timed steps")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--cache-mb", type=float, default=64)
    p.add_argument("--host-cache-mb", type=float, default=256)
    p.add_argument("--read-rows", type=int, default=1_000_000, help="rows stored for the read test")
    p.add_argument("--read-batch", type=int, default=65536)
    p.add_argument("--dir", default=None, help="folder for the SSD stores, made if missing "
                                               "(default: a temp dir)")
    p.add_argument("--only", default=None, help="run only stores whose name contains this")
    args = p.parse_args(argv)
    line_size = 2 * args.dim
    config = {"keys": args.keys, "dim": args.dim, "line_size": line_size, "batch": "26x4096",
              "zipf": 1.05, "warmup": args.warmup, "timed": args.batches, "cache_mb": args.cache_mb,
              "host_cache_mb": args.host_cache_mb, "read_rows": args.read_rows,
              "read_batch": args.read_batch}
    m = print_header("Tiered stores: lookup + put, rows/s", config)
    root = run_folder("bench_stores_", args.dir)
    config["fs_dir"] = root
    try:
        rng = np.random.default_rng(0)
        batches = [zipf_ids(rng, 1.05, args.keys, BATCH) for _ in range(args.warmup + args.batches)]
        rows = []
        for name, options in store_configs(args, root).items():
            if args.only and args.only not in name:
                continue
            r = run_chain(name, options, batches, args.warmup, line_size)
            rows.append(r)
            print(f"  {name}: {r['rows_per_s']:,.0f} rows/s, hit rate {r['top_hit_rate']:.3f}", flush=True)
        print()
        print(markdown_table(rows, ["store", "rows_per_s", "top_hit_rate", "unique_rows_per_step",
                                    "stored_keys", "disk_MB"]))
        reads = engine_reads(args, root, line_size)
        print()
        print(markdown_table(reads, ["read", "rows_per_s", "baseline", "baseline_rows_per_s", "ratio"]))
        print("ratio = engine rows/s / baseline rows/s (buffered slot engine: goal >= 0.8); for "
              "O_DIRECT, the engine's blocks read/s / the raw reads/s (blocks_per_s in the JSON)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = save_result("bench_stores", {"machine": m, "config": config, "stores": rows, "reads": reads})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
