"""``one-embedding serve``: a ``Predictor`` behind the Open Inference Protocol over HTTP (and,
with ``--grpc-port``, its gRPC service: ``grpc_service``), with Prometheus metrics at ``/metrics``.

Starlette routes, run by uvicorn (the ``serve`` extra; with uvloop and httptools when installed).
The models and their inputs are ``service``'s. Every inference response's ``parameters`` name the
``snapshot`` that answered. A thread polls the training path every ``poll_seconds`` and switches
to a newer checkpoint (``Predictor.refresh``: atomic per request; the old snapshot is let go
after its last request). A request is read, decoded and checked on the event loop; its model call
runs in a worker thread (or the dynamic batcher's, ``--max-batch-size`` > 1), so health and
metadata requests are answered while a batch computes. A refused request gets a 4xx and
``{"error": ...}`` naming the problem; the server keeps serving. Data the server cannot read (a
row failing its checksum) is the server's fault, not the client's: a 500 whose error names the
snapshot and the run's file, also logged.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import threading
import time

from ..errors import OneEmbeddingError
from .predictor import Predictor
from .protocol import HEADER, ProtocolError, decode_request, encode_response
from .service import Service, check_version, model_inputs, model_metadata, run_model

log = logging.getLogger("one_embedding.serve")

DEFAULT_MAX_REQUEST_MB = 64.0

__all__ = ["create_app", "infer", "model_metadata", "serve", "Follower"]


def infer(predictor: Predictor, name: str, body: bytes, header_length) -> tuple[bytes, dict]:
    """One inference request, answered in this thread (no batching) -> (response body,
    headers). ProtocolError for a refused one."""
    request, tensors = decode_request(body, header_length)
    outputs, snapshot = run_model(predictor, name, model_inputs(predictor, name, tensors))
    return encode_response(request, name, outputs, {"snapshot": snapshot})


def create_app(service: Service, max_request_mb: float = DEFAULT_MAX_REQUEST_MB):
    """The Starlette application serving ``service`` (a ``Service``; a bare ``Predictor`` is
    wrapped in one without batching)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    if isinstance(service, Predictor):
        service = Service(service)
    predictor = service.predictor
    limit = int(max_request_mb * 2**20)

    def error(e: ProtocolError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=e.status)

    async def live(request):
        return JSONResponse({"live": True})

    async def ready(request):
        # the protocol's health answers are their status: 200 true, 4xx false (before the
        # first checkpoint of a server started with --wait-for-checkpoint)
        return JSONResponse({"ready": predictor.ready}, status_code=200 if predictor.ready else 400)

    async def server_metadata(request):
        return JSONResponse({"name": "one_embedding", "version": "1",
                             "extensions": ["binary_tensor_data"]})

    async def metadata(request):
        try:
            return JSONResponse(model_metadata(predictor, request.path_params["model"],
                                               request.path_params.get("version")))
        except ProtocolError as e:
            return error(e)

    async def model_ready(request):
        name = request.path_params["model"]
        if not predictor.ready:
            return JSONResponse({"name": name, "ready": False}, status_code=400)
        try:
            model_metadata(predictor, name, request.path_params.get("version"))
        except ProtocolError as e:
            return error(e)
        return JSONResponse({"name": name, "ready": True})

    async def read_body(headers: dict, receive) -> bytes:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ProtocolError(f"the request body of {int(declared):,} bytes exceeds the "
                                f"server's limit of {limit:,} (--max-request-mb)", 413)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                raise ProtocolError("the client closed the connection", 499)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ProtocolError(f"the request body exceeds the server's limit of {limit:,} "
                                    "bytes (--max-request-mb)", 413)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def infer_asgi(name: str, version: str | None, scope, receive, send) -> None:
        """POST .../infer as a bare ASGI handler: the hot path skips Starlette's request,
        routing and middleware objects (~0.1 ms a request here)."""
        started, rows = time.perf_counter(), 0
        headers = dict(scope["headers"])
        try:
            check_version(name, version)
            body = await read_body(headers, receive)
            header = headers.get(HEADER.lower().encode())
            decoded, tensors = decode_request(
                body, None if header is None else header.decode("latin-1"))
            outputs, snapshot = await service.submit_async(name, tensors)
            rows = next(iter(outputs.values())).shape[0]
            content, extra = encode_response(decoded, name, outputs, {"snapshot": snapshot})
            status = 200
        except ProtocolError as e:
            if e.status >= 500 and e.status != 503:   # 503: not ready yet, nothing failed
                log.error("inference on %r failed: %s", name, e)
            status, content, extra = e.status, json.dumps({"error": str(e)}).encode(), {}
        except asyncio.CancelledError:
            # uvicorn cancels what is still in flight once a SIGTERM's grace ended (a
            # client stalled in its body, a call that outlasted it): answered 503, not a
            # traceback in the log
            log.warning("a request to %r was still in flight when the shutdown's grace "
                        "(--shutdown-grace-seconds) ended: answered 503", name)
            status, extra = 503, {}
            content = json.dumps({"error": "the server is shutting down"}).encode()
        except Exception as e:  # a server fault: logged, answered, and the server goes on
            log.exception("inference on %r failed", name)
            status = 500
            content = json.dumps({"error": f"internal error: {type(e).__name__}: {e}"}).encode()
            extra = {}
        extra.setdefault("content-type", "application/json")
        if status != 499:
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-length", str(len(content)).encode()),
                *((k.lower().encode(), v.encode()) for k, v in extra.items())]})
            await send({"type": "http.response.body", "body": content})
        service.answered(name, "rest", status, started, rows)

    async def metrics(request):
        if service.metrics is None:
            return JSONResponse({"error": "this server keeps no metrics"}, status_code=404)
        from prometheus_client import CONTENT_TYPE_LATEST

        if predictor.ready:   # before the first checkpoint there is none to name
            service.metrics.served(predictor.snapshot)
        return Response(service.metrics.exposition(), headers={"content-type": CONTENT_TYPE_LATEST})

    routes = [
        Route("/v2/health/live", live), Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
        Route("/v2/models/{model}", metadata),
        Route("/v2/models/{model}/versions/{version}", metadata),
        Route("/v2/models/{model}/ready", model_ready),
        Route("/v2/models/{model}/versions/{version}/ready", model_ready),
        Route("/metrics", metrics),
    ]

    async def not_found(request, exc):
        return JSONResponse({"error": f"no route {request.method} {request.url.path}"},
                            status_code=getattr(exc, "status_code", 404))

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    infer_path = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")

    async def application(scope, receive, send):
        if scope["type"] == "http":
            match = infer_path.fullmatch(scope["path"])
            if match is not None:
                if scope["method"] == "POST":
                    return await infer_asgi(match.group(1), match.group(2), scope, receive,
                                            send)
                return await _method_not_allowed(scope, send)
        return await app(scope, receive, send)

    return application


