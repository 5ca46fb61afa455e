"""benchmarks.bench_scale runs end to end at tiny sizes: both parts, the baseline worktree, the
cgroup-limited training run; results go to a temp dir."""
import json
import math
import os
import subprocess
import sys

import pytest

import helpers

ROOT = helpers.ROOT
pytestmark = pytest.mark.slow

BASELINE_REF = "2bf9b1a"  # the script's default: the commit before the segment-log SSD tier


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def test_bench_scale_measures_new_and_baseline_code_and_a_limited_training_run(tmp_path):
    env = {**os.environ, "ONE_EMBEDDING_BENCH_RESULTS": str(tmp_path / "results"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    work = tmp_path / "work"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_scale", "--part", "both", "--dir", str(work),
         "--keys", "60000", "--cache-mb", "1", "--fill-batch", "8192",
         "--baseline-ref", BASELINE_REF, "--steps", "3", "--batch", "128",
         "--cardinality-scale", "0.001", "--synthetic-rows", "20000", "--train-cache-mb", "4",
         "--raw-mb", "16", "--raw-seconds", "0.3", "--io-threads", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "machine:" in out and "| engine | figure |" in out and "| store | limit |" in out

    data = json.loads((tmp_path / "results" / "bench_scale.json").read_text())
    assert (tmp_path / "results" / "bench_scale.png").stat().st_size > 0

    # (a): every engine measured on this checkout, and on the baseline where git has the ref
    a = data["a"]
    has_ref = git("rev-parse", "--verify", f"{BASELINE_REF}^{{commit}}").returncode == 0
    codes = ["baseline", "new"] if has_ref else ["new"]
    assert sorted(a["runs"]) == sorted(f"{c}/{e}" for c in codes for e in ("slots", "rocksdb"))
    for key, run in a["runs"].items():
        assert run["reopened_rows"] == run["table_rows"] > 0, key
        assert len(run["snapshots"]) == 5 and run["disk_all_bytes"] > 0, key
        f = run["figures"]
        assert f["snapshot_write_x"] >= 0 and f["reopen_seconds"] > 0, key
        assert all(v is None or math.isfinite(v) for v in f.values()), key
    for engine in ("slots", "rocksdb"):  # this checkout can delete snapshots and reports procstats
        new = a["runs"][f"new/{engine}"]
        assert os.path.realpath(new["library"]) == os.path.realpath(helpers.PACKAGE.parent)
        assert new["proc_tools"] == "procstats"
        assert new["has_delete_snapshot"] and new["disk_kept_bytes"] <= new["disk_all_bytes"]
    if has_ref:  # the same worker ran the old code from a worktree, then the worktree went
        folder = a["codes"]["baseline"]
        assert os.path.realpath(a["runs"]["baseline/slots"]["library"]) == os.path.realpath(folder)
        assert not os.path.exists(folder) and folder not in git("worktree", "list").stdout

    # (b): both stores trained; the cached_ssd run's cgroup (where one was made) is gone
    b = data["b"]
    assert set(b["runs"]) == {"device_mem", "cached_ssd"}
    assert all(run["samples_per_s"] > 0 and run["peak_rss_bytes"] > 0 for run in b["runs"].values())
    ssd = b["runs"]["cached_ssd"]
    assert ssd["ssd_tier"].startswith("ssd.") and ssd["disk_bytes"] > 0
    assert b["raw_reads_per_s_mean"] > 0 and b["ratios"]["samples_per_s"] > 0
    if "cgroup" in ssd:
        assert not os.path.exists(ssd["cgroup"])
    else:
        assert "ran without a limit" in ssd["limit"]
    # the run folder and the worktree made for this run are removed
    assert not any(name.startswith("bench_scale_") for name in os.listdir(work))
