"""What the REST and gRPC front ends share: the models' contract, the checked inputs, running a
request (alone or merged by the dynamic batcher) and the Prometheus metrics.

Models:

- ``embedding``: input ``keys`` INT64 [n] -> output ``embeddings`` FP32 [n, dim];
- the trained model under its name (``dlrm``, ``dcn``, ``deepfm``): inputs ``dense`` FP32
  [n, 13] (raw integer features, NaN = missing) and ``categorical`` BYTES [n, 26] ("" = missing)
  -> output ``probability`` FP32 [n].

``Service.submit`` returns a ``concurrent.futures.Future`` of (outputs, snapshot), and
``Service.submit_async`` (for the front ends' event loops) an ``asyncio.Future`` of the same: a
request to the trained model goes to the ``Batcher`` when dynamic batching is on
(``max_batch_size`` > 1), else, like every ``embedding`` request, to a small thread pool (the
forward keeps no activations, so requests run side by side). A refused request is a
``ProtocolError`` (4xx), data the server cannot read a ``ProtocolError`` 500, and a request
to a server still waiting for its first checkpoint (``serve --wait-for-checkpoint``) a
``ProtocolError`` 503.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..errors import OneEmbeddingError, StoreError
from .predictor import NotReadyError, Predictor
from .protocol import DTYPES, ProtocolError

log = logging.getLogger("one_embedding.serve")

#: threads running requests when dynamic batching is off (and every ``embedding`` request)
WORKERS = 4
#: request latency histogram buckets, seconds
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                   1.0, 2.0, 5.0)
#: rows per model call (a merged batch, or one request when batching is off)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


#: the one version each model has: a checkpoint switch is the same model answering from newer
#: rows (its answers name the checkpoint: ``parameters.snapshot``)
MODEL_VERSION = "1"


def check_version(name: str, version: str | None) -> None:
    """ProtocolError 404 unless ``version`` (None or "": unspecified) is the model's one."""
    if version not in (None, "", MODEL_VERSION):
        raise ProtocolError(f"model {name!r} has no version {version!r}; its one version is "
                            f"{MODEL_VERSION!r} (or leave the version out)", 404)


