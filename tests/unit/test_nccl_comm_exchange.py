"""``NcclComm``'s all-to-all and all-reduce over several ranks, without GPUs: the ranks are
threads, the device arrays numpy arrays that say they are CuPy's, and NCCL a stand-in that
moves raw memory by address, as NCCL does: grouped sends and receives (pointer, element count,
dtype, peer) completed at ``groupEnd``, and a summing all-reduce. What this checks is the part of
``NcclComm`` that NCCL cannot check for it: the byte offsets of each peer's block, counts in
elements (rows times row length, not bytes), the dtype mapping, and which block goes to which
peer. NCCL itself runs in tests/gpu/test_nccl_comm_gpu.py (one rank on one GPU)."""
import ctypes
import threading
import types

import numpy as np
import pytest

from one_embedding.errors import ConfigError
from one_embedding.parallel.comm import NcclComm


class _DeviceArray(np.ndarray):
    """A numpy array that ``backend.is_cupy_array`` takes for a CuPy array, with CuPy's
    ``.data.ptr`` (its address)."""

    __module__ = "cupy._stand_in"

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _device(a):
    return np.ascontiguousarray(a).view(_DeviceArray)


def _cupy():
    cp = types.ModuleType("cupy")
    cp.ascontiguousarray = _device
    cp.empty = lambda shape, dtype: np.empty(shape, dtype).view(_DeviceArray)
    cp.empty_like = lambda a: np.empty_like(np.asarray(a)).view(_DeviceArray)
    cp.concatenate = lambda arrays: _device(np.concatenate([np.asarray(a) for a in arrays]))
    cp.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0))
    return cp


class _Hub:
    """What the ranks' stand-in NCCL share: posted messages and a barrier."""

    def __init__(self, world):
        self.world, self.barrier = world, threading.Barrier(world, timeout=20)
        self.posted, self.local = {}, threading.local()


def _nccl(hub):
    """The stand-in ``cupy.cuda.nccl``: dtype constants name numpy dtypes; sends and receives of
    the calling thread's group are held until ``groupEnd``, which posts every send's bytes, waits
    for every rank, then copies each receive's bytes in."""
    nccl = types.ModuleType("nccl")
    for name in NcclComm._DTYPES.values():
        setattr(nccl, name, np.dtype(name[len("NCCL_"):].lower()))
    nccl.NCCL_SUM = "sum"

    def group_start():
        hub.local.ops = []

    def group_end():
        ops, hub.local.ops = hub.local.ops, None
        for kind, rank, ptr, count, dtype, peer in ops:
            if kind == "send":
                assert (rank, peer) not in hub.posted, "two sends to one peer in a group"
                hub.posted[(rank, peer)] = ctypes.string_at(ptr, count * dtype.itemsize)
        hub.barrier.wait()
        for kind, rank, ptr, count, dtype, peer in ops:
            if kind == "recv":
                message = hub.posted[(peer, rank)]
                assert len(message) == count * dtype.itemsize, "a receive of another size"
                ctypes.memmove(ptr, message, len(message))
        hub.barrier.wait()
        if ops and ops[0][1] == 0:
            hub.posted.clear()
        hub.barrier.wait()

    nccl.groupStart, nccl.groupEnd = group_start, group_end
    return nccl


class _Communicator:
    def __init__(self, hub, rank):
        self.hub, self.rank = hub, rank

    def send(self, ptr, count, dtype, peer, stream):
        self.hub.local.ops.append(("send", self.rank, ptr, count, dtype, peer))

    def recv(self, ptr, count, dtype, peer, stream):
        self.hub.local.ops.append(("recv", self.rank, ptr, count, dtype, peer))

    def allReduce(self, send_ptr, recv_ptr, count, dtype, op, stream):
        assert op == "sum"
        self.hub.posted[("reduce", self.rank)] = np.frombuffer(
            ctypes.string_at(send_ptr, count * dtype.itemsize), dtype)
        self.hub.barrier.wait()
        total = sum(self.hub.posted[("reduce", r)] for r in range(self.hub.world))
        ctypes.memmove(recv_ptr, np.ascontiguousarray(total, dtype).tobytes(),
                       count * dtype.itemsize)
        self.hub.barrier.wait()


def _ranks(world):
    hub = _Hub(world)
    comms = []
    for rank in range(world):
        comm = object.__new__(NcclComm)
        comm._cupy, comm._nccl, comm._comm = _cupy(), _nccl(hub), _Communicator(hub, rank)
        comm._mpi = None                      # host arrays are not sent here
        comm.rank, comm.world = rank, world
        comms.append(comm)
    return comms


def _run(comms, work):
    """work(comm) on every rank at once, one thread each -> the results in rank order."""
    out, errors = [None] * len(comms), []

    def one(comm):
        try:
            out[comm.rank] = work(comm)
        except BaseException as e:   # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(e)
            comm._comm.hub.barrier.abort()

    threads = [threading.Thread(target=one, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("dtype,row", [("float32", (3,)), ("int8", (16,)), ("uint64", ()),
                                       ("float16", (2, 4))])
def test_alltoallv_sends_each_peer_its_block_over_three_ranks(dtype, row):
    world = 3
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 6, size=(world, world))        # counts[src, dst] rows
    counts[1, 2] = 0                                         # a pair that sends nothing
    blocks = {(s, d): (rng.standard_normal((int(counts[s, d]),) + row) * 50).astype(dtype)
              for s in range(world) for d in range(world)}

    def exchange(comm):
        r = comm.rank
        send = np.concatenate([blocks[(r, d)] for d in range(world)])
        got = comm.alltoallv(_device(send), counts[r], counts[:, r])
        assert type(got) is _DeviceArray
        return np.asarray(got)

    for r, got in enumerate(_run(_ranks(world), exchange)):
        want = np.concatenate([blocks[(s, r)] for s in range(world)])
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_allreduce_sums_over_the_ranks_and_bool_is_refused():
    world = 4
    values = [np.arange(10, dtype=np.float32) * (r + 1) for r in range(world)]
    sums = _run(_ranks(world),
                lambda comm: np.asarray(comm.allreduce_sum(_device(values[comm.rank]))))
    for got in sums:
        np.testing.assert_array_equal(got, sum(values))
    comm = _ranks(1)[0]
    with pytest.raises(ConfigError, match="NCCL cannot send dtype bool"):
        comm.alltoallv(_device(np.zeros(3, np.bool_)), np.array([3]), np.array([3]))
