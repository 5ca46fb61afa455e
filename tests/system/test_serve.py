"""``one-embedding serve`` through Triton's HTTP client: metadata, rows equal to the snapshot's,
scores equal to the in-process ``Predictor``'s, every kind of bad request refused with a 4xx
(and the server still serving), and the switch to each checkpoint a running training publishes,
while its retention deletes the one being served."""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import helpers
import one_embedding as oe
from one_embedding.serving import Predictor

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
from tritonclient.utils import InferenceServerException  # noqa: E402

E = 16
TRAIN = ["--synthetic-rows", "20000", "--batch-size", "256", "--no-progress", "--store",
         "cached_ssd", "--cache-mb", "0.25", "--eval-batches", "2"]


def train(path, *args, wait=True):
    cmd = [sys.executable, "-m", "one_embedding", "train", *TRAIN, "--persistent-path", str(path),
           "--metrics", os.devnull, *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``one-embedding serve`` on free ports, REST (``client``) and gRPC (``grpc``). Its private
    stores go to a scratch folder beside the run (under the test's temporary folder), not to the
    system's /tmp: a server stopped with SIGTERM or SIGKILL cannot remove its scratch folder
    itself."""

    def __init__(self, path, *args, ready=True):
        self.port, self.grpc_port = free_port(), free_port()
        self.scratch = Path(path).parent / f"serve_scratch_{self.port}"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "one_embedding", "serve", "--persistent-path", str(path),
             "--port", str(self.port), "--grpc-port", str(self.grpc_port),
             "--scratch", str(self.scratch), *map(str, args)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.client = httpclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        self.grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()[-3000:]
            try:
                if ready and self.client.is_server_ready() and self.grpc.is_server_ready():
                    return
                if not ready and self.client.is_server_live() and self.grpc.is_server_live():
                    return
            except Exception:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)

    def raw(self, method, url, body=b"", headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request(method, url, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "t"
    train(path, "--steps", 20)
    return path


@pytest.fixture(scope="module")
def server(run):
    s = Server(run, "--cache-mb", "0.05", "--max-request-mb", "0.5")
    yield s
    s.close()


def keys_input(keys, binary=True):
    i = httpclient.InferInput("keys", [len(keys)], "INT64")
    i.set_data_from_numpy(np.asarray(keys, np.int64), binary_data=binary)
    return i


def requests_for(n, rng):
    """Raw features for the synthetic run: dense with NaNs, categorical value indexes."""
    p = Predictor.__new__(Predictor)  # noqa: F841  (only the transform below is needed)
    from one_embedding.data.features import FeatureTransform
    from one_embedding.config import TrainConfig

    t = FeatureTransform.for_config(TrainConfig(synthetic_rows=20000))
    dense = rng.integers(0, 50, (n, 13)).astype(np.float32)
    dense[rng.random((n, 13)) < 0.2] = np.nan
    cat = np.array([[str(int(rng.integers(0, c))) for c in t.cardinalities] for _ in range(n)],
                   dtype=object)
    return dense, cat


def model_inputs(dense, cat, binary=True):
    a = httpclient.InferInput("dense", list(dense.shape), "FP32")
    a.set_data_from_numpy(dense, binary_data=binary)
    b = httpclient.InferInput("categorical", list(cat.shape), "BYTES")
    b.set_data_from_numpy(cat, binary_data=binary)
    return [a, b]


def test_metadata_and_health(server):
    c = server.client
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("embedding") and c.is_model_ready("dlrm")
    meta = c.get_model_metadata("embedding")
    assert meta["inputs"] == [{"name": "keys", "datatype": "INT64", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "embeddings", "datatype": "FP32", "shape": [-1, E]}]
    meta = c.get_model_metadata("dlrm")
    assert [i["name"] for i in meta["inputs"]] == ["dense", "categorical"]
    assert meta["outputs"][0]["name"] == "probability" and meta["parameters"]["snapshot"] == "final"


def test_rows_equal_the_snapshot_and_unknown_keys_their_initial_value(server, run):
    with oe.make_persistent_table_reader([str(run / "0-1")], "final", np.int64, np.float32,
                                         2 * E) as reader:
        keys, lines = map(np.concatenate, zip(*reader))
    assert keys.shape[0] > 1000
    for binary in (True, False):
        for start in range(0, keys.shape[0], 4096):
            r = server.client.infer("embedding", [keys_input(keys[start:start + 4096], binary)])
            np.testing.assert_array_equal(r.as_numpy("embeddings"), lines[start:start + 4096, :E])
            assert r.get_response()["parameters"]["snapshot"] == "final"
    unknown = np.array([2**40 + 7, 2**41 + 9], np.int64)
    got = server.client.infer("embedding", [keys_input(unknown)]).as_numpy("embeddings")
    with Predictor(run) as p:
        np.testing.assert_array_equal(got, p.lookup(unknown))
    assert np.abs(got).max() > 0  # the initializer's values, not zeros


def server_scores(run, dense, cat):
    """The in-process Predictor's scores under the server's BLAS threads (``--blas-threads``,
    default 1): OpenBLAS splits a product differently for another thread count, and on some
    processors (AVX2, OpenBLAS 0.3.31) that changes the last bit of ~1 score in 6."""
    from threadpoolctl import threadpool_limits

    with Predictor(run) as p, threadpool_limits(1, user_api="blas"):
        return p.predict(dense, cat)


def test_scores_equal_the_in_process_predictor(server, run):
    dense, cat = requests_for(300, np.random.default_rng(0))
    want = server_scores(run, dense, cat)
    for binary in (True, False):
        got = server.client.infer("dlrm", model_inputs(dense, cat, binary)).as_numpy("probability")
        np.testing.assert_array_equal(got, want)
    assert 0 < want.min() and want.max() < 1


def test_predictor_scores_equal_the_trained_model(run):
    """The served score is the trained model's: the same checkpoint loaded into a training-side
    model, fed the ids the transform makes, gives the same probabilities."""
    from one_embedding.checkpoint import load_checkpoint
    from one_embedding.config import TrainConfig
    from one_embedding.data.features import FeatureTransform
    from one_embedding.training_setup import build_model

    dense, cat = requests_for(64, np.random.default_rng(1))
    with Predictor(run) as p:
        got = p.predict(dense, cat)
    cfg = TrainConfig(synthetic_rows=20000)
    t = FeatureTransform.for_config(cfg)
    store = oe.make_cached_ssd_store_options(0.25, str(run), size_factor=2, capacity=None)
    model = build_model(cfg, 26, store)
    load_checkpoint("final", model.embedding, model=model)
    logits = model.forward(t.dense(dense), t.keys(cat))
    model.embedding.close()
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-np.asarray(logits, np.float64))), rtol=1e-6)


def test_bad_requests_get_a_4xx_naming_the_problem(server):
    c = server.client
    dense, cat = requests_for(4, np.random.default_rng(2))
    cases = {
        "unknown model": lambda: c.infer("nope", [keys_input([1])]),
        "wrong input name": lambda: c.infer("embedding", model_inputs(dense, cat)[:1]),
        "wrong shape": lambda: c.infer("dlrm", model_inputs(dense[:, :12].copy(), cat)),
        "wrong dtype": lambda: c.infer("dlrm", [_typed("dense", dense.astype(np.float64), "FP64"),
                                                model_inputs(dense, cat)[1]]),
        "keys as FP32": lambda: c.infer("embedding", [_typed("keys", np.ones(3, np.float32), "FP32")]),
        "bad categorical": lambda: c.infer("dlrm", model_inputs(dense, np.full((4, 26), "zz",
                                                                               dtype=object))),
        "rows differ": lambda: c.infer("dlrm", model_inputs(dense[:3].copy(), cat)),
        "oversized": lambda: c.infer("embedding", [keys_input(np.arange(200_000))]),
    }
    for what, call in cases.items():
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() in ("400", "404", "413"), (what, e.value)
        assert e.value.message(), what
    assert "413" == _status(cases["oversized"])
    assert "404" == _status(cases["unknown model"])
    body = json.dumps({"inputs": [{"name": "keys", "shape": [2], "datatype": "INT64",
                                   "parameters": {"binary_data_size": 16}}]}).encode()
    raw_cases = [
        (body + b"\0" * 16, {"Inference-Header-Content-Length": "9999"}),      # past the body
        (body + b"\0" * 16, {"Inference-Header-Content-Length": "abc"}),       # not a number
        (body + b"\0" * 8, {"Inference-Header-Content-Length": str(len(body))}),  # short data
        (b"{not json", {}),
        (json.dumps({"inputs": [{"name": "keys", "shape": [2], "datatype": "INT64",
                                 "data": [1]}]}).encode(), {}),                # 1 value for 2
        (json.dumps({"inputs": [{"name": "keys", "shape": [1], "datatype": "INT99",
                                 "data": [1]}]}).encode(), {}),
    ]
    for payload, headers in raw_cases:
        status, reply = server.raw("POST", "/v2/models/embedding/infer", payload, headers)
        assert status == 400, (payload[:60], status, reply)
        assert json.loads(reply)["error"]
    assert server.raw("GET", "/v2/nowhere")[0] == 404
    # a version the model does not have (its one version is "1"): 404 on every route
    for method, url in (("POST", "/v2/models/embedding/versions/7/infer"),
                        ("GET", "/v2/models/embedding/versions/7"),
                        ("GET", "/v2/models/embedding/versions/7/ready")):
        status, reply = server.raw(method, url, json.dumps({"inputs": []}).encode())
        assert status == 404 and "no version '7'" in json.loads(reply)["error"], (url, reply)
    assert c.infer("embedding", [keys_input([1])], model_version="1").as_numpy(
        "embeddings").shape == (1, E)
    # and it still serves
    assert c.is_server_live()
    assert c.infer("embedding", [keys_input([1, 2])]).as_numpy("embeddings").shape == (2, E)


def grpc_inputs(**arrays):
    """tritonclient.grpc inputs: name=(array, datatype)."""
    out = []
    for name, (array, datatype) in arrays.items():
        i = grpcclient.InferInput(name, list(array.shape), datatype)
        i.set_data_from_numpy(array)
        out.append(i)
    return out


def test_grpc_answers_as_rest_does(server, run):
    g = server.grpc
    assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("dlrm")
    meta = g.get_model_metadata("dlrm", as_json=True)
    assert [i["name"] for i in meta["inputs"]] == ["dense", "categorical"]
    dense, cat = requests_for(300, np.random.default_rng(4))
    want = server_scores(run, dense, cat)
    keys = np.arange(0, 5000, 7, dtype=np.int64)
    with Predictor(run) as p:
        rows = p.lookup(keys)
    r = g.infer("dlrm", grpc_inputs(dense=(dense, "FP32"), categorical=(cat, "BYTES")))
    np.testing.assert_array_equal(r.as_numpy("probability"), want)
    assert r.get_response().parameters["snapshot"].string_param == "final"
    r = g.infer("embedding", grpc_inputs(keys=(keys, "INT64")))
    np.testing.assert_array_equal(r.as_numpy("embeddings"), rows)


GRPC_STATUS = {"400": "StatusCode.INVALID_ARGUMENT", "404": "StatusCode.NOT_FOUND",
               "413": "StatusCode.RESOURCE_EXHAUSTED"}


def test_grpc_refuses_what_rest_refuses_with_the_matching_status(server):
    """Every bad request of the REST test, sent over both: REST's 4xx and gRPC's status match."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    c, g = server.client, server.grpc
    dense, cat = requests_for(4, np.random.default_rng(2))
    bad_cat = np.full((4, 26), "zz", dtype=object)
    cases = {  # what: (model, {input: (array, datatype)})
        "unknown model": ("nope", {"keys": (np.array([1], np.int64), "INT64")}),
        "wrong input name": ("embedding", {"dense": (dense, "FP32")}),
        "wrong shape": ("dlrm", {"dense": (dense[:, :12].copy(), "FP32"), "categorical": (cat, "BYTES")}),
        "wrong dtype": ("dlrm", {"dense": (dense.astype(np.float64), "FP64"),
                                 "categorical": (cat, "BYTES")}),
        "keys as FP32": ("embedding", {"keys": (np.ones(3, np.float32), "FP32")}),
        "bad categorical": ("dlrm", {"dense": (dense, "FP32"), "categorical": (bad_cat, "BYTES")}),
        "rows differ": ("dlrm", {"dense": (dense[:3].copy(), "FP32"), "categorical": (cat, "BYTES")}),
        "oversized": ("embedding", {"keys": (np.arange(200_000), "INT64")}),
    }
    for what, (model, arrays) in cases.items():
        rest = [_typed(n, a, d) for n, (a, d) in arrays.items()]
        with pytest.raises(InferenceServerException) as r:
            c.infer(model, rest)
        with pytest.raises(InferenceServerException) as e:
            g.infer(model, grpc_inputs(**arrays))
        assert e.value.status() == GRPC_STATUS[r.value.status()], (what, r.value, e.value)
        assert e.value.message(), what
        if r.value.status() != "413":  # the same words (a size limit is gRPC's own message)
            assert r.value.message() == e.value.message(), what
    # malformed messages tritonclient would not send: INVALID_ARGUMENT naming the problem
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))

    def keys_request(**kw):
        req = pb.ModelInferRequest(model_name="embedding")
        req.inputs.add(name="keys", datatype=kw.get("datatype", "INT64"), shape=kw.get("shape", [2]))
        if "contents" in kw:
            req.inputs[0].contents.int64_contents.extend(kw["contents"])
        for raw in kw.get("raw", []):
            req.raw_input_contents.append(raw)
        return req

    raw_cases = {
        "short raw data": (keys_request(raw=[b"\0" * 8]), "8 bytes of raw contents"),
        "raw for no input": (keys_request(raw=[b"\0" * 16, b"x"]), "2 raw_input_contents"),
        "one value for two": (keys_request(contents=[1]), "1 elements"),
        "unknown datatype": (keys_request(datatype="INT99", contents=[1, 2]), "INT99"),
        "negative shape": (keys_request(shape=[-2], contents=[1]), "non-negative"),
        "2**64 elements": (keys_request(shape=[2**32, 2**32], raw=[b""]), "0 bytes of raw"),
        # found by a fault campaign (2026-12-07): both were INTERNAL
        "70 dimensions": (keys_request(shape=[1] * 69 + [2], contents=[1, 2]), "70 dimensions"),
        "past int64": (keys_request(shape=[2**62, 2**62, 0], raw=[b""]), "cannot be made"),
    }
    for what, (req, words) in raw_cases.items():
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, e.value)
        assert words in e.value.details(), (what, e.value.details())
    int8 = pb.ModelInferRequest(model_name="embedding")
    int8.inputs.add(name="keys", datatype="INT8", shape=[1]).contents.int_contents.append(300)
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(int8)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "INT8" in e.value.details()
    for call in (lambda: g.is_model_ready("nope"), lambda: g.get_model_metadata("nope"),
                 lambda: g.is_model_ready("embedding", "7"),
                 lambda: g.get_model_metadata("embedding", "7"),
                 lambda: g.infer("embedding", grpc_inputs(keys=(np.array([1]), "INT64")),
                                 model_version="7")):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "StatusCode.NOT_FOUND"
    # and it still serves
    r = stub.ModelInfer(keys_request(contents=[1, 2]))
    assert list(r.outputs[0].shape) == [2, E]


