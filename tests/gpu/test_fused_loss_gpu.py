"""Issue 32 item 2: on the device path the training step runs the loss fused with the last
layer's backward (one ``dense_ops.bce_last_layer`` launch per step in place of the loss, its
gradient and the last layer's backward), trains as the unfused step does, and reads nothing more
from the device.

Runs on a GPU with CuPy, and on the CPU dry run of the device path (``-p gpu_dry_run``: numpy
for CuPy, the fused kernel on the emulator, ``host_sync`` counting the reads a GPU run would
make). The unfused run is the same Trainer with ``fused=False`` forced.
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
STEPS = 8


def _run(tmp_path, monkeypatch, model: str, amp: str, fused: bool, store: str = "device_mem",
         prefetch_depth: int = 2):
    """-> (the step losses, the fused kernel's calls, the main thread's reads by reason). Every
    step runs uncaptured (``cuda_graph=False``): a replayed CUDA graph relaunches the kernel
    without calling Python, so the calls would not count the steps (an H200 run: 3 of 8); the
    graph's replays are checked against uncaptured steps in test_cuda_graph_gpu.py."""
    from one_embedding.config import TrainConfig
    from one_embedding.kernels import dense_ops
    from one_embedding.models.base import CTRModel
    from one_embedding.training import Trainer

    calls = []
    real_kernel = dense_ops.bce_last_layer
    real_method = CTRModel.loss_and_backward_to_embeddings

    def counted(*args, **kwargs):
        calls.append(1)
        return real_kernel(*args, **kwargs)

    def forced(self, logits, labels, **kwargs):
        return real_method(self, logits, labels, **{**kwargs, "fused": False})

    monkeypatch.setattr(dense_ops, "bce_last_layer", counted)
    if not fused:
        monkeypatch.setattr(CTRModel, "loss_and_backward_to_embeddings", forced)
    cfg = TrainConfig(model=model, amp=amp, steps=STEPS, batch_size=128 if DRY else 8192,
                      synthetic_rows=20_000, embedding_dim=8, bottom_mlp=(16, 8),
                      top_mlp=(16, 1), dnn=(32, 16), store=store, cache_mb=0.05,
                      optimizer="adagrad", eval_batches=1, device="cuda",
                      prefetch_depth=prefetch_depth, log_interval=4, cuda_graph=False,
                      persistent_path=str(tmp_path / "-".join(
                          map(str, (model, amp, fused, store, prefetch_depth)))))
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    losses, step = [], trainer.train_step

    def recorded(batch, state=None):
        losses.append(step(batch, state))
        return losses[-1]

    trainer.train_step = recorded
    with host_sync.counting() as reads:
        trainer.run()
    monkeypatch.undo()
    return [float(x) for x in losses], len(calls), dict(reads.main_thread)


@pytest.mark.parametrize("model, amp", [("dlrm", "off"), ("dcn", "off"), ("deepfm", "off"),
                                        ("dlrm", "fp16")])
def test_the_step_fuses_the_loss_trains_alike_and_reads_no_more(tmp_path, monkeypatch, model,
                                                                  amp):
    unfused, unfused_calls, unfused_reads = _run(tmp_path, monkeypatch, model, amp, fused=False)
    fused, fused_calls, fused_reads = _run(tmp_path, monkeypatch, model, amp, fused=True)
    assert unfused_calls == 0 and fused_calls == STEPS  # one fused launch per step
    assert len(fused) == len(unfused) == STEPS
    # the dry run measured at most 1.8e-7 relative apart (DCN; the kernel's batch sums and expf /
    # log1p against the unfused passes'; fp16's loss scale is a power of two: one multiply)
    assert fused == pytest.approx(unfused, rel=1e-5)
    assert fused_reads == unfused_reads, (fused_reads, unfused_reads)


def test_fused_runs_are_bit_identical_across_stores_and_prefetch_depths(tmp_path, monkeypatch):
    """DESIGN.md's invariant on the fused path: the kernel's batch sums have a fixed order (no
    atomics), so the store and the prefetch depth change no bit of the losses."""
    first, calls, _ = _run(tmp_path, monkeypatch, "dcn", "off", True)
    other, _, _ = _run(tmp_path, monkeypatch, "dcn", "off", True, store="cached_host_mem",
                       prefetch_depth=0)
    assert calls == STEPS and other == first
