"""REST against gRPC on one `one-embedding serve` process: rows/s and the server's CPU per
request, dynamic batching on, batch 1 and 64, CLIENTS requests in flight.

    python -m benchmarks.bench_serve_fronts [--seconds 5] [--baseline-src DIR]

A shorter companion of ``bench_serve`` (its helpers: wrk for REST, h2load and grpcio's asyncio
client for gRPC, the server's /metrics for the count of answered requests, /proc for its CPU).
With ``--baseline-src`` (another checkout's ``src`` folder, e.g. the commit before a change),
a server running that code is measured the same way right before this checkout's, in the same
run: the machine is shared, so only cells measured back to back compare.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from .bench_serve import (BATCHES, Server, children_cpu_seconds, drive_grpc, drive_h2load,
                          drive_rest, ensure_tool, grpc_body, make_requests, rest_body,
                          server_count, train)
from .common import markdown_table, print_header, save_result

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def measure(server: Server, proto: str, files: tuple, clients: int, seconds: float,
            tools: dict, root: str) -> dict:
    """One cell: ``proto`` load on ``server`` -> rate, latency and CPU per answered request."""
    rest_file, header, grpc_file, h2_file = files
    answered = server_count(server, "one_embedding_requests_total", model="dlrm")
    server_cpu, client_cpu = server.cpu_seconds(), children_cpu_seconds()
    if proto == "REST":
        r = drive_rest(tools["wrk"], server.port, rest_file, header, clients, seconds, root)
    elif proto == "gRPC":
        r = drive_h2load(tools["h2load"], server, h2_file, clients, seconds)
    else:
        r = drive_grpc(server.grpc_port, grpc_file, clients, seconds)
    served = max(1.0, server_count(server, "one_embedding_requests_total", model="dlrm")
                 - answered)
    return {"qps": r["qps"], "failed": r["failed"], "p50_ms": r.get("p50_ms"),
            "p99_ms": r.get("p99_ms"), "mean_ms": r.get("mean_ms"),
            "server_cpu_ms": (server.cpu_seconds() - server_cpu) * 1e3 / served,
            "client_cpu_ms": (children_cpu_seconds() - client_cpu) * 1e3 / served}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50, help="training steps before serving")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell")
    p.add_argument("--clients", type=int, default=16, help="requests kept in flight")
    p.add_argument("--max-batch-size", type=int, default=1024)
    p.add_argument("--baseline-src", default=None,
                   help="a `src` folder of another version, served and measured first")
    p.add_argument("--dir", default=None, help="folder for the run (default: $TMPDIR)")
    args = p.parse_args(argv)
    tools = {"wrk": ensure_tool("wrk", "wrk", "wrk"),
             "h2load": ensure_tool("h2load", "nghttp2-client", "h2load")}
    versions = ([("baseline", os.path.abspath(args.baseline_src))] if args.baseline_src else []) \
        + [("this checkout", HERE)]
    config = {"model": "dlrm", "steps": args.steps, "clients": args.clients,
              "seconds per cell": args.seconds, "server": f"--max-batch-size "
              f"{args.max_batch_size} --poll-seconds 0",
              "versions": {k: v for k, v in versions}}
    machine = print_header("serving: REST vs gRPC on one server, CPU per request", config)
    rows = []
    saved = os.environ.get("PYTHONPATH")
    with tempfile.TemporaryDirectory(prefix="bench_fronts_", dir=args.dir) as root:
        path = os.path.join(root, "run")
        train(path, "--steps", args.steps, "--snapshot-interval", args.steps)
        files = {}
        for batch in BATCHES:
            dense, cat = make_requests(batch, 1, seed=batch)[0]
            body, header = rest_body(dense, cat)
            message = grpc_body(dense, cat)
            names = [os.path.join(root, f"{k}{batch}.bin") for k in ("rest", "grpc", "h2_")]
            for name, data in zip(names, (body, message,
                                          b"\0" + len(message).to_bytes(4, "big") + message)):
                with open(name, "wb") as f:
                    f.write(data)
            files[batch] = (names[0], header, names[1], names[2])
        for version, src in versions:
            os.environ["PYTHONPATH"] = src + (os.pathsep + saved if saved else "")
            try:
                server = Server(path, "--poll-seconds", 0, "--max-batch-size",
                                args.max_batch_size)
            finally:
                if saved is None:
                    os.environ.pop("PYTHONPATH")
                else:
                    os.environ["PYTHONPATH"] = saved
            try:
                for batch in BATCHES:  # warm-up, not measured: first calls compile kernels
                    rest_file, header, grpc_file, _ = files[batch]
                    drive_rest(tools["wrk"], server.port, rest_file, header, args.clients, 2,
                               root)
                    drive_grpc(server.grpc_port, grpc_file, args.clients, 1)
                for batch in BATCHES:
                    cells = {}
                    for proto in ("REST", "gRPC", "gRPC aio client"):
                        r = measure(server, proto, files[batch], args.clients, args.seconds,
                                    tools, root)
                        cells[proto] = r
                        row = {"version": version, "front end": proto, "batch": batch,
                               "rows_per_s": r["qps"] * batch, **r}
                        rows.append(row)
                        print(f"{version:14s} {proto:16s} batch {batch:3d}: "
                              f"{row['rows_per_s']:9.0f} rows/s, server CPU {r['server_cpu_ms']:.3f} ms/request, client "
                              f"{r['client_cpu_ms']:.3f} ms, {r['failed']} failed", flush=True)
                    for proto in ("gRPC", "gRPC aio client"):
                        rows[-3 + ("REST", "gRPC", "gRPC aio client").index(proto)][
                            "vs_rest"] = cells[proto]["qps"] / cells["REST"]["qps"]
            finally:
                server.close()
    columns = ["version", "front end", "batch", "rows_per_s", "vs_rest", "server_cpu_ms",
               "client_cpu_ms", "p50_ms", "p99_ms", "mean_ms", "failed"]
    print(markdown_table(rows, columns))
    print("wrote", save_result("serve_fronts", {"machine": machine, "config": config,
                                                "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
