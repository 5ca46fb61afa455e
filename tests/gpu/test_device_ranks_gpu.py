"""Two ranks on one GPU (issue 30 item 4): ``mpiexec -n 2`` of tests/mpi/device_ranks_worker.py
with ``--cuda``: each rank trains the same embedding on the CPU path and on CuPy, bit for bit
alike, its exchanges staged through host memory by MPI (NCCL takes one rank per GPU, and the
machines lent to this project have one). A device_mem step's reads: the per-rank counts, and
MPI's staging of the ids, table ids, rows and gradients (NcclComm keeps those on the device)."""
import os
import sys
from pathlib import Path

import pytest

from one_embedding.backend import cupy_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))

from test_device_ranks import COUNTS_READ, run, run_trainer  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

STAGED = {"MPI alltoallv: device array staged on the host"}
DRY = os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1"


@pytest.mark.parametrize("exchange_dtype", ["fp32", "int8"])
def test_two_ranks_on_one_gpu_give_the_cpu_bits(tmp_path, exchange_dtype):
    report = run(tmp_path, None, 2, "--exchange-dtype", exchange_dtype)
    assert report["rows_identical"] and report["tables_identical"], report
    for rank_reads in report["reads"]:
        for step in rank_reads:
            assert step.get(COUNTS_READ) == 1 and set(step) <= {COUNTS_READ} | STAGED, step


def _gpus() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.skipif(DRY or not cupy_available() or _gpus() < 2,
                    reason="NCCL takes one GPU per rank: needs two GPUs (not the dry run)")
@pytest.mark.parametrize("exchange_dtype", ["fp32", "int8"])
def test_two_ranks_over_nccl_give_the_cpu_bits_reading_only_the_counts(tmp_path, exchange_dtype):
    """Two ranks on two GPUs, the device embedding exchanging over NcclComm: the CPU path's bits,
    and a step's only host read is the per-rank counts (nothing staged through host memory)."""
    from one_embedding.parallel.comm import nccl_available

    if not nccl_available():
        pytest.skip("CuPy cannot load NCCL")
    report = run(tmp_path, None, 2, "--exchange-dtype", exchange_dtype, "--nccl")
    assert report["rows_identical"] and report["tables_identical"], report
    for rank_reads in report["reads"]:
        assert rank_reads and all(step == {COUNTS_READ: 1} for step in rank_reads), rank_reads


def test_the_trainer_runs_two_ranks_on_one_gpu(tmp_path):
    """The trainer's device path over 2 ranks on the one GPU: in 20 steady-state steps the
    steps' thread reads the losses twice and otherwise only MPI's staging (NcclComm would keep
    the exchanges on the device); the prefetch thread reads each batch's per-rank counts."""
    report = run_trainer(tmp_path, 2, *(["--dry-run"] if DRY else []))
    for rank in report["ranks"]:
        main = rank["steady_main"]
        assert main.get("losses") == 2, rank
        assert set(main) <= {"losses"} | {r for r in main if r.startswith("MPI ")}, rank
        assert rank["steady"].get(COUNTS_READ) == 20, rank
