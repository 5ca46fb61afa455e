"""The Open Inference Protocol's gRPC service (``inference.GRPCInferenceService``, KServe v2's
``grpc_predict_v2.proto`` as Triton extends it), answering through the same ``Service`` as REST.

The messages and the service stub are the protocol's own, as ``tritonclient[grpc]`` ships them
generated (``tritonclient.grpc.service_pb2`` / ``service_pb2_grpc``: package ``inference``), so
``tritonclient.grpc`` and KServe's gRPC clients call it unchanged. Implemented: ServerLive,
ServerReady, ServerMetadata, ModelReady, ModelMetadata and ModelInfer; the rest (repository
control, shared memory, statistics, streaming) answer UNIMPLEMENTED.

Tensors come as ``raw_input_contents`` (one per input, in input order; BYTES serialized as in
REST's binary extension) or as typed ``contents``; outputs go back as ``raw_output_contents``.
A request REST refuses with a 4xx is refused here with the matching status: 400 ->
INVALID_ARGUMENT, 404 -> NOT_FOUND, 413 -> RESOURCE_EXHAUSTED (the message size limit), 500 ->
INTERNAL, 503 -> UNAVAILABLE; the details carry REST's error message.

Served by grpcio's asyncio server (``grpc.aio``) on its own event loop in one thread: a call is
parsed and decoded on the loop, its model runs in ``Service``'s worker pool or dynamic batcher,
and the loop awaits it, so a call in flight costs no thread (grpcio's synchronous server, a
thread per call, cost 0.3-0.8 ms more server CPU per call: ``benchmarks/bench_serve_fronts.py``).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np

from .protocol import (DTYPES, ProtocolError, _element_count, bytes_elements, check_datatype,
                       shaped)
from .service import Service, check_version, model_metadata

log = logging.getLogger("one_embedding.serve")

#: the typed ``InferTensorContents`` field of each datatype
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def _status_code(status: int):
    import grpc

    return {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
            413: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}.get(
                status, grpc.StatusCode.INTERNAL if status >= 500 else
                grpc.StatusCode.INVALID_ARGUMENT)


def decode_infer_request(request) -> dict:
    """A ``ModelInferRequest`` -> {input name: ndarray shaped as declared}; ProtocolError 400
    naming what is wrong."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(f"the request has {len(raw)} raw_input_contents for "
                            f"{len(request.inputs)} inputs: give one per input, in input order")
    tensors = {}
    for k, spec in enumerate(request.inputs):
        name, dtype, shape = spec.name, spec.datatype, list(spec.shape)
        check_datatype(dtype, name)
        count = _element_count(shape, name)
        if raw:
            data = raw[k]
            if dtype == "BYTES":
                array = bytes_elements(data, count, name)
            else:
                item = np.dtype(DTYPES[dtype]).itemsize
                if len(data) != count * item:
                    raise ProtocolError(f"input {name!r}: {len(data)} bytes of raw contents for "
                                        f"shape {shape} of {dtype} ({count * item} bytes)")
                array = np.frombuffer(data, dtype=DTYPES[dtype])
        else:
            field = _CONTENTS.get(dtype)
            values = getattr(spec.contents, field) if field else ()
            if len(values) != count:
                raise ProtocolError(f"input {name!r}: its contents hold {len(values)} elements, "
                                    f"its shape {count}" + ("" if field else
                                                            f" ({dtype} goes as raw contents)"))
            try:
                array = np.array(list(values), dtype=object) if dtype == "BYTES" else \
                    np.array(values, dtype=DTYPES[dtype])
            except (OverflowError, ValueError, TypeError):
                raise ProtocolError(f"input {name!r}: a value of its contents is out of "
                                    f"{dtype}'s range") from None
        if name in tensors:
            raise ProtocolError(f"input {name!r} is given twice")
        tensors[name] = shaped(array, shape, name)
    return tensors


