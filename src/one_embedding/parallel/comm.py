"""Communicators: the collectives the shuffles and the data-parallel dense step run over.

One interface, one implementation per engine: ``LocalComm`` (one process: every exchange is the
identity) and ``MpiComm`` (mpi4py, for processes launched by ``mpiexec``); NCCL on GPU plugs in
beside them. The front end never knows which one it holds, so one rank runs exactly the code
path that P ranks run.

Conventions: an all-to-all sends a block of rows to every rank, ordered by destination rank
(``send_counts[p]`` rows for rank p), and receives blocks ordered by source rank. All ranks call
the collectives of one communicator in the same order; a thread that runs collectives of its own
(the prefetch thread's ID shuffle) uses a ``dup()`` of the communicator, so the two threads'
collectives never interleave.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod

import numpy as np

from .. import host_sync
from ..backend import is_cupy_array
from ..errors import ConfigError

#: Environment variables a process launcher sets for each rank (MPICH / Intel MPI: PMI_*, Open
#: MPI: OMPI_*, PMIx launchers: PMIX_*).
_LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


class Communicator(ABC):
    """The collectives of a group of ``world`` processes, seen from ``rank``."""

    rank: int
    world: int
    #: ranks running on this machine (they share its cores)
    local_size: int = 1
    #: this rank's place among them, 0 .. local_size - 1 (which of the machine's GPUs it takes)
    local_rank: int = 0

    @abstractmethod
    def alltoall_counts(self, send_counts: np.ndarray) -> np.ndarray:
        """send_counts: (P,) int64 rows this rank sends to each rank -> (P,) int64 rows it
        receives from each rank."""

    @abstractmethod
    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray,
                  recv_counts: np.ndarray) -> np.ndarray:
        """send: (sum(send_counts), ...) rows grouped by destination rank -> (sum(recv_counts),
        ...) rows of the same dtype and row shape, grouped by source rank."""

    @abstractmethod
    def allreduce_sum(self, array: np.ndarray) -> np.ndarray:
        """The element-wise sum of ``array`` over all ranks (same shape and dtype on each)."""

    @abstractmethod
    def allgather(self, array: np.ndarray) -> np.ndarray:
        """(n_r, ...) from each rank -> (sum n_r, ...) concatenated in rank order, on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    @abstractmethod
    def dup(self) -> "Communicator":
        """A communicator over the same ranks whose collectives are separate from this one's."""

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (after an error on this one)."""
        raise SystemExit(code)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world={self.world})"


class LocalComm(Communicator):
    """One process: rank 0 of 1. Every exchange returns its input (no copy)."""

    rank = 0
    world = 1

    def alltoall_counts(self, send_counts):
        return _check_counts(send_counts, 1)

    def alltoallv(self, send, send_counts, recv_counts):
        _check_counts(send_counts, 1)
        if int(send_counts[0]) != send.shape[0]:
            raise ConfigError(f"alltoallv: send_counts={list(send_counts)} but {send.shape[0]} "
                              "rows to send")
        return send

    def allreduce_sum(self, array):
        return array

    def allgather(self, array):
        return array

    def barrier(self):
        return None

    def dup(self):
        return self


def _on_host(method):
    """MPI here is not CUDA-aware: a CuPy array goes through host memory (a read that waits for
    the device, counted by ``host_sync``) and comes back as one."""
    def wrapper(self, array, *args):
        if not is_cupy_array(array):
            return method(self, array, *args)
        import cupy

        staged = host_sync.to_host(array, f"MPI {method.__name__}: device array staged on the host")
        return cupy.asarray(method(self, staged, *args))

    wrapper.__doc__ = method.__doc__
    return wrapper


class MpiComm(Communicator):
    """The ranks of an MPI communicator (mpi4py), by default a private copy of COMM_WORLD.

    Rows travel as raw bytes (``MPI.BYTE``), so any dtype and row shape works; mpi4py switches to
    MPI-4's large-count calls when a message needs it. CuPy arrays are staged through host memory
    (use ``NcclComm`` to keep GPU exchanges on the device).
    """

    def __init__(self, mpi_comm=None):
        try:
            from mpi4py import MPI
        except ImportError:  # pragma: no cover - the mpi extra installs it
            raise ConfigError("several ranks need mpi4py: pip install 'one_embedding[mpi]'") from None
        self._MPI = MPI
        self._comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD.Dup()
        self.rank = self._comm.Get_rank()
        self.world = self._comm.Get_size()
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_size, self.local_rank = node.Get_size(), node.Get_rank()
        node.Free()
        if self.world > 1:
            abort_on_uncaught_exception(self)

    def alltoall_counts(self, send_counts):
        send = np.ascontiguousarray(_check_counts(send_counts, self.world))
        recv = np.empty(self.world, np.int64)
        self._comm.Alltoall(send, recv)
        return recv

    @_on_host
    def alltoallv(self, send, send_counts, recv_counts):
        send = np.ascontiguousarray(send)
        send_counts = _check_counts(send_counts, self.world)
        recv_counts = _check_counts(recv_counts, self.world)
        if int(send_counts.sum()) != send.shape[0]:
            raise ConfigError(f"alltoallv: send_counts={list(send_counts)} but {send.shape[0]} "
                              "rows to send")
        recv = np.empty((int(recv_counts.sum()),) + send.shape[1:], send.dtype)
        row_bytes = send.dtype.itemsize * int(np.prod(send.shape[1:], dtype=np.int64))
        byte = self._MPI.BYTE
        self._comm.Alltoallv(
            [send.reshape(-1).view(np.uint8), _blocks(send_counts * row_bytes), byte],
            [recv.reshape(-1).view(np.uint8), _blocks(recv_counts * row_bytes), byte])
        return recv

    @_on_host
    def allreduce_sum(self, array):
        array = np.ascontiguousarray(array)
        out = np.empty_like(array)
        self._comm.Allreduce(array, out, op=self._MPI.SUM)
        return out

    @_on_host
    def allgather(self, array):
        array = np.ascontiguousarray(array)
        counts = np.empty(self.world, np.int64)
        self._comm.Allgather(np.array([array.shape[0]], np.int64), counts)
        out = np.empty((int(counts.sum()),) + array.shape[1:], array.dtype)
        row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
        self._comm.Allgatherv([array.reshape(-1).view(np.uint8), self._MPI.BYTE],
                              [out.reshape(-1).view(np.uint8), _blocks(counts * row_bytes),
                               self._MPI.BYTE])
        return out

    def barrier(self):
        self._comm.Barrier()

    def dup(self):
        return MpiComm(self._comm.Dup())

    def abort(self, code: int = 1) -> None:
        """MPI_Abort, with a watchdog: should it neither return nor end this process within
        ``ABORT_GRACE_S`` seconds (MPI_Abort can wait on a lock another thread of this process
        holds while it spins in a collective whose peers are gone), every thread's traceback is
        printed and the process exits with code 1 (``faulthandler``: a C thread, no GIL
        needed), which the launcher takes as a failed rank and ends the job."""
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(ABORT_GRACE_S, exit=True, file=sys.stderr)
        self._comm.Abort(code)


class NcclComm(Communicator):
    """GPU ranks: rows, gradients and dense gradients exchanged on the device by NCCL
    (``cupy.cuda.nccl``), bootstrapped by an ``MpiComm`` (which also carries the small host-side
    messages: counts, barriers). One GPU per rank: rank r uses device ``r % local_size``.

    All-to-all is a group of NCCL sends and receives, one pair per peer, on the current stream.
    Host (numpy) arrays go over the MPI communicator and come back as host arrays, as they would
    from ``MpiComm``.
    Not run yet: the GPU machines lent to this project have one GPU, and NCCL takes one rank
    per GPU. The device path it carries runs under ``mpiexec`` with ``MpiComm`` in the default
    checks (tests/mpi/test_device_ranks.py: the kernels on the host emulator).
    """

    _DTYPES = {"float32": "NCCL_FLOAT32", "float16": "NCCL_FLOAT16", "float64": "NCCL_FLOAT64",
               "int64": "NCCL_INT64", "int32": "NCCL_INT32", "uint8": "NCCL_UINT8",
               "int8": "NCCL_INT8", "uint64": "NCCL_UINT64"}

    def __init__(self, mpi: MpiComm | None = None):
        import cupy
        from cupy.cuda import nccl

        self._cupy, self._nccl = cupy, nccl
        self._mpi = mpi if mpi is not None else MpiComm()
        self.rank, self.world = self._mpi.rank, self._mpi.world
        self.local_size, self.local_rank = self._mpi.local_size, self._mpi.local_rank
        cupy.cuda.Device(local_gpu(self)).use()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self._mpi._comm.bcast(uid, root=0)
        self._comm = nccl.NcclCommunicator(self.world, uid, self.rank)

    def _nccl_dtype(self, dtype):
        name = self._DTYPES.get(np.dtype(dtype).name)
        if name is None:
            raise ConfigError(f"NCCL cannot send dtype {dtype}: use one of {sorted(self._DTYPES)}")
        return getattr(self._nccl, name)

    def alltoall_counts(self, send_counts):
        return self._mpi.alltoall_counts(send_counts)

    def alltoallv(self, send, send_counts, recv_counts):
        if not is_cupy_array(send):   # host arrays (the trainer's own messages) go over MPI
            return self._mpi.alltoallv(send, send_counts, recv_counts)
        cp, nccl = self._cupy, self._nccl
        send = cp.ascontiguousarray(send)
        send_counts = _check_counts(send_counts, self.world)
        recv_counts = _check_counts(recv_counts, self.world)
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        recv = cp.empty((int(recv_counts.sum()),) + send.shape[1:], send.dtype)
        dtype, stream = self._nccl_dtype(send.dtype), cp.cuda.get_current_stream().ptr
        item = send.dtype.itemsize
        s_off = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
        r_off = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
        nccl.groupStart()
        for peer in range(self.world):
            if send_counts[peer]:
                self._comm.send(send.data.ptr + int(s_off[peer]) * row * item,
                                int(send_counts[peer]) * row, dtype, peer, stream)
            if recv_counts[peer]:
                self._comm.recv(recv.data.ptr + int(r_off[peer]) * row * item,
                                int(recv_counts[peer]) * row, dtype, peer, stream)
        nccl.groupEnd()
        return recv

    def allreduce_sum(self, array):
        if not is_cupy_array(array):   # e.g. the trainer's losses: a host array stays one
            return self._mpi.allreduce_sum(array)
        cp = self._cupy
        array = cp.ascontiguousarray(array)
        out = cp.empty_like(array)
        self._comm.allReduce(array.data.ptr, out.data.ptr, array.size,
                             self._nccl_dtype(array.dtype), self._nccl.NCCL_SUM,
                             cp.cuda.get_current_stream().ptr)
        return out

    def allgather(self, array):
        if not is_cupy_array(array):
            return self._mpi.allgather(array)
        cp = self._cupy
        array = cp.ascontiguousarray(array)
        counts = self._mpi.allgather(np.array([array.shape[0]], np.int64))
        send_counts = np.full(self.world, array.shape[0], np.int64)
        # every rank sends its whole block to every rank: an all-to-all with equal blocks
        send = cp.concatenate([array] * self.world) if self.world > 1 else array
        return self.alltoallv(send, send_counts, counts)

    def barrier(self):
        self._cupy.cuda.get_current_stream().synchronize()
        self._mpi.barrier()

    def dup(self):
        return NcclComm(self._mpi.dup())

    def abort(self, code: int = 1) -> None:
        self._mpi.abort(code)


def _blocks(byte_counts: np.ndarray) -> tuple[list[int], list[int]]:
    """(counts, displacements) of consecutive blocks, as mpi4py's vector calls take them."""
    counts = [int(c) for c in byte_counts]
    displs = [0] * len(counts)
    for i in range(1, len(counts)):
        displs[i] = displs[i - 1] + counts[i - 1]
    return counts, displs


