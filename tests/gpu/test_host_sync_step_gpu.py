"""Issue 30 item 2: a steady-state training step on the device path reads nothing back from the
device; the trainer reads its losses (and flags) once every ``--log-interval`` steps.

Runs on a GPU with CuPy, and on the CPU dry run of the device path (``-p gpu_dry_run``, numpy
standing in for CuPy), where ``host_sync`` counts the reads a GPU run would make.
"""
from __future__ import annotations

import os

import pytest

from one_embedding import host_sync
from one_embedding.backend import cupy_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

DRY = bool(os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN"))


def _reads(tmp_path, steps: int):
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(steps=steps, batch_size=256 if DRY else 8192, synthetic_rows=50_000,
                      embedding_dim=16, store="device_mem", cache_mb=1.0, optimizer="adagrad",
                      eval_batches=1, device="cuda", prefetch_depth=2, log_interval=10,
                      persistent_path=str(tmp_path / f"run{steps}"))
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    with host_sync.counting() as reads:
        trainer.run()
    return reads.by_reason


@pytest.mark.xfail(strict=True, reason=(
    "issue 30 item 2 is not finished: measured 4.10 counted host reads per steady-state step on "
    "the dry run (the checks, the optimizer's zero-gradient test and the refresh patch now stay "
    "on the device, new rows are initialised by one masked kernel; left: the device_mem "
    "bottom layer's four sizes: unique count, missing count, new row count, new key count); "
    "goal <= 1"))
def test_a_steady_state_step_reads_at_most_once(tmp_path):
    """The reads of a 30-step run minus those of a 10-step run (same start-up, same end) are
    the 20 steady-state steps' reads: at most one per step on average (the loss read every 10
    steps counts once per 10 steps)."""
    short, long = _reads(tmp_path, 10), _reads(tmp_path, 30)
    steady = long.copy()
    steady.subtract(short)
    per_step = sum(steady.values()) / 20
    breakdown = {k: v for k, v in sorted(steady.items()) if v}
    print(f"host reads per steady-state step: {per_step:.2f}; by reason over 20 steps: "
          f"{breakdown}")
    assert per_step <= 1.0, (f"{per_step:.2f} host reads per steady-state step (at most 1); "
                             f"by reason over 20 steps: {breakdown}")
