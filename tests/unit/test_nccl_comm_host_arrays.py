"""``NcclComm`` carries device arrays over NCCL and host arrays over its MPI communicator (the
trainer's losses and counts are numpy arrays and must come back as numpy arrays). Checked
without NCCL: a communicator whose CuPy and NCCL are absent, over a one-rank MPI stand-in,
answers every host-array collective without touching them."""
import numpy as np

from one_embedding.parallel.comm import LocalComm, NcclComm


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"a host array reached CuPy / NCCL ({name})")


def _comm() -> NcclComm:
    comm = object.__new__(NcclComm)   # no GPU here: the routing alone, over one rank
    comm._mpi, comm._cupy, comm._nccl, comm._comm = LocalComm(), _Untouchable(), \
        _Untouchable(), _Untouchable()
    comm.rank, comm.world = 0, 1
    return comm


def test_host_arrays_go_over_mpi_and_stay_host_arrays():
    comm = _comm()
    losses = np.array([0.5, 0.25])
    assert comm.allreduce_sum(losses) is losses
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert comm.allgather(rows) is rows
    assert comm.alltoallv(rows, np.array([3]), np.array([3])) is rows
    np.testing.assert_array_equal(comm.alltoall_counts(np.array([3])), [3])
