"""REST against gRPC on one `one-embedding serve` process: rows/s and the server's CPU per
request, dynamic batching on, batch 1 and 64, CLIENTS requests in flight.

    python -m benchmarks.bench_serve_fronts [--seconds 5] [--baseline-src DIR]

A shorter companion of ``bench_serve`` (its helpers: wrk for REST, h2load and grpcio's asyncio
client for gRPC, the server's /metrics for the count of answered requests, /proc for its CPU).
With ``--baseline-src`` (another checkout's ``src`` folder, e.g. the commit before a change),
a server running that code runs beside this checkout's and the two take turns, cell by cell,
``--rounds`` times; the medians are reported: the machine is shared, so only cells measured
back to back compare.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from .bench_serve import (BATCHES, INSTALL_HELP, PROTOCOLS, Server, drive_grpc, drive_rest,
                          find_tools, grpc_body, make_requests, measure_cell, median_cell,
                          rest_body, train)
from .common import markdown_table, print_header, save_result

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50, help="training steps before serving")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per cell")
    p.add_argument("--clients", type=int, default=16, help="requests kept in flight")
    p.add_argument("--max-batch-size", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of cells; each cell's versions measured back to back, medians "
                        "reported")
    p.add_argument("--baseline-src", default=None,
                   help="a `src` folder of another version, served beside this checkout and "
                        "measured in turns")
    p.add_argument("--dir", default=None, help="folder for the run (default: $TMPDIR)")
    p.add_argument("--install-tools", action="store_true", help=INSTALL_HELP)
    args = p.parse_args(argv)
    tools = find_tools(args.install_tools)
    versions = ([("baseline", os.path.abspath(args.baseline_src))] if args.baseline_src else []) \
        + [("this checkout", HERE)]
    config = {"model": "dlrm", "steps": args.steps, "clients": args.clients, "rounds": args.rounds,
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
        servers = {}
        try:
            for version, src in versions:  # every version's server up, idle until its turn
                os.environ["PYTHONPATH"] = src + (os.pathsep + saved if saved else "")
                try:
                    servers[version] = Server(path, "--poll-seconds", 0, "--max-batch-size",
                                              args.max_batch_size)
                finally:
                    if saved is None:
                        os.environ.pop("PYTHONPATH")
                    else:
                        os.environ["PYTHONPATH"] = saved
            for server in servers.values():  # warm-up, not measured: first calls compile kernels
                for batch in BATCHES:
                    rest_file, header, grpc_file, _ = files[batch]
                    drive_rest(tools["wrk"], server.port, rest_file, header, args.clients, 2,
                               root)
                    drive_grpc(server.grpc_port, grpc_file, args.clients, 1)
            # the versions take turns cell by cell, round after round: the machine is shared,
            # so each cell's versions are measured back to back and the medians compared
            cells: dict = {}
            for _ in range(args.rounds):
                for batch in BATCHES:
                    for proto in PROTOCOLS:
                        for version, server in servers.items():
                            r = measure_cell(server, proto, files[batch], args.clients,
                                             args.seconds, tools, root)
                            cells.setdefault((version, proto, batch), []).append(r)
                            print(f"{version:14s} {proto:16s} batch {batch:3d}: "
                                  f"{r['qps'] * batch:9.0f} rows/s, server CPU "
                                  f"{r['server_cpu_ms']:.3f} ms/request, client "
                                  f"{r['client_cpu_ms']:.3f} ms, {r['failed']} failed",
                                  flush=True)
        finally:
            for server in servers.values():
                server.close()
    for (version, proto, batch), runs in cells.items():
        row = {"version": version, "front end": proto, "batch": batch, **median_cell(runs)}
        row["rows_per_s"] = row["qps"] * batch
        row["vs_rest"] = row["qps"] / median_cell(cells[(version, "REST", batch)])["qps"]
        rows.append(row)
    columns = ["version", "front end", "batch", "rounds", "rows_per_s", "vs_rest", "server_cpu_ms",
               "client_cpu_ms", "p50_ms", "p99_ms", "mean_ms", "failed"]
    print(markdown_table(rows, columns))
    print("wrote", save_result("serve_fronts", {"machine": machine, "config": config,
                                                "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