def _metric_samples(server) -> dict:
    """{(sample name, sorted labels): value} of the server's /metrics, parsed by
    prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = server.raw("GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_count_the_requests_sent(server):
    before = _metric_samples(server)
    dense, cat = requests_for(5, np.random.default_rng(6))
    for _ in range(3):
        server.client.infer("dlrm", model_inputs(dense, cat))
    for _ in range(2):
        server.grpc.infer("dlrm", grpc_inputs(dense=(dense, "FP32"), categorical=(cat, "BYTES")))
        server.grpc.infer("embedding", grpc_inputs(keys=(np.arange(7, dtype=np.int64), "INT64")))
    for _ in range(4):
        with pytest.raises(InferenceServerException):
            server.client.infer("dlrm", model_inputs(dense[:3].copy(), cat))
    with pytest.raises(InferenceServerException):
        server.grpc.infer("nope", grpc_inputs(keys=(np.arange(2, dtype=np.int64), "INT64")))
    after = _metric_samples(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("one_embedding_requests_total", model="dlrm", protocol="rest", code="200") == 3
    assert delta("one_embedding_requests_total", model="dlrm", protocol="grpc", code="200") == 2
    assert delta("one_embedding_requests_total", model="embedding", protocol="grpc", code="200") == 2
    assert delta("one_embedding_requests_total", model="dlrm", protocol="rest", code="400") == 4
    assert delta("one_embedding_request_failures_total", model="dlrm", protocol="rest",
                 code="400") == 4
    assert delta("one_embedding_request_failures_total", model="unknown", protocol="grpc",
                 code="404") == 1
    assert delta("one_embedding_rows_total", model="dlrm", protocol="rest") == 15
    assert delta("one_embedding_rows_total", model="embedding", protocol="grpc") == 14
    assert delta("one_embedding_request_seconds_count", model="dlrm", protocol="rest") == 7
    assert delta("one_embedding_request_seconds_bucket", model="dlrm", protocol="rest",
                 le="+Inf") == 7
    assert delta("one_embedding_batch_rows_sum", model="dlrm") == 25  # 5 calls of 5 rows
    assert after[("one_embedding_snapshot_info", (("snapshot", "final"),))] == 1


def _typed(name, array, datatype):
    i = httpclient.InferInput(name, list(array.shape), datatype)
    i.set_data_from_numpy(array)
    return i


def _status(call):
    try:
        call()
    except InferenceServerException as e:
        return e.status()
    return None


def test_follows_training_as_it_publishes_and_prunes(tmp_path):
    """Under load (scores over REST and gRPC through the dynamic batcher, lookups) while training
    publishes and prunes: no request fails, each is answered by some checkpoint in turn."""
    import threading

    path = tmp_path / "live"
    train(path, "--steps", 10, "--snapshot-interval", 5, "--keep-snapshots", 1)
    server = Server(path, "--poll-seconds", "0.1", "--max-batch-size", "64")
    try:
        proc = train(path, "--steps", 60, "--snapshot-interval", 5, "--keep-snapshots", 1,
                     "--resume", wait=False)
        seen, failures = [], []
        keys = np.arange(50)
        deadline = time.monotonic() + 300
        dense, cat = requests_for(8, np.random.default_rng(7))
        answered = []

        def load(call):
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    call()
                    answered.append(1)
                except Exception as e:  # any failed request fails the test
                    failures.append(repr(e))

        rest = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
        loaders = [threading.Thread(target=load, args=(call,), daemon=True) for call in (
            lambda: rest.infer("dlrm", model_inputs(dense, cat)),
            lambda: server.grpc.infer("dlrm", grpc_inputs(dense=(dense, "FP32"),
                                                          categorical=(cat, "BYTES"))))]
        for t in loaders:
            t.start()
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                r = server.client.infer("embedding", [keys_input(keys)])
                snap = r.get_response()["parameters"]["snapshot"]
                if not seen or seen[-1] != snap:
                    seen.append(snap)
            except Exception as e:  # any failed request fails the test
                failures.append(repr(e))
            time.sleep(0.02)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
        for t in loaders:
            t.join(timeout=60)
        assert len(answered) > 20, len(answered)
        time.sleep(1.0)
        r = server.client.infer("embedding", [keys_input(keys)])
        assert r.get_response()["parameters"]["snapshot"] == "final"
        assert not failures, failures[:3]
        assert len(seen) >= 3, seen  # several checkpoints served in turn while training ran
        # the served rows are the final snapshot's
        with Predictor(path, snapshot="final") as p:
            np.testing.assert_array_equal(r.as_numpy("embeddings"), p.lookup(keys))
        # retention deleted the older checkpoints even though the server had served them
        left = sorted(os.listdir(path / "0-1" / "snapshots"))
        assert [n for n in left if n.startswith("step-")] == ["step-60"], left
    finally:
        server.close()


@pytest.mark.slow  # a server and a training run of its own (~10 s); the unit tests cover the parts
def test_a_server_started_before_its_training_waits_then_serves(tmp_path):
    """`serve --wait-for-checkpoint` on a run not started yet: live and answering, not ready
    (REST 400 and gRPC false, as the protocol's health answers are), inference 503 naming the
    wait; once training publishes, it serves that checkpoint's rows, the first one counted as
    served, not as a switch. Without the flag the same path is refused at start."""
    path = tmp_path / "later"
    refused = subprocess.run([sys.executable, "-m", "one_embedding", "serve", "--persistent-path",
                              str(path), "--port", str(free_port())],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "does not exist" in refused.stderr, refused.stderr
    server = Server(path, "--wait-for-checkpoint", "--poll-seconds", "0.1", ready=False)
    try:
        assert not server.client.is_server_ready() and not server.grpc.is_server_ready()
        assert not server.client.is_model_ready("dlrm") and not server.grpc.is_model_ready("dlrm")
        assert server.raw("GET", "/v2/health/ready")[0] == 400
        assert ("one_embedding_snapshot_switches_total", ()) in _metric_samples(server)  # 200
        status, body = server.raw("POST", "/v2/models/embedding/infer", json.dumps(
            {"inputs": [{"name": "keys", "datatype": "INT64", "shape": [1], "data": [1]}]}))
        assert status == 503 and b"not ready" in body, body
        with pytest.raises(InferenceServerException, match="not ready"):
            server.grpc.infer("embedding", grpc_inputs(keys=(np.arange(3, dtype=np.int64), "INT64")))
        train(path, "--steps", 10)
        deadline = time.monotonic() + 60
        while not server.client.is_server_ready():
            assert time.monotonic() < deadline, "the first checkpoint was never served"
            time.sleep(0.1)
        assert server.grpc.is_server_ready() and server.client.is_model_ready("dlrm")
        keys = np.arange(200)
        r = server.client.infer("embedding", [keys_input(keys)])
        assert r.get_response()["parameters"]["snapshot"] == "final"
        with Predictor(path, snapshot="final") as p:
            np.testing.assert_array_equal(r.as_numpy("embeddings"), p.lookup(keys))
        samples = _metric_samples(server)
        assert samples[("one_embedding_snapshot_switches_total", ())] == 0.0, samples
        assert samples[("one_embedding_snapshot_info", (("snapshot", "final"),))] == 1.0, samples
    finally:
        server.close()


def doc_serving_blocks(page: str, heading: str) -> list[str]:
    """The Python blocks of ``page``'s section ``heading`` (to the next heading of its level)."""
    import re

    text = (helpers.ROOT / page).read_text()
    start = text.index(heading + "\n")
    level = heading.split(" ")[0]
    end = text.find("\n" + level + " ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert blocks, f"{page}: the section {heading!r} lost its examples"
    return blocks


def run_blocks(blocks, port, scope=None, grpc_port=None) -> dict:
    """Run the blocks in order in one scope, the documented ports replaced by the test server's
    (8001: the gRPC port, beside REST's 8000; 8002: a second REST server, of a TSV run)."""
    scope = {} if scope is None else scope
    for code in blocks:
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        code = code.replace("127.0.0.1:8001", f"127.0.0.1:{grpc_port}")
        code = code.replace("127.0.0.1:8002", f"127.0.0.1:{port}")
        exec(compile(code, "docs", "exec"), scope)
    return scope


def check_prediction(scope, run_path, n):
    """The documented request's answer is the in-process Predictor's on the same inputs."""
    prob = scope["probability"]
    assert prob.shape == (n,) and prob.dtype == np.float32
    assert np.all((prob > 0) & (prob < 1))
    with Predictor(run_path) as p:
        np.testing.assert_allclose(prob, p.predict(scope["dense"], scope["categorical"]),
                                   rtol=1e-6)


def test_readme_client_example_runs(server, run):
    """The README's lookup and its dlrm request, as written, against a synthetic run."""
    scope = run_blocks(doc_serving_blocks("README.md", "## Serving: `one-embedding serve`"),
                       server.port, grpc_port=server.grpc_port)
    assert scope["rows"].shape == (3, E) and scope["snapshot"] == "final"
    # the gRPC client's answer is the REST one's
    np.testing.assert_array_equal(scope["grpc_rows"], scope["rows"])
    assert scope["grpc_snapshot"] == "final"
    check_prediction(scope, run, 2)


def test_docs_serving_synthetic_requests_run(server, run):
    scope = run_blocks(doc_serving_blocks("docs/serving.md", "# Serving: `one-embedding serve`")[:2],
                       server.port)
    assert scope["rows"].shape == (3, E)
    check_prediction(scope, run, 2)


def test_docs_serving_criteo_request_runs(tmp_path):
    """docs/serving.md's request built from a Criteo TSV line, against a run trained on TSV."""
    data = tmp_path / "day_0.tsv"
    helpers.write_criteo_tsv(data, 600)
    path = tmp_path / "criteo"
    proc = subprocess.run(
        [sys.executable, "-m", "one_embedding", "train", "--data", str(data), "--steps", "4",
         "--batch-size", "64", "--no-progress", "--eval-batches", "1", "--metrics", os.devnull,
         "--persistent-path", str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    server = Server(path, "--poll-seconds", "0")
    try:
        blocks = doc_serving_blocks("docs/serving.md", "## Click predictions")
        scope = run_blocks(blocks[1:], server.port)  # blocks[0] is the synthetic run's
        assert scope["categorical"].shape == (1, 26) and np.isnan(scope["dense"][0, 1])
        check_prediction(scope, path, 1)
    finally:
        server.close()


def test_sigterm_leaves_no_scratch_folder(run):
    server = Server(run)
    try:
        assert any(server.scratch.iterdir())  # the private store of the served snapshot
    finally:
        server.close()
    assert not any(server.scratch.iterdir()), sorted(server.scratch.rglob("*"))


def test_ctrl_c_exits_130_and_leaves_no_scratch_folder(run):
    """A Ctrl-C (SIGINT) exited 0: uvicorn raised it again inside asyncio, which swallowed it,
    so a supervisor or an `&&` chain took the stopped server for a success (found by a fault
    campaign)."""
    server = Server(run)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=30) == 130
    assert "Traceback" not in server.proc.stderr.read()
    assert not any(server.scratch.iterdir()), sorted(server.scratch.rglob("*"))


@pytest.mark.slow  # three server starts (~10 s)
def test_a_signal_while_the_snapshot_loads_leaves_no_scratch_folder(run, tmp_path):
    """SIGTERM before the server had installed its handler (while it loaded the snapshot)
    killed it with its private store left in the scratch folder."""
    scratch = tmp_path / "scratch"
    for delay in (0.8, 1.6, 2.4):
        proc = subprocess.Popen(
            [sys.executable, "-m", "one_embedding", "serve", "--persistent-path", str(run),
             "--port", str(free_port()), "--scratch", str(scratch)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.terminate()
        code = proc.wait(timeout=30)
        err = proc.stderr.read()
        assert code in (143, -signal.SIGTERM), err[-2000:]   # killed before the package loaded
        assert "Traceback" not in err, err[-2000:]
        assert not scratch.exists() or not any(scratch.iterdir()), sorted(scratch.rglob("*"))


def test_sigterm_with_a_client_stalled_in_its_body_exits_after_the_grace(run):
    """A client that sent half its body and stopped kept SIGTERM waiting for ever; now the
    request is answered 503 when --shutdown-grace-seconds ends, and the server exits (143)
    without a traceback and without its scratch folder."""
    server = Server(run, "--shutdown-grace-seconds", "1")
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        stalled.sendall(b"POST /v2/models/embedding/infer HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 100\r\n\r\n{\"inp")
        time.sleep(0.5)
        started = time.monotonic()
        server.proc.terminate()
        assert server.proc.wait(timeout=20) == 143
        assert time.monotonic() - started < 15
        reply = stalled.recv(4096)
    finally:
        stalled.close()
        if server.proc.poll() is None:
            server.proc.kill()
    assert reply.startswith(b"HTTP/1.1 503"), reply
    err = server.proc.stderr.read()
    assert "Traceback" not in err, err
    assert "answered 503" in err, err
    assert not any(server.scratch.iterdir()), sorted(server.scratch.rglob("*"))


def test_servers_killed_while_switching_leave_the_run_intact(tmp_path):
    """kill -9 of servers that switch snapshots every few hundred ms while training publishes
    and prunes: training finishes, every snapshot inspects clean, a new server serves `final`."""
    import signal

    from one_embedding.inspect_snapshot import inspect_path

    path = tmp_path / "live"
    train(path, "--steps", 4, "--snapshot-interval", 2, "--keep-snapshots", 1)
    proc = train(path, "--steps", 80, "--snapshot-interval", 2, "--keep-snapshots", 1, "--resume",
                 wait=False)
    killed = 0
    rng = np.random.default_rng(3)
    while proc.poll() is None and killed < 4:
        server = Server(path, "--poll-seconds", "0.05")
        time.sleep(float(rng.uniform(0.1, 0.6)))
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        killed += 1
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    assert killed >= 1
    report = inspect_path(str(path))
    assert report and all(r["status"] == "ok" for r in report), report
    server = Server(path)
    try:
        r = server.client.infer("embedding", [keys_input(np.arange(20))])
        assert r.get_response()["parameters"]["snapshot"] == "final"
    finally:
        server.close()


def test_damaged_rows_are_a_500_naming_the_runs_file(tmp_path):
    """A blob file of the run damaged while served: the HTTP answer is a 500 (the server's
    fault) naming the snapshot and the run's own file, and the server goes on serving."""
    import glob

    path = tmp_path / "run"
    train(path, "--steps", 4, "--engine", "rocksdb")
    server = Server(path, "--cache-mb", "0")
    try:
        blobs = glob.glob(str(path / "0-1" / "snapshots" / "final" / "db" / "*.blob"))
        assert blobs
        for blob in blobs:
            os.chmod(blob, 0o644)
            data = bytearray(open(blob, "rb").read())
            for i in range(100, len(data), 997):
                data[i] ^= 0xFF
            with open(blob, "r+b") as f:
                f.write(bytes(data))
        body = json.dumps({"inputs": [{"name": "keys", "datatype": "INT64", "shape": [5000],
                                       "data": list(range(5000))}]}).encode()
        status, answer = server.raw("POST", "/v2/models/embedding/infer", body,
                                    {"Content-Type": "application/json"})
        error = json.loads(answer)["error"]
        assert status == 500, (status, error)
        assert "'final'" in error and any(repr(b) in error for b in blobs), error
        assert server.client.is_server_live()
    finally:
        server.close()