def make_servicer(service: Service):
    """The ``GRPCInferenceServiceServicer`` answering through ``service``, for grpcio's asyncio
    server: its methods are coroutines; ``ModelInfer`` decodes on the event loop and awaits the
    model's future (the worker pool's or the dynamic batcher's), so a call in flight holds no
    thread."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    predictor = service.predictor

    async def refuse(context, e: ProtocolError):
        await context.abort(_status_code(e.status), str(e))

    def tensor_metadata(specs):
        return [pb.ModelMetadataResponse.TensorMetadata(name=s["name"], datatype=s["datatype"],
                                                        shape=s["shape"]) for s in specs]

    class Servicer(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=predictor.ready)

        async def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="one_embedding", version="1",
                                             extensions=["binary_tensor_data"])

        async def ModelReady(self, request, context):
            if not predictor.ready:
                return pb.ModelReadyResponse(ready=False)
            try:
                model_metadata(predictor, request.name, request.version)
            except ProtocolError as e:
                await refuse(context, e)
            return pb.ModelReadyResponse(ready=True)

        async def ModelMetadata(self, request, context):
            try:
                meta = model_metadata(predictor, request.name, request.version)
            except ProtocolError as e:
                await refuse(context, e)
            return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"],
                                            platform=meta["platform"],
                                            inputs=tensor_metadata(meta["inputs"]),
                                            outputs=tensor_metadata(meta["outputs"]))

        async def ModelInfer(self, request, context):
            # counted before the answer goes out (aio's abort sends the status at once), so a
            # client reading /metrics after its answer finds its request there
            name, started = request.model_name, time.perf_counter()
            try:
                check_version(name, request.model_version)
                tensors = decode_infer_request(request)
                outputs, snapshot = await service.submit_async(name, tensors)
                asked = [o.name for o in request.outputs]
                unknown = [a for a in asked if a not in outputs]
                if unknown:
                    raise ProtocolError(f"model {name!r} has no output {unknown[0]!r}; it has "
                                        f"{sorted(outputs)}")
                response = pb.ModelInferResponse(model_name=name, model_version="1",
                                                 id=request.id)
                response.parameters["snapshot"].string_param = snapshot
                for out in asked or list(outputs):
                    array = np.ascontiguousarray(outputs[out], np.float32)
                    response.outputs.add(name=out, datatype="FP32", shape=list(array.shape))
                    response.raw_output_contents.append(array.tobytes())
                rows = next(iter(outputs.values())).shape[0]
            except asyncio.CancelledError:  # the client cancelled the call or went away
                service.answered(name, "grpc", 499, started, 0)
                raise
            except ProtocolError as e:
                if e.status >= 500:
                    log.error("inference on %r failed: %s", name, e)
                code, status, message = e.status, _status_code(e.status), str(e)
            except Exception as e:  # a server fault: logged, answered, and the server goes on
                log.exception("inference on %r failed", name)
                code, status = 500, grpc.StatusCode.INTERNAL
                message = f"internal error: {type(e).__name__}: {e}"
            else:
                service.answered(name, "grpc", 200, started, rows)
                return response
            service.answered(name, "grpc", code, started, 0)
            await context.abort(status, message)

    return Servicer()


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (as uvicorn picks it: measured 5-15% less server CPU per
    gRPC call than asyncio's own, benchmarks/bench_serve_fronts.py), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class GrpcServer:
    """grpcio's asyncio server for ``service`` on ``host:port``, running on its own event loop
    (uvloop's when installed) in one thread (``one_embedding-grpc``) from construction until
    ``stop()``. Its messages are limited to ``max_request_mb`` (a larger one:
    RESOURCE_EXHAUSTED). ConfigError when the address cannot be listened on."""

    def __init__(self, service: Service, host: str, port: int, max_request_mb: float):
        self.address = f"{host}:{port}"
        self._loop = _new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="one_embedding-grpc",
                                        daemon=True)
        self._thread.start()
        try:
            self._server = asyncio.run_coroutine_threadsafe(
                self._start(service, port, int(max_request_mb * 2**20)), self._loop).result()
        except BaseException:
            self._close_loop()
            raise

    async def _start(self, service: Service, port: int, limit: int):
        import grpc
        from tritonclient.grpc import service_pb2_grpc as pb_grpc

        server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                          ("grpc.max_send_message_length", -1)])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(make_servicer(service), server)
        try:
            bound = server.add_insecure_port(self.address)
        except RuntimeError as e:  # grpcio >= 1.5x raises where older ones returned 0
            log.error("gRPC cannot bind %s: %s", self.address, e)
            bound = 0
        if bound == 0:
            from ..errors import ConfigError

            raise ConfigError(f"--grpc-port {port}: cannot listen on {self.address} (in use?)")
        await server.start()
        return server

    def stop(self, grace: float | None = None) -> None:
        """Stop taking calls, let those in flight finish for up to ``grace`` seconds (None:
        cancel them), then end the loop's thread."""
        try:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop).result()
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


def start_grpc(service: Service, host: str, port: int, max_request_mb: float) -> GrpcServer:
    """A started ``GrpcServer`` for ``service`` on ``host:port`` (``stop(grace)`` to end it);
    its messages are limited to ``max_request_mb`` (a larger one: RESOURCE_EXHAUSTED)."""
    return GrpcServer(service, host, port, max_request_mb)
