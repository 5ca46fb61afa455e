"""benchmarks/bench_data quotes the step rates a data source must keep up with: each figure must be
in the committed result it names (it cited PERFORMANCE.md, no such file, and an H100 figure no
committed result holds)."""
from __future__ import annotations

import json
import sys

import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
bench_data = pytest.importorskip("benchmarks.bench_data")
RESULTS = helpers.ROOT / "benchmarks" / "results"


def test_the_quoted_step_rates_are_the_committed_results():
    (cpu_label, cpu), (gpu_label, gpu) = bench_data.STEP_RATES.items()
    peers = json.loads((RESULTS / "bench_dlrm_peers.json").read_text())
    ours = next(r for r in peers["rows"] if r["implementation"] == "one_embedding")
    assert "bench_dlrm_peers.json" in cpu_label and cpu == round(ours["samples/s"])
    run = RESULTS / "gpu_check_h200_2026-11-27" / "run2" / "bench.txt"
    assert "gpu_check_h200_2026-11-27/run2" in gpu_label and "H200" in gpu_label
    text = run.read_text()
    assert "NVIDIA H200" in text and f"| one_embedding (device_mem on the GPU, CuPy) | {gpu:,} |" in text


def test_the_documents_it_cites_exist():
    doc = bench_data.__doc__
    assert "PERFORMANCE.md" not in doc and "H100" not in " ".join(bench_data.STEP_RATES)
    assert "docs/performance.md" in doc and (helpers.ROOT / "docs" / "performance.md").is_file()
