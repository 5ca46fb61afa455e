"""Serving side by side: an inference forward keeps no activations, so requests run their forwards
concurrently without a lock; the dynamic batcher merges concurrent requests and answers each
as it would have been answered alone."""
import os
import socket
import threading

import numpy as np
import pytest

from one_embedding.config import TrainConfig
from one_embedding.data.features import FeatureTransform
from one_embedding.serving import Predictor
from one_embedding.training import train

CFG = dict(steps=4, batch_size=128, synthetic_rows=5000, eval_batches=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("serving") / "run"
    train(TrainConfig(persistent_path=str(path), **CFG), metrics_path=os.devnull, progress=False)
    return path


def raw_rows(n: int, seed: int):
    """n raw synthetic requests rows: dense (n, 13) with NaNs, categorical (n, 26) strings."""
    rng = np.random.default_rng(seed)
    t = FeatureTransform.for_config(TrainConfig(**CFG))
    dense = rng.integers(0, 50, (n, 13)).astype(np.float32)
    dense[rng.random((n, 13)) < 0.2] = np.nan
    cat = np.array([[str(int(rng.integers(0, c))) for c in t.cardinalities] for _ in range(n)],
                   dtype=object)
    return dense, cat


def activations(model) -> list:
    """Names of the arrays a model's modules hold for a backward pass."""
    held = []
    for m in model.modules():
        for name in ("_x", "_mask", "_xs", "_keep"):
            if getattr(m, name, None) is not None:
                held.append(f"{type(m).__name__}.{name}")
    return held


def test_an_inference_forward_keeps_no_activations_and_runs_side_by_side(run):
    requests = [raw_rows(int(n), seed) for seed, n in enumerate([1, 7, 64, 3, 200, 64, 2, 31])]
    with Predictor(run) as p:
        alone = [p.predict(d, c) for d, c in requests]
        assert activations(p._current.model) == []
        got = [None] * (len(requests) * 4)
        start = threading.Barrier(8)

        def work(k):
            start.wait()
            for i in range(k, len(got), 8):
                got[i] = p.predict(*requests[i % len(requests)])

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, g in enumerate(got):
            np.testing.assert_array_equal(g, alone[i % len(requests)])
        assert activations(p._current.model) == []


def test_the_batcher_merges_concurrent_requests_and_answers_each_as_alone(run, monkeypatch):
    """Requests queued together are one model call (the metrics count a merged batch), and each
    gets the scores ``predict`` gives it alone, up to float32 rounding: OpenBLAS picks other
    kernels (other summation orders) for other row counts, so a row's logit can differ in its
    last bits between a 1-row and a 130-row call, as under Triton's batching. A bad request in
    the batch is refused alone while the others are answered."""
    from one_embedding.serving.protocol import ProtocolError
    from one_embedding.serving.service import Service

    requests = [raw_rows(int(n), 100 + seed) for seed, n in enumerate([1, 5, 64, 1, 33, 2, 17, 9])]
    bad_dense, bad_cat = raw_rows(3, 99)
    bad_cat[1, 2] = "x"
    from one_embedding.serving import predictor as predictor_module

    joint = []
    transform_together = predictor_module._joint_inputs
    monkeypatch.setattr(predictor_module, "_joint_inputs",
                        lambda *a: joint.append(transform_together(*a)) or joint[-1])
    with Predictor(run) as p:
        alone = [p.predict(d, c) for d, c in requests]
        service = Service(p, max_batch_size=4096, max_queue_delay=0.5)
        try:
            for with_bad in (False, True):  # transformed together; one by one around the bad one
                futures = [service.submit("dlrm", {"dense": d, "categorical": c})
                           for d, c in requests]
                if with_bad:
                    refused = service.submit("dlrm", {"dense": bad_dense, "categorical": bad_cat})
                for f, want in zip(futures, alone):
                    outputs, snapshot = f.result(timeout=60)
                    assert snapshot == "final"
                    assert outputs["probability"].shape == want.shape
                    np.testing.assert_allclose(outputs["probability"], want, rtol=0, atol=1e-6)
            with pytest.raises(ProtocolError, match=r"categorical\[1, 2\] = 'x'") as e:
                refused.result(timeout=60)
            assert e.value.status == 400
            assert any(j is not None for j in joint) and any(j is None for j in joint)
            merged = {s.name: s.value for s in service.metrics.registry.collect()
                      for s in s.samples if s.name == "one_embedding_batch_requests_sum"}
            assert merged["one_embedding_batch_requests_sum"] == 2 * len(requests) + 1
            count = {s.name: s.value for m in service.metrics.registry.collect()
                     for s in m.samples if s.name == "one_embedding_batch_requests_count"}
            assert count["one_embedding_batch_requests_count"] < 2 * len(requests), count  # merged
        finally:
            service.close()


def test_a_cancelled_request_is_dropped_and_the_batcher_goes_on(run):
    """A caller that went away cancels its future while it waits in the queue (a gRPC call the
    client cancelled, through ``asyncio.wrap_future``): the batcher drops it and answers the
    requests merged with it and after it."""
    from one_embedding.serving.service import Service

    (dense, cat), (dense2, cat2) = raw_rows(3, 7), raw_rows(2, 8)
    with Predictor(run) as p:
        want = p.predict(dense2, cat2)
        service = Service(p, max_batch_size=4096, max_queue_delay=0.3)
        try:
            gone = service.submit("dlrm", {"dense": dense, "categorical": cat})
            assert gone.cancel()  # still queued: the batch waits 0.3 s for others
            kept = service.submit("dlrm", {"dense": dense2, "categorical": cat2})
            np.testing.assert_allclose(kept.result(timeout=30)[0]["probability"], want,
                                       rtol=0, atol=1e-6)
            later = service.submit("dlrm", {"dense": dense2, "categorical": cat2})
            np.testing.assert_allclose(later.result(timeout=30)[0]["probability"], want,
                                       rtol=0, atol=1e-6)
            merged = {s.name: s.value for m in service.metrics.registry.collect()
                      for s in m.samples if s.name.startswith("one_embedding_batch_requests")}
            assert merged["one_embedding_batch_requests_sum"] == 2  # the cancelled one not run
        finally:
            service.close()


def test_a_cancelled_grpc_call_is_dropped_counted_499_and_the_server_goes_on(run):
    """A gRPC call cancelled by its client while it waits in the batcher's queue: the server's
    coroutine is cancelled, its future dropped by the batcher (no model call), the request
    counted with code 499; the next call is answered."""
    import time

    grpc = pytest.importorskip("grpc")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    from one_embedding.serving.grpc_service import start_grpc
    from one_embedding.serving.service import Service

    dense, cat = raw_rows(2, 5)
    request = pb.ModelInferRequest(model_name="dlrm")
    for name, array, dtype in (("dense", dense, "FP32"), ("categorical", cat, "BYTES")):
        i = grpcclient.InferInput(name, list(array.shape), dtype)
        i.set_data_from_numpy(array)
        request.inputs.extend([i._get_tensor()])
        request.raw_input_contents.extend([i._get_content()])

    def count(code):
        return sum(s.value for m in service.metrics.registry.collect() for s in m.samples
                   if s.name == "one_embedding_requests_total" and s.labels["code"] == code
                   and s.labels["protocol"] == "grpc")

    with Predictor(run) as p:
        want = p.predict(dense, cat)
        service = Service(p, max_batch_size=4096, max_queue_delay=1.0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = start_grpc(service, "127.0.0.1", port, 64)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                call = stub.ModelInfer.future(request)
                deadline = time.monotonic() + 30
                while not service.batcher._queue:  # queued: its batch waits 1 s for others
                    assert time.monotonic() < deadline and not call.done()
                    time.sleep(0.01)
                assert call.cancel()
                while count("499") < 1:
                    assert time.monotonic() < deadline, "the cancelled call was not counted"
                    time.sleep(0.01)
                answer = stub.ModelInfer(request, timeout=30)
            got = np.frombuffer(answer.raw_output_contents[0], np.float32)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
            assert (count("499"), count("200")) == (1, 1)
            merged = {s.name: s.value for m in service.metrics.registry.collect()
                      for s in m.samples if s.name == "one_embedding_batch_requests_sum"}
            assert merged["one_embedding_batch_requests_sum"] == 1  # the cancelled one not run
        finally:
            server.stop(0)
            service.close()


@pytest.mark.parametrize("argv,words", [
    (["--max-batch-size", "0"], "--max-batch-size 0 must be >= 1"),
    (["--max-queue-delay-us", "-5"], "--max-queue-delay-us -5.0 must be a finite number >= 0"),
    # infinite values passed the >= 0 check and broke the batcher / follower thread later
    (["--max-queue-delay-us", "inf"], "--max-queue-delay-us inf must be a finite number"),
    (["--poll-seconds", "inf"], "--poll-seconds inf must be a finite number"),
    (["--cache-mb", "nan"], "--cache-mb nan must be a finite number"),
    (["--shutdown-grace-seconds", "-1"], "--shutdown-grace-seconds -1.0 must be a finite"),
    (["--scratch", __file__], "is a file: pass a folder"),
    (["--grpc-port", "8000"], "--grpc-port 8000 must be in 1..65535 and differ from --port 8000"),
    (["--grpc-port", "70000"], "--grpc-port 70000 must be in 1..65535"),
    (["--blas-threads", "0"], "--blas-threads 0 must be >= 1"),
])
def test_serve_refuses_bad_batching_and_grpc_options(run, capsys, argv, words):
    from one_embedding import cli

    assert cli.main(["serve", "--persistent-path", str(run), *argv]) == 2
    assert words in capsys.readouterr().err


def test_a_grpc_port_in_use_is_a_config_error_and_leaves_no_thread(run):
    pytest.importorskip("grpc")
    from one_embedding.errors import ConfigError
    from one_embedding.serving.grpc_service import start_grpc
    from one_embedding.serving.service import Service

    with Predictor(run) as p, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = Service(p)
        try:
            with pytest.raises(ConfigError, match=f"--grpc-port {port}: cannot listen on "
                                                  f"127.0.0.1:{port}"):
                start_grpc(service, "127.0.0.1", port, 64)
        finally:
            service.close()
    assert not [t for t in threading.enumerate() if t.name == "one_embedding-grpc"]


def test_an_event_loops_requests_are_answered_in_one_hand_over_per_batch(run):
    """``submit_async`` from an event loop: the requests merged into one model call are handed
    to their loop in one ``call_soon_threadsafe`` (one wake-up per batch, not per request), each
    gets its own rows' scores, a refused one its error, and one cancelled while queued is
    dropped without stopping the batcher."""
    import asyncio

    from one_embedding.serving.protocol import ProtocolError
    from one_embedding.serving.service import Service

    rows = [raw_rows(k + 1, 20 + k) for k in range(4)]
    bad_dense, bad_cat = raw_rows(2, 30)
    bad_cat[1, 2] = "x"
    hand_overs = []

    class CountingLoop(asyncio.SelectorEventLoop):
        def call_soon_threadsafe(self, callback, *args, **kw):
            if threading.current_thread().name == "one_embedding-batcher":
                hand_overs.append(len(args[0]))
            return super().call_soon_threadsafe(callback, *args, **kw)

    with Predictor(run) as p:
        want = [p.predict(d, c) for d, c in rows]
        service = Service(p, max_batch_size=4096, max_queue_delay=0.3)

        async def main():
            futures = [service.submit_async("dlrm", {"dense": d, "categorical": c})
                       for d, c in rows]
            refused = service.submit_async("dlrm", {"dense": bad_dense, "categorical": bad_cat})
            gone = service.submit_async("dlrm", {"dense": rows[0][0], "categorical": rows[0][1]})
            gone.cancel()
            answers = await asyncio.gather(*futures)
            with pytest.raises(ProtocolError, match=r"categorical\[1, 2\] = 'x'"):
                await refused
            later = await service.submit_async("dlrm", {"dense": rows[1][0],
                                                        "categorical": rows[1][1]})
            return answers, later

        loop = CountingLoop()
        try:
            answers, later = loop.run_until_complete(main())
        finally:
            loop.close()
            service.close()
    for (outputs, snapshot), w in zip(answers, want):
        np.testing.assert_allclose(outputs["probability"], w, rtol=0, atol=1e-6)
        assert snapshot == p.snapshot
    np.testing.assert_allclose(later[0]["probability"], want[1], rtol=0, atol=1e-6)
    assert hand_overs == [5, 1], hand_overs  # the merged five in one, then the later one


def test_an_event_loops_requests_of_one_iteration_wake_the_batcher_once(run):
    """The requests an event loop submits in one iteration join the batcher's queue together
    when the iteration ends: one wake-up of its thread for them all (a wake-up per request
    made it take the GIL from the loop once per request), none visible to it before; and a
    request submitted after ``close`` is refused with a 503."""
    import asyncio

    from one_embedding.serving.protocol import ProtocolError
    from one_embedding.serving.service import Service

    rows = [raw_rows(k + 1, 40 + k) for k in range(4)]
    with Predictor(run) as p:
        service = Service(p, max_batch_size=4096, max_queue_delay=0.2)
        batcher = service.batcher
        wakes = []
        notify = batcher._ready.notify

        def counting_notify(n=1):
            wakes.append(len(batcher._queue))
            notify(n)

        batcher._ready.notify = counting_notify

        async def main():
            first = [service.submit_async("dlrm", {"dense": d, "categorical": c})
                     for d, c in rows]
            queued_before = len(batcher._queue)
            await asyncio.sleep(0)                      # the iteration ends
            second = service.submit_async("dlrm", {"dense": rows[0][0],
                                                   "categorical": rows[0][1]})
            answers = await asyncio.gather(*first, second)
            return queued_before, answers

        loop = asyncio.new_event_loop()
        try:
            queued_before, answers = loop.run_until_complete(main())
            woken = list(wakes)
            service.close()
            with pytest.raises(ProtocolError, match="shutting down") as e:
                loop.run_until_complete(_submit_after_close(service, rows[0]))
            assert e.value.status == 503
        finally:
            loop.close()
        want = [p.predict(d, c) for d, c in rows] + [p.predict(*rows[0])]
    assert queued_before == 0
    # two wake-ups (the queue's length after each): the first iteration's four joined it at
    # once, the later one alone (the batcher waits up to 0.2 s for more before it takes them)
    assert woken == [4, 5], woken
    for (outputs, _), w in zip(answers, want):
        np.testing.assert_allclose(outputs["probability"], w, rtol=0, atol=1e-6)


async def _submit_after_close(service, row):
    return await service.submit_async("dlrm", {"dense": row[0], "categorical": row[1]})
