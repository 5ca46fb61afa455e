"""The training step at its smallest shapes, for the sanitizers: ``scripts/gpu_check.sh`` runs
this file first under compute-sanitizer's memcheck, racecheck, synccheck and initcheck (issue 30:
the step's kernels without hazards). A few steps of the CLI's trainer on device_mem: the dedup
and the store's find fused, the gather into the interaction's input, the dense step captured
as a CUDA graph and replayed, the fused gradient sum and row update. Small, because racecheck
instruments every shared-memory access of every kernel, cuBLAS's products included (at the
shapes of test_cuda_graph_gpu.py it finished no test in 271 s on an H200).

Runs on a GPU with CuPy, and on the CPU dry run of the device path (``-p gpu_dry_run``).
"""
from __future__ import annotations

import math
import os

import pytest

from one_embedding.backend import cupy_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_a_few_small_steps_replayed_as_a_graph(tmp_path, amp):
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(model="dlrm", steps=5, batch_size=64, synthetic_rows=2_000,
                      embedding_dim=8, store="device_mem", cache_mb=1.0, eval_batches=1,
                      device="cuda", amp=amp, log_interval=5, prefetch_depth=1,
                      bottom_mlp=(16, 8), top_mlp=(16, 1), optimizer="adagrad",
                      persistent_path=str(tmp_path / amp))
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    final = trainer.run()
    assert final["cuda_graph"] == "replaying", final["cuda_graph"]
    assert final["cuda_graph_replays"] == 5 - 3
    assert all(math.isfinite(x) for x in trainer.progress.losses)
    assert final["rows_stored"] > 0


@pytest.mark.skipif(not os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN"),
                    reason="the dry run's strict arrays see which CuPy functions a run calls")
def test_a_whole_small_run_calls_no_cupy_nonzero(tmp_path):
    """racecheck's one report over the run above on an H200 (2026-11-27) was inside CuPy's own
    nonzero kernel (``cupy_nonzero_kernel_incomplete_scan``, 65,536 hazards), called once per
    run: by the device index's ``items`` at the final snapshot. The device code compacts with
    ``device_ops.flatnonzero`` (a counted size read and a scatter) instead: no CuPy nonzero,
    flatnonzero or implicit read anywhere in a run, set-up, steps, evaluation and snapshot."""
    import hidden_syncs
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    with hidden_syncs.strict() as seen:
        cfg = TrainConfig(model="dlrm", steps=5, batch_size=64, synthetic_rows=2_000,
                          embedding_dim=8, store="device_mem", cache_mb=1.0, eval_batches=1,
                          device="cuda", log_interval=5, prefetch_depth=1, bottom_mlp=(16, 8),
                          top_mlp=(16, 1), optimizer="adagrad", persistent_path=str(tmp_path))
        Trainer(cfg, metrics_path=os.devnull, progress=False).run()
    assert not seen, dict(seen)
