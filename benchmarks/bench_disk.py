"""Disk use of a long training run with interval checkpoints: bounded by --keep-snapshots.

    python -m benchmarks.bench_disk [--steps 400] [--snapshot-interval 20] [--keep 3]

Runs `one-embedding train` on a cached_ssd store (a small RAM cache over the SSD table, Adagrad:
a line is the row and its accumulator) for each SSD engine, once with ``--keep-snapshots K``
and once keeping every checkpoint (``--keep-snapshots 0``, the baseline: what the run wrote
before retention existed). While it trains, a thread samples the bytes allocated under
``--persistent-path`` (``st_blocks``, each hard-linked file counted once) every 0.2 s.
Reported per run: the peak and the final disk use, both as bytes and as a multiple of the live
table (rows stored x line bytes at the end), the checkpoints left, and about 40 of the samples
in time order, so growth over the run is visible.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from one_embedding.store.rocksdb_store import tree_disk_bytes

from .common import markdown_table, print_header, run_folder, save_result


def train(args, engine: str, keep: int, root: str) -> dict:
    path = os.path.join(root, f"{engine}-keep{keep}")
    metrics = os.path.join(root, f"{engine}-keep{keep}.jsonl")
    cmd = [sys.executable, "-m", "one_embedding", "train", "--model", "dlrm", "--data", "synthetic",
           "--synthetic-scale", str(args.synthetic_scale), "--store", "cached_ssd",
           "--engine", engine, "--cache-mb", str(args.cache_mb), "--optimizer", "adagrad",
           "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--snapshot-interval", str(args.snapshot_interval), "--keep-snapshots", str(keep),
           "--eval-interval", "0", "--persistent-path", path, "--metrics", metrics]
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            if os.path.isdir(path):
                samples.append((time.monotonic(), tree_disk_bytes(path)))
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.monotonic()
    sampler.start()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"train failed ({engine}, keep {keep}):\n{proc.stderr[-2000:]}")
    final = [json.loads(line) for line in open(metrics)]
    record = next(r for r in final if r["event"] == "final")
    config = next(r for r in final if r["event"] == "config")
    line_bytes = 4 * config["embedding_dim"] * 2  # Adagrad: row + accumulator
    live = record["rows_stored"] * line_bytes
    end_bytes = tree_disk_bytes(path)
    peak = max([b for _, b in samples] + [end_bytes])
    snaps = sorted(os.listdir(os.path.join(path, "0-1", "snapshots")))
    return {
        "engine": engine, "keep_snapshots": keep, "steps": args.steps,
        "checkpoints_written": args.steps // args.snapshot_interval + 1,  # and the final one
        "checkpoints_left": len(snaps),
        "live_mb": live / 2**20, "peak_mb": peak / 2**20, "end_mb": end_bytes / 2**20,
        "peak_x_live": peak / live, "end_x_live": end_bytes / live,
        "seconds": time.monotonic() - t0,
        "disk_mb_over_time": [round(b / 2**20, 2) for _, b in samples[:: max(1, len(samples) // 40)]],
        "snapshots_left": snaps,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--snapshot-interval", type=int, default=20)
    p.add_argument("--keep", type=int, default=3, help="--keep-snapshots of the bounded runs")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--synthetic-scale", type=float, default=0.01)
    p.add_argument("--cache-mb", type=float, default=1.0)
    p.add_argument("--engines", nargs="+", default=["slots", "rocksdb"])
    p.add_argument("--dir", help="where the runs write, made if missing (default: a run folder "
                                 "in the current one, on this disk)")
    args = p.parse_args(argv)
    config = {k: v for k, v in vars(args).items() if k != "dir"}
    machine = print_header("Disk use over a run with interval checkpoints", config)
    root = run_folder("bench_disk_", args.dir or os.getcwd())
    rows = []
    try:
        for engine in args.engines:
            for keep in (args.keep, 0):
                r = train(args, engine, keep, root)
                rows.append(r)
                print(f"  {engine}, --keep-snapshots {keep}: peak {r['peak_mb']:.1f} MB "
                      f"({r['peak_x_live']:.1f}x the live table of {r['live_mb']:.1f} MB), "
                      f"end {r['end_mb']:.1f} MB, {r['checkpoints_left']} checkpoints left",
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(markdown_table(rows, ["engine", "keep_snapshots", "checkpoints_left", "live_mb",
                                "peak_mb", "peak_x_live", "end_mb", "end_x_live"]))
    for engine in args.engines:
        bounded, every = [r for r in rows if r["engine"] == engine]
        print(f"{engine}: --keep-snapshots {args.keep} peaks at {bounded['peak_mb']:.1f} MB, "
              f"{bounded['peak_mb'] / every['peak_mb']:.2f}x of keeping every checkpoint "
              f"({every['peak_mb']:.1f} MB)")
    save_result("bench_disk", {"machine": machine, "config": config, "runs": rows})


if __name__ == "__main__":
    main()
