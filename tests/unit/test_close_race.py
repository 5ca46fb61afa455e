"""close() while another thread is inside a lookup (a prefetch thread's prepare): the other
thread ends in ClosedError, never in the closed store's innards (a KeyError from the slot
store's segments, an AttributeError on RocksDB's closed handle or on the shard's chain), found by
a fault campaign."""
import collections
import threading
import time

import numpy as np
import pytest

import one_embedding as oe


def _store(kind, path):
    if kind == "host":
        return oe.make_cached_host_mem_store_options(0.05, str(path), 200_000)
    return oe.make_cached_ssd_store_options(0.05, str(path), engine=kind)


@pytest.mark.parametrize("kind", ["slots", "rocksdb", "host"])
def test_a_lookup_racing_close_ends_in_closed_error(tmp_path, kind):
    seen = collections.Counter()
    for attempt in range(12):
        emb = oe.MultiTableEmbedding("e", 8, np.float32, np.int64, None,
                                     _store(kind, tmp_path / f"{attempt}"))
        rng = np.random.default_rng(attempt)
        emb(rng.integers(0, 100_000, 4096))
        started = threading.Event()

        def prepare_for_ever():
            started.set()
            try:
                while True:
                    emb.prepare(rng.integers(0, 10**6, 2048))
            except oe.ClosedError:
                seen["ClosedError"] += 1
            except BaseException as e:  # noqa: BLE001 - the test names what leaked out
                seen[f"{type(e).__name__}: {e}"] += 1

        worker = threading.Thread(target=prepare_for_ever)
        worker.start()
        started.wait()
        time.sleep(0.002 * (attempt % 6))
        emb.close()
        worker.join(30)
        assert not worker.is_alive(), "the lookup thread hung after close"
    assert seen == {"ClosedError": 12}, dict(seen)


def test_an_embedding_dropped_with_its_optimizer_frees_its_path_at_once(tmp_path):
    """The optimizer's parameter groups held the optimizer, a cycle through the embedding: a
    dropped embedding kept its path locked until the cyclic collector ran (found by a fault
    campaign). Plain reference counting frees it now."""
    import gc
    import weakref

    gc.disable()
    try:
        store = oe.make_cached_ssd_store_options(0.05, str(tmp_path), size_factor=2)
        emb = oe.MultiTableEmbedding("e", 8, np.float32, np.int64, None, store)
        opt = oe.Optimizer(oe.optim.Adagrad(lr=0.05), embeddings=[emb])
        out = emb(np.arange(100))
        emb.backward(np.ones_like(out))
        opt.step()
        opt.zero_grad()
        gone = weakref.ref(emb)
        del emb, opt, out
        assert gone() is None
        oe.MultiTableEmbedding("e", 8, np.float32, np.int64, None, store).close()  # not locked
    finally:
        gc.enable()
