"""``one-embedding serve``: a ``Predictor`` behind the Open Inference Protocol over HTTP.

Starlette routes, run by uvicorn (the ``serve`` extra). Models:

- ``embedding``: input ``keys`` INT64 [n] -> output ``embeddings`` FP32 [n, dim];
- the trained model under its name (``dlrm``, ``dcn``, ``deepfm``): inputs ``dense`` FP32
  [n, 13] (raw integer features, NaN = missing) and ``categorical`` BYTES [n, 26] ("" = missing)
  -> output ``probability`` FP32 [n].

Every inference response's ``parameters`` name the ``snapshot`` that answered. A thread polls
the training path every ``poll_seconds`` and switches to a newer checkpoint (``Predictor.refresh``:
atomic per request; the old snapshot is let go after its last request). Inference runs in a
worker thread, so health and metadata requests are answered while a batch computes. A refused
request gets a 4xx and ``{"error": ...}`` naming the problem; the server keeps serving. Data
the server cannot read (a row failing its checksum) is the server's fault, not the client's:
a 500 whose error names the snapshot and the run's file, also logged.
"""
from __future__ import annotations

import logging
import threading

import numpy as np

from ..errors import OneEmbeddingError, StoreError
from .predictor import Predictor
from .protocol import DTYPES, HEADER, ProtocolError, decode_request, encode_response

log = logging.getLogger("one_embedding.serve")

DEFAULT_MAX_REQUEST_MB = 64.0


def model_metadata(predictor: Predictor, name: str) -> dict:
    """The protocol's model metadata of ``name`` (ProtocolError 404 for an unknown one)."""
    dim = predictor.embedding_dim
    if name == "embedding":
        inputs = [{"name": "keys", "datatype": "INT64", "shape": [-1]}]
        outputs = [{"name": "embeddings", "datatype": "FP32", "shape": [-1, dim]}]
    elif name == predictor.model_name:
        inputs = [{"name": "dense", "datatype": "FP32", "shape": [-1, 13]},
                  {"name": "categorical", "datatype": "BYTES", "shape": [-1, predictor.num_sparse]}]
        outputs = [{"name": "probability", "datatype": "FP32", "shape": [-1]}]
    else:
        raise ProtocolError(f"unknown model {name!r}: this server has 'embedding' and "
                            f"{predictor.model_name!r}", 404)
    return {"name": name, "versions": ["1"], "platform": "one_embedding", "inputs": inputs,
            "outputs": outputs, "parameters": {"snapshot": predictor.snapshot}}


def _input(tensors: dict, name: str, model: str, datatype: str, shape: list) -> np.ndarray:
    """The input ``name`` of a request, checked against its datatype and shape (-1: any)."""
    if name not in tensors:
        raise ProtocolError(f"model {model!r} needs input {name!r}; the request has "
                            f"{sorted(tensors)}")
    a = tensors[name]
    if a.dtype != np.dtype(DTYPES[datatype]) and not (datatype == "BYTES" and a.dtype.kind == "S"):
        got = "BYTES" if a.dtype.kind == "S" else \
            next(k for k, v in DTYPES.items() if np.dtype(v) == a.dtype)
        raise ProtocolError(f"input {name!r} is {got}; model {model!r} takes {datatype}")
    if a.ndim != len(shape) or any(w not in (-1, g) for w, g in zip(shape, a.shape)):
        raise ProtocolError(f"input {name!r} has shape {list(a.shape)}; model {model!r} takes "
                            f"{shape} (-1: any size)")
    return a


def infer(predictor: Predictor, name: str, body: bytes, header_length) -> tuple[bytes, dict]:
    """One inference request -> (response body, headers). ProtocolError for a refused one."""
    model_metadata(predictor, name)  # 404 first for an unknown model
    request, tensors = decode_request(body, header_length)
    expected = {"keys"} if name == "embedding" else {"dense", "categorical"}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ProtocolError(f"model {name!r} has no input {extra[0]!r}; it takes "
                            f"{sorted(expected)}")
    try:
        if name == "embedding":
            keys = _input(tensors, "keys", name, "INT64", [-1])
            rows, snapshot = predictor.lookup(keys, with_snapshot=True)
            outputs = {"embeddings": rows}
        else:
            dense = _input(tensors, "dense", name, "FP32", [-1, 13])
            cat = _input(tensors, "categorical", name, "BYTES", [-1, predictor.num_sparse])
            if dense.shape[0] != cat.shape[0]:
                raise ProtocolError(f"dense has {dense.shape[0]} rows but categorical "
                                    f"{cat.shape[0]}: give one row of each per sample")
            prob, snapshot = predictor.predict(dense, cat, with_snapshot=True)
            outputs = {"probability": prob}
    except StoreError as e:  # the served snapshot's data, not the request: a server fault
        raise ProtocolError(f"the server cannot read its data: {e}", 500) from None
    except OneEmbeddingError as e:  # a value the model cannot take, named by the predictor
        raise ProtocolError(str(e)) from None
    return encode_response(request, name, outputs, {"snapshot": snapshot})