def differing_settings(comm: Communicator, fields: dict) -> str | None:
    """Compare ``fields`` (JSON-able settings) across the ranks (a collective call): None when
    every rank has the same, else a text naming each differing field and each rank's value."""
    if comm.world == 1:
        return None
    import json

    mine = json.dumps(fields, sort_keys=True, default=str).encode()
    sizes = np.asarray(comm.allgather(np.array([len(mine)], np.int64)))
    every = np.asarray(comm.allgather(np.frombuffer(mine, np.uint8)))
    ends = np.cumsum(sizes)
    settings = [json.loads(every[end - size:end].tobytes())
                for size, end in zip(sizes.tolist(), ends.tolist())]
    keys = sorted(set().union(*settings))
    differ = [k for k in keys if any(c.get(k) != settings[0].get(k) for c in settings[1:])]
    if not differ:
        return None
    return "; ".join(f"{k}: " + ", ".join(f"rank {r} {c.get(k)!r}" for r, c in enumerate(settings))
                     for k in differ[:6])


def launched_world_size() -> int | None:
    """The number of ranks a launcher (``mpiexec``) started this process among, or None."""
    for var in _LAUNCHER_SIZE_VARS:
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return None


_DEFAULT: Communicator | None = None


#: set ONE_EMBEDDING_ABORT_ON_ERROR=0 to keep Python's default: an uncaught exception on one
#: rank then ends that rank only, and the others wait in their next collective
ABORT_ENV = "ONE_EMBEDDING_ABORT_ON_ERROR"
#: seconds ``MpiComm.abort`` gives MPI_Abort before its watchdog ends this process itself
ABORT_GRACE_S = 10.0
_HOOKED: list = []


