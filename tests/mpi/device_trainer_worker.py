"""Run under ``mpiexec -n P``: the trainer's device path (``TrainConfig(device="cuda")``) over P
ranks, its host reads counted (``host_sync``) per reason, for all threads and for the thread that
runs the steps, over a 10-step and a 30-step run (the same start-up and end: their difference is
20 steady-state steps). Rank 0 writes a JSON report.

    mpiexec -n 2 python tests/mpi/device_trainer_worker.py OUT.json [--dry-run] [--stream-order]

--dry-run: the CPU dry run of the device path (tests/gpu_dry_run.py: numpy standing in for CuPy,
the CUDA kernels on the host emulator, built in OUT's folder by rank 0 first); without it, CuPy
on the GPU (every rank on device 0 of a one-GPU machine, MPI staging the exchanges).
--stream-order (with --dry-run): instead, one 12-step run per rank inside
``stream_order.checked()`` (tests/stream_order.py); the report lists each rank's races between
its CUDA streams.
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the dry run

from device_ranks_worker import _gather_strings  # noqa: E402


def reads(cfg_args: dict, steps: int, folder: Path):
    """(reads by reason, the steps' thread's reads by reason) of a ``steps``-step run."""
    from one_embedding import host_sync
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(steps=steps, persistent_path=str(folder / f"run{steps}"), **cfg_args)
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    with host_sync.counting() as counted:
        trainer.run()
    return dict(counted.by_reason), dict(counted.main_thread)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--stream-order", action="store_true")
    args = ap.parse_args()
    from one_embedding.parallel.comm import default_comm

    comm = default_comm()
    folder = Path(args.out).parent
    if args.dry_run:
        import gpu_dry_run

        if comm.rank == 0:
            gpu_dry_run.install(folder / "emulation")
        comm.barrier()
        if comm.rank != 0:
            gpu_dry_run.install(folder / "emulation")
    dry = os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN") == "1"
    cfg_args = dict(batch_size=256 if dry else 8192, synthetic_rows=50_000, embedding_dim=16,
                    store="device_mem", cache_mb=1.0, optimizer="adagrad", eval_batches=1,
                    device="cuda", prefetch_depth=2, log_interval=10)
    base = folder / f"rank{comm.rank}"
    if args.stream_order:
        import stream_order

        with stream_order.checked(seed=comm.rank) as hazards:
            reads(cfg_args, 12, base)
        seen = dict(stream_order.checked.last.seen)
        ranks = [json.loads(s) for s in _gather_strings(
            comm, json.dumps({"hazards": dict(hazards), "seen": seen}))]
        if comm.rank == 0:
            Path(args.out).write_text(json.dumps({"world": comm.world, "ranks": ranks}))
        return
    short, short_main = reads(cfg_args, 10, base)
    long, long_main = reads(cfg_args, 30, base)
    steady = {k: long.get(k, 0) - short.get(k, 0) for k in set(long) | set(short)}
    steady_main = {k: long_main.get(k, 0) - short_main.get(k, 0)
                   for k in set(long_main) | set(short_main)}
    mine = {"steady": {k: v for k, v in sorted(steady.items()) if v},
            "steady_main": {k: v for k, v in sorted(steady_main.items()) if v}}
    ranks = [json.loads(s) for s in _gather_strings(comm, json.dumps(mine))]
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"world": comm.world, "ranks": ranks}))


if __name__ == "__main__":
    main()