def create_app(predictor: Predictor, max_request_mb: float = DEFAULT_MAX_REQUEST_MB):
    """The Starlette application serving ``predictor``."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    limit = int(max_request_mb * 2**20)

    def error(e: ProtocolError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=e.status)

    async def live(request):
        return JSONResponse({"live": True})

    async def ready(request):
        return JSONResponse({"ready": True})

    async def server_metadata(request):
        return JSONResponse({"name": "one_embedding", "version": "1",
                             "extensions": ["binary_tensor_data"]})

    async def metadata(request):
        try:
            return JSONResponse(model_metadata(predictor, request.path_params["model"]))
        except ProtocolError as e:
            return error(e)

    async def model_ready(request):
        try:
            model_metadata(predictor, request.path_params["model"])
        except ProtocolError as e:
            return error(e)
        return JSONResponse({"name": request.path_params["model"], "ready": True})

    async def read_body(request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ProtocolError(f"the request body of {int(declared):,} bytes exceeds the "
                                f"server's limit of {limit:,} (--max-request-mb)", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(f"the request body exceeds the server's limit of {limit:,} "
                                    "bytes (--max-request-mb)", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def infer_route(request):
        name = request.path_params["model"]
        try:
            body = await read_body(request)
            content, headers = await run_in_threadpool(infer, predictor, name, body,
                                                       request.headers.get(HEADER))
        except ProtocolError as e:
            if e.status >= 500:
                log.error("inference on %r failed: %s", name, e)
            return error(e)
        except Exception as e:  # a server fault: logged, answered, and the server goes on
            log.exception("inference on %r failed", name)
            return JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"},
                                status_code=500)
        return Response(content, headers=headers)

    routes = [
        Route("/v2/health/live", live), Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
        Route("/v2/models/{model}", metadata),
        Route("/v2/models/{model}/versions/{version}", metadata),
        Route("/v2/models/{model}/ready", model_ready),
        Route("/v2/models/{model}/versions/{version}/ready", model_ready),
        Route("/v2/models/{model}/infer", infer_route, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/infer", infer_route, methods=["POST"]),
    ]

    async def not_found(request, exc):
        return JSONResponse({"error": f"no route {request.method} {request.url.path}"},
                            status_code=getattr(exc, "status_code", 404))

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


class Follower:
    """A daemon thread calling ``predictor.refresh()`` every ``seconds`` until stopped."""

    def __init__(self, predictor: Predictor, seconds: float):
        self.predictor, self.seconds = predictor, float(seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="one_embedding-follow", daemon=True)

    def start(self) -> "Follower":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            try:
                if self.predictor.refresh():
                    log.warning("serving snapshot %r", self.predictor.snapshot)
            except OneEmbeddingError as e:  # the newest checkpoint is damaged: refused
                log.error("the newest checkpoint was refused: %s; still serving %r", e,
                          self.predictor.snapshot)
            except Exception:  # a snapshot half-deleted under us: try again next time
                log.exception("following the training path failed; still serving %r",
                              self.predictor.snapshot)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def serve(persistent_path: str, snapshot: str | None = None, host: str = "127.0.0.1",
          port: int = 8000, cache_mb: float = 64.0, poll_seconds: float = 1.0,
          max_request_mb: float = DEFAULT_MAX_REQUEST_MB, scratch: str | None = None) -> None:
    """Serve until interrupted."""
    import uvicorn

    predictor = Predictor(persistent_path, snapshot=snapshot, cache_mb=cache_mb, scratch=scratch)
    follower = Follower(predictor, poll_seconds).start() if poll_seconds > 0 else None
    log.warning("serving %r (snapshot %r, model %r) on http://%s:%d", persistent_path,
                predictor.snapshot, predictor.model_name, host, port)
    try:
        uvicorn.run(create_app(predictor, max_request_mb), host=host, port=port,
                    log_level="warning")
    finally:
        if follower is not None:
            follower.stop()
        predictor.close()