def abort_enabled() -> bool:
    """Whether an error on one rank ends the whole job (``ONE_EMBEDDING_ABORT_ON_ERROR``, on
    unless set to 0)."""
    return os.environ.get(ABORT_ENV, "1") != "0"


def end_job(comm: Communicator, why: str, error: BaseException | None = None) -> None:
    """Report ``error`` (if any) and one line naming this rank and ``why``, then end every rank
    of ``comm``'s job (``comm.abort``: MPI_Abort, which does not return). As the CLI does: an
    error this library raises on purpose is its one-line message and exit code 2, Ctrl-C 130,
    anything else its traceback and 1."""
    import sys
    import traceback

    from ..errors import OneEmbeddingError

    code = 1
    if isinstance(error, OneEmbeddingError):
        print(f"one_embedding: rank {comm.rank} of {comm.world}: error: {error}",
              file=sys.stderr)
        code = 2
    elif isinstance(error, KeyboardInterrupt):
        code = 130
    elif error is not None:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    print(f"one_embedding: rank {comm.rank} of {comm.world}: {why}: ending the job (set "
          f"{ABORT_ENV}=0 to leave the other ranks running)", file=sys.stderr, flush=True)
    comm.abort(code)


def abort_on_uncaught_exception(comm: Communicator, enable: bool | None = None) -> None:
    """Make an exception nobody catches, on the main thread or any other, end every rank of
    ``comm``'s job (MPI_Abort) after printing its traceback, instead of leaving the other ranks
    waiting in a collective for ever. Installed by every ``MpiComm`` of more than one rank;
    ``enable=False`` (or ``ONE_EMBEDDING_ABORT_ON_ERROR=0``) removes it."""
    import sys
    import threading

    if enable is None:
        enable = abort_enabled()
    if not enable:
        if _HOOKED:
            sys.excepthook, threading.excepthook = _HOOKED.pop()
        return
    if _HOOKED:
        return
    previous = (sys.excepthook, threading.excepthook)
    _HOOKED.append(previous)

    def end_job(kind, value, tb):
        previous[0](kind, value, tb)  # the traceback, as Python prints it
        if not issubclass(kind, KeyboardInterrupt):
            print(f"one_embedding: rank {comm.rank} of {comm.world} raised {kind.__name__}: "
                  f"ending the job (set {ABORT_ENV}=0 to leave the other ranks running)",
                  file=sys.stderr, flush=True)
        comm.abort(1)

    def end_job_from_thread(args):
        previous[1](args)  # the traceback, as Python prints it
        if args.exc_type is SystemExit:
            return
        print(f"one_embedding: rank {comm.rank} of {comm.world}: thread "
              f"{getattr(args.thread, 'name', '?')} raised {args.exc_type.__name__}: ending the "
              "job", file=sys.stderr, flush=True)
        comm.abort(1)

    sys.excepthook = end_job
    threading.excepthook = end_job_from_thread