async def _method_not_allowed(scope, send) -> None:
    content = json.dumps({"error": f"no route {scope['method']} {scope['path']}"}).encode()
    await send({"type": "http.response.start", "status": 405, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
        (b"allow", b"POST")]})
    await send({"type": "http.response.body", "body": content})


class Follower:
    """A daemon thread calling ``predictor.refresh()`` every ``seconds`` until stopped;
    ``on_switch(snapshot)`` after each switch, ``on_first(snapshot)`` instead when it loaded
    the first checkpoint of a predictor that waited for one (that is no switch)."""

    def __init__(self, predictor: Predictor, seconds: float, on_switch=None, on_first=None):
        self.predictor, self.seconds, self.on_switch = predictor, float(seconds), on_switch
        self.on_first = on_first
        self._stop = threading.Event()
        self._last_refusal = None
        self._thread = threading.Thread(target=self._run, name="one_embedding-follow", daemon=True)

    def start(self) -> "Follower":
        self._thread.start()
        return self

    def _serving(self) -> str:
        return repr(self.predictor.snapshot) if self.predictor.ready else "nothing yet"

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            self.poll()

    def poll(self) -> None:
        """One look for a newer checkpoint (the thread's loop body)."""
        first = not self.predictor.ready
        try:
            if self.predictor.refresh():
                log.warning("serving snapshot %r", self.predictor.snapshot)
                then = self.on_first if first else self.on_switch
                if then is not None:
                    then(self.predictor.snapshot)
        except OneEmbeddingError as e:  # the newest checkpoint is damaged: refused
            if str(e) != self._last_refusal:  # once, not at every poll
                log.error("the newest checkpoint was refused: %s; still serving %s", e,
                          self._serving())
                self._last_refusal = str(e)
        except Exception:  # a snapshot half-deleted under us: try again next time
            log.exception("following the training path failed; still serving %s",
                          self._serving())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


