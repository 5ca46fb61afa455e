"""benchmarks/bench_data.py runs end to end at tiny sizes and prints every source's rate."""
import json
import os
import subprocess
import sys

import pytest

import helpers

pytestmark = pytest.mark.slow


def test_bench_data_prints_each_source_beside_the_step_rates(tmp_path):
    env = {**os.environ, "ONE_EMBEDDING_BENCH_RESULTS": str(tmp_path),
           "PYTHONPATH": str(helpers.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_data", "--rows", "16384",
                        "--file-rows", "16384", "--tsv-rows", "8192", "--batch-size", "4096",
                        "--repeats", "1"], cwd=helpers.ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "machine:" in r.stdout and "step rate to feed" in r.stdout
    rows = json.loads((tmp_path / "bench_data.json").read_text())["rows"]
    sources = " | ".join(row["source"] for row in rows)
    for name in ("CPU numba", "before issue 30", "Parquet", "TSV", "BatchLoader"):
        assert name in sources
    assert all(row["samples_per_s"] > 0 for row in rows)