def model_metadata(predictor: Predictor, name: str, version: str | None = None) -> dict:
    """The protocol's model metadata of ``name`` (ProtocolError 404 for an unknown one, or a
    version it does not have; 503 before the first checkpoint)."""
    try:
        predictor.check_ready()
    except NotReadyError as e:
        raise _refusal(e) from None
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
    check_version(name, version)
    return {"name": name, "versions": [MODEL_VERSION], "platform": "one_embedding", "inputs": inputs,
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


def model_inputs(predictor: Predictor, name: str, tensors: dict) -> tuple:
    """A request's decoded tensors -> the model's checked inputs: (keys,) for ``embedding``,
    (dense, categorical) for the trained model. ProtocolError (404 / 400) for a refused one."""
    model_metadata(predictor, name)  # 404 first for an unknown model
    expected = {"keys"} if name == "embedding" else {"dense", "categorical"}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ProtocolError(f"model {name!r} has no input {extra[0]!r}; it takes "
                            f"{sorted(expected)}")
    if name == "embedding":
        return (_input(tensors, "keys", name, "INT64", [-1]),)
    dense = _input(tensors, "dense", name, "FP32", [-1, 13])
    cat = _input(tensors, "categorical", name, "BYTES", [-1, predictor.num_sparse])
    if dense.shape[0] != cat.shape[0]:
        raise ProtocolError(f"dense has {dense.shape[0]} rows but categorical "
                            f"{cat.shape[0]}: give one row of each per sample")
    return dense, cat


def run_model(predictor: Predictor, name: str, inputs: tuple) -> tuple[dict, str]:
    """``model_inputs``'s inputs -> ({output name: array}, snapshot), in this thread."""
    try:
        if name == "embedding":
            rows, snapshot = predictor.lookup(inputs[0], with_snapshot=True)
            return {"embeddings": rows}, snapshot
        prob, snapshot = predictor.predict(*inputs, with_snapshot=True)
        return {"probability": prob}, snapshot
    except Exception as e:
        raise _refusal(e) from None


def _refusal(e: Exception) -> ProtocolError:
    """A predictor's exception -> the ProtocolError answering it."""
    if isinstance(e, NotReadyError):  # no checkpoint yet: come back later
        return ProtocolError(str(e), 503)
    if isinstance(e, StoreError):  # the served snapshot's data, not the request: a server fault
        return ProtocolError(f"the server cannot read its data: {e}", 500)
    if isinstance(e, OneEmbeddingError):  # a value the model cannot take, named by the predictor
        return ProtocolError(str(e))
    return e


class Metrics:
    """The server's Prometheus metrics, in their own registry (``exposition()``: the text of
    ``/metrics``)."""

    def __init__(self, predictor: Predictor):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("one_embedding_requests", "Inference requests answered",
                                ["model", "protocol", "code"], registry=r)
        self.failures = Counter("one_embedding_request_failures",
                                "Inference requests refused (4xx) or failed (5xx)",
                                ["model", "protocol", "code"], registry=r)
        self.rows = Counter("one_embedding_rows", "Rows (samples or keys) answered",
                            ["model", "protocol"], registry=r)
        self.latency = Histogram("one_embedding_request_seconds",
                                 "Inference request latency, from the request read to the answer "
                                 "encoded", ["model", "protocol"], buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.batch_rows = Histogram("one_embedding_batch_rows",
                                    "Rows per model call (a merged batch when batching is on)",
                                    ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_requests = Histogram("one_embedding_batch_requests",
                                        "Requests per model call", ["model"],
                                        buckets=BATCH_BUCKETS, registry=r)
        self.snapshot = Gauge("one_embedding_snapshot_info",
                              "The checkpoint answering requests (1 on its label)",
                              ["snapshot"], registry=r)
        self.switches = Counter("one_embedding_snapshot_switches",
                                "Switches to a newer checkpoint", registry=r)
        self._served = None
        self._lock = threading.Lock()
        self._answered: dict = {}  # (model, protocol, code) -> the children answered() moves
        self._merged: dict = {}    # model -> the children merged() moves
        if predictor.ready:
            self.served(predictor.snapshot)

    def served(self, snapshot: str) -> None:
        """The checkpoint answering now is ``snapshot`` (the info gauge's label; counts nothing:
        a request answered late by the checkpoint before a switch does not move it back)."""
        with self._lock:
            if snapshot == self._served:
                return
            if self._served is not None:
                self.snapshot.remove(self._served)
            self.snapshot.labels(snapshot).set(1)
            self._served = snapshot

    def switched(self, snapshot: str) -> None:
        """The predictor switched checkpoints, to ``snapshot`` (the follower's call after each
        switch: counted once each, even where the new checkpoint has the old one's name; the
        first checkpoint of a server that waited for one is ``served``, no switch)."""
        self.switches.inc()
        self.served(snapshot)

    def answered(self, model: str, protocol: str, code: int, seconds: float, rows: int) -> None:
        """One inference request answered with status ``code`` after ``seconds``."""
        key = (model, protocol, code)
        children = self._answered.get(key)
        if children is None:  # a label set's first request: its children, looked up once
            children = self._answered[key] = (
                self.requests.labels(model, protocol, str(code)),
                self.failures.labels(model, protocol, str(code)) if code >= 400 else
                self.rows.labels(model, protocol), self.latency.labels(model, protocol))
        children[0].inc()
        children[1].inc(1 if code >= 400 else rows)
        children[2].observe(seconds)

    def merged(self, model: str, rows: int, requests: int) -> None:
        """One model call of ``rows`` rows answering ``requests`` requests."""
        children = self._merged.get(model)
        if children is None:
            children = self._merged[model] = (self.batch_rows.labels(model),
                                                self.batch_requests.labels(model))
        children[0].observe(rows)
        children[1].observe(requests)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Batcher:
    """Dynamic batching of one model's requests, as Triton's: a request waits at most
    ``max_queue_delay`` seconds for others; the queue's requests are merged (in arrival order)
    up to ``max_batch_size`` rows and answered by one ``Predictor.predict_many`` call, each with
    its own rows' scores. A request larger than ``max_batch_size`` runs alone.

    A request's answer goes to a ``concurrent.futures.Future`` (``submit``) or to an
    ``asyncio.Future`` of an event loop (``submit_async``). The requests an event loop submits
    in one of its iterations join the queue together when the iteration ends (one wake-up of
    the batcher's thread per iteration, not per request; their queue delay counts from their
    submission), and the answers of one merged call that go to one loop are handed over in one
    ``call_soon_threadsafe`` (one wake-up of the loop per batch)."""

    def __init__(self, predictor: Predictor, max_batch_size: int, max_queue_delay: float,
                 metrics: Metrics | None = None):
        self.predictor, self.metrics = predictor, metrics
        self.max_batch_size, self.max_queue_delay = int(max_batch_size), float(max_queue_delay)
        self._queue: collections.deque = collections.deque()
        self._pending: dict = {}  # event loop -> its requests of this iteration, not queued yet
        self._ready = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="one_embedding-batcher",
                                        daemon=True)
        self._thread.start()

    def submit(self, dense: np.ndarray, categorical: np.ndarray) -> Future:
        """-> Future of ({"probability": (n,) float32}, snapshot)."""
        future: Future = Future()
        self._enqueue(dense, categorical, future, None)
        return future

    def submit_async(self, dense: np.ndarray, categorical: np.ndarray) -> asyncio.Future:
        """``submit`` from a running event loop -> an ``asyncio.Future`` of that loop (cancel
        it to drop the request while it waits)."""
        loop = asyncio.get_running_loop()
        if self._stopped:
            raise ProtocolError("the server is shutting down", 503)
        future = loop.create_future()
        pending = self._pending.get(loop)
        if pending is None:  # the first of this loop iteration's requests: queued after it
            pending = self._pending[loop] = []
            loop.call_soon(self._flush, loop)
        pending.append((time.perf_counter(), dense.shape[0], dense, categorical, future, loop))
        return future

    def _flush(self, loop) -> None:
        """On ``loop``: the requests it submitted in its last iteration join the queue
        together, with one wake-up of the batcher's thread (a wake-up per request made the
        thread take the GIL from the loop once per request: ~0.03 ms of the loop's time each)."""
        items = self._pending.pop(loop)
        with self._ready:
            if self._stopped:  # closed meanwhile: nobody will take them
                _settle([(item[4], ProtocolError("the server is shutting down", 503))
                         for item in items])
                return
            self._queue.extend(items)
            self._ready.notify()

    def _enqueue(self, dense, categorical, future, loop) -> None:
        with self._ready:
            if self._stopped:
                raise ProtocolError("the server is shutting down", 503)
            self._queue.append((time.perf_counter(), dense.shape[0], dense, categorical, future,
                                loop))
            self._ready.notify()

    def _take(self) -> list | None:
        """The next batch (None once closed): waits for a first request, then for more until
        ``max_batch_size`` rows are queued or the first has waited ``max_queue_delay``. A
        request whose future was cancelled meanwhile (its caller went away: a gRPC call the
        client cancelled) is dropped; the others' futures are marked running (no longer
        cancellable), so each gets its answer."""
        with self._ready:
            while not self._queue and not self._stopped:
                self._ready.wait()
            if not self._queue:
                return None
            deadline = self._queue[0][0] + self.max_queue_delay
            while not self._stopped:
                queued = sum(item[1] for item in self._queue)
                left = deadline - time.perf_counter()
                if queued >= self.max_batch_size or left <= 0:
                    break
                self._ready.wait(left)
            batch = [self._queue.popleft()]
            rows = batch[0][1]
            while self._queue and rows + self._queue[0][1] <= self.max_batch_size:
                item = self._queue.popleft()
                batch.append(item)
                rows += item[1]
        # an asyncio future's state is read from this thread: one cancelled right after is
        # found done by _settle on its loop and left alone
        return [item for item in batch if (item[4].set_running_or_notify_cancel()
                                           if item[5] is None else not item[4].cancelled())]

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if not batch:  # every request of it was cancelled
                continue
            try:
                results, snapshot = self.predictor.predict_many([(b[2], b[3]) for b in batch])
            except Exception as e:  # the whole call failed (unreadable data): every request
                log.error("a batch of %d requests failed: %s", len(batch), e)
                _answer(batch, [_refusal(e)] * len(batch))
                continue
            if self.metrics is not None:
                self.metrics.merged(self.predictor.model_name, sum(item[1] for item in batch),
                                    len(batch))
            _answer(batch, [_refusal(r) if isinstance(r, Exception) else
                            ({"probability": r}, snapshot) for r in results])

    def close(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify_all()
        self._thread.join(timeout=10)
        left = [item for item in self._queue
                if item[5] is not None or item[4].set_running_or_notify_cancel()]
        _answer(left, [ProtocolError("the server is shutting down", 503)] * len(left))
        self._queue.clear()


def _answer(items: list, answers: list) -> None:
    """Each queued item's answer (a result, or an exception to raise) to its future: a
    ``concurrent.futures.Future`` at once, the asyncio futures of each loop in one hand-over."""
    by_loop: dict = {}
    for item, answer in zip(items, answers):
        future, loop = item[4], item[5]
        if loop is None:
            if isinstance(answer, BaseException):
                future.set_exception(answer)
            else:
                future.set_result(answer)
        else:
            by_loop.setdefault(loop, []).append((future, answer))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, pairs)
        except RuntimeError:  # the loop is closed: its front end stopped, nobody waits
            log.debug("%d answers for a closed event loop dropped", len(pairs))


def _settle(pairs: list) -> None:
    """On the futures' loop: each (asyncio future, answer) settled, unless cancelled meanwhile."""
    for future, answer in pairs:
        if future.done():
            continue
        if isinstance(answer, BaseException):
            future.set_exception(answer)
        else:
            future.set_result(answer)


class Service:
    """A ``Predictor`` answering inference requests of either front end.

    max_batch_size: rows a merged batch holds (1: dynamic batching off); max_queue_delay:
    seconds a request waits for others to merge with."""

    def __init__(self, predictor: Predictor, max_batch_size: int = 1,
                 max_queue_delay: float = 0.0, metrics: bool = True):
        self.predictor = predictor
        self.metrics = Metrics(predictor) if metrics else None
        self.batcher = Batcher(predictor, max_batch_size, max_queue_delay, self.metrics) \
            if max_batch_size > 1 else None
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="one_embedding-infer")

    def _run(self, name: str, inputs: tuple) -> tuple[dict, str]:
        outputs, snapshot = run_model(self.predictor, name, inputs)
        if self.metrics is not None:
            self.metrics.merged(name, inputs[0].shape[0], 1)
        return outputs, snapshot

    def submit(self, name: str, tensors: dict) -> Future:
        """A request's decoded tensors -> Future of ({output name: array}, snapshot). Raises
        ProtocolError at once for a request refused by its names, types or shapes."""
        inputs = model_inputs(self.predictor, name, tensors)
        if self.batcher is not None and name != "embedding":
            return self.batcher.submit(*inputs)
        return self._pool.submit(self._run, name, inputs)

    def submit_async(self, name: str, tensors: dict) -> asyncio.Future:
        """``submit`` from a running event loop -> an ``asyncio.Future`` of that loop (the
        dynamic batcher settles a batch's futures in one hand-over to the loop)."""
        inputs = model_inputs(self.predictor, name, tensors)
        if self.batcher is not None and name != "embedding":
            return self.batcher.submit_async(*inputs)
        return asyncio.wrap_future(self._pool.submit(self._run, name, inputs))

    def call(self, name: str, tensors: dict) -> tuple[dict, str]:
        """``submit``, waited for; without batching the model runs in the calling thread (a
        gRPC worker: no second thread hop)."""
        inputs = model_inputs(self.predictor, name, tensors)
        if self.batcher is not None and name != "embedding":
            return self.batcher.submit(*inputs).result()
        return self._run(name, inputs)

    def answered(self, model: str, protocol: str, code: int, started: float, rows: int) -> None:
        """Record one answered request in the metrics (no-op without them); a model this
        server does not have is counted as "unknown"."""
        if self.metrics is not None:
            if model != "embedding" and (not self.predictor.ready
                                         or model != self.predictor.model_name):
                model = "unknown"
            self.metrics.answered(model, protocol, code, time.perf_counter() - started, rows)

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        self._pool.shutdown(wait=True)
