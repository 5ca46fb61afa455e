"""``--device cuda`` end to end, run on the host: the Trainer with the GPU switched on, where CuPy
is replaced by numpy and the GPU by the kernel emulator (tests/cuda_emulation.py). The embedding
then takes the whole device path (device tiers, chain crossings, device kernels, prefetch with
events) while the dense model runs on numpy, and the run logs exactly the CPU run's losses and
metrics for every store preset.
"""
from __future__ import annotations


import numpy as np
import pytest

from one_embedding import training
from one_embedding.config import TrainConfig
from one_embedding.kernels import device_ops



def _run(cfg: TrainConfig, losses: list) -> dict:
    trainer = training.Trainer(cfg, metrics_path="/dev/null", progress=False)
    step = trainer.train_step

    def counted(batch, state=None):
        loss = step(batch, state)
        losses.append(loss)
        return loss

    trainer.train_step = counted
    return trainer.run()


@pytest.mark.parametrize("store", ["device_mem", "cached_host_mem", "cached_ssd"])
def test_train_device_cuda_logs_the_cpu_run(launch, monkeypatch, tmp_path, store):
    common = dict(steps=12, batch_size=256, synthetic_rows=20_000, synthetic_scale=0.002,
                  embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1), store=store,
                  cache_mb=0.05, optimizer="adagrad", eval_batches=2, prefetch_depth=2)
    cpu_losses, dev_losses = [], []
    cpu = _run(TrainConfig(**common, persistent_path=str(tmp_path / "cpu")), cpu_losses)
    # "cuda" on this machine: numpy for CuPy, the emulator for the GPU
    monkeypatch.setattr(training, "device_namespace", lambda device: np)
    real = device_ops.device_launcher
    monkeypatch.setattr(device_ops, "device_launcher",
                        lambda device: launch if device == "cuda" else real(device))
    dev = _run(TrainConfig(**common, persistent_path=str(tmp_path / "dev"), device="cuda"),
               dev_losses)
    assert dev_losses == cpu_losses
    # (hit rates are left out: with prefetch they depend on when a lookup ran, on any device)
    for key in ("auc", "logloss", "rows_stored", "loss_first_10pct", "loss_last_10pct"):
        assert dev[key] == cpu[key], key
    top = dev["store_stats"][0]
    assert top["tier"].startswith("device.") and "h2d_bytes" in top
    # one rank, fp32 exchange: each key's gradient rows are summed inside the row update
    assert "embedding_init_missing" in launch.launched
    assert "optim_summed_adagrad" in launch.launched
