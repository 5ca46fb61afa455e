"""Serving load: QPS and p50 / p99 latency of `one-embedding serve` through tritonclient, against
the same `Predictor` called in-process on the same requests, in the same run.

    python -m benchmarks.bench_serve [--steps 200] [--seconds 4]

A DLRM (Adagrad, cached_ssd slots, synthetic Kaggle x 0.05) is trained first; its final
checkpoint is served. Requests carry raw features (dense (b, 13) with NaNs, categorical (b, 26)
value strings) drawn from the synthetic source, batches of 1, 64 and 512 rows, at concurrency 1
and 16: in-process, 16 threads share one Predictor; over HTTP, 16 threads with a tritonclient
each, one request in flight per thread (binary tensors, tritonclient's default). Then batch 64 at concurrency 16
again while a training run resumes on the same path and publishes a checkpoint every 5 steps
(keeping 1), so the server switches snapshots under load: its QPS, latency, switches seen and
failed requests. Writes results/serve.json and prints the markdown table docs/serving.md shows.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .common import markdown_table, print_header, save_result

BATCHES = (1, 64, 512)
CONCURRENCY = (1, 16)
TRAIN = ["--model", "dlrm", "--optimizer", "adagrad", "--store", "cached_ssd", "--cache-mb", "16",
         "--synthetic-scale", "0.05", "--batch-size", "1024", "--eval-batches", "2",
         "--no-progress", "--metrics", os.devnull]


def train(path: str, *args, wait: bool = True):
    cmd = [sys.executable, "-m", "one_embedding", "train", *TRAIN, "--persistent-path", path,
           *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def make_requests(batch: int, count: int, seed: int):
    """``count`` (dense, categorical) raw requests of ``batch`` synthetic rows."""
    from one_embedding.data import SyntheticCriteo

    src = SyntheticCriteo("kaggle", scale=0.05, seed=7, num_rows=None)
    out = []
    for i in range(count):
        chunk = src.rows(seed * 1_000_003 + i * batch, batch)
        dense = np.round(np.expm1(chunk.dense.astype(np.float64))).astype(np.float32)
        dense[chunk.dense == 0] = np.nan  # the source's missing values
        cat = (chunk.ids - src.offsets[None, :]).astype(str).astype(object)
        out.append((dense, cat))
    return out


def summarize(latencies: list, seconds: float, batch: int) -> dict:
    lat = np.array(latencies) * 1e3
    return {"qps": len(latencies) / seconds, "samples_per_s": len(latencies) * batch / seconds,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "requests": len(latencies)}


def in_process(predictor, requests, concurrency: int, seconds: float) -> dict:
    lat, stop = [], time.perf_counter() + seconds
    lock = threading.Lock()

    def worker(k):
        i = k
        while time.perf_counter() < stop:
            dense, cat = requests[i % len(requests)]
            t = time.perf_counter()
            predictor.predict(dense, cat)
            with lock:
                lat.append(time.perf_counter() - t)
            i += concurrency

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    return summarize(lat, time.perf_counter() - t0, requests[0][0].shape[0])


def over_http(url: str, requests, concurrency: int, seconds: float, snapshots=None) -> dict:
    """``concurrency`` threads, each with its own tritonclient (a client is not thread-safe;
    its gevent-based async_infer adds ~10 ms a request here), each keeping one request in
    flight."""
    import tritonclient.http as httpclient

    def inputs(dense, cat):
        a = httpclient.InferInput("dense", list(dense.shape), "FP32")
        a.set_data_from_numpy(dense)
        b = httpclient.InferInput("categorical", list(cat.shape), "BYTES")
        b.set_data_from_numpy(cat)
        return [a, b]

    prepared = [inputs(*r) for r in requests]
    lat, failures = [], []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker(k):
        client = httpclient.InferenceServerClient(url, network_timeout=120,
                                                  connection_timeout=120)
        i = k
        try:
            while time.perf_counter() < stop:
                t = time.perf_counter()
                try:
                    result = client.infer("dlrm", prepared[i % len(prepared)])
                except Exception as e:
                    with lock:
                        failures.append(repr(e))
                    continue
                with lock:
                    lat.append(time.perf_counter() - t)
                    if snapshots is not None:
                        snapshots.add(result.get_response()["parameters"]["snapshot"])
                i += concurrency
        finally:
            client.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    out = summarize(lat, time.perf_counter() - t0, requests[0][0].shape[0])
    out["failed"] = len(failures)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps before serving")
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per cell")
    p.add_argument("--dir", default=None, help="folder for the run (default: $TMPDIR)")
    args = p.parse_args(argv)
    machine = print_header("serving: one-embedding serve (tritonclient) vs Predictor in-process",
                           {"model": "dlrm", "store": "cached_ssd slots", "steps": args.steps,
                            "batches": BATCHES, "concurrency": CONCURRENCY,
                            "seconds per cell": args.seconds})
    import tritonclient.http as httpclient

    from one_embedding.serving import Predictor

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_serve_", dir=args.dir) as root:
        path = os.path.join(root, "run")
        train(path, "--steps", args.steps, "--snapshot-interval", args.steps)
        port = free_port()
        # the server's private stores go under root too: a terminated server leaves them behind
        server = subprocess.Popen([sys.executable, "-m", "one_embedding", "serve",
                                   "--persistent-path", path, "--port", str(port),
                                   "--poll-seconds", "0.5", "--scratch", root],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"127.0.0.1:{port}"
        try:
            probe = httpclient.InferenceServerClient(url)
            deadline = time.monotonic() + 120
            while True:
                try:
                    if probe.is_server_ready():
                        break
                except Exception:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not come up")
                time.sleep(0.2)
            with Predictor(path) as predictor:
                for batch in BATCHES:
                    requests = make_requests(batch, max(8, 4096 // batch), seed=batch)
                    for conc in CONCURRENCY:
                        local = in_process(predictor, requests, conc, args.seconds)
                        remote = over_http(url, requests, conc, args.seconds)
                        for mode, r in (("in-process", local), ("server", remote)):
                            rows.append({"mode": mode, "batch": batch, "concurrency": conc, **r})
                        rows[-1]["vs_in_process"] = remote["qps"] / local["qps"]
                        print(f"batch {batch:4d} x{conc:<3d} in-process {local['qps']:8.1f} "
                              f"q/s p99 {local['p99_ms']:7.1f} ms | server {remote['qps']:8.1f} "
                              f"q/s p99 {remote['p99_ms']:7.1f} ms ({rows[-1]['vs_in_process']:.2f}x)",
                              flush=True)
                requests = make_requests(64, 64, seed=64)
                trainer = train(path, "--steps", args.steps + 400, "--snapshot-interval", 5,
                                "--keep-snapshots", 1, "--resume", wait=False)
                seen: set = set()
                time.sleep(1.0)  # the resumed run is under way
                reload = over_http(url, requests, 16, max(args.seconds, 8.0), snapshots=seen)
                trainer.terminate()
                trainer.wait()
                rows.append({"mode": "server, training publishing", "batch": 64,
                             "concurrency": 16, **reload, "snapshots_served": len(seen)})
                print(f"during reload: {reload['qps']:.1f} q/s, p99 {reload['p99_ms']:.1f} ms, "
                      f"{len(seen)} snapshots served, {reload['failed']} failed", flush=True)
        finally:
            server.terminate()
            server.wait()
    columns = ["mode", "batch", "concurrency", "qps", "samples_per_s", "p50_ms", "p99_ms",
               "vs_in_process", "snapshots_served", "failed"]
    print(markdown_table(rows, columns))
    print("wrote", save_result("serve", {"machine": machine, "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
