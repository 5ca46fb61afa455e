"""benchmarks/bench_gpu.py runs end to end: here in its dry-run mode (numpy on the CPU, tiny
sizes: the benchmark's logic, tables, result file and summary line), and on a GPU with small
sizes (gpu mark) before scripts/gpu_check.sh runs it in full."""
import json
import os
import subprocess
import sys

import pytest

from one_embedding.backend import cupy_available

import helpers

ROOT = helpers.ROOT


def _run(tmp_path, *args):
    env = {**os.environ, "ONE_EMBEDDING_BENCH_RESULTS": str(tmp_path),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    dry = "--dry-run" in args   # a dry run writes its own file, and only when asked (--save)
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", *args,
                        *(["--save"] if dry else [])], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (dry and (tmp_path / "bench_gpu.json").exists())
    name = "bench_gpu_dry_run.json" if dry else "bench_gpu.json"
    return r.stdout, json.loads((tmp_path / name).read_text())


@pytest.mark.slow  # ~20 s (torch import, two trainings): with the other benchmark smoke tests
def test_bench_gpu_dry_run_measures_both_parts_and_summarises(tmp_path):
    pytest.importorskip("torch")
    out, data = _run(tmp_path, "--dry-run")
    assert "machine:" in out and "device copy (baseline)" in out and "HugeCTR" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("summary (dry run") and "x copy" in last and "x PyTorch" in last
    assert data["lookup"]["ratio"] > 0 and data["dlrm"]["ours"]["samples_per_s"] > 0
    assert data["dlrm"]["torch"]["samples_per_s"] > 0
    # part 3, the CLI's path beside part 2's pre-built batches, with its wait share and host reads
    assert "x pre-built" in last and data["cli"]["samples_per_s"] > 0
    assert 0 <= data["cli"]["wait_share"] < 1 and data["cli"]["host_reads_per_step"] >= 0
    # part 4: the CLI's path under every --amp mode beside PyTorch's bf16 autocast and HugeCTR
    assert "AMP fastest --amp" in last and "x PyTorch bf16 autocast" in last
    modes = [r["amp"] for r in data["amp"]["rows"] if "amp" in r]
    assert modes == ["off", "tf32", "fp16", "bf16"]
    assert all(r["samples_per_s"] > 0 for r in data["amp"]["rows"])
    assert data["amp"]["torch_bf16"]["samples_per_s"] > 0 and "one table, bf16 autocast" in out
    # part 5: the dense step; a dry run times the unfused loss only (the fused one needs CuPy)
    rows = data["fused_loss"]["rows"]
    assert [(r["amp"], r["fused"]) for r in rows] == [("off", "unfused"), ("bf16", "unfused")]
    assert all(r["step ms"] > 0 and r["loss + last layer ms"] > 0 for r in rows)
    # part 7: the dense update; a dry run without the emulator times the per-parameter path only
    update = data["dense_update"]
    assert [r["what"] for r in update["rows"]] == ["sgd: per parameter", "adam: per parameter"]
    assert all(r["ms"] > 0 for r in update["rows"]) and update["parameters"] == 8
    assert data["failed"] == {}


@pytest.mark.gpu
@pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device")
def test_bench_gpu_small_run_on_the_gpu(tmp_path):
    out, data = _run(tmp_path, "--batch-size", "2048", "--steps", "2", "--warmup", "1",
                     "--max-rows", "20000", "--lookup-keys", "100000", "--repeats", "2", "--amp-steps", "2")
    assert data["lookup"]["copy_GBps"] > 0 and data["lookup"]["parts_s"]
    assert data["dlrm"]["ours"]["samples_per_s"] > 0
    assert {r["amp"] for r in data["amp"]["rows"] if "amp" in r} == {"off", "tf32", "fp16", "bf16"}
    assert set(data["fused_loss"]["fused_step_speedup"]) == {"off", "bf16"}
    last = out.strip().splitlines()[-1]
    assert last.startswith("summary (") and "fused loss: dense step" in last
    # part 6: the dense step's stages and the MLPs' products (off and bf16 on a dry run)
    parts = data["dense_parts"]["modes"]
    assert list(parts) == ["off", "tf32", "bf16"] and "dense step off" in last
    for mode in parts.values():
        stages = {r["stage"]: r for r in mode["rows"]}
        assert {"bottom MLP", "interaction", "top MLP"} <= set(stages)
        assert all(stages[s]["forward ms"] > 0 for s in ("bottom MLP", "interaction", "top MLP"))
        assert mode["step_ms"] > 0 and 0 < mode["products_ms"] and mode["products_tflops"] > 0
        # the step replayed as the trainer's graph, and the bias + ReLU loads one at a time
        assert any("CUDA graph" in s and "replaying" in s for s in stages), list(stages)
        assert any("loads one at a time" in s for s in stages)
    # part 7: the dense update in one launch against one parameter at a time, the same bits
    update = data["dense_update"]
    assert set(update["speedup"]) == {"sgd", "adam"} and update["same_bits"] == {"sgd": True,
                                                                                 "adam": True}
    assert "dense update: one launch" in last
    # part 8: the CLI step's kernels as CUPTI recorded them (where PyTorch has CUDA)
    for table in data["profile"].values():
        assert table["per_step"]["launches"] > 0 and table["kernels"]
        assert 0 < table["per_step"]["busy_share"] <= 1.0
    # every part ran: a part that raises is reported and the benchmark exits 1
    assert data["failed"] == {}
