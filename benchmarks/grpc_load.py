"""A gRPC load generator for the Open Inference Protocol: CLIENTS calls of one pre-serialized
``ModelInferRequest`` kept in flight for SECONDS, through grpcio's asyncio client (its C core does
the HTTP/2 work; Python only awaits each call, the request and response stay bytes). Prints one
JSON object: requests, failed, seconds, p50_ms, p99_ms, and the first failure's status.

    python -m benchmarks.grpc_load HOST:PORT REQUEST_FILE --clients 16 --seconds 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

METHOD = "/inference.GRPCInferenceService/ModelInfer"


async def drive(target: str, body: bytes, clients: int, seconds: float, channels: int) -> dict:
    import grpc

    pool = [grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)])
            for _ in range(channels)]
    calls = [c.unary_unary(METHOD) for c in pool]  # bytes in, bytes out
    latencies, failures = [], []
    for call in calls:  # connected before the clock starts
        await call(body, timeout=60)
    stop = time.perf_counter() + seconds

    async def client(k: int) -> None:
        call = calls[k % len(calls)]
        while time.perf_counter() < stop:
            t = time.perf_counter()
            try:
                await call(body, timeout=60)
            except grpc.aio.AioRpcError as e:
                failures.append(f"{e.code()}: {e.details()}")
                continue
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    elapsed = time.perf_counter() - t0
    for c in pool:
        await c.close()
    lat = np.array(latencies or [0.0]) * 1e3
    return {"requests": len(latencies), "failed": len(failures), "seconds": elapsed,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "first_failure": failures[0] if failures else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="HOST:PORT of the gRPC service")
    p.add_argument("request", help="file holding one serialized ModelInferRequest")
    p.add_argument("--clients", type=int, default=16, help="calls kept in flight")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--channels", type=int, default=4, help="HTTP/2 connections the calls share")
    args = p.parse_args(argv)
    with open(args.request, "rb") as f:
        body = f.read()
    print(json.dumps(asyncio.run(drive(args.target, body, args.clients, args.seconds,
                                       args.channels))))


if __name__ == "__main__":
    main()