def default_comm() -> Communicator:
    """The job's communicator: ``MpiComm`` over every rank when a launcher started this process
    (as OneFlow takes rank and world from its launcher's environment), else ``LocalComm``.
    The same object on every call."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = MpiComm() if launched_world_size() is not None else LocalComm()
    return _DEFAULT


def nccl_available() -> bool:
    """Whether CuPy can load NCCL (``cupy.cuda.nccl.available``; the pip wheels take it from
    the nvidia-nccl package)."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


def local_gpu(comm: Communicator) -> int:
    """The GPU of this rank among those it sees: its place among the machine's ranks, modulo
    their number (all GPUs visible to every rank: rank k of a machine takes GPU k; one GPU
    visible to each rank, as a scheduler that binds a GPU per task leaves it: GPU 0)."""
    import cupy

    return comm.local_rank % max(1, cupy.cuda.runtime.getDeviceCount())


def training_comm(choice: str, on_gpu: bool) -> Communicator:
    """The communicator of a training run (``TrainConfig.comm``, ``--comm``): "mpi" is
    ``default_comm()``; "nccl" an ``NcclComm`` over it (refused by name where NCCL cannot run:
    ranks sharing a GPU, a rank whose CuPy cannot load NCCL); "auto" is NCCL for several ranks
    on GPUs where it can run, else ``default_comm()``. Collective: every rank calls it, and
    every rank gets the same kind."""
    base = default_comm()
    if choice == "mpi" or not on_gpu or (choice == "auto" and base.world == 1):
        if choice == "nccl":
            raise ConfigError("--comm nccl exchanges device arrays between GPUs: add --device "
                              "cuda, or use --comm mpi")
        return base
    problem = _nccl_problem(base)
    if problem is not None:
        if choice == "nccl":
            raise ConfigError(f"--comm nccl: {problem}, or use --comm mpi")
        return base
    return NcclComm(base if isinstance(base, MpiComm) else MpiComm())