#: seconds a SIGTERM / SIGINT waits for requests in flight (and connections that stall in the
#: middle of a body) before the server cancels them and exits
SHUTDOWN_GRACE_S = 10.0


def serve(persistent_path: str, snapshot: str | None = None, host: str = "127.0.0.1",
          port: int = 8000, cache_mb: float = 64.0, poll_seconds: float = 1.0,
          max_request_mb: float = DEFAULT_MAX_REQUEST_MB, scratch: str | None = None,
          grpc_port: int | None = None, max_batch_size: int = 1,
          max_queue_delay_us: float = 0.0, blas_threads: int = 1,
          shutdown_grace_seconds: float = SHUTDOWN_GRACE_S,
          wait_for_checkpoint: bool = False) -> None:
    """Serve until interrupted: REST on ``port``, gRPC on ``grpc_port`` (None: no gRPC);
    dynamic batching when ``max_batch_size`` > 1 (a request waits up to ``max_queue_delay_us``
    microseconds for others); ``blas_threads``: BLAS threads per model call (requests already
    run side by side: a second BLAS thread per call mostly waits for a core);
    ``shutdown_grace_seconds``: after SIGTERM / SIGINT, how long requests in flight may finish
    (a client stalled in its body included) before they are answered 503 and the server exits;
    ``wait_for_checkpoint``: where training has published no checkpoint yet, serve anyway (live,
    not ready: requests answered 503) and load the first one the follower finds."""
    import uvicorn
    from threadpoolctl import threadpool_limits

    threadpool_limits(blas_threads, user_api="blas")

    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again under the
    # handler it found: with the default SIGTERM one the process died before the finally below
    # closed the predictor (whose scratch folder stayed behind), and asyncio swallowed the
    # SIGINT (exit status 0 after a Ctrl-C); these exit through the finally with 128 + signal.
    # Installed before anything is loaded: a signal while the snapshot loads exits the same way
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _exit_on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT)}
    predictor = service = follower = grpc_server = None
    try:
        predictor = Predictor(persistent_path, snapshot=snapshot, cache_mb=cache_mb,
                              scratch=scratch, wait=wait_for_checkpoint)
        service = Service(predictor, max_batch_size, max_queue_delay_us * 1e-6)
        follower = Follower(predictor, poll_seconds, on_switch=service.metrics.switched,
                            on_first=service.metrics.served).start() \
            if poll_seconds > 0 else None
        if grpc_port is not None:
            from .grpc_service import start_grpc

            grpc_server = start_grpc(service, host, grpc_port, max_request_mb)
        what = f"snapshot {predictor.snapshot!r}, model {predictor.model_name!r}" \
            if predictor.ready else "not ready: waiting for its first checkpoint"
        log.warning("serving %r (%s) on http://%s:%d%s%s", persistent_path, what, host, port,
                    f" and grpc {host}:{grpc_port}" if grpc_port is not None else "",
                    f", batching up to {max_batch_size} rows, {max_queue_delay_us:g} us"
                    if max_batch_size > 1 else "")
        # no access log, no proxy-headers middleware, no Server header: per-request work the
        # inference path does not use
        uvicorn.run(create_app(service, max_request_mb), host=host, port=port,
                    log_level="warning", access_log=False, proxy_headers=False,
                    server_header=False, timeout_graceful_shutdown=shutdown_grace_seconds)
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace=2)
        if follower is not None:
            follower.stop()
        if service is not None:
            service.close()
        if predictor is not None:
            predictor.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit_on_signal(signum, frame):
    """SIGTERM / SIGINT as SystemExit (exit status 128 + the signal, as a process killed by it
    reports: 143, 130)."""
    raise SystemExit(128 + signum)
