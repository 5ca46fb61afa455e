"""Data sources at the pace of the step they feed: samples/s of each source, beside the step rates.

    python -m benchmarks.bench_data [--rows 2000000] [--file-rows 1000000] [--batch-size 65536]
        [--cardinalities kaggle] [--scale 0.01] [--alpha 1.05] [--repeats 3]

Sources, in one run on this machine:

* synthetic, CPU numba (``SyntheticCriteo.generate``: all cores, the generator the CPU trainer
  and ``bench`` use) and, as the same-run baseline, the numpy generator this one replaced (one
  thread, ``numpy.random.default_rng`` per 4096-row block, kept below as ``legacy_block``), plus
  the numpy reference of today's arithmetic (``reference_rows``, the test oracle);
* synthetic through the loader (``BatchLoader(split="train")``: the CLI's path, its read-ahead
  thread included);
* synthetic on the device (``DeviceSynthetic``, CuPy; only where CuPy sees a GPU);
* Parquet and TSV files through ``BatchLoader`` (pyarrow decoding / the numba TSV parser), then
  through ``DeviceBatches`` (page-locked staging and its own stream on a GPU; plain buffers here),
  each file dropped from the page cache first (posix_fadvise DONTNEED), so the disk is measured.

Each figure is the best of ``--repeats`` passes (the machine is shared; figures move 10-30%);
CPU seconds per sample are printed beside wall time so a busy machine reads as such. The step
rates to feed are committed measurements, quoted, not re-measured here: the CPU DLRM step,
21,376 samples/s (``bench_dlrm_peers``, batch 4096, 2 cores: ``results/bench_dlrm_peers.json``,
the table of docs/performance.md), and the GPU one, ``bench_gpu``'s part 2 DLRM step on one
NVIDIA H200 at batch 65,536: 1.26-1.73 M samples/s over the committed runs under
``results/gpu_check_h200*/``, the fastest quoted (1,726,705 samples/s,
``results/gpu_check_h200_2026-11-27/run2/bench.txt``). No committed figure is from an H100.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from .common import markdown_table, print_header, save_result

#: the step rates a source must keep up with, quoted from committed results (the docstring says
#: which): the CPU DLRM step of bench_dlrm_peers and bench_gpu's fastest DLRM step on an H200
STEP_RATES = {"CPU DLRM step (bench_dlrm_peers.json, 2 cores, batch 4096)": 21_376,
              "GPU bench_gpu.py step (gpu_check_h200_2026-11-27/run2, one H200, batch 65,536)":
                  1_726_705}


def legacy_block(src, block: int, rows: int = 4096):
    """The synthetic generator as it was before issue 30 (numpy, one thread, PCG64 per block,
    rejection-inversion on libm's log/exp): same distributions, other values. Baseline only."""
    rng = np.random.default_rng([src.seed, block])
    f = src.num_features
    ids = np.empty((rows, f), np.int64)
    weight = np.empty((rows, f))
    for c, n in enumerate(src.cardinalities):
        a = src.alpha
        H = lambda x: np.expm1((1 - a) * np.log(x)) / (1 - a) if a != 1 else np.log(x)  # noqa
        H_inv = lambda y: np.exp(np.log1p((1 - a) * y) / (1 - a)) if a != 1 else np.exp(y)  # noqa
        h = lambda x: np.exp(-a * np.log(x))  # noqa
        h_x1, h_n = H(1.5) - 1.0, H(n + 0.5)
        s = 2.0 - H_inv(H(2.5) - h(2.0))
        out = np.empty(rows, np.int64)
        todo = np.arange(rows)
        while todo.size:
            u = h_n + rng.random(todo.size) * (h_x1 - h_n)
            x = H_inv(u)
            k = np.clip(np.floor(x + 0.5), 1, n)
            accept = (k - x <= s) | (u >= H(k + 0.5) - h(k))
            out[todo[accept]] = k[accept].astype(np.int64)
            todo = todo[~accept]
        weight[:, c] = src.head_rank / (src.head_rank + out - 1.0)
        ids[:, c] = src.offsets[c] + ((out - 1) * src._mult[c] + src._shift[c]) % n
    z = rng.standard_normal((rows, 13))
    x = np.floor(np.exp(src.DENSE_MU + src.DENSE_SIGMA * z))
    missing = rng.random((rows, 13)) < src.DENSE_MISSING
    dense = np.where(missing, 0.0, np.log1p(x)).astype(np.float32)
    from one_embedding.data.schema import splitmix64
    unit = (splitmix64(ids.astype(np.uint64) ^ src._salt) >> np.uint64(11)) * 2.0 ** -53
    logits = src.bias + z[:, :4] @ src.DENSE_WEIGHTS + ((2 * unit - 1) * weight * src._amp).sum(1)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return dense, ids, labels


def best_rate(fn, rows: int, repeats: int) -> dict:
    """fn() produces ``rows`` samples; best wall rate of ``repeats`` and CPU ns per sample."""
    best, cpu = 0.0, float("inf")
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall, used = time.perf_counter() - w, time.process_time() - c
        best = max(best, rows / wall)
        cpu = min(cpu, used / rows * 1e9)
    return {"samples_per_s": best, "cpu_ns_per_sample": cpu}


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_tsv(path: str, src, rows: int) -> None:
    """Raw Criteo lines: label, 13 integers (empty when missing), 26 hex categoricals."""
    with open(path, "w") as f:
        for lo in range(0, rows, 100_000):
            dense, ids, labels, _ = src.generate(lo, min(100_000, rows - lo))
            raw = np.rint(np.expm1(dense.astype(np.float64))).astype(np.int64)
            cols = [labels.astype(np.int64).astype(str)]
            cols += [np.where(dense[:, j] == 0, "", raw[:, j].astype(str)) for j in range(13)]
            cols += [np.char.mod("%08x", ids[:, c] % (1 << 32)) for c in range(ids.shape[1])]
            f.write("\n".join("\t".join(r) for r in zip(*cols)) + "\n")


def consume(iterable) -> int:
    n = 0
    for batch in iterable:
        n += len(batch)
    return n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="synthetic rows per pass")
    p.add_argument("--file-rows", type=int, default=1_000_000, help="rows in the Parquet file")
    p.add_argument("--tsv-rows", type=int, default=300_000, help="rows in the TSV file")
    p.add_argument("--batch-size", type=int, default=65_536)
    p.add_argument("--cardinalities", default="kaggle")
    p.add_argument("--scale", type=float, default=0.01, help="the CLI's default: kaggle x 0.01")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import numba

    from one_embedding.backend import cupy_available
    from one_embedding.data import BatchLoader, SyntheticCriteo, write_parquet
    from one_embedding.data.device import DeviceBatches
    from one_embedding.kernels.device_ops import Launcher

    config = {k: v for k, v in vars(args).items()}
    config["numba_threads"] = numba.get_num_threads()
    machine = print_header("bench_data: samples/s of each data source", config)
    print(f"load average at start: {os.getloadavg()}")
    src = SyntheticCriteo(args.cardinalities, scale=args.scale, alpha=args.alpha, seed=0,
                          num_rows=args.rows)
    src.generate(0, 1000)         # compile (numba caches it on disk afterwards)
    n, b = args.rows, args.batch_size
    rows = []

    def gen_numba():
        for lo in range(0, n, b):
            src.generate(lo, min(b, n - lo))

    rows.append({"source": "synthetic, CPU numba (generate)", **best_rate(gen_numba, n,
                                                                           args.repeats)})
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    one_thread = best_rate(gen_numba, n, args.repeats)
    numba.set_num_threads(threads)
    rows.append({"source": "synthetic, CPU numba, 1 thread", **one_thread})
    legacy_rows = min(n, 262_144)
    rows.append({"source": "synthetic, CPU numpy before issue 30 (baseline)",
                 **best_rate(lambda: [legacy_block(src, k) for k in range(legacy_rows // 4096)],
                             legacy_rows // 4096 * 4096, args.repeats)})
    ref_rows = min(n, 131_072)
    rows.append({"source": "synthetic, numpy reference of today's arithmetic",
                 **best_rate(lambda: src.reference_rows(0, ref_rows), ref_rows, 1)})
    train_rows = int(n * 0.9) // b * b
    rows.append({"source": "synthetic through BatchLoader(split=train) (the CLI's path)",
                 **best_rate(lambda: consume(BatchLoader(src, b, split="train", drop_last=True)),
                             train_rows, args.repeats)})

    if cupy_available():
        import cupy

        from one_embedding.data.device import DeviceSynthetic

        device = DeviceSynthetic(src)
        device.rows(0, b)
        cupy.cuda.get_current_stream().synchronize()

        def gen_device():
            for lo in range(0, n, b):
                device.rows(lo, min(b, n - lo))
            cupy.cuda.get_current_stream().synchronize()

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        rows.append({"source": f"synthetic, device ({name})",
                     **best_rate(gen_device, n, args.repeats)})
        want = src.generate(12345, 4096)
        got = [cupy.asnumpy(a) for a in device.rows(12345, 4096)]
        same = all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
        print(f"device rows 12345..16440 equal the CPU generator's bit for bit: {same}")
        staging = None      # the CuPy launcher
    else:
        print("synthetic on the device: skipped (no CuPy or no CUDA device)")
        staging = Launcher()    # the same staging code path, numpy buffers, no streams

    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        parquet = os.path.join(tmp, "data.parquet")
        write_parquet(parquet, [src.rows(lo, min(b, args.file_rows - lo)).batch()
                                for lo in range(0, args.file_rows, b)])
        size = os.path.getsize(parquet)
        file_rows = args.file_rows // b * b

        def parquet_pass(stage):
            drop_from_page_cache(parquet)
            loader = BatchLoader([parquet], b, drop_last=True)
            return consume(DeviceBatches(loader, staging) if stage else loader)

        rows.append({"source": f"Parquet ({size / 2**20:.0f} MiB) through BatchLoader",
                     **best_rate(lambda: parquet_pass(False), file_rows, args.repeats)})
        rows.append({"source": "Parquet through BatchLoader + DeviceBatches (staging)",
                     **best_rate(lambda: parquet_pass(True), file_rows, args.repeats)})
        tsv = os.path.join(tmp, "data.tsv")
        write_tsv(tsv, src, args.tsv_rows)
        tsv_rows = args.tsv_rows // b * b

        def tsv_pass():
            drop_from_page_cache(tsv)
            return consume(DeviceBatches(BatchLoader([tsv], b, drop_last=True), staging))

        rows.append({"source": f"TSV ({os.path.getsize(tsv) / 2**20:.0f} MiB) through BatchLoader"
                               " + DeviceBatches", **best_rate(tsv_pass, tsv_rows, args.repeats)})

    for r in rows:
        for label, rate in STEP_RATES.items():
            r["x " + label.split(" (")[0]] = r["samples_per_s"] / rate
    columns = ["source", "samples_per_s", "cpu_ns_per_sample"] + [
        "x " + label.split(" (")[0] for label in STEP_RATES]
    print(markdown_table(rows, columns))
    for label, rate in STEP_RATES.items():
        print(f"step rate to feed: {label}: {rate:,} samples/s")
    cores = os.cpu_count() or 1
    projected = cores * 1e9 / one_thread["cpu_ns_per_sample"]
    print(f"numba generator, 1 thread: {one_thread['cpu_ns_per_sample']:,.0f} CPU ns per sample, "
          f"so {projected:,.0f} samples/s on {cores} cores that nothing else uses (a projection; "
          f"the measured rates above share the cores with whatever else runs)")
    print(f"load average at end: {os.getloadavg()}")
    print("result:", save_result("bench_data", {"machine": machine, "config": config,
                                                "rows": rows, "step_rates": STEP_RATES}))


if __name__ == "__main__":
    main()