#: bytes of a rank's GPU identity (machine name / PCI bus id) in ``_nccl_problem``'s exchange
_IDENTITY_BYTES = 128


def _nccl_problem(base: Communicator) -> str | None:
    """Why NCCL cannot carry this job's exchanges, or None; the same answer on every rank (each
    rank's GPU identity and NCCL flag go to every rank). NCCL takes one GPU per rank: two ranks
    whose GPUs have one machine and PCI bus id share it."""
    import socket

    import cupy

    device = cupy.cuda.Device(local_gpu(base))
    identity = f"{socket.gethostname()}/{getattr(device, 'pci_bus_id', device.id)}".encode()
    identity = identity[:_IDENTITY_BYTES]
    mine = np.zeros((1, _IDENTITY_BYTES + 1), np.uint8)
    mine[0, :len(identity)] = np.frombuffer(identity, np.uint8)
    mine[0, -1] = nccl_available()
    rows = base.allgather(mine)                                   # (world, 129)
    seen: dict = {}
    for rank, row in enumerate(rows):
        name = bytes(row[:-1]).rstrip(b"\0").decode(errors="replace")
        if name in seen:
            return (f"ranks {seen[name]} and {rank} share the GPU {name} and NCCL takes one GPU "
                    "per rank: start at most one rank per GPU")
        seen[name] = rank
    lacking = [rank for rank, row in enumerate(rows) if not row[-1]]
    if lacking:
        return (f"CuPy cannot load NCCL on rank(s) {lacking}: pip install nvidia-nccl-cu12 (or "
                "the NCCL of your CUDA)")
    return None


def _check_counts(counts, world: int) -> np.ndarray:
    counts = np.asarray(counts, np.int64)
    if counts.shape != (world,):
        raise ConfigError(f"counts of shape {counts.shape} for a world of {world} ranks")
    return counts
