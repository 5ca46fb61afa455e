"""The feature lifecycle's rules, each on a hand-made stream: admission after N steps, the
time-to-live and the row limit removing rows from every tier (the disk shrinking after GC), an
evicted key coming back as new, snapshots carrying the admission state, and bad settings."""
import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError, SnapshotError
from one_embedding.lifecycle import CountMinSketch

E = 4
INIT = oe.make_uniform_initializer(-0.5, 0.5)


def embedding(store=None, lifecycle=None, path=None, line=E, **kw):
    if store is None:
        store = oe.make_device_mem_store_options(path and str(path), capacity=64,
                                                 lifecycle=lifecycle, size_factor=line // E)
    return oe.MultiTableEmbedding("t", E, np.float32, np.int64, None, store,
                                  default_initializer=INIT, seed=11, **kw)


def step(emb, opt, ids, grad=1.0):
    out = emb.forward(np.asarray(ids, np.int64))
    emb.backward(np.full(out.shape, grad, np.float32))
    opt.step()
    return out


def stored(emb) -> set:
    return set(emb.export()[0].tolist())


def initial_rows(ids) -> np.ndarray:
    """The initializer's values: what a lookup of never-stored ids returns."""
    with embedding() as fresh:
        return fresh.forward(np.asarray(ids, np.int64))


# ---------------------------------------------------------------- admission

def test_admission_stores_a_key_at_its_nth_step_and_drops_earlier_gradients():
    lifecycle = oe.make_lifecycle_options(admit_min_count=3)
    emb = embedding(lifecycle=lifecycle)
    opt = oe.Optimizer(oe.optim.SGD(lr=1.0), embeddings=[emb])
    init = dict(zip([1, 2, 3], initial_rows([1, 2, 3])))
    # key 1 in steps 1, 2, 3; key 2 twice in step 1 (one step), then steps 4 and 5; key 3 once
    stream = [[1, 2, 2], [1, 3], [1], [2], [2]]
    want_stored = [set(), set(), {1}, {1}, {1, 2}]
    for i, (ids, want) in enumerate(zip(stream, want_stored)):
        before = stored(emb)
        out = step(emb, opt, ids)
        for k, row in zip(ids, out):
            if k not in before:  # not admitted yet: the lookup gives the initializer's value
                np.testing.assert_array_equal(row, init[k])
        assert stored(emb) == want, f"after step {i + 1}"
    keys, lines = emb.export()
    rows = dict(zip(keys.tolist(), lines))
    # the row starts from the initializer's value plus the update of the step that admitted it
    # (SGD lr 1, gradient 1 per occurrence: key 2 in step 5 once) -- earlier gradients dropped
    np.testing.assert_array_equal(rows[1], init[1] - 1.0)
    np.testing.assert_array_equal(rows[2], init[2] - 1.0)
    stats = emb.store_stats()[-1]
    assert stats["admitted_rows"] == 2
    assert stats["not_admitted_lookups"] == 5  # 1, 2 | 1, 3 | - | 2 | -
    assert stats["evicted_rows"] == 0


def test_min_count_one_stores_every_key_and_counts_it():
    emb = embedding()
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    step(emb, opt, [5, 6, 6])
    step(emb, opt, [6, 7])
    assert stored(emb) == {5, 6, 7}
    s = emb.store_stats()[-1]
    assert (s["admitted_rows"], s["not_admitted_lookups"], s["evicted_rows"]) == (3, 0, 0)


def test_count_min_sketch_never_undercounts_and_is_order_free():
    rng = np.random.default_rng(0)
    sketch = CountMinSketch(4096, 2)  # 500 keys into 4,096 cells a row: some collide; ~1,100
    # keys counted, under the 2,048 that would halve the counters
    truth = {}
    for _ in range(30):
        keys = np.unique(rng.integers(0, 500, 40).astype(np.uint64))
        counts, cells = sketch.counts_after(keys)
        shuffled = rng.permutation(keys.shape[0])
        counts2, _ = sketch.counts_after(keys[shuffled])
        np.testing.assert_array_equal(counts2, counts[shuffled])
        sketch.add(cells, counts)
        for k in keys.tolist():
            truth[k] = truth.get(k, 0) + 1
    assert sketch.halvings == 0
    keys = np.array(sorted(truth), np.uint64)
    est = sketch.counts_after(keys)[0] - 1
    assert (est >= np.array([truth[k] for k in keys.tolist()])).all()
    big = CountMinSketch.sized(1.0, 4)
    assert big.nbytes <= 2**20 and big.width == 1 << 17


def test_the_sketch_halves_its_counters_after_counting_half_its_width():
    sketch = CountMinSketch(64, 2)
    first = np.array([7], np.uint64)
    counts, cells = sketch.counts_after(first)
    sketch.add(cells, counts)
    assert sketch.counts_after(first)[0][0] == 2  # seen once: one more occurrence makes 2
    others = np.arange(1000, 1031, dtype=np.uint64)  # 31 more keys: 32 counted in all
    sketch.add(*sketch.counts_after(others)[::-1])
    assert sketch.halvings == 1 and sketch.counted == 0
    assert sketch.counts.max() <= 1  # 2 (a collision at most) halved; 1 -> 0
    assert sketch.counts_after(first)[0][0] == 1  # key 7's old occurrence has aged out


def test_one_call_counting_several_half_widths_halves_once_for_each():
    """A step with more new ids than half the sketch's width halved it only once and dropped
    the excess from the count (found by a fault campaign: 10,240 ids into a 1,024-wide sketch
    gave 5 halvings where the rule gives 20)."""
    sketch = CountMinSketch(64, 2)
    keys = np.arange(1, 81, dtype=np.uint64)   # 80 keys: two halvings (32 each), 16 left over
    sketch.add(*sketch.counts_after(keys)[::-1])
    assert sketch.halvings == 2 and sketch.counted == 16
    assert sketch.counts.max() == 0   # counts of 1 or 2 (collisions) halved twice
    sketch.add(*sketch.counts_after(np.arange(100, 116, dtype=np.uint64))[::-1])
    assert sketch.halvings == 3 and sketch.counted == 0


def test_admission_state_with_halvings_resumes_exactly(tmp_path):
    lifecycle = oe.make_lifecycle_options(admit_min_count=3, sketch_mb=64 * 4 * 2 / 2**20)
    emb = embedding(lifecycle=lifecycle, path=tmp_path)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    rng = np.random.default_rng(2)
    stream = [rng.integers(0, 60, 12) for _ in range(12)]
    for ids in stream[:6]:
        step(emb, opt, ids)
    emb.save_snapshot("mid")
    for ids in stream[6:]:
        step(emb, opt, ids)
    want = emb.export(), emb.store_stats()[-1]
    assert want[1]["admission_sketch_halvings"] > 0
    emb.load_snapshot("mid")
    opt.step_count = 6
    for ids in stream[6:]:
        step(emb, opt, ids)
    got = emb.export(), emb.store_stats()[-1]
    np.testing.assert_array_equal(got[0][0], want[0][0])
    np.testing.assert_array_equal(got[0][1], want[0][1])
    lifecycle_stats = ("admitted_rows", "not_admitted_lookups", "evicted_rows",
                       "admission_sketch_halvings")
    assert {k: got[1][k] for k in lifecycle_stats} == {k: want[1][k] for k in lifecycle_stats}
    emb.close()


# ---------------------------------------------------------------- eviction

def ssd_store(path, engine, lifecycle, line=E):
    return oe.make_cached_ssd_store_options(0.002, str(path), size_factor=line // E, engine=engine,
                                            host_cache_budget_mb=0.004, lifecycle=lifecycle)


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_time_to_live_removes_rows_from_every_tier(tmp_path, engine):
    lifecycle = oe.make_lifecycle_options(steps_to_live=3, evict_interval=1)
    emb = embedding(ssd_store(tmp_path, engine, lifecycle))
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    old = np.arange(1000, 1400)  # seen in step 1 only
    step(emb, opt, np.concatenate([old, [1, 2]]))
    for _ in range(2):
        step(emb, opt, [1, 2])
    assert stored(emb) >= set(old.tolist())  # steps 1..3: still within the time to live
    step(emb, opt, [1, 2])  # step 4 sweeps: last seen at step 1 <= 4 - 3
    assert stored(emb) == {1, 2}
    chain = emb._shard._chain
    keys = old.astype(np.uint64)
    for tier in chain.tiers:  # device cache, host cache, SSD: none holds an evicted key
        out = np.empty((keys.shape[0], tier.line_size), np.float32)
        assert tier.find(keys, out, np.arange(keys.shape[0])).shape[0] == keys.shape[0], tier.name
    assert emb.store_stats()[-1]["evicted_rows"] == 400
    assert len(emb) == 2


def test_an_evicted_key_that_comes_back_is_new():
    lifecycle = oe.make_lifecycle_options(steps_to_live=2, evict_interval=1)
    emb = embedding(lifecycle=lifecycle, line=3 * E)
    opt = oe.Optimizer(oe.optim.Adam(lr=0.1), embeddings=[emb])
    first = step(emb, opt, [9, 1])
    step(emb, opt, [1])
    step(emb, opt, [1])  # step 3 sweeps key 9 (last seen at step 1)
    assert stored(emb) == {1}
    again = step(emb, opt, [9, 1])
    np.testing.assert_array_equal(again[0], first[0])  # the initializer's value again
    with embedding(line=3 * E) as ref:  # a key updated once by a fresh Adam state
        ref_opt = oe.Optimizer(oe.optim.Adam(lr=0.1), embeddings=[ref])
        ref_opt.step_count = 3  # the same step number
        step(ref, ref_opt, [9])
        want = ref.export()[1][0]
    got = dict(zip(*emb.export()))[9]
    np.testing.assert_array_equal(got[:3 * E], want)


def test_max_rows_evicts_the_least_frequently_used_down_to_low_water():
    lifecycle = oe.make_lifecycle_options(max_rows=10, low_water=0.5, frequency_half_life=0)
    emb = embedding(lifecycle=lifecycle)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    # frequencies after 4 steps: keys 0-3 four times, 4-5 three, 6-7 twice, 8-9 once
    for s in range(4):
        step(emb, opt, [k for k in range(10) if k < 4 or (k < 6 and s > 0) or (k < 8 and s > 1)
                        or s > 2])
    assert stored(emb) == set(range(10))  # at the limit, not over it
    step(emb, opt, [20])  # 11 rows > 10: evict down to 5
    # 6 go: 8, 9 and the new 20 (once; 20 seen later), 6, 7 (twice), then 4: keys 4 and 5 tie
    # on frequency and last-seen step, and the smaller key goes first
    assert stored(emb) == {0, 1, 2, 3, 5}
    s = emb.store_stats()[-1]
    assert s["evicted_rows"] == 6 and len(emb) == 5


def test_frequency_decays_with_its_half_life():
    lifecycle = oe.make_lifecycle_options(max_rows=2, low_water=0.5, frequency_half_life=2)
    emb = embedding(lifecycle=lifecycle)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    for _ in range(6):
        step(emb, opt, [1])            # steps 1-6: key 1 frequent long ago
    for _ in range(5):
        step(emb, opt, [2])            # steps 7-11: key 1's frequency halves at 8 and 10
    keys, lines = emb.export()
    freq = dict(zip(keys.tolist(), lines[:, E + 1]))
    # f <- f * 2**-(halvings since last seen) + 1, a halving at every even step
    assert freq[1] == 2.625 and freq[2] == 3.25
    step(emb, opt, [3])                # step 12: 3 rows > 2: evict down to 1
    # decayed to step 12: key 1 2.625 / 8 < key 3's 1 < key 2's 3.25 / 2: only key 2 stays
    assert stored(emb) == {2}


def test_slot_disk_shrinks_after_eviction_and_gc(tmp_path):
    lifecycle = oe.make_lifecycle_options(max_rows=2000, low_water=0.5)
    line = 64
    emb = oe.MultiTableEmbedding("t", line, np.float32, np.int64, None,
                                 oe.make_cached_ssd_store_options(0.05, str(tmp_path),
                                                                  engine="slots",
                                                                  lifecycle=lifecycle))
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    rng = np.random.default_rng(1)
    for s in range(8):  # 8 x 1,000 new keys, plus 100 hot ones each step
        ids = np.concatenate([np.arange(100), 1000 + s * 1000 + np.arange(1000)])
        out = emb.forward(ids)
        emb.backward(rng.standard_normal(out.shape).astype(np.float32))
        opt.step()
    tier = emb.store_stats()[-1]
    assert tier["rows"] <= 2000 and tier["evicted_rows"] >= 6000
    written = 8 * 1000 * line * 4  # bytes of the rows ever written
    # the live rows (<= 2000) plus at most one segment not yet compacted
    assert tier["disk_bytes"] < written / 2, tier
    assert set(range(100)) <= stored(emb)  # the hot keys were never evicted


def test_rocksdb_disk_shrinks_after_eviction_and_gc(tmp_path):
    line, rows = 256, 12_000  # 12 MB of live rows, three versions of each written
    lifecycle = oe.make_lifecycle_options(max_rows=rows, low_water=0.1)
    emb = oe.MultiTableEmbedding("t", line, np.float32, np.int64, None,
                                 oe.make_cached_ssd_store_options(0.5, str(tmp_path),
                                                                  engine="rocksdb",
                                                                  lifecycle=lifecycle))
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    ids = np.arange(rows)
    for _ in range(3):
        out = emb.forward(ids)
        emb.backward(np.ones(out.shape, np.float32))
        opt.step()
        len(emb)  # the caches written down
        emb._shard._chain.bottom.flush()  # and RocksDB's memtables (no WAL) into files, as a
        # table larger than its memtables does all the time
    before = emb.store_stats()[-1]["disk_bytes"]
    assert before > 1.5 * rows * line * 4  # old versions of the rows: garbage, no GC yet
    out = emb.forward(np.arange(rows, rows + 300))  # 12,300 rows > 12,000: down to 1,200
    emb.backward(np.ones(out.shape, np.float32))
    opt.step()
    after = emb.store_stats()[-1]
    assert after["rows"] == 1200 and after["evicted_rows"] == 11_100
    assert after["disk_bytes"] < before / 3, (before, after["disk_bytes"])


# ---------------------------------------------------------------- snapshots

def test_snapshot_reloads_the_admission_state_and_counters(tmp_path):
    lifecycle = oe.make_lifecycle_options(admit_min_count=2, steps_to_live=5)
    emb = embedding(lifecycle=lifecycle, path=tmp_path)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    step(emb, opt, [1, 2, 3])
    emb.save_snapshot("s")
    sketch = emb._shard._lifecycle.sketch.counts.copy()
    stats = emb.store_stats()[-1]
    step(emb, opt, [4, 5])
    emb.load_snapshot("s")
    np.testing.assert_array_equal(emb._shard._lifecycle.sketch.counts, sketch)
    assert {k: emb.store_stats()[-1][k] for k in ("admitted_rows", "not_admitted_lookups")} == \
        {k: stats[k] for k in ("admitted_rows", "not_admitted_lookups")}
    step(emb, opt, [1, 4])  # 1 is admitted (second step), 4's first count was rolled back
    assert stored(emb) == {1}
    emb.close()


def test_a_snapshot_with_eviction_columns_needs_eviction_to_load(tmp_path):
    with embedding(lifecycle=oe.make_lifecycle_options(steps_to_live=4), path=tmp_path) as emb:
        opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
        step(emb, opt, [1])
        emb.save_snapshot("s")
    with embedding(path=tmp_path) as plain:
        with pytest.raises(SnapshotError, match="lifecycle_columns=2.*turn eviction on"):
            plain.load_snapshot("s")
    with embedding(lifecycle=oe.make_lifecycle_options(max_rows=9), path=tmp_path) as other:
        other.load_snapshot("s")  # another rule, the same columns: loads
        assert stored(other) == {1}


# ---------------------------------------------------------------- settings

@pytest.mark.parametrize("kwargs,match", [
    ({"admit_min_count": 0}, r"admit_min_count=0 \(--admit-min-count\) must be an integer >= 1"),
    ({"admit_min_count": -2}, "admit_min_count=-2"),
    ({"steps_to_live": -1}, r"steps_to_live=-1 \(--steps-to-live\)"),
    ({"max_rows": 2.5}, r"max_rows=2.5 \(--max-rows\)"),
    ({"admit_min_count": 70000}, "at most 65535"),
    ({"sketch_mb": 0}, "sketch_mb=0"),
    ({"low_water": 0}, "low_water=0"),
])
def test_bad_lifecycle_settings_are_refused_with_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        oe.make_lifecycle_options(**kwargs)


@pytest.mark.parametrize("flag,value,match", [
    ("admit_min_count", 0, r"--admit-min-count\): use a value >= 1"),
    ("steps_to_live", -5, r"--steps-to-live\): use a value >= 0"),
    ("max_rows", -1, r"--max-rows\): use a value >= 0"),
    ("admit_sketch_mb", 0.0, r"--admit-sketch-mb\): use a value > 0"),
])
def test_train_config_refuses_bad_lifecycle_flags(flag, value, match):
    from one_embedding.config import TrainConfig

    with pytest.raises(ConfigError, match=match):
        TrainConfig(**{flag: value})


def test_a_sketch_beyond_ram_is_refused_before_it_is_allocated(monkeypatch):
    """issue 29: sketch_mb=1e9 was numpy's _ArrayMemoryError (512 TiB); now a ConfigError
    naming the option and the RAM. A sketch that fits is still built."""
    import one_embedding.lifecycle as lifecycle

    monkeypatch.setattr(lifecycle, "physical_memory_mb", lambda: 10.0)
    rules = oe.make_lifecycle_options(admit_min_count=2, sketch_mb=1e9)
    with pytest.raises(ConfigError, match=r"sketch_mb=1e\+09 \(--admit-sketch-mb\) asks for an "
                                          r"admission sketch of [\d,]+ MB .*more than this "
                                          r"machine's 10 MB of RAM"):
        lifecycle.Lifecycle(rules, line_size=16)
    with pytest.raises(ConfigError, match=r"sketch_mb=20 .* sketch of 16 MB"):  # through a store
        embedding(lifecycle=oe.make_lifecycle_options(admit_min_count=2, sketch_mb=20))
    fits = lifecycle.Lifecycle(oe.make_lifecycle_options(admit_min_count=2, sketch_mb=8), 16)
    assert fits.sketch.nbytes == 8 * 2**20


def test_store_options_take_only_lifecycle_options():
    with pytest.raises(ConfigError, match="make_lifecycle_options"):
        oe.make_device_mem_store_options(None, capacity=4, lifecycle={"max_rows": 3})


def test_table_reader_and_inspect_read_a_table_with_eviction(tmp_path):
    from one_embedding.inspect_snapshot import inspect_path

    with embedding(lifecycle=oe.make_lifecycle_options(steps_to_live=4), path=tmp_path) as emb:
        opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
        step(emb, opt, [3, 1])
        step(emb, opt, [1])
        keys, lines = emb.export()
        emb.save_snapshot("s")
    with oe.make_persistent_table_reader([str(tmp_path / "0-1")], "s", np.int64, np.float32,
                                         E) as reader:
        got = list(reader)
    np.testing.assert_array_equal(np.concatenate([k for k, _ in got]), keys.astype(np.int64))
    np.testing.assert_array_equal(np.concatenate([v for _, v in got]), lines[:, :E])
    report = inspect_path(str(tmp_path), rows=5)
    assert report[0]["status"] == "ok", report
    rows = {r["key"]: r for r in report[0]["rows"]}
    assert (rows[1]["last_seen_step"], rows[1]["frequency"]) == (2, 2.0)
    assert (rows[3]["last_seen_step"], rows[3]["frequency"]) == (1, 1.0)


def test_a_damaged_admission_sketch_is_refused_at_load(tmp_path):
    with embedding(lifecycle=oe.make_lifecycle_options(admit_min_count=2), path=tmp_path) as emb:
        opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
        step(emb, opt, [1, 2, 3])
        emb.save_snapshot("s")
        sketch = tmp_path / "0-1" / "snapshots" / "s" / "admission_sketch.npy"
        data = bytearray(sketch.read_bytes())
        data[200] ^= 0x01
        sketch.write_bytes(bytes(data))
        with pytest.raises(SnapshotError, match="admission_sketch.npy' fails its checksum"):
            emb.load_snapshot("s")


def test_inspect_counts_the_lifecycle_columns_in_a_line(tmp_path):
    """With eviction on each stored line carries the last-seen step and the frequency: inspect's
    summary said the line was the embedding and its state alone (E floats where E + 2 are
    stored)."""
    from one_embedding.inspect_snapshot import format_inspection, inspect_path

    emb = embedding(lifecycle=oe.make_lifecycle_options(steps_to_live=5), path=tmp_path)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    step(emb, opt, [1, 2, 3])
    emb.save_snapshot("s")
    emb.close()
    found = inspect_path(str(tmp_path))
    assert found[0]["lifecycle_columns"] == 2
    text = " ".join(format_inspection(found).split())   # the summary wraps at 100 columns
    assert (f"A key's line: {E + 2} floats ({4 * (E + 2)} B): the {E}-float embedding, 2 of the "
            "lifecycle (last-seen step, frequency).") in text, text
