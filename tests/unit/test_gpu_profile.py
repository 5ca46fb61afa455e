"""bench_gpu part 8's reading of a profiler trace (benchmarks/gpu_profile.kernel_table): device
time per step as the union of the kernels' and copies' intervals (overlaps counted once), launches
per step, categories by the launching library, the costliest kernels first; host-side events left
out. The profiling itself needs PyTorch with CUDA (bench_gpu on a GPU)."""
from __future__ import annotations

import sys

import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
gpu_profile = pytest.importorskip("benchmarks.gpu_profile")


def _event(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_kernel_table_counts_the_device_time_once_and_orders_the_kernels():
    trace = {"traceEvents": [
        _event("void embedding_gather_vector<float>(float const*, long)", 0, 10),
        _event("void embedding_gather_vector<float>(float const*, long)", 100, 10),
        _event("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 5, 30),  # overlaps
        _event("cupy_add__float32_float32_float32", 200, 4),
        _event("Memcpy HtoD (Pinned -> Device)", 300, 6, cat="gpu_memcpy"),
        _event("cudaLaunchKernel", 0, 50, cat="cuda_runtime"),                      # host side
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1},
    ]}
    table = gpu_profile.kernel_table(trace, steps=2, wall_s=0.001)
    step = table["per_step"]
    assert step["launches"] == 2.5                        # 5 device events over 2 steps
    assert step["kernel_ms"] == pytest.approx((10 + 10 + 30 + 4 + 6) / 2 / 1e3)
    assert step["busy_ms"] == pytest.approx((35 + 10 + 4 + 6) / 2 / 1e3)   # [0, 35) once
    assert step["wall_ms"] == pytest.approx(0.5) and step["busy_share"] == pytest.approx(0.055)
    cats = {c["category"]: c for c in table["categories"]}
    assert set(cats) == {"one_embedding", "cuBLAS", "CuPy", "copy / fill"}
    assert cats["one_embedding"]["launches/step"] == 1 and cats["cuBLAS"]["ms/step"] == 0.015
    assert [c["category"] for c in table["categories"]][0] == "cuBLAS"
    kernels = table["kernels"]
    assert kernels[0]["category"] == "cuBLAS" and kernels[1]["us/launch"] == 10
    assert sum(k["share"] for k in kernels) == pytest.approx(1.0)
    assert len(gpu_profile.kernel_table(trace, 2, 0.001, top=2)["kernels"]) == 2


def test_an_empty_trace_gives_zero_device_time():
    table = gpu_profile.kernel_table({"traceEvents": []}, steps=3, wall_s=0.3)
    assert table["per_step"]["busy_ms"] == 0 and table["kernels"] == []


def test_print_profile_prints_both_tables_and_returns_the_summary(capsys):
    trace = {"traceEvents": [_event("void optim_dense_sgd<float>(float*, int)", 0, 8)]}
    phrase = gpu_profile.print_profile(gpu_profile.kernel_table(trace, 1, 0.001), "bf16", 1)
    out = capsys.readouterr().out
    assert "--amp bf16" in out and "| one_embedding |" in out and "optim_dense_sgd" in out
    assert phrase == "profile --amp bf16: device busy 1% of 1.0 ms/step, 1 launches/step"
