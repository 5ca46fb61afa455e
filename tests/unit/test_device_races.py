"""The device path's suspected races and undefined corners (issue 24, item 4), each fixed and
pinned here on the host emulator of the CUDA kernels:

- a key given twice to the device hash index's ``find_or_insert`` gets one slot (the insert
  kernel claims one bucket per thread, so two copies of a key would take two);
- the int8 codec of a row holding NaN or inf is defined and the same on both backends (the warp
  max of a NaN depended on the lane order, and the float -> int8 cast of NaN is undefined);
- the tier chain's first call waits for an event recorded when its tiers were built, so a
  prefetch stream (which does not wait for the null stream) reads the tiers' buffers filled;
- the write log is written and read on the consumer's thread only; but on the fixed-capacity
  path (one rank over device_mem) its entries hold the prefetch thread's arrays, so an entry
  dropped from the log stays referenced until the reads queued on it have run (a race seen on
  an H200, 2026-11-27: prefetch depth 2 trained otherwise than depth 0).

The two kernel tests also run in the emulator's stress mode (seeds 1, 2, 3: threads racing
between barriers and blocks interleaved, so repeated keys really race for buckets).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from one_embedding import options as opt_mod
from one_embedding.cache.device import DeviceHashIndex
from one_embedding.chain import build_chain
from one_embedding.kernels import codec_ops, device_ops
from one_embedding.parallel import codec
from one_embedding.tiers import HashIndex


@pytest.mark.stress_seeds
def test_device_find_or_insert_gives_a_repeated_key_one_slot_as_the_cpu(launch):
    rng = np.random.default_rng(3)
    dev, cpu = DeviceHashIndex(0, launch=launch), HashIndex(0)
    pool = rng.integers(0, 2**64, 60, dtype=np.uint64, endpoint=False)
    for size in [1, 7, 50, 200, 400]:
        keys = rng.choice(pool, size)                 # repeats within the batch and across
        slots, is_new = dev.find_or_insert(keys)
        want_slots, want_new = cpu.find_or_insert(keys)
        np.testing.assert_array_equal(slots, want_slots)
        np.testing.assert_array_equal(is_new, want_new)
        assert len(dev) == len(cpu)
        stored, stored_slots = dev.items()
        assert len(set(stored.tolist())) == stored.shape[0] == len(dev)   # each key once
        np.testing.assert_array_equal(dev.find(keys), slots)
    assert len(dev) == len(cpu) == len(np.unique(cpu.items()[0]))
    # a batch of one key repeated: one new slot, new only at the first place
    key = np.full(5, 2**64 - 1, np.uint64)
    slots, is_new = dev.find_or_insert(key)
    assert slots.tolist() == [len(cpu)] * 5 and is_new.tolist() == [True] + [False] * 4


def _poisoned_rows(dtype):
    rows = np.arange(1, 1 + 6 * 40, dtype=np.float64).reshape(6, 40) / 7.0
    rows[1, 3] = np.nan
    rows[2, 39] = np.inf
    rows[3, 0] = -np.inf
    rows[4, :] = np.nan
    rows[5, 17] = np.nan
    rows[5, 18] = np.inf
    return rows.astype(dtype)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_int8_codec_of_nan_and_inf_rows_is_defined_and_equal_on_both_backends(launch, dtype):
    rows = _poisoned_rows(dtype)
    with np.errstate(invalid="raise"):          # no undefined float -> int8 cast on the host
        want = codec.encode(rows, "int8")
    payload = codec_ops.encode(rows, "int8", launch=launch)
    np.testing.assert_array_equal(payload, want)
    decoded = codec.decode(want, "int8", rows.shape[1])
    np.testing.assert_array_equal(codec_ops.decode(payload, "int8", rows.shape[1], launch=launch)
                                  .view(np.int32), decoded.view(np.int32))
    assert np.isnan(decoded[1:]).all()                      # a poisoned row: all NaN
    assert (want[1:, :40] == 0).all()                       # q = 0, no undefined cast
    scale = want[:, 40:].copy().view(np.float32)[:, 0]
    assert np.isnan(scale[1:]).all() and scale[0] == np.float32(rows[0].max())
    clean = codec.decode(codec.encode(rows[:1], "int8"), "int8", 40)
    np.testing.assert_array_equal(decoded[:1], clean)       # finite rows are unaffected


class _EventLauncher(device_ops.Launcher):
    """The host launcher with numbered events: records which event each wait was given, per
    thread, so the order the chain imposes between threads can be read back."""

    def __init__(self, base):
        self._base = base
        self.xp, self.block, self.n_sms = base.xp, base.block, base.n_sms
        self.events = 0
        self.waits: list[tuple[str, object]] = []

    def run(self, *args):
        return self._base.run(*args)

    def record(self):
        self.events += 1
        return self.events

    def wait(self, event):
        self.waits.append((threading.current_thread().name, event))


def test_device_chain_orders_its_first_call_after_its_construction(launch, tmp_path):
    recorder = _EventLauncher(launch)
    options = opt_mod.make_device_mem_store_options(persistent_path=str(tmp_path), capacity=1000,
                                                    size_factor=1)
    chain = build_chain(options, 4, 4, str(tmp_path), 1, launch=recorder)
    built = recorder.events
    assert built >= 1, "no event recorded when the chain was built"

    def prefetch():
        chain.lookup(np.arange(10, dtype=np.uint64))

    thread = threading.Thread(target=prefetch, name="prefetch")
    thread.start()
    thread.join()
    first = recorder.waits[0]
    assert first == ("prefetch", built), f"the first call waited on {first}, not event {built}"
    chain.close()


def _train_looking_ahead(emb, opt, batches, **prepare):
    """SGD steps over ``batches``, each next batch prepared on another thread ("lookahead")
    before this step's put, whatever the timing of a busy machine."""
    states = {0: emb.prepare(batches[0], **prepare)}
    for i in range(len(batches)):
        if i + 1 < len(batches):
            ahead = threading.Thread(target=lambda j=i + 1: states.__setitem__(
                j, emb.prepare(batches[j], **prepare)), name="lookahead")
            ahead.start()
            ahead.join()
        out = emb.embed(states.pop(i))
        emb.backward(np.ones(out.shape, np.float32))
        opt.step()
        opt.zero_grad()


