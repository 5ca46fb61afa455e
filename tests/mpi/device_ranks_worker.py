"""Run under ``mpiexec -n P``: each rank trains the same embedding twice on its block of a fixed
sequence of global batches, once on the CPU path (numpy) and once on the device path (the CUDA
kernels on the host emulator, numpy standing in for CuPy's arrays), and compares the two bit for
bit; the device steps' host reads are counted by reason. Rank 0 writes a JSON report.

    mpiexec -n 2 python tests/mpi/device_ranks_worker.py OUT.json (--emulation DIR | --cuda)
        [--store device_mem|cached_host_mem] [--exchange-dtype fp32|fp16|int8] [--steps N]
        [--nccl]

--emulation: the emulator's library is built (or reused) in DIR (tests/cuda_emulation.py); rank
0 builds it before the others load it. --cuda: CuPy on the GPU (every rank on device 0 when the
machine has one: tests/gpu/test_device_ranks_gpu.py), the exchanges staged by MPI; with --nccl
the device embedding exchanges over ``NcclComm`` instead (a GPU per rank).
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the emulator

import one_embedding as oe  # noqa: E402
from one_embedding import host_sync  # noqa: E402
from one_embedding.parallel.comm import NcclComm, default_comm, local_gpu  # noqa: E402

TABLES, GLOBAL_BATCH, DIM = 3, 64, 8


def global_batches(steps, seed=11):
    """(ids (GLOBAL_BATCH, TABLES) int64, grad (GLOBAL_BATCH, TABLES, DIM) float32) per step:
    Zipf ids (duplicates within and across ranks) over a key range that grows (new keys)."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = (rng.zipf(1.2, size=(GLOBAL_BATCH, TABLES)) % (40 + 15 * step)).astype(np.int64)
        ids = ids * 7 + np.arange(TABLES) * 100_000 + 1
        grad = rng.standard_normal((GLOBAL_BATCH, TABLES, DIM)).astype(np.float32)
        yield ids, grad


def make_embedding(kind, folder, launch, exchange_dtype, comm=None):
    tables = [oe.make_table_options(oe.make_uniform_initializer(-0.1, 0.1)),
              oe.make_table_options(oe.make_normal_initializer(0.0, 0.05)),
              oe.make_table_options(oe.make_uniform_initializer(-0.2, 0.2))]
    if kind == "device_mem":
        store = oe.make_device_mem_store_options(folder, capacity=4000, size_factor=2)
    else:
        store = oe.make_cached_host_mem_store_options(0.001, folder, capacity=4000, size_factor=2)
    return oe.MultiTableEmbedding("t", DIM, np.float32, np.int64, tables, store, seed=5,
                                  device=launch, exchange_dtype=exchange_dtype, comm=comm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--emulation")
    where.add_argument("--cuda", action="store_true")
    ap.add_argument("--store", default="device_mem")
    ap.add_argument("--exchange-dtype", default="fp32")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--nccl", action="store_true")
    args = ap.parse_args()
    comm = default_comm()
    launch = _launcher(comm, args)
    device_comm = NcclComm(comm) if args.nccl else None
    base = Path(args.out).parent / f"rank{comm.rank}"
    cpu = make_embedding(args.store, str(base / "cpu"), None, args.exchange_dtype)
    dev = make_embedding(args.store, str(base / "device"), launch, args.exchange_dtype,
                         device_comm)
    optimizers = [oe.Optimizer(oe.optim.Adagrad(lr=0.05), embeddings=[e]) for e in (cpu, dev)]
    local = GLOBAL_BATCH // comm.world
    block = slice(comm.rank * local, (comm.rank + 1) * local)
    same_rows, reads = [], []
    for ids, grad in global_batches(args.steps):
        ids, grad = ids[block], grad[block]
        want = cpu(ids)
        cpu.backward(grad)
        optimizers[0].step()
        optimizers[0].zero_grad()
        checks = host_sync.DeferredChecks()   # the trainer's way: checks read at its metrics
        with host_sync.counting() as counted, host_sync.deferring(checks):
            got = dev(ids)
            dev.backward(dev.xp.asarray(grad))
            optimizers[1].step()
            optimizers[1].zero_grad()
        checks.read(dev.xp)
        reads.append(dict(counted.by_reason))
        got = got.get() if hasattr(got, "get") else got
        same_rows.append(bool(np.array_equal(np.asarray(got).view(np.uint32),
                                             want.view(np.uint32))))
    (ck, cl), (dk, dl) = cpu.export(), [a.get() if hasattr(a, "get") else a
                                        for a in dev.export()]
    oc, od = np.argsort(ck), np.argsort(dk)
    same_table = ck.shape == dk.shape and bool(np.array_equal(ck[oc], dk[od])) and \
        bool(np.array_equal(np.asarray(cl)[oc].view(np.uint32), np.asarray(dl)[od].view(np.uint32)))
    flags = comm.allgather(np.array([[all(same_rows), same_table]]))
    per_rank_reads = [json.loads(s) for s in _gather_strings(comm, json.dumps(reads))]
    if comm.rank == 0:
        report = {"world": comm.world, "rows_identical": bool(flags[:, 0].all()),
                  "tables_identical": bool(flags[:, 1].all()), "keys": int(ck.shape[0]),
                  "reads": per_rank_reads}
        Path(args.out).write_text(json.dumps(report))
    cpu.close()
    dev.close()


def _launcher(comm, args):
    """The device: CuPy's launcher (--cuda), or the emulator's, built once by rank 0."""
    from one_embedding.kernels import cuda_module as cm
    from one_embedding.kernels import device_ops

    if args.cuda:
        if os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1":   # the GPU test's dry run
            import gpu_dry_run

            folder = Path(args.out).parent / "emulation"
            if comm.rank == 0:
                gpu_dry_run.install(folder)
            comm.barrier()
            if comm.rank != 0:
                gpu_dry_run.install(folder)
        import cupy

        cupy.cuda.Device(local_gpu(comm)).use()
        return device_ops.cupy_launcher()
    from cuda_emulation import EmulatedLauncher, build

    if comm.rank == 0:
        build(cm.EMBEDDING_FAMILIES, Path(args.emulation))
    comm.barrier()
    return EmulatedLauncher(build(cm.EMBEDDING_FAMILIES, Path(args.emulation)),
                            cm.EMBEDDING_FAMILIES)


def _gather_strings(comm, text: str) -> list:
    """Each rank's ``text``, in rank order, on every rank (as bytes through allgather)."""
    data = np.frombuffer(text.encode(), np.uint8)
    lengths = comm.allgather(np.array([data.shape[0]], np.int64))
    joined = comm.allgather(data)
    out, at = [], 0
    for n in lengths:
        out.append(joined[at:at + int(n)].tobytes().decode())
        at += int(n)
    return out


if __name__ == "__main__":
    main()
