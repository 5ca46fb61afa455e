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


def _reads(tmp_path, steps: int, main_thread: bool = False):
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(steps=steps, batch_size=256 if DRY else 8192, synthetic_rows=50_000,
                      embedding_dim=16, store="device_mem", cache_mb=1.0, optimizer="adagrad",
                      eval_batches=1, device="cuda", prefetch_depth=2, log_interval=10,
                      persistent_path=str(tmp_path / f"run{steps}"))
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    with host_sync.counting() as reads:
        trainer.run()
    return reads.main_thread if main_thread else reads.by_reason


def _steady(tmp_path, main_thread: bool = False):
    """(reads per steady-state step, their breakdown over 20 steps): a 30-step run's reads minus
    a 10-step run's (same start-up, same end)."""
    short = _reads(tmp_path / "short", 10, main_thread)
    steady = _reads(tmp_path / "long", 30, main_thread)
    steady.subtract(short)
    return sum(steady.values()) / 20, {k: v for k, v in sorted(steady.items()) if v}


def test_a_steady_state_step_reads_at_most_once(tmp_path):
    """At most one read per steady-state step on average, by any thread (the loss read every 10
    steps counts once per 10 steps): the prefetch thread's dedup keeps its unique count on the
    device (fixed-capacity arrays, ``device_unique.unique_ids_fixed``) and reads nothing."""
    per_step, breakdown = _steady(tmp_path)
    print(f"host reads per steady-state step: {per_step:.2f}; by reason over 20 steps: "
          f"{breakdown}")
    assert per_step <= 1.0, (f"{per_step:.2f} host reads per steady-state step (at most 1); "
                             f"by reason over 20 steps: {breakdown}")


def test_the_steps_own_thread_reads_only_the_losses(tmp_path):
    """The thread that runs the steps reads the device once every --log-interval (10) steps:
    the losses with the deferred checks' flags."""
    per_step, breakdown = _steady(tmp_path, main_thread=True)
    print(f"main-thread host reads per steady-state step: {per_step:.2f}; over 20 steps: "
          f"{breakdown}")
    assert breakdown == {"losses": 2}, breakdown


def _hidden(tmp_path, steps: int):
    import hidden_syncs
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    with hidden_syncs.strict() as seen:
        cfg = TrainConfig(steps=steps, batch_size=256, synthetic_rows=50_000, embedding_dim=16,
                          store="device_mem", cache_mb=1.0, optimizer="adagrad", eval_batches=1,
                          device="cuda", prefetch_depth=2, log_interval=10,
                          persistent_path=str(tmp_path / f"run{steps}"))
        Trainer(cfg, metrics_path=os.devnull, progress=False).run()
    return seen


@pytest.mark.skipif(not DRY, reason="the dry run's strict arrays see CuPy's implicit reads; "
                                    "on a GPU the counted reads above are what can be seen")
def test_a_steady_state_step_makes_no_hidden_read(tmp_path):
    """No implicit device read (bool() of a device value, boolean-mask indexing, CuPy's
    nonzero / unique / bincount, ...) in a steady-state step: each would stall the host like a
    counted read, uncounted (tests/hidden_syncs.py)."""
    steady = _hidden(tmp_path / "long", 30)
    steady.subtract(_hidden(tmp_path / "short", 10))
    per_step = {k: v / 20 for k, v in sorted(steady.items()) if v > 0}
    assert not per_step, f"hidden reads per steady-state step: {per_step}"


@pytest.mark.skipif(not DRY, reason="checks the dry run's strict arrays themselves")
def test_strict_arrays_record_what_cupy_reads_and_nothing_else():
    """The strict arrays see CuPy's implicit reads (so the test above can fail) and nothing
    that stays on the device: arithmetic, reductions, integer indexing, searchsorted."""
    import cupy
    import hidden_syncs

    with hidden_syncs.strict() as seen:
        a = cupy.arange(10, dtype=cupy.int64)
        b = (a * 2 + 1).sum()                        # stays a 0-d device array
        c = a[cupy.argmax(a)] + a[3] + cupy.searchsorted(a, a[::2])
        host_sync.scalar(b, "test")                  # counted by host_sync, not hidden
    assert not seen, seen
    assert type(b).__name__ == "DeviceArray" and b.ndim == 0 and c.shape == (5,)
    with hidden_syncs.strict() as seen:
        a = cupy.arange(10, dtype=cupy.int64)
        if a.any():
            pass
        a[a > 4]
        a[a > 4] = 0
        cupy.bincount(a, minlength=12)
        cupy.nonzero(a)
        int(a.max())
    kinds = sorted(k.split(" at ")[0] for k in seen)
    assert kinds == ["bincount()", "bool()", "boolean-mask assignment", "boolean-mask indexing",
                     "int()", "nonzero()"], kinds


def _cached_reads(tmp_path, steps: int, main_thread: bool):
    """``_reads`` of a cached_host_mem run whose device cache holds a fraction of the rows, so
    that every step misses and evicts."""
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(steps=steps, batch_size=256 if DRY else 8192, synthetic_rows=50_000,
                      embedding_dim=16, store="cached_host_mem", cache_mb=0.05 if DRY else 2.0,
                      optimizer="adagrad", eval_batches=1, device="cuda", prefetch_depth=2,
                      log_interval=10, persistent_path=str(tmp_path / f"run{steps}"))
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    with host_sync.counting() as reads:
        trainer.run()
    return reads.main_thread if main_thread else reads.by_reason


def test_a_cached_step_reads_the_crossing_counts_and_copies_once_each(tmp_path):
    """cached_host_mem (a device cache over the host store), prefetch 2: a steady-state step
    reads the dedup's unique count, the lookup's misses with the last put's evictions (one
    read), and waits once for the evicted lines and the miss keys copied to the host together:
    3 reads a step besides the losses, all on the prefetch thread; the steps' own thread reads
    the losses alone."""
    every, main = {}, {}
    for which, out in ((False, every), (True, main)):
        short = _cached_reads(tmp_path / f"short{which}", 10, which)
        steady = _cached_reads(tmp_path / f"long{which}", 30, which)
        steady.subtract(short)
        out.update({k: v for k, v in sorted(steady.items()) if v})
    print(f"cached_host_mem, reads over 20 steady-state steps: {every}; main thread: {main}")
    assert sum(v for k, v in every.items() if k != "losses") <= 3 * 20, every
    if DRY:
        # on a GPU a put may now and then follow a put with no lookup between (the prefetch
        # thread's timing), and then settles the first one's evictions itself
        assert main == {"losses": 2}, main
        assert every == {"losses": 2, "dedup: unique count": 20,
                         "miss keys and evictions to host tier": 20,
                         "evicted lines and miss keys to host tier": 20}, every
