"""Several ranks on the device path (issue 30 item 4): under ``mpiexec -n 2`` each rank trains
the same embedding on the CPU path and on the device path (the CUDA kernels on the host
emulator; the exchanges over MPI, as ``NcclComm`` carries them on GPUs), bit for bit alike, and
a device_mem step reads the host once: the per-rank counts the exchange's messages are sized
with (the local and the owner-side dedup keep their counts on the device).

Runs ``tests/mpi/device_ranks_worker.py``; on GPUs ``scripts/gpu_check.sh`` has no second GPU
to run NCCL on (one rank per GPU), so this is where the multi-rank device logic is checked.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers
from test_ranks import mpiexec

pytestmark = pytest.mark.mpi

WORKER = Path(__file__).with_name("device_ranks_worker.py")
COUNTS_READ = "partition: per-rank counts for the exchange"


def run(tmp_path, folder, world, *args):
    """The worker's report; folder: the emulator's build folder, or None for CuPy (--cuda)."""
    out = tmp_path / "report.json"
    where = ["--cuda"] if folder is None else ["--emulation", str(folder)]
    cmd = [mpiexec(), "-n", str(world), sys.executable, str(WORKER), str(out), *where,
           *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(helpers.ROOT) + os.pathsep +
           os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("exchange_dtype", ["fp32", "int8"])
def test_device_mem_ranks_give_the_cpu_bits_with_one_host_read_per_step(
        tmp_path, emulation_lib, emulation_folder, exchange_dtype):
    report = run(tmp_path, emulation_folder, 2, "--exchange-dtype", exchange_dtype)
    assert report["world"] == 2 and report["keys"] > 50
    assert report["rows_identical"] and report["tables_identical"]
    for rank_reads in report["reads"]:
        assert rank_reads and all(step == {COUNTS_READ: 1} for step in rank_reads), rank_reads


def test_cached_host_mem_ranks_give_the_cpu_bits(tmp_path, emulation_lib, emulation_folder):
    """A cache over a host tier needs the host's view of its misses (more reads), but the
    exchange is the same and so are the bits."""
    report = run(tmp_path, emulation_folder, 2, "--store", "cached_host_mem")
    assert report["rows_identical"] and report["tables_identical"]
    assert all(COUNTS_READ in step for rank_reads in report["reads"] for step in rank_reads)


TRAINER = Path(__file__).with_name("device_trainer_worker.py")


def run_trainer(tmp_path, world, *args):
    """device_trainer_worker.py's report: each rank's reads over 20 steady-state steps."""
    out = tmp_path / "trainer.json"
    cmd = [mpiexec(), "-n", str(world), sys.executable, str(TRAINER), str(out), *args]
    env = {**os.environ, "PYTHONPATH": str(helpers.ROOT) + os.pathsep +
           os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_trainer_keeps_cuda_stream_order_over_two_ranks(tmp_path):
    """Over 2 ranks on the dry run, each rank's prefetch thread exchanges ids and rows (MPI
    staging through the host) on its own stream: no race between a rank's streams
    (tests/stream_order.py), and the checker saw the exchange's host crossings."""
    report = run_trainer(tmp_path, 2, "--dry-run", "--stream-order")
    assert report["world"] == 2
    for rank in report["ranks"]:
        assert rank["hazards"] == {}, "\n".join(rank["hazards"])
        assert rank["seen"]["accesses"] > 1000 and rank["seen"]["host syncs"] > 12, rank["seen"]


def test_the_trainers_steps_read_only_the_losses_over_two_ranks(tmp_path):
    """The trainer over 2 ranks on the dry run of the device path (prefetch depth 2, --log-interval
    10): in 20 steady-state steps the thread that runs the steps reads the losses twice and
    nothing else; the prefetch thread reads each batch's per-rank counts once (the exchange's
    message sizes), under the step before it."""
    report = run_trainer(tmp_path, 2, "--dry-run")
    assert report["world"] == 2
    for rank in report["ranks"]:
        assert rank["steady_main"] == {"losses": 2}, rank
        assert rank["steady"] == {"losses": 2, COUNTS_READ: 20}, rank