def test_device_write_log_is_written_and_read_by_the_consumer_thread_only(launch, tmp_path,
                                                                           monkeypatch):
    """The write log's arrays are allocated by the puts of the optimizer step and read by the
    patch of ``refresh``, both on the consumer's thread (and so its stream), never on the
    prefetch thread's: CuPy's pool gives a freed block back only to the stream that allocated it,
    so dropping an entry of this (cached_host_mem) path cannot hand memory to the other stream
    while a read is queued. The fixed-capacity path logs the prefetch's own arrays: the next
    test. Prefetch depth 2 keeps lookups outstanding across puts, so the log is used."""
    import one_embedding.shard as shard_mod
    from one_embedding.pipeline import Prefetcher

    seen = {"put": set(), "patch": set(), "patched_lines": 0}
    real_patch, real_put = shard_mod._patch_on_device, shard_mod.EmbeddingShard._put

    def patch(xp, rows, newer, *launch):
        seen["patch"].add(threading.current_thread().name)
        seen["patched_lines"] += sum(k.shape[0] for k, *_ in newer)
        return real_patch(xp, rows, newer, *launch)

    def put(self, keys, lines, live=None):
        seen["put"].add(threading.current_thread().name)
        return real_put(self, keys, lines, live)

    monkeypatch.setattr(shard_mod, "_patch_on_device", patch)
    monkeypatch.setattr(shard_mod.EmbeddingShard, "_put", put)
    import one_embedding as oe

    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                                 opt_mod.make_cached_host_mem_store_options(0.01, str(tmp_path), 500),
                                 device=launch)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 40, (16, 3)).astype(np.int64) for _ in range(8)]
    for _, state in Prefetcher(batches, emb, depth=2, ids=lambda b: b):
        out = emb.embed(state)
        emb.backward(np.ones(out.shape, np.float32))
        opt.step()
        opt.zero_grad()
    # and, whatever the prefetch thread's timing on a busy machine, lookups that surely precede
    # a put: each next batch prepared on another thread before this step's put
    _train_looking_ahead(emb, opt, batches)
    emb.close()
    main = threading.current_thread().name
    assert seen["put"] == {main} and seen["patch"] == {main}, seen
    assert seen["patched_lines"] > 0, "the log was never used: the test would prove nothing"


