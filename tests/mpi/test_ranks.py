"""P ranks under mpiexec train like one rank; exchange dtypes; snapshots re-shard across world sizes.

Each test launches ``tests/mpi/embedding_worker.py`` with ``mpiexec -n P`` (oversubscribed on a
2-core machine: slow, but real MPI).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import helpers


pytestmark = pytest.mark.mpi

WORKER = Path(__file__).with_name("embedding_worker.py")


def mpiexec():
    exe = shutil.which("mpiexec") or str(Path(sys.executable).with_name("mpiexec"))
    if not os.path.exists(exe):
        pytest.skip("mpiexec not found: pip install 'one_embedding[mpi]'")
    return exe


def run(tmp_path, world, *args, name=None, launcher=True):
    out = tmp_path / (name or f"w{world}.json")
    cmd = [sys.executable, str(WORKER), str(out), *map(str, args)]
    if launcher:
        cmd = [mpiexec(), "-n", str(world)] + cmd
    # this checkout's package, as the other subprocess tests do (not an installed copy)
    path = str(helpers.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    table = np.load(str(out) + ".npz")
    return report, table["keys"], table["lines"]


def test_mpiexec_n1_equals_a_plain_process(tmp_path):
    plain, k0, l0 = run(tmp_path, 1, launcher=False, name="plain.json")
    one, k1, l1 = run(tmp_path, 1)
    assert one["losses"] == plain["losses"]
    np.testing.assert_array_equal(k0, k1)
    np.testing.assert_array_equal(l0, l1)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_train_like_one_rank(world, tmp_path):
    base, keys, lines = run(tmp_path, 1)
    got, k, l = run(tmp_path, world)
    assert got["world"] == world
    assert helpers.max_rel_diff(got["losses"], base["losses"]) < 1e-4  # OneFlow's multi-rank tolerance
    np.testing.assert_array_equal(k, keys)  # the same keys exist, each on exactly one rank
    np.testing.assert_allclose(l, lines, rtol=1e-4, atol=1e-6)
    assert got["owned_only"], "a rank holds a key it does not own"
    assert got["dense_identical_across_ranks"]
    assert got["exchange_bytes"] > 0 and base["exchange_bytes"] == 0


def test_clipping_by_the_global_norm_trains_like_one_rank(tmp_path):
    # the clip norm sums the rows' gradients over the ranks (each key on one rank)
    base, keys, lines = run(tmp_path, 1, "--clip", 0.05, name="c1.json")
    got, k, l = run(tmp_path, 2, "--clip", 0.05, name="c2.json")
    unclipped, _, _ = run(tmp_path, 1, name="u1.json")
    assert helpers.max_rel_diff(base["losses"], unclipped["losses"]) > 1e-3   # it did clip
    assert helpers.max_rel_diff(got["losses"], base["losses"]) < 1e-4
    np.testing.assert_array_equal(k, keys)
    np.testing.assert_allclose(l, lines, rtol=1e-4, atol=1e-6)
    assert got["dense_identical_across_ranks"]


def test_int8_and_fp16_exchange_bytes_and_accuracy(tmp_path):
    reports = {d: run(tmp_path, 2, "--dim", 64, "--exchange-dtype", d, name=f"{d}.json")[0]
               for d in ("fp32", "fp16", "int8")}
    fp32 = reports["fp32"]
    assert reports["fp16"]["exchange_bytes"] == fp32["exchange_bytes"] // 2
    assert reports["int8"]["exchange_bytes"] <= 0.27 * fp32["exchange_bytes"]
    assert helpers.max_rel_diff(reports["fp16"]["losses"], fp32["losses"]) < 1e-2  # OneFlow's fp16 tolerance
    assert helpers.max_rel_diff(reports["int8"]["losses"], fp32["losses"]) < 2e-2
    assert reports["int8"]["losses"] != fp32["losses"]  # the codec really ran


@pytest.mark.parametrize("store", ["device_mem", "cached_ssd"])
def test_snapshot_saved_by_2_ranks_loads_at_1_and_3(store, tmp_path):
    path = tmp_path / "table"
    _, saved_keys, saved_lines = run(tmp_path, 2, "--store", store, "--path", path, "--save", "s",
                                     name="save.json")
    for world in (1, 3):
        report, keys, lines = run(tmp_path, world, "--store", store, "--path", path, "--load", "s",
                                  "--steps", 0, name=f"load{world}.json")
        np.testing.assert_array_equal(keys, saved_keys)
        np.testing.assert_array_equal(lines, saved_lines)
        assert report["owned_only"]


def test_a_set_incomplete_at_this_world_is_never_loaded_in_part(tmp_path):
    """A 3-rank save that rank 2 never finished (its part removed, as a kill before its save
    leaves it): loading at 3 ranks once raised on no rank and mixed two training states (ranks 0
    and 1 loaded the stale 3-rank parts, rank 2 the newer 2-rank set). Now the ranks decide
    together: every rank raises naming rank 2, and once a complete 2-rank set holds the name,
    every rank loads that one."""
    path = tmp_path / "table"
    run(tmp_path, 3, "--path", path, "--save", "s", "--steps", 2, name="stale.json")
    shutil.rmtree(path / "2-3" / "snapshots" / "s")
    cmd = [mpiexec(), "-n", "3", sys.executable, str(WORKER), str(tmp_path / "refused.json"),
           "--path", str(path), "--load", "s", "--steps", "0"]
    env = {**os.environ, "PYTHONPATH": str(helpers.ROOT) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "snapshot 's' is incomplete at 3 ranks: rank(s) [2] lack it" in proc.stderr, \
        proc.stderr[-3000:]
    _, saved_keys, saved_lines = run(tmp_path, 2, "--path", path, "--save", "s", "--steps", 4,
                                     name="complete.json")
    report, keys, lines = run(tmp_path, 3, "--path", path, "--load", "s", "--steps", 0,
                              name="load3.json")
    np.testing.assert_array_equal(keys, saved_keys)
    np.testing.assert_array_equal(lines, saved_lines)
    assert report["owned_only"]


def test_ranks_that_build_the_embedding_differently_are_refused_by_name(tmp_path):
    """Through the Python API (the CLI compares its flags already): rows of another codec or
    width cannot cross the all-to-all; it ended in an MPI error naming nothing, or, where the
    byte counts happened to agree (fp16 against int8 at dim 4), rows of uninitialised memory."""
    env = {**os.environ, "PYTHONPATH": str(helpers.ROOT) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    for one, other, named in ((["--exchange-dtype", "fp32"], ["--exchange-dtype", "int8"],
                               "exchange_dtype: rank 0 'fp32', rank 1 'int8'"),
                              (["--exchange-dtype", "fp16", "--dim", "4"],
                               ["--exchange-dtype", "int8", "--dim", "4"],
                               "exchange_dtype: rank 0 'fp16', rank 1 'int8'"),
                              (["--dim", "8"], ["--dim", "16"],
                               "embedding_dims: rank 0 [8], rank 1 [16]")):
        worker = [sys.executable, str(WORKER), str(tmp_path / "differ.json"), "--steps", "1"]
        cmd = [mpiexec(), "-n", "1", *worker, *one, ":", "-n", "1", *worker, *other]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode != 0
        assert f"embedding 't' was built differently on the ranks ({named}" in proc.stderr, \
            proc.stderr[-3000:]
