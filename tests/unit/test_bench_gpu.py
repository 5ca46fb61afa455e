"""benchmarks/bench_gpu without a GPU: a one-line reason and status 1 where CuPy or a CUDA device
is missing (a ModuleNotFoundError traceback before), and a --dry-run that never writes the GPU's
result file (its CPU figures landed in bench_gpu.json before)."""
from __future__ import annotations

import sys
import types

import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
bench_gpu = pytest.importorskip("benchmarks.bench_gpu")
common = pytest.importorskip("benchmarks.common")

ALL_PARTS = ["lookup", "dlrm", "cli", "amp", "fused", "dense", "update", "profile"]


def test_without_cupy_it_exits_with_one_line_naming_the_dry_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(SystemExit) as e:
        bench_gpu.main(["--steps", "2"])
    msg = str(e.value.code)
    assert "CuPy" in msg and "--dry-run" in msg and "\n" not in msg


def test_without_a_cuda_device_it_exits_with_one_line(monkeypatch):
    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=no_device)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(SystemExit) as e:
        bench_gpu.Device(dry_run=False)
    msg = str(e.value.code)
    assert "CUDA device" in msg and "--dry-run" in msg and "\n" not in msg


def test_a_dry_run_writes_no_gpu_result_file_unless_asked_under_its_own_name(monkeypatch,
                                                                            tmp_path):
    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    bench_gpu.main(["--dry-run", "--skip", *ALL_PARTS])
    assert list(tmp_path.iterdir()) == []
    bench_gpu.main(["--dry-run", "--save", "--skip", *ALL_PARTS])
    assert [p.name for p in tmp_path.iterdir()] == ["bench_gpu_dry_run.json"]


def test_the_result_names():
    ns = types.SimpleNamespace
    assert bench_gpu.result_name(ns(dry_run=False, save=False)) == "bench_gpu"
    assert bench_gpu.result_name(ns(dry_run=True, save=False)) is None
    assert bench_gpu.result_name(ns(dry_run=True, save=True)) == "bench_gpu_dry_run"
