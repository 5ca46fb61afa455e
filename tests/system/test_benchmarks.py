"""The benchmark scripts still run end to end (tiny sizes; results go to a temp dir)."""
import json
import os
import subprocess
import sys

import pytest

import helpers

ROOT = helpers.ROOT
pytestmark = pytest.mark.slow


def run_module(tmp_path, module, *args, timeout=600):
    env = {**os.environ, "ONE_EMBEDDING_BENCH_RESULTS": str(tmp_path),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_bench_embedding_runs_and_compares_with_its_baseline(tmp_path):
    out = run_module(tmp_path, "benchmarks.bench_embedding", "--keys", 200_000, "--steps", 2,
                     "--warmup", 1, "--batch", 512)
    assert "machine:" in out and "| one_embedding" in out and "numpy dense table" in out
    rows = json.loads((tmp_path / "bench_embedding.json").read_text())["rows"]
    assert all(r["ids/s"] > 0 for r in rows)


def test_bench_stores_runs_every_preset(tmp_path):
    out = run_module(tmp_path, "benchmarks.bench_stores", "--keys", 100_000, "--batches", 1,
                     "--warmup", 1, "--cache-mb", 2, "--host-cache-mb", 4, "--read-rows", 20_000,
                     "--read-batch", 4096, "--dir", tmp_path)
    data = json.loads((tmp_path / "bench_stores.json").read_text())
    names = " ".join(r["store"] for r in data["stores"])
    for preset in ("device_mem", "cached_host_mem", "slots", "rocksdb"):
        assert preset in names
    assert "np.memmap gather" in out


def test_bench_dlrm_peers_runs_against_plain_pytorch(tmp_path):
    pytest.importorskip("torch")
    out = run_module(tmp_path, "benchmarks.bench_dlrm_peers", "--steps", 1, "--warmup", 1,
                     "--rounds", 1, "--batches", 2, "--peers", "torch")
    assert "| one_embedding |" in out and "pytorch EmbeddingBag" in out
    rows = json.loads((tmp_path / "bench_dlrm_peers.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["samples/s"] > 0 for r in rows)


@pytest.mark.mpi
def test_bench_ranks_runs_and_projects(tmp_path):
    out = run_module(tmp_path, "benchmarks.bench_ranks", "--steps", 2, "--batch-size", 256,
                     "--rows", 20_000, "--ranks", 1, 2, "--embedding-dim", 16, "--project", 8)
    assert "machine:" in out and "cost model" in out
    data = json.loads((tmp_path / "bench_ranks.json").read_text())
    assert {(r["ranks"], r["exchange"]) for r in data["runs"]} == {
        (1, "fp32"), (2, "fp32"), (2, "fp16"), (2, "int8")}
    assert all(r["samples_per_s"] > 0 for r in data["runs"])
    assert {r["ranks"] for r in data["cost_model"]} == {2, 8}


def test_bench_disk_bounds_the_disk_with_keep_snapshots(tmp_path):
    out = run_module(tmp_path, "benchmarks.bench_disk", "--steps", 24, "--snapshot-interval", 3,
                     "--keep", 1, "--batch-size", 128, "--synthetic-scale", 0.001,
                     "--engines", "slots", "--dir", tmp_path)
    assert "machine:" in out and "keeping every checkpoint" in out
    bounded, every = json.loads((tmp_path / "bench_disk.json").read_text())["runs"]
    assert bounded["checkpoints_left"] == 2  # step-24 and final
    assert every["checkpoints_left"] == 9    # 8 interval checkpoints and final
    assert bounded["end_mb"] < every["end_mb"]


def test_bench_lifecycle_shrinks_the_table_against_its_baseline(tmp_path):
    out = run_module(tmp_path, "benchmarks.bench_lifecycle", "--part", "zipf", "--rows", 40000,
                     "--scratch", tmp_path)
    assert "machine:" in out and "min-count 1 (baseline)" in out
    results = json.loads((tmp_path / "lifecycle.json").read_text())["results"]
    base, *rest = results
    assert base["rows_vs_baseline"] == 1.0 and base["not_admitted_lookups"] == 0
    by_rule = {r["rules"]: r for r in rest}
    counts = [by_rule[f"min-count {n}"]["rows_stored"] for n in (2, 4, 8)]
    assert base["rows_stored"] > counts[0] > counts[1] > counts[2] > 0
    assert all(r["disk_bytes"] < base["disk_bytes"] for r in rest)
    assert any(r["evicted_rows"] > 0 for r in rest if r["rules"].startswith("TTL"))
    assert (tmp_path / "lifecycle.png").stat().st_size > 10_000


def test_bench_serve_measures_server_and_in_process(tmp_path):
    out = run_module(tmp_path, "benchmarks.bench_serve", "--steps", 10, "--seconds", 1,
                     "--dir", tmp_path)
    assert "machine:" in out and "during reload" in out and "goal >= 5" in out
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    modes = {(r["mode"], r["batch"]) for r in rows}
    assert {(f"{proto}, batching {on}", batch) for proto in ("REST", "gRPC")
            for on in ("off", "on") for batch in (1, 64)} <= modes
    assert ("in-process, 1 thread", 64) in modes
    assert all(r["qps"] > 0 for r in rows)
    assert all(r.get("failed", 0) == 0 for r in rows), (
        [r for r in rows if r.get("failed", 0)], out)
    # each server cell says what a request cost the server's and the load generator's CPU, and
    # the run splits a batch-1 request's server CPU into the model's and the request's own
    served = [r for r in rows if r["mode"].startswith(("REST", "gRPC")) and "server_cpu_ms" in r]
    assert len(served) >= 12 and all(r["server_cpu_ms"] > 0 for r in served)
    costs = json.loads((tmp_path / "serve.json").read_text())["batching_costs"]
    for proto in ("REST", "gRPC"):
        c = costs[proto]
        assert 0 < c["model_ms_per_row_merged"] < c["server_cpu_ms_batching_on"]
        assert c["request_handling_ms_batching_on"] > 0
    assert "5x the rows/s of batching off needs at most" in out
    # and what the two stacks cost with an empty handler, under the same load generators
    floors = json.loads((tmp_path / "serve.json").read_text())["stack_floors"]
    assert set(floors) == {"REST", "gRPC"}
    assert all(f["requests"] > 0 and f["server_cpu_ms"] > 0 for f in floors.values()), floors
    assert "the stacks alone (empty handlers" in out


def test_bench_serve_fronts_measures_rest_and_grpc_against_a_baseline(tmp_path):
    src = os.path.join(str(ROOT), "src")  # this checkout as its own baseline
    out = run_module(tmp_path, "benchmarks.bench_serve_fronts", "--steps", 10, "--seconds", 1,
                     "--baseline-src", src, "--dir", tmp_path)
    assert "machine:" in out
    rows = json.loads((tmp_path / "serve_fronts.json").read_text())["rows"]
    assert {(r["version"], r["front end"], r["batch"]) for r in rows} == {
        (v, f, b) for v in ("baseline", "this checkout")
        for f in ("REST", "gRPC", "gRPC aio client") for b in (1, 64)}
    bad = [r for r in rows if not (r["qps"] > 0 and r["server_cpu_ms"] > 0 and r["failed"] == 0)]
    assert not bad, (bad, out)


def test_dense_update_ops_counts_the_per_parameter_path(tmp_path):
    out = run_module(tmp_path, "benchmarks.dense_update_ops")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    counts = {r[0].strip(): int(r[1]) for r in rows}
    assert set(counts) == {"sgd", "adagrad", "adam"}
    assert 16 * 3 < counts["sgd"] < counts["adagrad"] < counts["adam"]   # several per parameter
