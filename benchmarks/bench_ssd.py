"""The SSD tier against the disk it runs on: raw random reads, the slot engine, a training run.

    python -m benchmarks.bench_ssd [--keys 4000000] [--steps 300] [--batch 256] [--dir /work]

Three measurements in one run, on the same disk (``--dir``, default a temp folder under the
current one; never tmpfs):

(a) raw: random 4 KiB reads with O_DIRECT (the page cache bypassed) from a ``--raw-mb`` file
    written with random bytes first (fallocated but unwritten blocks would read as zeros without
    touching the disk), with 1 and ``--io-threads`` threads. The reads are issued by the
    engine's GIL-free loop around libc ``pread``, so the figure is the disk's, not Python's.
    The 16-thread rate is taken again after each training round; the baseline is their mean.
(b) engine: ``SlotFileStore.find`` of ``--find-batch`` random rows out of ``--keys`` stored rows,
    with 1 and ``--io-threads`` I/O threads: rows/s and distinct blocks read/s, for two stores
    of the same rows, one whose blocks carry XXH3-64 checksums (the format written now) and one
    written with the legacy hand-made sum (as a format-2 snapshot brings them): every block read
    is verified, so the pair shows what the checksum costs the read path. The two are measured
    in turn, ``--find-rounds`` times each, and the CPU rate of each checksum over blocks in RAM
    is printed beside them.
(c) training: DLRM with tiny MLPs (bottom 16-E, top 16-1) on 26 columns of uniform random ids
    over ``--keys`` keys, dim 16, Adagrad (a line is 32 floats: 32 rows to a 4 KiB block), store
    cached_ssd (slots, built by the preset, so with its default I/O threads) with a device cache
    of ``--cache-share`` of the rows, prefetch depth 1. An untimed prefill trains every key
    ``--prefill-passes`` times, so the SSD tier holds them all and its free slots are spread as
    in a long run (garbage and compactions under way); then ``--steps`` steps are timed in ``--rounds`` rounds. Reported: the rows
    the SSD tier served (its ``hits`` in ``store_stats``) per training second, next to (a)'s
    16-thread rate; the goal is a ratio >= 0.7.

Uniform ids over a table of ``--keys`` x 32 floats (512 MB at 4M keys) keep the blocks a step
reads sparse (a few % of the file), so each row served costs one random block read, as in a
table far larger than memory. Results go to ``benchmarks/results/bench_ssd.json``.
``benchmarks.bench_scale`` measures the tier at scale (RAM per key, snapshot and reopen costs,
a table 3x the process's memory).
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import threading
import time
from types import SimpleNamespace

import numpy as np

import one_embedding as oe
from one_embedding.models import DLRM
from one_embedding.nn.loss import BCEWithLogits
from one_embedding.pipeline import Prefetcher
from one_embedding.store.direct_io import _pread_runs
from one_embedding.store.segments import BLOCK_CHECKSUM, LEGACY_BLOCK_CHECKSUM, block_checksums
from one_embedding.store.slot_file import SlotFileStore

from .common import markdown_table, print_header, run_folder, save_result

BLOCK = 4096
TABLES = 26
CHUNK = 1 << 17


# ---------------------------------------------------------------- (a) the raw disk
def write_raw_file(path: str, n_bytes: int) -> None:
    """``n_bytes`` of random bytes, written with O_DIRECT and fsync'd, so every block is real."""
    piece = 64 << 20
    buf = mmap.mmap(-1, piece)
    buf.write(np.random.default_rng(0).integers(0, 256, piece, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, n_bytes, piece):
            os.pwritev(fd, [memoryview(buf)[: min(piece, n_bytes - off)]], off)
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def raw_random_reads(path: str, threads: int, seconds: float) -> float:
    """Random 4 KiB O_DIRECT reads/s from ``path`` with ``threads`` threads, each with one read
    in flight, for ``seconds`` (256 reads per GIL-free call)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    n_blocks = os.path.getsize(path) // BLOCK
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    per_call = 256

    def worker(t):
        rng = np.random.default_rng(1000 + t)
        buf = mmap.mmap(-1, BLOCK)
        pinned = np.frombuffer(buf, np.uint8)
        at = np.zeros(per_call, np.int64)  # every read lands in the same 4 KiB buffer
        lengths = np.full(per_call, BLOCK, np.int64)
        fds = np.full(per_call, fd, np.int32)
        # one untimed call first: the kernel loads from numba's cache on its first call
        _pread_runs(fds[:1].copy(), pinned.ctypes.data, at[:1].copy(), at[:1].copy(),
                    lengths[:1].copy())
        start.wait()
        stop = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < stop:
            offsets = rng.integers(0, n_blocks, per_call) * BLOCK
            if _pread_runs(fds, pinned.ctypes.data, offsets, at, lengths) != -1:
                raise OSError(f"a read of {path!r} failed")
            n += per_call
        counts[t] = n
        del pinned

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return sum(counts) / elapsed


# ---------------------------------------------------------------- (b) the slot engine
def fill_store(store: SlotFileStore, n_keys: int) -> np.ndarray:
    """Store ``n_keys`` spread keys; row i holds the value i. Returns the keys (n,) uint64."""
    keys = np.arange(n_keys, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for s in range(0, n_keys, CHUNK):
        k = keys[s:s + CHUNK]
        values = np.arange(s, s + k.shape[0], dtype=np.float32)[:, None]
        store.insert_or_assign(k, np.broadcast_to(values, (k.shape[0], store.line_size)))
    return keys


def checksum_cpu_rates(seconds: float) -> dict:
    """GB/s of each block checksum over 8192 random 4 KiB blocks in RAM (one thread)."""
    blocks = np.random.default_rng(4).integers(0, 256, (8192, BLOCK), dtype=np.uint8)
    rates = {}
    for name in (BLOCK_CHECKSUM, LEGACY_BLOCK_CHECKSUM):
        block_checksums(blocks[:1], name)  # numba's cache loads on the first call
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            block_checksums(blocks, name)
            n += blocks.nbytes
        rates[name] = n / (time.perf_counter() - t0) / 1e9
    return rates


def engine_finds(args, root, line_size) -> list[dict]:
    """Finds of random rows on two stores of the same rows, one per block checksum, measured
    in turn (``--find-rounds`` times each, per I/O thread count) so drift hits both alike."""
    stores, keys = {}, None
    for checksum in (BLOCK_CHECKSUM, LEGACY_BLOCK_CHECKSUM):
        store = SlotFileStore(line_size, os.path.join(root, f"engine-{checksum}"),
                              expected_keys=args.keys, io_threads=args.io_threads)
        if not store.direct_io:
            raise SystemExit(f"{root} refuses O_DIRECT: run the benchmark on a disk (--dir)")
        store.pool.block_checksum = checksum  # the legacy one: as a format-2 snapshot's segments
        keys = fill_store(store, args.keys)
        stores[checksum] = store
    rng = np.random.default_rng(2)
    out = np.empty((args.find_batch, line_size), np.float32)
    rows = []
    for threads in (1, args.io_threads):
        totals = {c: [0, 0, 0.0] for c in stores}  # rows, blocks, seconds
        for _ in range(args.find_rounds):
            for checksum, store in stores.items():
                store.io_threads = threads
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < args.seconds / args.find_rounds:
                    idx = rng.choice(args.keys, args.find_batch, replace=False)
                    before = store.io_counts["read_blocks"]
                    missing = store.find(keys[idx], out, np.arange(args.find_batch, dtype=np.int64))
                    assert missing.shape[0] == 0 and np.array_equal(out[:, 0],
                                                                    idx.astype(np.float32))
                    totals[checksum][0] += args.find_batch
                    totals[checksum][1] += store.io_counts["read_blocks"] - before
                totals[checksum][2] += time.perf_counter() - t0
        for checksum, (n_rows, n_blocks, elapsed) in totals.items():
            rows.append({"what": f"slot engine find, {threads} I/O thread(s), blocks checked "
                                 f"with {checksum}" + (" (legacy)" if checksum
                                                       == LEGACY_BLOCK_CHECKSUM else ""),
                         "threads": threads, "checksum": checksum,
                         "rows_per_s": n_rows / elapsed, "blocks_per_s": n_blocks / elapsed})
    for store in stores.values():
        store.close()
    return rows


# ---------------------------------------------------------------- (c) a training run
def batches(rng, n, batch, per_table, ids_of=None):
    """``n`` batches of (dense (B, 13), ids (B, 26), labels (B,)); ids of column j in table j's
    range ``[j * per_table, (j + 1) * per_table)``, uniform unless ``ids_of(step)`` gives them."""
    offsets = np.arange(TABLES, dtype=np.int64) * per_table
    for step in range(n):
        ids = rng.integers(0, per_table, (batch, TABLES)) if ids_of is None else ids_of(step)
        b = ids.shape[0]
        yield SimpleNamespace(ids=ids + offsets,
                              dense=rng.standard_normal((b, 13)).astype(np.float32),
                              labels=(rng.random(b) < 0.25).astype(np.float32))


def train_steps(model, emb, opt, loss_fn, data, depth) -> None:
    with Prefetcher(data, emb, depth=depth) as prepared:
        for batch, state in prepared:
            loss_fn(model(batch.dense, state), batch.labels)
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()


def training_run(args, root, raw_path) -> dict:
    """Prefill, then ``--rounds`` rounds of timed training, the raw 16-thread rate measured
    after each round (so the baseline sees the same machine load as the training)."""
    per_table = args.keys // TABLES
    n_keys = per_table * TABLES
    line_size = 2 * args.dim  # embedding + Adagrad accumulator
    cache_mb = args.cache_share * n_keys * 4 * line_size / 2**20
    store = oe.make_cached_ssd_store_options(cache_mb, os.path.join(root, "train"),
                                             capacity=n_keys, size_factor=2, engine="slots")
    emb = oe.MultiTableEmbedding(
        "ssd_bench", args.dim, np.float32, np.int64,
        [oe.make_table_options(oe.make_uniform_initializer(-0.05, 0.05))] * TABLES, store, seed=1)
    model = DLRM(num_tables=TABLES, embedding_dim=args.dim, dense_features=13,
                 bottom_mlp=(16, args.dim), top_mlp=(16, 1), embedding=emb, seed=3)
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.05), embeddings=[emb],
                       parameters=list(model.parameters()))
    loss_fn = BCEWithLogits()
    rng = np.random.default_rng(5)

    # prefill (untimed): every key trained once per pass, in big batches of a permutation; a
    # second pass rewrites every row, so the file's free slots are spread as in a long run
    fill = args.prefill_batch
    t = time.perf_counter()
    for _ in range(args.prefill_passes):
        perms = np.stack([rng.permutation(per_table) for _ in range(TABLES)], axis=1)
        train_steps(model, emb, opt, loss_fn,
                    batches(rng, -(-per_table // fill), fill, per_table,
                            lambda s: perms[s * fill:(s + 1) * fill]), 1)
    prefill_s = time.perf_counter() - t
    before = emb.store_stats()
    ssd_tier = len(before) - 1
    assert "ssd" in before[ssd_tier]["tier"] and before[ssd_tier]["direct_io"]
    print(f"  prefill: {args.prefill_passes} x {n_keys:,} keys in {prefill_s:.1f} s; tiers: "
          + ", ".join(f"{s['tier']} {s['rows']:,} rows" for s in before), flush=True)

    # timed: uniform random ids; the prefetch thread reads step i+1's rows during step i
    seconds, raw_after = 0.0, []
    steps = -(-args.steps // args.rounds)
    for r in range(args.rounds):
        t = time.perf_counter()
        train_steps(model, emb, opt, loss_fn, batches(rng, steps, args.batch, per_table),
                    args.prefetch_depth)
        seconds += time.perf_counter() - t
        raw_after.append(raw_random_reads(raw_path, args.io_threads, args.seconds))
        hits = emb.store_stats()[ssd_tier]["hits"] - before[ssd_tier]["hits"]
        print(f"  round {r + 1}: SSD tier {hits / seconds:,.0f} rows/s so far; raw "
              f"{args.io_threads} threads after it {raw_after[-1]:,.0f} reads/s", flush=True)
    after = emb.store_stats()
    emb.close()
    delta = {k: after[ssd_tier][k] - before[ssd_tier][k]
             for k in ("hits", "misses", "writes", "read_blocks", "written_blocks", "compacted_rows")}
    top = {k: after[0][k] - before[0][k] for k in ("hits", "misses")}
    return {
        "keys": n_keys, "line_size": line_size, "cache_rows": after[0]["rows"],
        "cache_share": after[0]["rows"] / n_keys, "steps": steps * args.rounds, "batch": args.batch,
        "train_seconds": seconds, "samples_per_s": steps * args.rounds * args.batch / seconds,
        "top_hit_rate": top["hits"] / max(1, top["hits"] + top["misses"]),
        "ssd_tier": after[ssd_tier]["tier"], "ssd_hits": delta["hits"],
        "ssd_rows_per_s": delta["hits"] / seconds,
        "ssd_blocks_read_per_s": delta["read_blocks"] / seconds,
        "ssd_rows_written_per_s": delta["writes"] / seconds,
        "ssd_blocks_written_per_s": delta["written_blocks"] / seconds,
        "ssd_compacted_rows_per_s": delta["compacted_rows"] / seconds,
        "prefill_seconds": prefill_s, "raw_after_rounds": raw_after, "store_stats": after,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=4_000_000, help="rows of the SSD table")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=300, help="timed training steps")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds, raw reads after each")
    p.add_argument("--batch", type=int, default=256, help="samples per step (x 26 ids)")
    p.add_argument("--prefill-batch", type=int, default=8192)
    p.add_argument("--prefill-passes", type=int, default=2)
    p.add_argument("--cache-share", type=float, default=0.1, help="device cache, share of the rows")
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--io-threads", type=int, default=16, help="raw and engine-find threads")
    p.add_argument("--find-batch", type=int, default=8192, help="rows per engine find")
    p.add_argument("--raw-mb", type=int, default=2048, help="size of the raw-read file")
    p.add_argument("--seconds", type=float, default=4.0, help="per raw / find measurement")
    p.add_argument("--find-rounds", type=int, default=4,
                   help="turns each checksum's store takes in a find measurement")
    p.add_argument("--no-training", action="store_true", help="(a) and (b) only")
    p.add_argument("--dir", default=None, help="folder on the disk to measure, made if missing "
                                               "(default: the current folder)")
    args = p.parse_args(argv)
    config = {k: v for k, v in vars(args).items() if k != "dir"}
    m = print_header("SSD tier: raw disk, slot engine, training, rows/s", config)
    root = run_folder("bench_ssd_", args.dir or os.getcwd())
    config["fs_dir"] = root
    t = args.io_threads
    try:
        raw_path = os.path.join(root, "raw.bin")
        write_raw_file(raw_path, args.raw_mb << 20)
        raw = {n: raw_random_reads(raw_path, n, args.seconds) for n in (1, t)}
        print(f"  raw 4 KiB O_DIRECT reads/s: 1 thread {raw[1]:,.0f}, {t} threads {raw[t]:,.0f}",
              flush=True)
        finds = engine_finds(args, root, 2 * args.dim)
        for r in finds:
            print(f"  {r['what']}: {r['rows_per_s']:,.0f} rows/s, {r['blocks_per_s']:,.0f} blocks/s",
                  flush=True)
        raw_after_finds = raw_random_reads(raw_path, t, args.seconds)
        cpu = checksum_cpu_rates(min(args.seconds, 2.0))
        print("  block checksums over 4 KiB blocks in RAM, 1 thread: "
              + ", ".join(f"{k} {v:.2f} GB/s" for k, v in cpu.items()), flush=True)
        run = None if args.no_training else training_run(args, root, raw_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    raw_t = [raw[t], raw_after_finds, *(run["raw_after_rounds"] if run else [])]
    baseline = float(np.mean(raw_t))
    load = os.getloadavg()
    new_over_legacy = {
        th: next(r["rows_per_s"] for r in finds if r["threads"] == th
                 and r["checksum"] == BLOCK_CHECKSUM)
        / next(r["rows_per_s"] for r in finds if r["threads"] == th
               and r["checksum"] == LEGACY_BLOCK_CHECKSUM) for th in (1, t)}
    rows = [
        {"what": "raw random 4 KiB O_DIRECT reads, 1 thread", "per_s": raw[1], "unit": "reads/s"},
        {"what": f"raw random 4 KiB O_DIRECT reads, {t} threads (mean of before and after the "
                 "finds and after each training round)",
         "per_s": baseline, "unit": "reads/s (" + " / ".join(f"{r:,.0f}" for r in raw_t) + ")"},
        *[{"what": r["what"], "per_s": r["rows_per_s"],
           "unit": f"rows/s ({r['blocks_per_s']:,.0f} blocks/s)",
           "ratio": r["rows_per_s"] / (raw[1] if r["threads"] == 1 else baseline)} for r in finds],
        *[{"what": f"block checksum {k} over 4 KiB blocks in RAM, 1 thread", "per_s": v * 1e9,
           "unit": "bytes/s", "ratio": v * 1e9 / (BLOCK * baseline)} for k, v in cpu.items()],
    ]
    if run is not None:
        rows.append({"what": f"training: rows the SSD tier ({run['ssd_tier']}) served per "
                             "training second", "per_s": run["ssd_rows_per_s"],
                     "unit": f"rows/s ({run['ssd_blocks_read_per_s']:,.0f} blocks/s)",
                     "ratio": run["ssd_rows_per_s"] / baseline})
    print()
    print(markdown_table(rows, ["what", "per_s", "unit", "ratio"]))
    print(f"find rows/s with {BLOCK_CHECKSUM} / with the legacy sum, same run: "
          + ", ".join(f"{th} I/O thread(s) {v:.3f}" for th, v in new_over_legacy.items())
          + f"; checksum rows: ratio = bytes/s over the raw {t}-thread read rate in bytes/s")
    path = save_result("bench_ssd", {
        "machine": m, "config": config,
        "raw_reads_per_s": {"1": raw[1], str(t): raw_t, f"{t}_baseline": baseline},
        "engine_find": finds, "find_new_over_legacy": new_over_legacy,
        "checksum_cpu_gb_per_s": cpu, "training": run,
        "training_ratio": run["ssd_rows_per_s"] / baseline if run else None,
        "load_average_at_end": load, "rows": rows,
    })
    if run is None:
        print(f"\nwrote {path}")
        return
    print(f"ratio = rows/s / raw reads/s at the same thread count; training goal >= 0.7. Training: "
          f"{run['samples_per_s']:,.0f} samples/s, device cache {run['cache_rows']:,} rows "
          f"({run['cache_share']:.1%} of {run['keys']:,}), top-tier hit rate "
          f"{run['top_hit_rate']:.3f}; SSD writes {run['ssd_rows_written_per_s']:,.0f} rows/s in "
          f"{run['ssd_blocks_written_per_s']:,.0f} blocks/s (appends: none read first), plus "
          f"{run['ssd_compacted_rows_per_s']:,.0f} rows/s moved by compaction. Load average at the "
          f"end: "
          f"{load[0]:.1f} (1 min), {load[1]:.1f} (5 min) on {os.cpu_count()} cores")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