class _PendingEvents(_EventLauncher):
    """``_EventLauncher`` whose events complete only when the test says (``complete``): the
    device still has every queued read ahead of it."""

    def __init__(self, base):
        super().__init__(base)
        self.completed = 0

    def done(self, event) -> bool:
        return event is None or event <= self.completed

    def complete(self) -> None:
        self.completed = self.events


def test_device_write_log_keeps_dropped_entries_until_their_queued_reads_ran(launch, tmp_path,
                                                                              monkeypatch):
    """One rank over device_mem takes the fixed-capacity path: its puts log the prefetch
    thread's own unique keys and count (allocated on the prefetch stream), not copies made on
    the consumer's. An entry dropped from the log while a ``refresh`` patch that reads it is
    still queued would give that memory back to the prefetch stream's pool, whose next batch
    could overwrite it before the patch ran (seen on an H200: depth 2 trained otherwise than
    depth 0). So a dropped entry stays referenced until the event recorded after the last
    queued patch has passed, and is let go of then."""
    import gc
    import weakref

    import one_embedding as oe
    import one_embedding.shard as shard_mod

    device = _PendingEvents(launch)
    logged = []
    real_put = shard_mod.EmbeddingShard._put

    def put(self, keys, lines, live=None):
        logged.append((weakref.ref(keys), live is not None))
        return real_put(self, keys, lines, live)

    monkeypatch.setattr(shard_mod.EmbeddingShard, "_put", put)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                                 opt_mod.make_device_mem_store_options(str(tmp_path), 1000),
                                 device=device)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 40, (16, 3)).astype(np.int64) for _ in range(8)]
    _train_looking_ahead(emb, opt, batches, background=True)
    shard = emb._owner()
    gc.collect()
    assert logged and all(fixed for _, fixed in logged), "the fixed-capacity path was not taken"
    in_log = {id(e[1]) for e in shard._log}
    dropped = [ref for ref, _ in logged[:-2] if ref() is not None and id(ref()) not in in_log]
    # every entry trimmed from the log is still referenced: its patch's event has not passed
    assert len(dropped) == len(logged) - 2 and len(shard._retired) > 0, \
        (len(dropped), len(logged), len(shard._retired))
    device.complete()
    shard._retired.collect()
    dropped = None
    gc.collect()
    gone = [ref() is None for ref, _ in logged[:-3]]
    assert all(gone), f"{gone.count(False)} dropped entries still held after their events ran"
    emb.close()


def test_a_prefetched_batch_stays_referenced_until_the_step_that_reads_it_ran(launch, tmp_path):
    """The prefetch thread iterates the batches, so a device data source generates each batch's
    arrays on the prefetch stream. Dropped by the consumer while its step's kernels were still
    queued, a batch's memory went back to that stream's pool and the next batch's dedup could
    overwrite its labels before the loss read them (an H200 run of the CLI: "step 22: labels[0]
    is 5.96e+35"). The Prefetcher keeps each yielded batch, with its state, until the event
    recorded after its step has passed."""
    import gc
    import weakref

    import one_embedding as oe
    from one_embedding.pipeline import Prefetcher

    device = _PendingEvents(launch)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                                 opt_mod.make_device_mem_store_options(str(tmp_path), 1000),
                                 device=device)
    rng = np.random.default_rng(2)
    labels = []

    def batches():
        for _ in range(6):
            batch = {"ids": rng.integers(0, 40, (16, 3)).astype(np.int64),
                     "labels": rng.integers(0, 2, 16).astype(np.float32)}
            labels.append(weakref.ref(batch["labels"]))
            yield batch

    alive = []
    with Prefetcher(batches(), emb, depth=2, ids=lambda b: b["ids"]) as prefetcher:
        for i, (batch, state) in enumerate(prefetcher):
            emb.embed(state)
            batch = state = None
            gc.collect()
            alive.append(sum(ref() is not None for ref in labels[:i]))
            if i == 3:
                device.complete()           # every step so far has run on the device
    # steps not yet run keep their batches: all earlier ones until step 3, then only the
    # ones yielded after the events completed
    assert alive[:4] == [0, 1, 2, 3], alive
    assert alive[4] <= 1 and alive[5] <= 2, alive
    emb.close()
