"""The device path keeps CUDA stream order: no buffer is freed while another stream may still
use it, and no stream reads or overwrites another's data without an event between them.

Dry run only (``-p gpu_dry_run``; ``tests/system/test_stream_order_dry_run.py`` runs this file
in the default suite): ``tests/stream_order.py`` keeps a vector clock per stream and checks
every device array access of the training step, its prefetch thread and the device data against
it. The two races of this kind that the H200 found on 2026-11-27 (the write log's entries and
the prefetched batches, both freed while the consumer's stream still read them) are put back
by hand below, and the checker must find each. On a GPU, compute-sanitizer's racecheck does
not see these (they are races between streams of the host's making, not within a kernel).
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from one_embedding.backend import cupy_available

DRY = bool(os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
    pytest.mark.skipif(not DRY, reason="the dry run's stream model: on a GPU the streams are real"),
]


def _kinds(hazards) -> list:
    return sorted({h.split(":")[0] for h in hazards})


def _made_on_a_side_stream(cupy):
    """(the side stream, an array it made, the main stream waiting for it)."""
    prefetch = cupy.cuda.Stream(non_blocking=True)
    with prefetch:
        a = cupy.arange(64, dtype=cupy.float32)
        ready = prefetch.record()
    main = cupy.cuda.get_current_stream()
    main.wait_event(ready)
    return prefetch, a, main


def test_a_buffer_freed_before_the_other_streams_read_ran_is_a_use_after_free():
    import cupy
    import stream_order

    with stream_order.checked(max_lag=0) as hazards:
        prefetch, a, main = _made_on_a_side_stream(cupy)
        b = a * 2                      # read on the main stream, ordered after the write
        assert not hazards, hazards
        del a
        gc.collect()
        with prefetch:
            cupy.zeros(8)              # may take a's memory while the main stream reads it
    assert _kinds(hazards) == ["use after free"], hazards
    (text,) = hazards
    assert "test_stream_order_gpu.py" in text and "allocated again" in text
    assert float(b.sum()) == 2 * sum(range(64))


@pytest.mark.parametrize("how", ["host waits for the reader", "allocator waits for the reader",
                                 "event polled until done"])
def test_a_buffer_freed_after_its_readers_are_known_to_have_run_is_safe(how):
    import cupy
    import stream_order

    with stream_order.checked(max_lag=2, seed=5) as hazards:
        prefetch, a, main = _made_on_a_side_stream(cupy)
        b = a + 1
        read = main.record()
        if how == "host waits for the reader":
            read.synchronize()
        elif how == "allocator waits for the reader":
            prefetch.wait_event(read)
        else:
            polls = 1
            while not read.done:
                polls += 1
            assert polls <= 3
        del a
        gc.collect()
        with prefetch:
            cupy.zeros(8)
    assert not hazards, hazards
    assert stream_order.checked.last.seen["frees"] >= 1 and b.shape == (64,)


def test_reads_and_writes_across_streams_without_an_event_are_unordered():
    import cupy
    import stream_order

    with stream_order.checked() as hazards:
        side = cupy.cuda.Stream(non_blocking=True)
        a = cupy.zeros(16, dtype=cupy.float32)        # written (allocated) on the main stream
        with side:
            a[3] = 1.0                                # a write on side, no wait on main
        a.sum()                                       # and main reads it, no wait on side
    text = "\n".join(hazards)
    assert _kinds(hazards) == ["unordered"], hazards
    assert "a write on stream" in text and "after a write on the null stream" in text
    assert "a read on the null stream" in text
    # with the events, the same accesses are ordered
    with stream_order.checked() as hazards:
        side = cupy.cuda.Stream(non_blocking=True)
        a = cupy.zeros(16, dtype=cupy.float32)
        side.wait_event(cupy.cuda.get_current_stream().record())
        with side:
            a[3] = 1.0
            done = side.record()
        cupy.cuda.get_current_stream().wait_event(done)
        a.sum()
    assert not hazards, hazards


def _uploaded(cupy, launcher):
    """(a page-locked buffer of ones, its upload on a side stream, the upload's event)."""
    staging = launcher.host_empty((8,), np.float32)
    staging[...] = 1.0
    with cupy.cuda.Stream(non_blocking=True):
        up = launcher.to_device(staging)
        return staging, up, launcher.record()


def test_the_host_must_know_an_asynchronous_copy_ran_before_it_touches_its_buffer():
    """Page-locked buffers: the host overwrites one an upload may still read, or reads one a
    download may not have filled, only after an event says the copy ran."""
    import cupy
    import stream_order

    from one_embedding.kernels import device_ops

    launcher = device_ops.cupy_launcher()
    with stream_order.checked(max_lag=0) as hazards:
        staging, up, _ = _uploaded(cupy, launcher)
        staging[...] = 2.0                            # the upload may still read it
        back = launcher.host_empty((8,), np.float32)
        launcher.to_host_async(up, back)              # on the null stream: no wait on the upload
        float(back.sum())                             # nor has the download been waited for
    text = "\n".join(hazards)
    assert _kinds(hazards) == ["unordered"], hazards
    assert "a write on the host" in text and "after a read on stream" in text
    assert "a read on the host" in text and "after a write on the null stream" in text
    assert "a read on the null stream" in text      # the download read up before its upload
    with stream_order.checked(max_lag=0) as hazards:
        staging, up, uploaded = _uploaded(cupy, launcher)
        launcher.synchronize(uploaded)
        staging[...] = 2.0
        back = launcher.host_empty((8,), np.float32)
        launcher.wait(uploaded)
        launcher.to_host_async(up, back)
        downloaded = launcher.record()
        assert launcher.done(downloaded)
        assert float(back.sum()) == 8.0
    assert not hazards, hazards


def test_kernel_launches_write_their_non_const_arguments():
    """A kernel's non-const pointers are writes, its const ones reads (parsed from the .cu):
    a gather on a side stream into an array the main stream made, with no event, is unordered;
    reading the same source from two streams is not."""
    import cupy
    import stream_order

    from one_embedding.kernels import device_ops

    launcher = device_ops.cupy_launcher()
    with stream_order.checked() as hazards:
        rows = cupy.arange(40, dtype=cupy.float32).reshape(10, 4)
        index = cupy.asarray(np.array([3, 1, 3], np.int64))
        made = cupy.cuda.get_current_stream().record()
        with cupy.cuda.Stream(non_blocking=True) as side:
            side.wait_event(made)
            out = device_ops.gather_rows(rows, index, launcher)
        rows.sum()                                  # a second reader: fine
        assert not hazards, hazards
        rows[0] = 1.0                               # main overwrites what side read: unordered
    assert _kinds(hazards) == ["unordered"] and "after a read on stream" in "".join(hazards)
    assert out.shape == (3, 4)
    assert stream_order.checked.last.seen["accesses"] >= 4


#: the GPU's pace, as the checker draws it: "fast", every event done when first asked; "slow",
#: each answers "not yet" up to 5 times. Which races show depends on it: a slow GPU keeps a freed
#: batch's readers unknown for longer, but also sends the prefetch thread to a blocking read,
#: after which the host knows everything before it (so the write log's race shows when fast)
PACE = {"fast": 0, "slow": 5}


def _train(tmp_path, store: str, depth: int, steps: int = 12, log_interval: int = 12,
           **kwargs):
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(steps=steps, batch_size=128, synthetic_rows=20_000, embedding_dim=8,
                      store=store, cache_mb=0.05, optimizer="adagrad", eval_batches=2,
                      device="cuda", prefetch_depth=depth, log_interval=log_interval,
                      snapshot_interval=5, persistent_path=str(tmp_path / f"{store}{depth}"),
                      **kwargs)
    return Trainer(cfg, metrics_path=os.devnull, progress=False).run()


def _parquet(tmp_path, rows: int = 600) -> str:
    """A Parquet file of ``rows`` rows (600: 5 batches of 128, so 12 steps make 3 passes)."""
    from one_embedding.data import SyntheticCriteo
    from one_embedding.data.parquet import write_parquet

    path = tmp_path / "rows.parquet"
    write_parquet(str(path), [SyntheticCriteo("kaggle", scale=0.001, seed=3,
                                              num_rows=rows).batch(rows, 0)])
    return str(path)


@pytest.mark.parametrize("store,depth,source,amp,pace", [
    ("device_mem", 1, "synthetic", "off", "fast"), ("device_mem", 2, "synthetic", "off", "fast"),
    ("device_mem", 2, "synthetic", "off", "slow"), ("cached_host_mem", 2, "synthetic", "bf16", "slow"),
    ("cached_host_mem", 1, "parquet", "off", "fast")])
def test_training_on_the_device_path_keeps_stream_order(tmp_path, store, depth, source, amp, pace):
    """A training run with the prefetch thread on its own stream, the device data (synthetic
    rows generated there, or Parquet batches staged through page-locked buffers on a stream of
    their own), CUDA graphs, snapshots and the evaluation: no race between streams, and the
    checker saw the streams at work and the events between them."""
    import stream_order

    data = ("synthetic",) if source == "synthetic" else (_parquet(tmp_path),)
    with stream_order.checked(seed=depth, max_lag=PACE[pace]) as hazards:
        record = _train(tmp_path, store, depth, data=data, amp=amp, log_interval=4 * depth)
    assert not hazards, "\n".join(hazards)
    model = stream_order.checked.last
    threads = {n.split("thread ")[-1].rstrip(")") for n in model.names.values() if "thread" in n}
    want = {"one_embedding-prefetch"} | ({"one_embedding-device-batches"} if source == "parquet"
                                         else set())
    assert want <= threads, model.names
    assert model.seen["waits"] > 10 and model.seen["accesses"] > 1000 and model.seen["frees"] > 100
    assert record["steps"] == 12


def test_the_checker_finds_the_prefetched_batch_freed_too_early(tmp_path, monkeypatch):
    """The race of 2026-11-27 (run 2): the Prefetcher let go of a yielded batch, whose arrays
    the device data makes on the prefetch stream, before its step had run."""
    import stream_order

    from one_embedding import pipeline

    def retire_state_only(self, item):
        batch, state = item
        if self._launch is not None:
            self._in_use.hold(state, self._launch.record())

    monkeypatch.setattr(pipeline.Prefetcher, "_retire", retire_state_only)
    with stream_order.checked(seed=1, max_lag=PACE["slow"]) as hazards:
        _train(tmp_path, "device_mem", 2)
    frees = [h for h in hazards if h.startswith("use after free")]
    assert frees, "\n".join(hazards) or "no hazard found"
    assert any("data/device.py" in h for h in frees), "\n".join(frees)


def test_the_checker_finds_the_write_log_entry_freed_too_early(tmp_path, monkeypatch):
    """The race of 2026-11-27 (run 1): the write log dropped an entry (the prefetch thread's
    unique keys) while a ``refresh`` patch queued on the consumer's stream still read it."""
    import stream_order

    from one_embedding import write_log

    monkeypatch.setattr(write_log.RetiredEntries, "retire", lambda self, entries: None)
    with stream_order.checked(seed=1, max_lag=PACE["fast"]) as hazards:
        _train(tmp_path, "device_mem", 2, log_interval=4)
    frees = [h for h in hazards if h.startswith("use after free")]
    assert frees, "\n".join(hazards) or "no hazard found"
    assert any("write_log.py" in h for h in frees), "\n".join(frees)


def test_the_checker_finds_a_staging_buffer_overwritten_under_its_upload(tmp_path, monkeypatch):
    """DeviceBatches fills a page-locked buffer set only once that set's last upload has run
    (``launcher.synchronize`` of its event); without that wait the host overwrites a buffer a
    queued upload may still read."""
    import stream_order

    from one_embedding.data import device as device_data

    monkeypatch.setattr(device_data.DeviceBatches, "_staging", _staging_without_the_wait)
    with stream_order.checked(seed=1, max_lag=PACE["slow"]) as hazards:
        _train(tmp_path, "cached_host_mem", 1, data=(_parquet(tmp_path, 3000),))
    assert any(h.startswith("unordered: a write on the host at one_embedding/data/device.py")
               and "after a read on stream" in h for h in hazards), "\n".join(hazards)


def _staging_without_the_wait(self, batch, ring, slot):
    bufs = ring[slot]
    shapes = [(a.shape, a.dtype) for a in (batch.dense, batch.ids, batch.labels)]
    if bufs is None or [(b.shape, b.dtype) for b in bufs[:3]] != shapes:
        bufs = [self.launcher.host_empty(s, d) for s, d in shapes] + [None]
    for buf, a in zip(bufs, (batch.dense, batch.ids, batch.labels)):
        np.copyto(buf, a)
    ring[slot] = bufs
    return bufs


@pytest.mark.parametrize("held", [True, False])
def test_a_puts_evictions_taken_on_another_stream_stay_held_until_read(tmp_path, monkeypatch, held):
    """A put leaves its cache's evictions on the device (made on the put's stream); the next
    lookup takes them on its own stream (the prefetch thread's) and lets go of them while its
    reads are queued. The chain holds them until that stream has passed them; without the hold
    the put's stream allocates their memory again under the reads (the race the checker found
    on 2026-12-07 at the slow pace, 2 runs in 5)."""
    import cupy
    import stream_order

    import one_embedding as oe
    from one_embedding.kernels import device_ops

    if not held:
        monkeypatch.setattr(device_ops.HeldUntil, "hold", lambda self, obj, event: None)
    line = 8
    store = oe.make_cached_host_mem_store_options(16 * 4 * line / 2**20, str(tmp_path), 1000,
                                                  size_factor=1)
    with stream_order.checked(max_lag=0) as hazards:
        emb = oe.MultiTableEmbedding("t", line, np.float32, np.int64,
                                     [oe.make_table_options(oe.make_normal_initializer(0, 0.1))],
                                     store, device="cuda")
        chain = emb._shard._chain
        keys = cupy.arange(1, 201, dtype=cupy.uint64)
        chain.put(keys, cupy.ones((200, line), dtype=cupy.float32))   # 200 lines, room for 16
        assert chain._pending is not None
        with chain.launch.stream():                                    # the lookup's stream
            chain.launch.wait(chain._last_event)   # ordered after the put, as every call is
            count = device_ops.count_true(chain.xp, chain._pending[3], "test: evictions")
            down = chain._take_pending(count)
        assert count > 0 and down[1].shape == (count,)
        del down
        gc.collect()
        cupy.zeros(4 * 200 * line)                 # the put's stream allocates again
        emb.close()
    if held:
        assert not hazards, "\n".join(hazards)
    else:
        frees = [h for h in hazards if h.startswith("use after free")]
        assert any("insert_pending" in h for h in frees), "\n".join(hazards) or "no hazard found"
