"""The in-process ``Predictor`` on every store kind, and the protocol codec without a server."""
import json
import os
import struct

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.config import TrainConfig
from one_embedding.data.features import FeatureTransform
from one_embedding.data.schema import KeyScheme
from one_embedding.errors import InputError, SnapshotError
from one_embedding.serving import Predictor
from one_embedding.serving.protocol import ProtocolError, decode_request, encode_response
from one_embedding.training import train


def tree_state(path) -> dict:
    """{relative path: (size, mtime_ns)} of every file under ``path``."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), path)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("store,engine", [("device_mem", "slots"), ("cached_ssd", "slots"),
                                          ("cached_ssd", "rocksdb"),
                                          ("cached_host_mem", "slots")])
def test_predictor_serves_the_snapshot_read_only(tmp_path, store, engine):
    path = tmp_path / "run"
    cfg = TrainConfig(steps=6, batch_size=128, synthetic_rows=5000, store=store, engine=engine,
                      cache_mb=0.1, persistent_path=str(path), eval_batches=1)
    train(cfg, metrics_path=os.devnull, progress=False)
    before = tree_state(path)
    with oe.make_persistent_table_reader([str(path / "0-1")], "final", np.int64, np.float32,
                                         2 * cfg.embedding_dim) as reader:
        keys, lines = map(np.concatenate, zip(*reader))
    with Predictor(path, cache_mb=0.01) as p:
        assert (p.snapshot, p.model_name, p.embedding_dim) == ("final", "dlrm", 16)
        for _ in range(2):  # through the cache's misses, then its hits
            np.testing.assert_array_equal(p.lookup(keys), lines[:, :16])
        rng = np.random.default_rng(0)
        t = FeatureTransform.for_config(cfg)
        cat = np.array([[str(int(rng.integers(0, c))) for c in t.cardinalities]
                        for _ in range(10)], dtype=object)
        prob = p.predict(np.full((10, 13), np.nan, np.float32), cat)
        assert prob.shape == (10,) and ((prob > 0) & (prob < 1)).all()
    assert tree_state(path) == before  # nothing under the training path was written


def test_predictor_refuses_what_it_cannot_serve(tmp_path):
    with pytest.raises(oe.ConfigError, match="does not exist"):
        Predictor(tmp_path / "missing")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(SnapshotError, match="holds no complete checkpoint"):
        Predictor(tmp_path / "empty")
    path = tmp_path / "run"
    train(TrainConfig(steps=2, batch_size=64, synthetic_rows=2000, persistent_path=str(path),
                      eval_batches=1), metrics_path=os.devnull, progress=False)
    with pytest.raises(SnapshotError, match="named 'nope'; it holds 'final': pick one"):
        Predictor(path, snapshot="nope")
    with Predictor(path) as p:
        with pytest.raises(InputError, match="shape"):
            p.lookup(np.ones((2, 2), np.int64))
        with pytest.raises(InputError, match=r"categorical\[0, 0\] = 'x'"):
            p.predict(np.zeros((1, 13), np.float32), np.full((1, 26), "x", dtype=object))
        with pytest.raises(InputError, match="expected \\(n, 13\\)"):
            p.predict(np.zeros((1, 12), np.float32), np.full((1, 26), "0", dtype=object))


def test_criteo_transform_matches_the_tsv_reader():
    """Raw Criteo strings through the serving transform give the keys and dense values the TSV
    reader gives for the same line."""
    from one_embedding.data.tsv import parse_lines

    line = ("1\t5\t-3\t\t7\t100\t\t1\t2\t0\t\t1\t\t4\t68fd1e64\t\t0b153874\ta73ee510\t\t"
            "b8deab54\t\t\te5ba7672\tf54016b9\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t")
    fields = line.split("\t")
    buf = np.frombuffer((line + "\n").encode(), np.uint8)
    dense, ids, _, _, bad = parse_lines(buf)
    assert not bad.any()
    t = FeatureTransform()
    raw = np.array([[float(v) if v else np.nan for v in fields[1:14]]], np.float32)
    np.testing.assert_array_equal(t.dense(raw), dense)
    np.testing.assert_array_equal(t.keys(np.array([fields[14:40]], dtype=object)), ids)


# ---------------------------------------------------------------- the protocol codec

def _binary_request(inputs):
    """(body, header length) as tritonclient.http builds them: JSON, then raw tensors."""
    specs, blobs = [], []
    for name, dtype, shape, raw in inputs:
        specs.append({"name": name, "datatype": dtype, "shape": shape,
                      "parameters": {"binary_data_size": len(raw)}})
        blobs.append(raw)
    head = json.dumps({"inputs": specs}).encode()
    return head + b"".join(blobs), str(len(head))


def test_decode_binary_and_json_tensors():
    keys = np.array([3, -1, 2**40], np.int64)
    strings = [b"ab", b"", "\u00e9".encode()]
    raw = b"".join(struct.pack("<I", len(s)) + s for s in strings)
    body, n = _binary_request([("keys", "INT64", [3], keys.tobytes()), ("s", "BYTES", [3, 1], raw)])
    request, tensors = decode_request(body, n)
    np.testing.assert_array_equal(tensors["keys"], keys)
    assert tensors["s"].shape == (3, 1) and tensors["s"][2, 0] == strings[2]
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2],
                                   "data": [[1, 2], [3, 4]]}]}).encode()
    np.testing.assert_array_equal(decode_request(body, None)[1]["x"], [[1, 2], [3, 4]])


@pytest.mark.parametrize("head,binary,match", [
    (b"[1, 2]", None, '"inputs" list'),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "INT64"}]}', None, "neither"),
    (b'{"inputs": [{"name": "k", "shape": [-2], "datatype": "INT64", "data": [1]}]}', None,
     "non-negative"),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "INT64", "data": ["a"]}]}', None,
     "not INT64"),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "BYTES", "data": [1]}]}', None,
     "must be strings"),
    (b'{"inputs": [{"name": "k", "shape": [2], "datatype": "INT64", '
     b'"parameters": {"binary_data_size": 12}}]}', b"\0" * 12, "12 bytes of binary data"),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "BYTES", '
     b'"parameters": {"binary_data_size": 6}}]}', b"\x09\0\0\0ab", "runs past"),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "INT64", '
     b'"parameters": {"binary_data_size": 8}}]}', b"\0" * 4, "runs past the 4 bytes"),
    (b'{"inputs": []}', b"xx", "belong to no input"),
    # 2**64 elements: an int64 product wraps to 0 and matched the empty data (then a 500)
    (b'{"inputs": [{"name": "k", "shape": [4294967296, 4294967296], "datatype": "FP32", '
     b'"parameters": {"binary_data_size": 0}}]}', b"", "0 bytes of binary data for shape"),
    # found by a fault campaign (2026-12-07): each was a 500 or a silently coerced 200
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": ["INT64"], "data": [1]}]}', None,
     r"datatype \['INT64'\] is not one of"),
    (b'{"inputs": [{"name": "k", "shape": [18446744073709551616, 0], "datatype": "INT64", '
     b'"data": []}]}', None, "cannot be made"),
    (b'{"inputs": [{"name": "k", "shape": [0, 9223372036854775808], "datatype": "INT64", '
     b'"data": []}]}', None, "cannot be made"),
    (b'{"inputs": [{"name": "k", "shape": [' + b"1, " * 40 + b'1], "datatype": "INT64", '
     b'"data": [1]}]}', None, "41 dimensions"),
    (b'{"inputs":' + b"[" * 100000 + b"]" * 100000 + b"}", None, "nested too deeply"),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "INT64", "data": [1]}], '
     b'"outputs": 5}', None, '"outputs" is 5'),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "INT64", "data": [1]}], '
     b'"outputs": [{"name": ["x"]}]}', None, 'string "name"'),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "INT64", "data": [1]}], '
     b'"outputs": [{"name": "x", "parameters": "p"}]}', None, "must be an object"),
    (b'{"inputs": [{"name": "k", "shape": [2], "datatype": "INT64", "data": [1.7, 2.2]}]}',
     None, "1.7 is a float"),
    (b'{"inputs": [{"name": "k", "shape": [2], "datatype": "INT64", "data": [true, false]}]}',
     None, "True is a bool"),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "INT64", "data": [NaN]}]}', None,
     "nan is a float"),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "FP32", "data": ["1"]}]}', None,
     "'1' is a str"),
    (b'{"inputs": [{"name": "k", "shape": [1], "datatype": "INT8", "data": [300]}]}', None,
     "out of its range"),
    (b'{"inputs": [{"name": "k", "shape": [2], "datatype": "INT64", "data": [[1, 2], [3]]}]}',
     None, "is a list"),
])
def test_decode_refuses_malformed_requests(head, binary, match):
    header = None if binary is None else str(len(head))
    with pytest.raises(ProtocolError, match=match) as e:
        decode_request(head + (binary or b""), header)
    assert e.value.status == 400


@pytest.mark.parametrize("header", ["-1", "1_0", "abc", " 5", "\u0665", "\xff\xfe"])
def test_a_header_length_that_is_not_plain_digits_is_refused(header):
    with pytest.raises(ProtocolError, match="is not a number of bytes") as e:
        decode_request(b'{"inputs": []}', header)
    assert e.value.status == 400


def test_json_data_of_the_declared_type_and_nested_rows_decode():
    _, tensors = decode_request(json.dumps({"inputs": [
        {"name": "k", "shape": [2], "datatype": "INT64", "data": [[1], [2]]},
        {"name": "d", "shape": [1, 2], "datatype": "FP32", "data": [[1, 2.5]]},
        {"name": "b", "shape": [2], "datatype": "BOOL", "data": [True, False]}]}).encode(), None)
    np.testing.assert_array_equal(tensors["k"], np.array([1, 2], np.int64))
    np.testing.assert_array_equal(tensors["d"], np.array([[1.0, 2.5]], np.float32))
    np.testing.assert_array_equal(tensors["b"], np.array([True, False]))


def test_encode_binary_and_json_outputs():
    out = {"probability": np.array([0.25, 0.5], np.float32)}
    body, headers = encode_response({"parameters": {"binary_data_output": True}, "id": "7"},
                                    "dlrm", out, {"snapshot": "s"})
    n = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:n])
    assert head["id"] == "7" and head["parameters"] == {"snapshot": "s"}
    np.testing.assert_array_equal(np.frombuffer(body[n:], np.float32), out["probability"])
    body, headers = encode_response({}, "dlrm", out, {"snapshot": "s"})
    assert json.loads(body)["outputs"][0]["data"] == [0.25, 0.5]
    with pytest.raises(ProtocolError, match="no output 'x'"):
        encode_response({"outputs": [{"name": "x"}]}, "dlrm", out, {})


@pytest.mark.parametrize("orjson", [True, False])
def test_json_data_reads_back_as_the_same_float32_values(orjson, monkeypatch):
    """Every float32 (subnormals, extremes, -0.0, random bits) written as JSON data parses back,
    through a double, to the same float32, with orjson and without it (``json``)."""
    import builtins

    if orjson:
        pytest.importorskip("orjson")
    else:
        real_import = builtins.__import__

        def no_orjson(name, *args, **kw):
            if name == "orjson":
                raise ImportError(name)
            return real_import(name, *args, **kw)

        monkeypatch.setattr(builtins, "__import__", no_orjson)
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = np.concatenate([values[np.isfinite(values)], np.array(
        [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38, 0.1], np.float32)])
    out = {"embeddings": values.reshape(-1, 2) if values.size % 2 == 0 else values}
    body, _ = encode_response({"id": 2**70}, "embedding", out, {"snapshot": "s"})
    answer = json.loads(body)
    assert answer["id"] == 2**70
    got = np.array(answer["outputs"][0]["data"], np.float64).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), out["embeddings"].reshape(-1).view(np.uint32))
    body, _ = encode_response({"id": "x"}, "embedding", out, {"snapshot": "s"})
    got = np.array(json.loads(body)["outputs"][0]["data"], np.float64).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), out["embeddings"].reshape(-1).view(np.uint32))


def test_an_answer_too_large_for_json_is_refused_naming_binary_output(monkeypatch):
    from one_embedding.serving import protocol

    monkeypatch.setattr(protocol, "MAX_JSON_ELEMENTS", 1000)
    out = {"embeddings": np.zeros((100, 16), np.float32)}
    with pytest.raises(ProtocolError, match="1,600 values.*binary_data_output") as e:
        encode_response({}, "embedding", out, {})
    assert e.value.status == 400
    body, headers = encode_response({"parameters": {"binary_data_output": True}}, "embedding",
                                    out, {})
    assert len(body) - int(headers["Inference-Header-Content-Length"]) == 6400


def test_a_damaged_snapshot_is_never_served(tmp_path):
    """A flipped byte in a checkpoint's rows is refused at open; a follower that meets one
    keeps serving the snapshot it has."""
    path = tmp_path / "run"
    cfg = TrainConfig(steps=4, batch_size=64, synthetic_rows=2000, persistent_path=str(path),
                      eval_batches=1, snapshot_interval=2, keep_snapshots=0)
    train(cfg, metrics_path=os.devnull, progress=False)
    snaps = path / "0-1" / "snapshots"
    lines = snaps / "step-2" / "lines.npy"
    data = bytearray(lines.read_bytes())
    data[-5] ^= 0xFF
    os.chmod(lines, 0o644)
    lines.write_bytes(bytes(data))  # a fresh file: final and step-4 keep their own
    with pytest.raises(SnapshotError, match="fails its checksum"):
        Predictor(path, snapshot="step-2")
    with Predictor(path, snapshot="step-4") as p:
        rows = p.lookup(np.arange(10))
        final_lines = snaps / "final" / "lines.npy"
        blob = bytearray(final_lines.read_bytes())
        blob[-5] ^= 0xFF
        final_lines.unlink()
        final_lines.write_bytes(bytes(blob))
        p.requested = None  # follow the newest: `final`, now damaged
        with pytest.raises(SnapshotError):
            p.refresh()
        assert p.snapshot == "step-4"
        np.testing.assert_array_equal(p.lookup(np.arange(10)), rows)


# ---------------------------------------------------------------- damaged data while serving
def _flip(path, every=997):
    """Flip bytes all over ``path`` in place (every link of the file sees it)."""
    os.chmod(path, 0o644)
    data = bytearray(open(path, "rb").read())
    for i in range(100, len(data), every):
        data[i] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))


def _ssd_run(path, engine, **kw):
    cfg = TrainConfig(steps=4, batch_size=128, synthetic_rows=5000, store="cached_ssd",
                      engine=engine, cache_mb=0.1, persistent_path=str(path), eval_batches=1,
                      **kw)
    train(cfg, metrics_path=os.devnull, progress=False)


def _run_data_files(path, engine, snapshot="final"):
    """The run's own files holding rows: slot segments in its pool, RocksDB's SST/blob files."""
    import glob

    if engine == "slots":
        return sorted(glob.glob(str(path / "0-1" / "slots" / "segments" / "*.rows")))
    return sorted(glob.glob(str(path / "0-1" / "snapshots" / snapshot / "db" / "*.blob")))


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_a_block_failing_its_checksum_is_a_500_naming_the_runs_file(tmp_path, engine):
    """Issue 29 item 7: the server's own damaged data is a 5xx naming the run's file and the
    snapshot (never the scratch store's link or copy of it), logged; not a client's 400."""
    from one_embedding.serving.server import infer

    path = tmp_path / "run"
    _ssd_run(path, engine)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with Predictor(path, cache_mb=0, scratch=str(scratch)) as p:
        for f in _run_data_files(path, engine):
            _flip(f)
        body = json.dumps({"inputs": [{"name": "keys", "datatype": "INT64", "shape": [3000],
                                       "data": list(range(3000))}]}).encode()
        with pytest.raises(ProtocolError) as info:
            infer(p, "embedding", body, None)
    message = str(info.value)
    assert info.value.status == 500, message
    assert "'final'" in message, message
    assert str(scratch) not in message, message
    assert any(repr(f) in message for f in _run_data_files(path, engine)), message


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_a_newer_snapshot_with_damaged_new_files_is_refused_and_the_old_one_served(
        tmp_path, engine, caplog, monkeypatch):
    """The follower checks every file a new snapshot does not share with the served one before
    it switches: damaged rows in the new files are refused (logged, naming the file) and the
    last good snapshot goes on answering."""
    import time

    from one_embedding.serving.server import Follower

    path = tmp_path / "run"
    _ssd_run(path, engine, snapshot_interval=2, keep_snapshots=0)
    with Predictor(path, snapshot="step-2", cache_mb=0) as p:
        keys = np.arange(5000)
        rows = p.lookup(keys)
        snaps = path / "0-1" / "snapshots"
        if engine == "slots":
            old = set(json.loads((snaps / "step-2" / "slots.json").read_text())["segments"][i]["id"]
                      for i in range(len(json.loads((snaps / "step-2" / "slots.json").read_text())
                                         ["segments"])))
            new = [f for f in _run_data_files(path, engine)
                   if int(os.path.basename(f).split(".")[0], 16) not in old]
        else:
            old = {os.stat(f).st_ino for f in _run_data_files(path, engine, "step-2")}
            new = [f for f in _run_data_files(path, engine) if os.stat(f).st_ino not in old]
        assert new, "the newer snapshots share every file with step-2"
        for f in new:
            _flip(f)
        p.requested = None  # follow the newest: `final`, damaged in files step-2 lacks
        with pytest.raises(SnapshotError, match="fails its checksum|damaged"):
            p.refresh()
        assert p.snapshot == "step-2"
        from one_embedding.serving import predictor as predictor_module

        opened = []
        real_open = predictor_module.Predictor._open
        monkeypatch.setattr(predictor_module.Predictor, "_open",
                            lambda self, *a, **kw: opened.append(a) or real_open(self, *a, **kw))
        follower = Follower(p, 0.02).start()
        try:
            time.sleep(0.5)
        finally:
            follower.stop()
        assert p.snapshot == "step-2"
        said = [r.getMessage() for r in caplog.records if "still serving 'step-2'" in r.getMessage()]
        # refused once: not read in full again, nor logged again, at every poll
        assert len(said) == 1 and not opened, (said, len(opened))
        np.testing.assert_array_equal(p.lookup(keys), rows)


def test_the_checked_snapshot_is_the_one_served_when_training_saves_it_again(tmp_path,
                                                                             monkeypatch):
    """Issue 34 item 3: training saves `final` again under its name while a server opens it,
    right after the server checked it. The server leases before it checks and reads the folder
    its lease holds: it serves the rows it checked, never the new, unchecked (here damaged)
    files that now carry the name."""
    import shutil
    import uuid

    from one_embedding.serving import predictor as predictor_module

    path = tmp_path / "run"
    train(TrainConfig(steps=4, batch_size=64, synthetic_rows=2000, persistent_path=str(path),
                      eval_batches=1), metrics_path=os.devnull, progress=False)
    with Predictor(path) as p:
        keys = np.arange(2000)
        good = p.lookup(keys)
    snaps = path / "0-1" / "snapshots"
    build = predictor_module._build_model
    swapped = []

    def build_then_save_again(*args):
        if not swapped:  # what SnapshotDirectory.save does, with damaged rows
            tmp = snaps / f".tmp-final-{uuid.uuid4().hex}"
            shutil.copytree(snaps / "final", tmp)
            _flip(tmp / "lines.npy", every=64)
            os.rename(snaps / "final", snaps / f".old-final-{uuid.uuid4().hex}")
            os.rename(tmp, snaps / "final")
            swapped.append(True)
        return build(*args)

    monkeypatch.setattr(predictor_module, "_build_model", build_then_save_again)
    with Predictor(path, cache_mb=0) as p:
        assert swapped
        np.testing.assert_array_equal(p.lookup(keys), good)


def test_columnwise_parse_equals_the_elementwise_one():
    """The numpy parse of plain-digit strings (any of str / bytes / fixed-width arrays) gives the
    keys the element-by-element ``int`` parse gives; anything else goes element by element."""
    rng = np.random.default_rng(5)
    synthetic = FeatureTransform.for_config(TrainConfig(synthetic_rows=20000))
    cat = np.array([[str(int(rng.integers(0, c))) for c in synthetic.cardinalities]
                    for _ in range(40)], dtype=object)
    values, _ = FeatureTransform._parse_each(cat, 10)
    want = (values + np.array(synthetic.offsets, np.uint64)).astype(np.int64)
    as_bytes = np.array([[s.encode() for s in row] for row in cat], dtype=object)
    for form in (cat, cat.astype(str), cat.astype(bytes), as_bytes, cat.tolist()):
        np.testing.assert_array_equal(synthetic.keys(form), want)
    criteo = FeatureTransform()
    hexes = np.array([[format(int(rng.integers(0, 2**32)), "x") if rng.random() > 0.2 else ""
                       for _ in range(26)] for _ in range(40)], dtype=object)
    hexes[0, :4] = ["ABCDEF12", "0", "ffffffffffffffff", "00000000000000000001"]
    values, present = FeatureTransform._parse_each(hexes, 16)
    want = KeyScheme().keys(values, present)
    for form in (hexes, hexes.astype(str), hexes.astype(bytes)):
        np.testing.assert_array_equal(criteo.keys(form), want)
    for bad, match in (("zz", "not a hex"), ("5\x00", "not a hex"), ("1" * 17, "64 bits"),
                       (" 7", "not a hex"), ("+7", "not a hex"), ("1_0", "not a hex"),
                       ("0x1f", "not a hex"), ("-1", "not a hex"), ("\u0660", "not a hex")):
        wrong = hexes.copy()
        wrong[3, 4] = bad
        with pytest.raises(InputError, match=rf"categorical\[3, 4\].*{match}"):
            criteo.keys(wrong)


def test_bytes_elements_of_any_length():
    from one_embedding.serving.protocol import bytes_elements

    for strings in ([b"ab", b"", b"\xc3\xa9", b"12345"], [b"abcd"] * 5, [b""] * 3,
                    [b"a\0", b"b"], [b"abc", b""], []):
        raw = b"".join(struct.pack("<I", len(s)) + s for s in strings)
        got = bytes_elements(raw, len(strings), "s")
        assert got.shape == (len(strings),) and list(got) == strings, (strings, got)


def test_small_and_large_bytes_tensors_decode_alike(monkeypatch):
    """A BYTES tensor of a few elements is split in Python (the batch-1 fast path), a larger one
    by the vectorised path: same arrays, same dtypes, the same refusals of broken framing."""
    from one_embedding.serving import protocol

    rng = np.random.default_rng(5)
    cases = [[bytes(rng.integers(0, 256, rng.integers(0, 9), dtype=np.uint8)) for _ in range(n)]
             for n in (0, 1, 26, 64, 256) for _ in range(4)]
    cases += [[b"a\0", b"b"], [b""] * 3, [b"123"] * 26]
    for strings in cases:
        raw = b"".join(struct.pack("<I", len(s)) + s for s in strings)
        small = protocol.bytes_elements(raw, len(strings), "s")
        monkeypatch.setattr(protocol, "SMALL_BYTES_TENSOR", -1)
        large = protocol.bytes_elements(raw, len(strings), "s")
        monkeypatch.undo()
        assert small.dtype == large.dtype and list(small) == list(large) == strings
        for broken in (raw[:-1], raw + b"x"):
            if not raw:
                continue
            with pytest.raises(ProtocolError) as small_error:
                protocol.bytes_elements(broken, len(strings), "s")
            monkeypatch.setattr(protocol, "SMALL_BYTES_TENSOR", -1)
            with pytest.raises(ProtocolError) as large_error:
                protocol.bytes_elements(broken, len(strings), "s")
            monkeypatch.undo()
            assert str(small_error.value) == str(large_error.value)
