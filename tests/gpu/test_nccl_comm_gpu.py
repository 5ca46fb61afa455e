"""``NcclComm`` on a real GPU (issue 30 item 4), over one rank: the machines lent to this project
have one GPU and NCCL takes one rank per GPU, so several ranks cannot run here; one rank still
runs every NCCL call the exchanges make (grouped sends and receives to itself, the all-reduce)
with the pointers, element counts and dtypes the library computes, and the trainer's
``--comm nccl`` sends its ids and int8 rows through them.

Skipped where CuPy cannot load NCCL or mpi4py is absent (NCCL is bootstrapped by MPI), and on
the dry run (no NCCL there).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from one_embedding.backend import cupy_available

DRY = os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1"


def _nccl_reason():
    if not cupy_available() or DRY:
        return "needs CuPy and a CUDA device (not the dry run: no NCCL there)"
    from one_embedding.parallel.comm import nccl_available

    if not nccl_available():
        return "CuPy cannot load NCCL"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py absent: NCCL is bootstrapped by MPI"
    return None


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_nccl_reason() is not None, reason=str(_nccl_reason()))]


@pytest.fixture(scope="module")
def nccl():
    from one_embedding.parallel.comm import NcclComm

    return NcclComm()


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int64", "int32", "uint8",
                                   "int8", "uint64"])
def test_alltoallv_to_itself_moves_every_row_whole(nccl, dtype):
    import cupy as cp

    rng = np.random.default_rng(3)
    rows = rng.integers(0, 120, size=(37, 5)).astype(dtype)
    got = nccl.alltoallv(cp.asarray(rows), np.array([37]), np.array([37]))
    assert isinstance(got, cp.ndarray) and got.dtype == rows.dtype and got.shape == rows.shape
    np.testing.assert_array_equal(got.get(), rows)
    flat = nccl.alltoallv(cp.asarray(rows[:, 0]), np.array([37]), np.array([37]))
    np.testing.assert_array_equal(flat.get(), rows[:, 0])
    empty = nccl.alltoallv(cp.asarray(rows[:0]), np.array([0]), np.array([0]))
    assert empty.shape == (0, 5)


def test_allreduce_allgather_and_host_arrays(nccl):
    import cupy as cp

    grads = cp.arange(1000, dtype=cp.float32) / 7
    np.testing.assert_array_equal(nccl.allreduce_sum(grads).get(), grads.get())   # one rank
    block = cp.arange(12, dtype=cp.int64).reshape(4, 3)
    np.testing.assert_array_equal(nccl.allgather(block).get(), block.get())
    losses = np.array([0.5, 0.25])
    assert isinstance(nccl.allreduce_sum(losses), np.ndarray)   # host arrays go over MPI
    with pytest.raises(Exception, match="NCCL cannot send dtype bool"):
        nccl.alltoallv(cp.zeros(3, dtype=cp.bool_), np.array([3]), np.array([3]))


def test_the_trainer_over_nccl_gives_the_bits_of_one_local_rank(tmp_path):
    """--comm nccl (ids and int8 rows through NCCL to the one rank itself) against --comm mpi
    (one rank: no communicator at all): the same losses, weights and evaluation, bit for bit."""
    from one_embedding.config import TrainConfig
    from one_embedding.parallel.comm import NcclComm
    from one_embedding.training import Trainer

    finals = {}
    for comm in ("nccl", "mpi"):
        cfg = TrainConfig(steps=6, batch_size=4096, synthetic_rows=20_000, embedding_dim=8,
                          store="device_mem", eval_batches=1, device="cuda", comm=comm,
                          exchange_dtype="int8", log_interval=3, bottom_mlp=(16, 8),
                          top_mlp=(16, 1), persistent_path=str(tmp_path / comm))
        trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
        assert isinstance(trainer.comm, NcclComm) == (comm == "nccl")
        final = trainer.run()
        finals[comm] = (np.array(trainer.progress.losses).tobytes(),
                        [p.data.get().tobytes() for p in trainer.model.parameters()],
                        np.float64(final["auc"]).tobytes())
    assert finals["nccl"] == finals["mpi"]
