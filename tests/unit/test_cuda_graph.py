"""CUDA graphs (issue 30 item 3) where no GPU is needed: the ``--no-cuda-graph`` flag, the CPU
path (no graph, nothing changes), ``host_sync.capturing``. The graphs themselves are tested in
tests/gpu/test_cuda_graph_gpu.py (on a GPU, and emulated on the dry run)."""
from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from one_embedding import host_sync
from one_embedding.config import TrainConfig
from one_embedding.cuda_graph import StepGraph
from one_embedding.errors import InputError
from one_embedding.training import Trainer


def _parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    TrainConfig.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cuda_graph_is_on_by_default_and_no_cuda_graph_turns_it_off():
    assert TrainConfig().cuda_graph is True
    assert TrainConfig.from_args(_parse()).cuda_graph is True
    assert TrainConfig.from_args(_parse("--no-cuda-graph")).cuda_graph is False
    with pytest.raises(SystemExit):   # there is no --cuda-graph: it is the default
        _parse("--cuda-graph")
    assert _parse("--resume").resume is True   # off-by-default flags keep their form


def test_the_cpu_path_has_no_graph_and_reports_none(tmp_path):
    cfg = TrainConfig(steps=3, batch_size=64, synthetic_rows=5_000, embedding_dim=4,
                      bottom_mlp=(8, 4), top_mlp=(8, 1))
    trainer = Trainer(cfg, metrics_path=str(tmp_path / "m.jsonl"), progress=False)
    final = trainer.run()
    assert trainer.step_graph is None and trainer.cuda_graph_status() is None
    assert "cuda_graph" not in final
    plain = Trainer(TrainConfig(**{**cfg.__dict__, "cuda_graph": False}), progress=False,
                    metrics_path=os.devnull).run()
    assert plain["loss_last_10pct"] == final["loss_last_10pct"]


def test_a_run_resumes_with_the_graph_switched_off(tmp_path):
    """--no-cuda-graph changes how a step runs, never its results: a resume may change it."""
    common = dict(batch_size=64, synthetic_rows=5_000, embedding_dim=4, bottom_mlp=(8, 4),
                  top_mlp=(8, 1), persistent_path=str(tmp_path / "run"), snapshot_interval=2)
    Trainer(TrainConfig(steps=2, **common), metrics_path=os.devnull, progress=False).run()
    final = Trainer(TrainConfig(steps=4, resume=True, cuda_graph=False, **common),
                    metrics_path=os.devnull, progress=False).run()
    assert final["steps"] == 4


def test_step_graph_on_numpy_runs_the_function_as_it_is():
    calls = []

    def fn(x):
        calls.append(x.shape)
        return x * 2

    graph = StepGraph(fn, np, warmup=0)
    for _ in range(3):
        assert np.array_equal(graph(np.ones(3)), np.full(3, 2.0))
    assert len(calls) == 3 and graph.status == "off" and graph.stats.captures == 0
    with pytest.raises(ValueError, match="warmup=-1"):
        StepGraph(fn, np, warmup=-1)


def test_every_host_read_raises_while_capturing_and_checks_are_kept_for_the_graph():
    a = np.arange(3)
    with host_sync.capturing("a test step"):
        for read in (lambda: host_sync.to_host(a, "r1"), lambda: host_sync.scalar(a[0], "r2"),
                     lambda: host_sync.flag(a.any(), "r3")):
            with pytest.raises(host_sync.HostReadInCapture, match="a test step"):
                read()
        with pytest.raises(RuntimeError, match="one capture at a time"):
            with host_sync.capturing("another"):
                pass
    host_sync.to_host(a, "after")   # reads work again after the capture
    queue = host_sync.DeferredChecks()
    queue.step = 4
    with host_sync.deferring(queue), host_sync.capturing("a test step") as kept:
        host_sync.check(np.array(True), lambda: "bad", "t: check")
    assert len(queue) == 0 and len(kept) == 1   # kept for the graph, not queued
    queue.step = 9
    host_sync.requeue(kept[0], queue, np.copy)
    with pytest.raises(InputError, match="step 9: bad"):
        queue.read(np)


def test_gemm_bypasses_cupys_cublas_wrappers_only_while_capturing(monkeypatch):
    """CuPy's cuBLAS wrappers raise while a stream captures: kernels.gemm issues its calls
    through ctypes then, and through CuPy's wrappers otherwise."""
    import sys
    import types

    from one_embedding.kernels import gemm

    wrappers = types.ModuleType("cupy.cuda.cublas")
    cuda = types.ModuleType("cupy.cuda")
    cuda.cublas = wrappers
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.cublas", wrappers)):
        monkeypatch.setitem(sys.modules, name, module)
    assert gemm._cublas_calls() is wrappers
    direct = object()
    monkeypatch.setattr(gemm, "_captured_cublas", direct)
    with host_sync.capturing("a test"):
        assert gemm._cublas_calls() is direct
    assert gemm._cublas_calls() is wrappers


def test_the_direct_cublas_calls_need_the_library_cupy_loaded():
    from one_embedding.kernels import gemm

    with open("/proc/self/maps") as maps:
        if "/libcublas.so" in maps.read():
            pytest.skip("this process has cuBLAS loaded")
    with pytest.raises(RuntimeError, match="no libcublas.so in this process"):
        gemm._CapturedCublas()
