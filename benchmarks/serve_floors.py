"""What a request costs the serving stacks themselves: an empty handler on each front end's stack
(uvicorn + httptools + uvloop for REST, as `one-embedding serve` runs it; grpcio's asyncio server
on uvloop for gRPC), driven by the same load generators as ``bench_serve`` (wrk, h2load), with
the server's CPU per answered request read from /proc.

    python -m benchmarks.serve_floors [--seconds 5] [--clients 16]

No model, no decoding: each answer is a fixed body. The gRPC stack's floor against the whole
REST request (``bench_serve``'s cells) bounds what gRPC can reach against REST on one machine.
``bench_serve`` runs ``measure_floors`` after its cells; run alone it prints the two floors.

Run as ``python -m benchmarks.serve_floors serve-rest|serve-grpc PORT`` it is one of the empty
servers (what ``measure_floors`` starts).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

#: a ``ModelInferResponse`` with model_name "dlrm" (field 1), serialized
GRPC_ANSWER = b"\x0a\x04dlrm"
REST_ANSWER = b'{"model_name":"dlrm","outputs":[]}'


def serve_rest(port: int) -> None:
    """uvicorn as ``serve`` configures it, answering every request with ``REST_ANSWER``."""
    import uvicorn

    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(REST_ANSWER)).encode())]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": REST_ANSWER})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                proxy_headers=False, server_header=False)


def serve_grpc(port: int) -> None:
    """grpcio's asyncio server on uvloop (as ``grpc_service.GrpcServer``), its ModelInfer an
    empty coroutine answering ``GRPC_ANSWER`` (bytes in, bytes out: no protobuf work)."""
    import grpc

    from one_embedding.serving.grpc_service import _new_event_loop

    async def infer(request: bytes, context) -> bytes:
        return GRPC_ANSWER

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(kind: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.serve_floors", f"serve-{kind}",
                             str(port)], cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": root + os.pathsep
                                 + os.environ.get("PYTHONPATH", "")})
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"the empty {kind} server did not come up") from None
            time.sleep(0.1)


def measure_floors(wrk: str, h2load: str, clients: int, seconds: float, folder: str) -> dict:
    """{"REST": cell, "gRPC": cell}, each cell {"qps", "requests", "server_cpu_ms"}: the empty
    servers under ``clients`` requests in flight for ``seconds``."""
    from .bench_serve import drive_rest, process_cpu_seconds, run_h2load

    body = os.path.join(folder, "floor_request.bin")
    with open(body, "wb") as f:  # an empty ModelInferRequest, gRPC-framed; REST posts it too
        f.write(b"\0\0\0\0\0")
    out = {}
    for kind in ("rest", "grpc"):
        proc, port = _start(kind)
        try:
            before = process_cpu_seconds(proc.pid)
            if kind == "rest":
                r = drive_rest(wrk, port, body, 0, clients, seconds, folder, path="/")
            else:
                # no warm-up: its requests would cost CPU h2load does not count
                r = run_h2load(h2load, port, body, clients, seconds, warm_up=0)
            cpu = process_cpu_seconds(proc.pid) - before
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        out["REST" if kind == "rest" else "gRPC"] = {
            "qps": r["qps"], "requests": r["requests"],
            "server_cpu_ms": cpu * 1e3 / max(1, r["requests"])}
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("serve-rest", "serve-grpc"):
        (serve_rest if argv[0] == "serve-rest" else serve_grpc)(int(argv[1]))
        return
    import tempfile

    from .bench_serve import INSTALL_HELP, find_tools
    from .common import print_header

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--install-tools", action="store_true", help=INSTALL_HELP)
    args = p.parse_args(argv)
    tools = find_tools(args.install_tools)
    wrk, h2load = tools["wrk"], tools["h2load"]
    print_header("serving stacks: an empty handler's server CPU per request",
                 {"clients": args.clients, "seconds": args.seconds,
                  "REST": "uvicorn + httptools + uvloop, wrk -t1",
                  "gRPC": "grpc.aio on uvloop, h2load -c4"})
    with tempfile.TemporaryDirectory(prefix="serve_floors_") as folder:
        floors = measure_floors(wrk, h2load, args.clients, args.seconds, folder)
    for kind, cell in floors.items():
        print(f"{kind:4s} empty handler: {cell['qps']:9.0f} requests/s, server CPU "
              f"{cell['server_cpu_ms']:.3f} ms per request")


if __name__ == "__main__":
    main()
