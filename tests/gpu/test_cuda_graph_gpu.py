"""Issue 30 item 3: the training step's dense part captured once as a CUDA graph and replayed
(``cuda_graph.StepGraph``; ``--no-cuda-graph`` switches it off).

Runs on a GPU with CuPy (real capture and replay), and on the CPU dry run of the device path
(``-p gpu_dry_run``), where a graph is emulated: its capture records the kernels launched (the
emulator's and the numpy kernels standing in for the dense CUDA kernels), and each replay runs
the function again and fails when that trace differs from the capture's.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from one_embedding import host_sync
from one_embedding.backend import cupy_available, to_numpy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

DRY = bool(os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN"))


def _cp():
    import cupy

    return cupy


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(to_numpy(a)).view(np.uint8)


# ---------------------------------------------------------------- the trainer


def _train(tmp_path, model: str, amp: str, cuda_graph: bool, steps: int = 7, log_interval=3,
           **extra):
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(model=model, steps=steps, batch_size=128 if DRY else 4096,
                      synthetic_rows=20_000, embedding_dim=8, store="device_mem", cache_mb=1.0,
                      eval_batches=1, device="cuda", amp=amp, cuda_graph=cuda_graph,
                      log_interval=log_interval, bottom_mlp=(16, 8), top_mlp=(16, 1), dnn=(16, 8),
                      persistent_path=str(tmp_path / f"{model}-{amp}-{cuda_graph}"), **extra)
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    final = trainer.run()
    weights = [_bits(p.data) for p in trainer.model.parameters()]
    return trainer, final, weights


MODELS_AMPS = [("dlrm", "off"), ("dlrm", "bf16"), ("dlrm", "fp16"), ("dcn", "off"),
               ("deepfm", "bf16")]


@pytest.mark.parametrize("model, amp", MODELS_AMPS)
def test_graph_replay_trains_bit_for_bit_as_uncaptured_steps(tmp_path, model, amp):
    """7 steps with the graph (2 warm-up steps, a capture, 4 replays) give the losses, the dense
    weights and the evaluation (which reads the embedding rows) of --no-cuda-graph, bit for
    bit (whatever the graph's status: a failed capture must cost no bit either)."""
    graphed, final, weights = _train(tmp_path, model, amp, cuda_graph=True)
    plain, plain_final, plain_weights = _train(tmp_path, model, amp, cuda_graph=False)
    print(f"{model} --amp {amp}: cuda_graph {final['cuda_graph']!r}, "
          f"{final['cuda_graph_replays']} replays")
    assert plain_final["cuda_graph"] == "off: --no-cuda-graph"
    assert plain.step_graph.stats.replays == 0
    assert np.array(graphed.progress.losses).tobytes() == np.array(plain.progress.losses).tobytes()
    for mine, theirs in zip(weights, plain_weights):
        assert np.array_equal(mine, theirs)
    for key in ("auc", "logloss", "rows_stored", "loss_first_10pct", "loss_last_10pct"):
        assert np.float64(final[key]).tobytes() == np.float64(plain_final[key]).tobytes(), key


@pytest.mark.parametrize("model, amp", [("dlrm", "off"), ("dlrm", "bf16"), ("dcn", "off"),
                                        ("deepfm", "bf16")])
def test_the_trainer_replays_the_dense_step(tmp_path, model, amp):
    """The dense step is captured at step 3 and replayed from step 4 on (on a GPU its cuBLAS
    products included: kernels.gemm issues them without CuPy's capture guard)."""
    graphed, final, _ = _train(tmp_path, model, amp, cuda_graph=True)
    assert final["cuda_graph"] == "replaying", final["cuda_graph"]
    assert final["cuda_graph_replays"] == 7 - 3 and graphed.step_graph.stats.captures == 1


def test_dropout_runs_uncaptured_and_says_why(tmp_path):
    """DCN's dropout draws each step's mask from a host counter: the trainer does not graph it."""
    trainer, final, _ = _train(tmp_path, "dcn", "off", cuda_graph=True, steps=4, dropout=0.2)
    assert final["cuda_graph"].startswith("off: dropout"), final["cuda_graph"]
    assert trainer.step_graph.stats.captures == 0


@pytest.mark.skipif(not DRY, reason="the emulated graph's trace check exists on the dry run only")
def test_a_graph_of_a_dropout_step_would_replay_a_stale_mask(tmp_path):
    """Why dropout stays uncaptured: graphed anyway, the replay launches the dropout kernel with
    the captured step counter, and the dry run's trace check says so."""
    import gpu_dry_run
    from one_embedding.config import TrainConfig
    from one_embedding.cuda_graph import StepGraph
    from one_embedding.training import Trainer

    cfg = TrainConfig(model="dcn", steps=5, batch_size=128, synthetic_rows=20_000,
                      embedding_dim=8, store="device_mem", cache_mb=1.0, eval_batches=1,
                      device="cuda", dnn=(16, 8), dropout=0.2,
                      persistent_path=str(tmp_path / "dropout"))
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    trainer.step_graph = StepGraph(trainer.dense_step, trainer.xp, name="the dense step")
    trainer.graph_off_reason = None
    with pytest.raises(gpu_dry_run.GraphReplayMismatch, match="dropout_forward"):
        trainer.run()


def test_a_failed_capture_falls_back_to_uncaptured_steps(tmp_path, monkeypatch, caplog):
    """A host read inside the dense step: the capture raises, the trainer logs a warning and
    trains on uncaptured, with the results of --no-cuda-graph."""
    from one_embedding.models.dlrm import DLRM

    forward = DLRM.forward_from_embeddings

    def reading_forward(self, dense, embedded):
        host_sync.scalar(dense[0, 0], "test: a read in the dense step")
        return forward(self, dense, embedded)

    monkeypatch.setattr(DLRM, "forward_from_embeddings", reading_forward)
    with caplog.at_level(logging.WARNING, logger="one_embedding.cuda_graph"):
        graphed, final, weights = _train(tmp_path, "dlrm", "off", cuda_graph=True, steps=5)
    plain, _, plain_weights = _train(tmp_path, "dlrm", "off", cuda_graph=False, steps=5)
    assert final["cuda_graph"].startswith("failed: HostReadInCapture"), final["cuda_graph"]
    assert "test: a read in the dense step" in final["cuda_graph"]
    assert any("capture failed" in r.getMessage() for r in caplog.records)
    assert graphed.step_graph.stats.replays == 0
    assert graphed.progress.losses == plain.progress.losses
    for mine, theirs in zip(weights, plain_weights):
        assert np.array_equal(mine, theirs)


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_a_bad_label_in_a_replayed_step_raises_at_the_next_read_naming_its_step(
        tmp_path, monkeypatch, cuda_graph):
    """The labels check sits inside the graph: its flag, recomputed by each replay, is queued
    after each launch, so a bad label in step 6 (a replay) raises at the loss read of step 8,
    naming step 6, as without the graph."""
    from one_embedding.errors import InputError
    from one_embedding.training import Trainer

    step = Trainer.train_step

    def corrupting_step(self, batch, state=None):
        if self.progress.step + 1 == 6:
            batch.labels[3] = 2.5
        return step(self, batch, state)

    monkeypatch.setattr(Trainer, "train_step", corrupting_step)
    with pytest.raises(InputError, match=r"step 6: labels\[3\] is 2.5"):
        _train(tmp_path, "dlrm", "off", cuda_graph=cuda_graph, steps=8, log_interval=10)


# ---------------------------------------------------------------- StepGraph itself


def _affine(x, w):
    """A fixed-shape function with a reduction and an in-place update of a persistent array."""
    cp = _cp()
    y = x * w + cp.float32(0.5)
    w += y.sum(axis=0) * cp.float32(1e-3)   # in place: a replay updates the same w
    return y, y.max()


def test_step_graph_replays_bit_for_bit_and_runs_other_shapes_uncaptured():
    from one_embedding.cuda_graph import StepGraph

    cp = _cp()
    rng = np.random.default_rng(0)
    w_graph = cp.asarray(rng.standard_normal(64).astype(np.float32))
    w_plain = w_graph.copy()
    graph = StepGraph(lambda x: _affine(x, w_graph), cp, warmup=2, persistent=lambda: [w_graph])
    shapes = [(32, 64)] * 4 + [(7, 64)] + [(32, 64)] * 3
    for i, shape in enumerate(shapes):
        x = cp.asarray(rng.standard_normal(shape).astype(np.float32))
        y, top = graph(x)
        y_plain, top_plain = _affine(x, w_plain)
        assert np.array_equal(_bits(y), _bits(y_plain)), i
        assert np.array_equal(_bits(top), _bits(top_plain)), i
        assert np.array_equal(_bits(w_graph), _bits(w_plain)), i
        if shape == (7, 64):
            assert graph.status == "uncaptured"
    assert graph.stats.captures == 1 and graph.stats.replays == 4 and graph.stats.uncaptured == 3


@pytest.mark.skipif(DRY, reason="cuBLAS: a GPU only (the dry run's products are numpy's)")
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_captured_cublas_products_give_the_uncaptured_bits(precision):
    """kernels.gemm's products, which CuPy's matmul cannot issue while a stream captures,
    captured and replayed: the bits of the same products run uncaptured."""
    from one_embedding.cuda_graph import StepGraph
    from one_embedding.kernels import gemm

    cp = _cp()
    rng = np.random.default_rng(3)
    w = cp.asarray(rng.standard_normal((96, 80)).astype(np.float32))

    def products(x, xb):
        return (gemm.matmul(x, w.T, precision), gemm.matmul(x.T, x, precision),
                gemm.matmul(xb, xb.transpose(0, 2, 1), precision))

    graph = StepGraph(products, cp, warmup=1)
    for i in range(4):
        x = cp.asarray(rng.standard_normal((64, 80)).astype(np.float32))
        xb = cp.asarray(rng.standard_normal((16, 27, 32)).astype(np.float32))
        got = [to_numpy(a) for a in graph(x, xb)]
        want = [to_numpy(a) for a in products(x, xb)]
        for g, ref in zip(got, want):
            assert np.array_equal(g.view(np.uint8), ref.view(np.uint8)), (precision, i)
    assert graph.status == "replaying" and graph.stats.replays == 2, graph.status


def test_a_new_key_runs_uncaptured_until_it_is_captured_in_its_turn():
    """A Python value baked into the captured kernels (fp16's loss scale) is part of the key:
    a new value never replays the old graph; seen warmup + 1 times in a row, it is captured."""
    from one_embedding.cuda_graph import StepGraph

    cp = _cp()
    scale = {"now": 2.0}
    graph = StepGraph(lambda x: x * cp.float32(scale["now"]), cp, warmup=1)
    x = cp.arange(6, dtype=cp.float32)
    for now, status in ((2.0, "warming up"), (2.0, "replaying"), (2.0, "replaying"),
                        (0.5, "uncaptured"), (0.5, "replaying"), (0.5, "replaying")):
        scale["now"] = now
        out = graph(x, key=now)
        assert np.array_equal(to_numpy(out), np.arange(6, dtype=np.float32) * np.float32(now))
        assert graph.status == status, (now, graph.status)
    assert graph.stats.captures == 2 and graph.stats.replays == 2


def test_a_host_read_while_capturing_raises_and_the_graph_falls_back(caplog):
    from one_embedding.cuda_graph import StepGraph

    cp = _cp()

    def reads(x):
        if host_sync.flag((x > 0).any(), "test: branch on a device value"):
            return x * cp.float32(2)
        return x

    with pytest.raises(host_sync.HostReadInCapture, match="test: branch on a device value"):
        with host_sync.capturing("a test"):
            reads(cp.ones(4, cp.float32))
    graph = StepGraph(reads, cp, warmup=1)
    x = cp.arange(4, dtype=cp.float32)
    with caplog.at_level(logging.WARNING, logger="one_embedding.cuda_graph"):
        outs = [graph(x) for _ in range(3)]
    assert graph.status.startswith("failed: HostReadInCapture")
    assert graph.stats.captures == 0 and graph.stats.uncaptured == 3
    for out in outs:
        assert np.array_equal(to_numpy(out), np.arange(4, dtype=np.float32) * 2)
    assert any("capture failed" in r.getMessage() for r in caplog.records)


def test_a_rebound_persistent_array_makes_a_new_capture():
    """An optimizer that rebinds a weight instead of updating it in place would leave a replay
    reading the old memory: the graph notices and captures again."""
    from one_embedding.cuda_graph import StepGraph

    cp = _cp()
    box = {"w": cp.ones(8, cp.float32)}
    graph = StepGraph(lambda x: x * box["w"], cp, warmup=1, persistent=lambda: [box["w"]])
    x = cp.arange(8, dtype=cp.float32)
    graph(x)   # warm-up
    graph(x)   # capture
    box["w"] = cp.full(8, 3, cp.float32)
    assert np.array_equal(to_numpy(graph(x)), np.arange(8, dtype=np.float32) * 3)
    assert graph.stats.captures == 2 and graph.stats.recaptures


@pytest.mark.skipif(not DRY, reason="the emulated graph's trace check exists on the dry run only "
                                    "(a real replay keeps the captured scalar silently)")
def test_a_changing_python_scalar_fails_the_emulated_replay():
    """A dropout counter that advances each call: a real replay would reuse the captured mask;
    the dry run's replay sees the scalar differ from the capture's and raises."""
    import gpu_dry_run
    from one_embedding.cuda_graph import StepGraph
    from one_embedding.kernels import reference

    counter = {"step": 0}

    def dropout(x):
        y, keep = reference.dropout_forward(x, 0.5, 7, counter["step"])
        counter["step"] += 1
        return y

    graph = StepGraph(dropout, _cp(), warmup=1)
    x = np.ones((4, 32), np.float32)
    graph(x)                      # warm-up
    graph(x)                      # capture
    with pytest.raises(gpu_dry_run.GraphReplayMismatch, match="reference.dropout_forward"):
        graph(x)
    # the same function with a constant counter replays
    steady = StepGraph(lambda x: reference.dropout_forward(x, 0.5, 7, 3)[0], _cp(), warmup=1)
    for _ in range(4):
        steady(x)
    assert steady.stats.replays == 2
