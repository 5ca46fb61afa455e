"""The device path of the embedding, run on the host: ``MultiTableEmbedding(device=launcher)``
with the emulated launcher (tests/cuda_emulation.py: the CUDA kernels compiled with g++, numpy
arrays standing in for CuPy arrays) against the CPU embedding.

What runs here exactly as on a GPU: the front end's device branch (ids, padding, keys), the ID
shuffle with the device unique, the tier chain with ``DeviceFullStore`` / ``DeviceCache`` on top
and its device <-> host crossing (staging, counted copies), initial values, the write-log patch
of prefetched lookups, segment sums, the gather, the fused optimizer kernels, the codecs, and a
DLRM trained through it. What only a GPU shows (tests/test_device_embedding_gpu.py): CuPy itself,
NVRTC, flush-to-zero, streams running concurrently.

Results are compared bit for bit: training with every store preset, with prefetch, with
padding and table ids, with int8 / fp16 exchange and with two lookups per step equals the CPU
embedding's (the initial values are exact here, where the emulated kernel and numpy share the
host's libm; on a GPU they may differ by 1 ulp, rarely). The tests marked ``stress_seeds`` also
run in the emulator's stress mode with seeds 1, 2, 3 (tests/conftest.py); with
ONE_EMBEDDING_CUDA_EMULATION_SEED set, all of them run in it.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from cuda_emulation import EmulatedLauncher

import one_embedding as oe
from one_embedding.backend import embedding_device
from one_embedding.kernels import cuda_module as cm
from one_embedding.pipeline import Prefetcher

E = 8
TABLES = 3



def _store(preset: str, path, size_factor: int, cache_rows: int = 24, lifecycle=None):
    line = size_factor * E
    mb = cache_rows * 4 * line / 2**20
    if preset == "device_mem":
        return oe.make_device_mem_store_options(str(path), capacity=1000, size_factor=size_factor,
                                                lifecycle=lifecycle)
    if preset == "cached_host_mem":
        return oe.make_cached_host_mem_store_options(mb, str(path), 1000, size_factor=size_factor,
                                                     lifecycle=lifecycle)
    if preset == "cached_host_mem_lfu":
        return oe.make_cached_host_mem_store_options(mb, str(path), 1000, size_factor=size_factor,
                                                     cache_policy="lfu", lifecycle=lifecycle)
    engine, host = {"cached_ssd": ("slots", 0.0), "cached_ssd_host": ("slots", 2 * mb),
                    "cached_ssd_rocksdb": ("rocksdb", 2 * mb)}[preset]
    return oe.make_cached_ssd_store_options(mb, str(path), size_factor=size_factor, engine=engine,
                                            host_cache_budget_mb=host, lifecycle=lifecycle)


def _batches(steps: int, batch: int = 40, seed: int = 4):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(steps):
        hi = 30 + 20 * k                                 # new keys every step
        ids = (rng.zipf(1.2, size=(batch, TABLES)) % hi) * 7919 + 11
        out.append(ids.astype(np.int64))
    return out


def _tables():
    return [oe.make_table_options(oe.make_uniform_initializer(-0.1, 0.1)),
            oe.make_table_options(oe.make_normal_initializer(0.0, 0.05)),
            oe.make_table_options(oe.make_trunc_normal_initializer(0.0, 0.2, -0.3, 0.3))]


def _optimizer(name: str):
    return {"sgd": lambda: oe.optim.SGD(lr=0.1),
            "adagrad": lambda: oe.optim.Adagrad(lr=0.1, initial_accumulator_value=0.1),
            "adam": lambda: oe.optim.Adam(lr=0.01, weight_decay=0.01),
            "momentum": lambda: oe.optim.SGD(lr=0.05, momentum=0.9, nesterov=True),
            "ftrl": lambda: oe.optim.Ftrl(lr=0.05, lambda1=0.001, convention="oneflow")}[name]()


def _host(a) -> np.ndarray:
    return np.asarray(a)


def _same_bits(got, want):
    got, want = _host(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _train(device, preset, optim, path, steps=6, depth=0, padding_idx=None, exchange_dtype=None,
           two_lookups=False, lifecycle=None, batches=None):
    """Train ``steps`` steps (of ``batches``, by default ``_batches(steps)``); returns (outputs
    per step, exported keys and lines, store stats)."""
    opt_rows = _optimizer(optim)
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                 _store(preset, path, opt_rows.required_size_factor(),
                                        lifecycle=lifecycle),
                                 padding_idx=padding_idx, seed=5, exchange_dtype=exchange_dtype,
                                 device=device)
    opt = oe.Optimizer(opt_rows, embeddings=[emb])
    grad_rng = np.random.default_rng(9)
    outputs = []
    batches = _batches(steps) if batches is None else batches
    for batch, state in Prefetcher(batches, emb, depth=depth, ids=lambda b: b):
        out = emb.embed(state)
        outputs.append(_host(out).copy())
        emb.backward(emb.xp.asarray(grad_rng.standard_normal(out.shape).astype(np.float32)))
        if two_lookups:                                   # a second lookup feeding the same step
            second = batch[::2, ::-1].copy()
            out2 = emb(second)
            outputs.append(_host(out2).copy())
            emb.backward(emb.xp.asarray(np.full(out2.shape, 0.5, np.float32)))
        opt.step()
        opt.zero_grad()
    keys, lines = emb.export()
    stats = emb.store_stats()
    emb.close()
    return outputs, (keys, lines), stats


PRESETS = ["device_mem", "cached_host_mem", "cached_host_mem_lfu", "cached_ssd", "cached_ssd_host",
           "cached_ssd_rocksdb"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("optim", ["sgd", "adagrad", "adam"])
def test_device_embedding_trains_as_the_cpu_embedding(launch, tmp_path, preset, optim):
    if preset.endswith("rocksdb"):
        pytest.importorskip("rocksdict", reason="the RocksDB engine needs rocksdict")
    want = _train("cpu", preset, optim, tmp_path / "cpu")
    got = _train(launch, preset, optim, tmp_path / "dev")
    for a, b in zip(got[0], want[0], strict=True):
        _same_bits(a, b)
    _same_bits(got[1][0], want[1][0])
    _same_bits(got[1][1], want[1][1])
    # every level saw the same hits, misses, writes and evictions as its CPU twin
    for g, w in zip(got[2], want[2], strict=True):
        assert {k: g[k] for k in ("tier", "hits", "misses", "writes", "evictions", "rows")} == \
            {k: w[k] for k in ("tier", "hits", "misses", "writes", "evictions", "rows")}
    assert got[2][0]["tier"].startswith("device.") and "d2h_bytes" in got[2][0]
    # one rank, fp32: the per-key gradient sum happens inside the update kernel; over one
    # device store (device_mem) the batch has fixed capacity, its unique count on the device:
    # the dedup's fixed-capacity output pass, then the store's find of the live keys
    # (device_unique.FIND_IN_DEDUP off by default: the fused probe is tested on its own)
    kernels = {"embedding_dedup_insert", "embedding_init_missing", f"optim_summed_{optim}"}
    kernels |= {"cache_find", "embedding_dedup_output"} if "cached" in preset else \
        {"embedding_dedup_output_fixed", "hashindex_find_live", "hashindex_put_rows"}
    assert kernels <= launch.launched
    # the gather at 4 or 16 bytes per thread, as the lines' layout allows (issue 32 item 3)
    assert {"embedding_gather", "embedding_gather_vector"} & launch.launched
    assert not {"embedding_segment_sum", f"optim_{optim}"} & launch.launched
    if "cached" not in preset:
        assert "hashindex_dedup_output_find" not in launch.launched


@pytest.mark.stress_seeds
@pytest.mark.parametrize("optim", ["momentum", "ftrl"])
def test_device_embedding_other_optimizers(launch, tmp_path, optim):
    want = _train("cpu", "cached_host_mem", optim, tmp_path / "cpu", steps=4)
    got = _train(launch, "cached_host_mem", optim, tmp_path / "dev", steps=4)
    _same_bits(got[1][1], want[1][1])


@pytest.mark.stress_seeds
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("preset", ["device_mem", "cached_host_mem", "cached_ssd_host"])
def test_device_prefetch_gives_the_serial_bits(launch, tmp_path, preset, depth):
    want = _train("cpu", preset, "adagrad", tmp_path / "cpu", steps=7)
    got = _train(launch, preset, "adagrad", tmp_path / "dev", steps=7, depth=depth)
    for a, b in zip(got[0], want[0], strict=True):
        _same_bits(a, b)
    _same_bits(got[1][1], want[1][1])


@pytest.mark.stress_seeds
@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("preset", ["device_mem", "cached_host_mem", "cached_ssd_host"])
def test_device_lifecycle_gives_the_cpu_bits(launch, tmp_path, preset, depth):
    """Admission, time-to-live and the row limit on the device path: the same rows admitted and
    evicted (the device cache's and full store's erase), the same lifecycle columns."""
    rules = oe.make_lifecycle_options(admit_min_count=2, steps_to_live=3, evict_interval=1,
                                      max_rows=80, frequency_half_life=2)
    want = _train("cpu", preset, "adagrad", tmp_path / "cpu", steps=10, lifecycle=rules)
    got = _train(launch, preset, "adagrad", tmp_path / "dev", steps=10, depth=depth,
                 lifecycle=rules)
    for a, b in zip(got[0], want[0], strict=True):
        _same_bits(a, b)
    _same_bits(got[1][0], want[1][0])
    _same_bits(got[1][1], want[1][1])
    counters = ("admitted_rows", "not_admitted_lookups", "evicted_rows")
    assert {k: got[2][-1][k] for k in counters} == {k: want[2][-1][k] for k in counters}
    assert want[2][-1]["evicted_rows"] > 0 and want[2][-1]["not_admitted_lookups"] > 0


@pytest.mark.stress_seeds
def test_device_padding_exchange_dtypes_and_two_lookups(launch, tmp_path):
    for kwargs in [dict(padding_idx=11), dict(exchange_dtype="int8"), dict(exchange_dtype="fp16"),
                   dict(two_lookups=True)]:
        want = _train("cpu", "cached_host_mem", "adagrad", tmp_path / "cpu", steps=4, **kwargs)
        got = _train(launch, "cached_host_mem", "adagrad", tmp_path / "dev", steps=4, **kwargs)
        for a, b in zip(got[0], want[0], strict=True):
            _same_bits(a, b)
        _same_bits(got[1][1], want[1][1])
        shutil.rmtree(tmp_path)


def _batches_with_key_zero(steps: int):
    """``_batches`` with id 0 (key 0, the placeholder key of a fixed-capacity batch) in every
    third batch, so that a prefetched lookup of key 0 sees puts with and without it."""
    out = _batches(steps)
    for k, ids in enumerate(out):
        if k % 3 == 1:
            ids[: 2 + k, 0] = 0
    return out


@pytest.mark.stress_seeds
@pytest.mark.parametrize("case", ["key_zero_prefetched", "padding", "int8", "fp16",
                                  "two_lookups", "eviction_prefetched"])
def test_device_mem_fixed_capacity_batches_give_the_cpu_bits(launch, tmp_path, case):
    """One rank over device_mem dedups into fixed-capacity arrays (the unique count stays on the
    device, placeholders of key 0 behind it): every way through it gives the CPU's bits. A real
    key 0 beside the placeholders, patched in from a fixed-capacity put by a prefetched lookup;
    padding ids; int8 / fp16 exchange (the rows and sums of the placeholders cross too); two
    lookups in one step (merged: cut to the count); eviction by time-to-live and row limit
    without admission (an erase in the write log beside fixed-capacity puts)."""
    kwargs = {"key_zero_prefetched": dict(depth=2, batches=_batches_with_key_zero(7), steps=7),
              "padding": dict(padding_idx=11, depth=1),
              "int8": dict(exchange_dtype="int8"), "fp16": dict(exchange_dtype="fp16"),
              "two_lookups": dict(two_lookups=True),
              "eviction_prefetched": dict(depth=2, steps=10, batches=_batches_with_key_zero(10),
                                          lifecycle=oe.make_lifecycle_options(
                                              steps_to_live=3, evict_interval=1, max_rows=80))}[case]
    want = _train("cpu", "device_mem", "adagrad", tmp_path / "cpu", **kwargs)
    got = _train(launch, "device_mem", "adagrad", tmp_path / "dev", **kwargs)
    for a, b in zip(got[0], want[0], strict=True):
        _same_bits(a, b)
    _same_bits(got[1][0], want[1][0])
    _same_bits(got[1][1], want[1][1])
    # a prefetched lookup's hits depend on the puts before it (thread timing): not compared
    counted = ("writes", "rows") if kwargs.get("depth") else ("hits", "misses", "writes", "rows")
    for g, w in zip(got[2], want[2], strict=True):
        assert {k: g[k] for k in counted} == {k: w[k] for k in counted}
    if case == "eviction_prefetched":
        counters = ("admitted_rows", "evicted_rows")
        assert {k: got[2][-1][k] for k in counters} == {k: want[2][-1][k] for k in counters}
        assert want[2][-1]["evicted_rows"] > 0
    # the default path: the dedup's fixed-capacity output, then the find of the live keys (the
    # fused probe, FIND_IN_DEDUP, against it: test_dlrm_dedup_fused_with_the_find_...)
    assert {"embedding_dedup_output_fixed", "hashindex_find_live"} <= launch.launched
    if case.startswith("key_zero"):
        assert 0 in want[1][0]


@pytest.mark.stress_seeds
def test_device_mem_refresh_skips_the_placeholders_of_fixed_capacity_puts(launch, tmp_path):
    """Each batch looked up before the previous step's put (as a prefetch does, but in a fixed
    order): its refresh patches in puts whose keys end in placeholders of key 0, and the
    batches with a real key 0 still get the CPU's rows (key 0 only in batch 2, so the puts
    before it hold key 0 only as a placeholder)."""
    batches = _batches(5)
    batches[2][:3, 0] = 0
    runs = {}
    for where in ("cpu", launch):
        emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                     _store("device_mem", tmp_path / str(where == "cpu"), 2),
                                     seed=5, device=where)
        opt = oe.Optimizer(_optimizer("adagrad"), embeddings=[emb])
        rng = np.random.default_rng(9)
        states, outputs = {0: emb.prepare(batches[0])}, []
        for i in range(len(batches)):
            if i + 1 < len(batches):
                states[i + 1] = emb.prepare(batches[i + 1])   # before this step's put
            out = emb.embed(states.pop(i))
            outputs.append(_host(out).copy())
            emb.backward(emb.xp.asarray(rng.standard_normal(out.shape).astype(np.float32)))
            opt.step()
            opt.zero_grad()
        runs[where == "cpu"] = outputs, emb.export()
        emb.close()
    for a, b in zip(runs[False][0], runs[True][0], strict=True):
        _same_bits(a, b)
    _same_bits(runs[False][1][1], runs[True][1][1])
    assert 0 in runs[True][1][0]


@pytest.mark.stress_seeds
def test_device_table_ids_and_key_types(launch, tmp_path):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2**31 - 1, size=(50, 4)).astype(np.int32)
    table_ids = rng.integers(0, TABLES, size=(50, 4))
    outs = []
    for device in ("cpu", launch):
        emb = oe.MultiTableEmbedding("t", E, np.float32, np.uint32, _tables(),
                                     _store("cached_host_mem", tmp_path / str(len(outs)), 1),
                                     device=device)
        outs.append(_host(emb(ids.astype(np.uint32), table_ids=table_ids)).copy())
        emb.close()
    _same_bits(outs[1], outs[0])


@pytest.mark.stress_seeds
def test_device_chain_counts_every_crossing(launch, tmp_path):
    """cached_host_mem: misses of the device cache come up from the host store, evictions go
    down; each crossing's bytes are counted once, and a device_mem table crosses nothing."""
    line = 2 * E
    _, _, stats = _train(launch, "cached_host_mem", "adagrad", tmp_path / "a", steps=5)
    top, host = stats[0], stats[1]
    assert top["tier"] == "device.lru" and "d2h_bytes" not in host
    # down: every line the host store took (evictions, and the flush of export()) as key + line,
    # and the keys of each lookup's device misses; up: staged lines + a found flag per miss
    assert top["d2h_bytes"] == host["writes"] * (8 + 4 * line) + top["misses"] * 8
    assert 0 < top["h2d_bytes"] <= top["misses"] * (4 * line + 1)
    assert host["hits"] > 0
    _, _, full = _train(launch, "device_mem", "adagrad", tmp_path / "b", steps=5)
    assert full[0]["tier"] == "device.full"
    rows = full[0]["rows"]
    # export() copied every key and line to the host once; training itself crossed nothing
    assert full[0]["d2h_bytes"] == rows * (8 + 4 * line) and full[0]["h2d_bytes"] == 0


@pytest.mark.stress_seeds
def test_device_cache_snapshots_write_what_changed_as_the_cpu_cache(launch, tmp_path):
    """cached_host_mem with snapshots between steps: the device cache's flush writes only its
    dirty lines and its clean victims go nowhere, so the host store takes exactly the writes it
    takes under the CPU cache (every held line each snapshot, and every victim, before)."""
    runs = {}
    for device in ("cpu", launch):
        emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                     _store("cached_host_mem", tmp_path / str(id(device)), 2),
                                     device=device)
        opt = oe.Optimizer(_optimizer("adagrad"), embeddings=[emb])
        writes = []
        for step, ids in enumerate(_batches(8)):
            out = emb(ids[: 10 if step % 2 else None])     # odd steps touch fewer keys
            emb.backward(emb.xp.ones(out.shape, dtype=np.float32))
            opt.step()
            if step % 2:
                emb.save_snapshot(f"s{step}")
                writes.append(emb.store_stats()[1]["writes"])
        runs[str(device)] = writes, emb.export(), len(emb.store_stats())
        emb.close()
    (cpu_writes, cpu_rows, _), (dev_writes, dev_rows, _) = runs["cpu"], runs[str(launch)]
    assert dev_writes == cpu_writes
    _same_bits(dev_rows[0], cpu_rows[0])
    _same_bits(dev_rows[1], cpu_rows[1])


def test_a_device_cache_keeps_its_counts_on_the_device(launch, tmp_path):
    """cached_host_mem: a step reads back the batch's unique count, how much crosses to the host
    tier (the lookup's misses and the last put's evictions, counted in one read) and what
    crosses (the evicted keys and lines and the miss keys, copied together and waited for
    once), but neither the number of sets a batch touches (the cache's grouping has room for a
    set per key) nor the cache's size (counted on the device; len() reads it): 3 reads a step
    (6 with the put reading its own evictions and each copy waited for alone, 10 before)."""
    from one_embedding import host_sync

    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                 _store("cached_host_mem", tmp_path, 2), device=launch)
    opt = oe.Optimizer(_optimizer("adagrad"), embeddings=[emb])
    steps = []
    for ids in _batches(6):
        checks = host_sync.DeferredChecks()
        with host_sync.counting() as reads, host_sync.deferring(checks):
            out = emb(ids)
            emb.backward(emb.xp.ones(out.shape, dtype=np.float32))
            opt.step()
            opt.zero_grad()
        checks.read(emb.xp)
        steps.append(dict(reads.by_reason))
    for step in steps[2:]:
        assert not any(r.startswith(("device cache", "cache size")) for r in step), step
        assert step == {"dedup: unique count": 1, "miss keys and evictions to host tier": 1,
                        "evicted lines and miss keys to host tier": 1}, step
    cache = emb._shard._chain.tiers[0]
    assert cache.name == "device.lru"
    with host_sync.counting() as reads:
        held = len(cache)
    emb.close()
    assert 0 < held <= cache.capacity and reads.by_reason == {"device cache: size": 1}


@pytest.mark.stress_seeds
def test_device_snapshot_loads_on_the_cpu_and_back(launch, tmp_path):
    outs = {}
    for first, second in [(launch, "cpu"), ("cpu", launch)]:
        path = tmp_path / f"{id(first)}"
        emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                     _store("cached_host_mem", path, 2), device=first)
        opt = oe.Optimizer(_optimizer("adagrad"), embeddings=[emb])
        for ids in _batches(3):
            out = emb(ids)
            emb.backward(emb.xp.ones(out.shape, dtype=np.float32))
            opt.step()
        emb.save_snapshot("s")
        want = emb.export()
        emb.close()
        again = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                       _store("cached_host_mem", path, 2), device=second)
        again.load_snapshot("s")
        got = again.export()
        _same_bits(got[0], want[0])
        _same_bits(got[1], want[1])
        outs[str(second)] = _host(again(_batches(1)[0])).copy()
        again.close()
    _same_bits(outs[str(launch)], outs["cpu"])


@pytest.mark.stress_seeds
def test_dlrm_with_a_device_embedding_trains_as_on_the_cpu(launch):
    """A model builds its own embedding: ``embedding_device`` puts it on the device."""
    from one_embedding.models import DLRM
    from one_embedding.nn.loss import BCEWithLogits

    losses = {}
    for device in ("cpu", launch):
        with embedding_device(device):
            model = DLRM(num_tables=TABLES, embedding_dim=E, dense_features=4, bottom_mlp=[16, E],
                         top_mlp=[16, 1], seed=1)
        assert (model.embedding.launch is None) == (device == "cpu")
        opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[model.embedding],
                           parameters=list(model.parameters()))
        loss_fn, rng, seen = BCEWithLogits(), np.random.default_rng(2), []
        for ids in _batches(5):
            dense = rng.standard_normal((ids.shape[0], 4)).astype(np.float32)
            labels = (rng.random(ids.shape[0]) < 0.3).astype(np.float32)
            seen.append(float(loss_fn(model(dense, ids), labels)))
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
        losses[device == "cpu"] = seen
        model.embedding.close()
    assert losses[False] == losses[True]


@pytest.mark.stress_seeds
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_dlrm_fused_gradient_update_gives_the_two_kernel_bits(launch, optim, monkeypatch):
    """Issue 32 item 3: a DLRM trained on the device path with the per-key gradient sum fused
    into the row update (``kernels.fused_update``) and with it forced off (``segment_sum`` then
    ``update_lines``): the same losses and rows, bit for bit, under a static loss scale (the
    update's factor 1/scale) and Adam's weight decay; each run launched the kernels it claims."""
    from one_embedding.kernels import fused_update
    from one_embedding.models import DLRM
    from one_embedding.nn.loss import BCEWithLogits

    make = {"sgd": lambda: oe.optim.SGD(lr=0.1),
            "adam": lambda: oe.optim.Adam(lr=0.01, weight_decay=0.01)}[optim]
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(fused_update, "ENABLED", fused)
        device = EmulatedLauncher(launch.lib, cm.EMBEDDING_FAMILIES, seed=launch.seed)
        with embedding_device(device):
            model = DLRM(num_tables=TABLES, embedding_dim=E, dense_features=4, bottom_mlp=[16, E],
                         top_mlp=[16, 1], seed=1, store_options=oe.make_device_mem_store_options(
                             persistent_path=None, capacity=None,
                             size_factor=make().required_size_factor()))
        opt = oe.Optimizer(make(), embeddings=[model.embedding],
                           parameters=list(model.parameters()), loss_scale=256.0)
        loss_fn, rng, losses = BCEWithLogits(), np.random.default_rng(2), []
        for ids in _batches(5):
            dense = rng.standard_normal((ids.shape[0], 4)).astype(np.float32)
            labels = (rng.random(ids.shape[0]) < 0.3).astype(np.float32)
            losses.append(float(loss_fn(model(dense, ids), labels)))
            model.backward(loss_fn.backward() * np.float32(256.0))
            opt.step()
            opt.zero_grad()
        runs[fused] = losses, model.embedding.export(), device.launched
        model.embedding.close()
    losses_on, (keys_on, lines_on), launched_on = runs[True]
    losses_off, (keys_off, lines_off), launched_off = runs[False]
    assert losses_on == losses_off
    _same_bits(keys_on, keys_off)
    _same_bits(lines_on, lines_off)
    assert f"optim_summed_{optim}" in launched_on and "embedding_segment_sum" not in launched_on
    assert f"optim_{optim}" in launched_off and "embedding_segment_sum" in launched_off
    assert f"optim_summed_{optim}" not in launched_off


def _dlrm_run(launch, path, depth: int, fused_find: bool, monkeypatch, steps: int = 10):
    """A DLRM on a device_mem embedding with eviction (time-to-live and a row limit, no
    admission: the fixed-capacity path), trained through a Prefetcher of ``depth``, with the
    dedup's output pass fused with the store's find or not -> (losses, exported table, store
    stats, launched kernels)."""
    from one_embedding.kernels import device_unique
    from one_embedding.models import DLRM
    from one_embedding.nn.loss import BCEWithLogits

    monkeypatch.setattr(device_unique, "FIND_IN_DEDUP", fused_find)
    device = EmulatedLauncher(launch.lib, cm.EMBEDDING_FAMILIES, seed=launch.seed)
    rules = oe.make_lifecycle_options(steps_to_live=3, evict_interval=1, max_rows=80)
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                 _store("device_mem", path, 2, lifecycle=rules), seed=5,
                                 device=device)
    model = DLRM(num_tables=TABLES, embedding_dim=E, dense_features=4, bottom_mlp=[16, E],
                 top_mlp=[16, 1], embedding=emb, seed=1)
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb],
                       parameters=list(model.parameters()))
    loss_fn, rng, losses = BCEWithLogits(), np.random.default_rng(2), []
    with Prefetcher(_batches_with_key_zero(steps), emb, depth=depth, ids=lambda b: b) as batches:
        for ids, state in batches:
            dense = rng.standard_normal((ids.shape[0], 4)).astype(np.float32)
            labels = (rng.random(ids.shape[0]) < 0.3).astype(np.float32)
            losses.append(float(loss_fn(model(dense, state), labels)))
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
    table, stats = emb.export(), emb.store_stats()
    emb.close()
    return losses, table, stats, device.launched


@pytest.mark.stress_seeds
@pytest.mark.parametrize("depth", [0, 2])
def test_dlrm_dedup_fused_with_the_find_gives_the_unfused_bits(launch, tmp_path, depth,
                                                               monkeypatch):
    """Issue 32 item 3: one rank over device_mem, the dedup's output pass probes the store's
    index itself (``hashindex_dedup_output_find``, under the chain's lock) where it ran
    ``embedding_dedup_output_fixed`` then ``hashindex_find_live``: a DLRM with eviction,
    prefetch off and 2 batches ahead, gets the same losses, rows and counters, bit for bit."""
    fused = _dlrm_run(launch, tmp_path / "fused", depth, True, monkeypatch)
    unfused = _dlrm_run(launch, tmp_path / "unfused", depth, False, monkeypatch)
    assert fused[0] == unfused[0]
    _same_bits(fused[1][0], unfused[1][0])
    _same_bits(fused[1][1], unfused[1][1])
    # a prefetched lookup's hits depend on the puts before it (thread timing): not compared
    counted = ("writes", "rows", "admitted_rows", "evicted_rows") + \
        (() if depth else ("hits", "misses"))
    for g, w in zip(fused[2], unfused[2], strict=True):
        assert {k: g.get(k) for k in counted} == {k: w.get(k) for k in counted}
    assert fused[2][-1]["evicted_rows"] > 0 and 0 in fused[1][0]
    assert "hashindex_dedup_output_find" in fused[3]
    assert "embedding_dedup_output_fixed" not in fused[3]
    assert {"embedding_dedup_output_fixed", "hashindex_find_live"} <= unfused[3]
    assert "hashindex_dedup_output_find" not in unfused[3]


def test_the_fused_lookup_launches_one_kernel_fewer(launch, tmp_path, monkeypatch):
    """One device_mem lookup (``prepare``: dedup + the store's find + initial values), the
    kernels in launch order: fused, the dedup's output pass and the find are one kernel; off,
    the same sequence with the two in its place."""
    from one_embedding.kernels import device_unique

    sequences = {}
    for fused in (True, False):
        monkeypatch.setattr(device_unique, "FIND_IN_DEDUP", fused)
        device = EmulatedLauncher(launch.lib, cm.EMBEDDING_FAMILIES, seed=launch.seed)
        emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                     _store("device_mem", tmp_path / str(fused), 2), seed=5,
                                     device=device)
        opt = oe.Optimizer(_optimizer("adagrad"), embeddings=[emb])
        batches = _batches(2)
        out = emb(batches[0])
        emb.backward(np.ones(out.shape, np.float32))
        opt.step()
        seen, run = [], device.run

        def recording(family, name, *args, run=run, seen=seen):
            seen.append(f"{family}_{name}")
            return run(family, name, *args)

        monkeypatch.setattr(device, "run", recording)
        emb.prepare(batches[1])
        sequences[fused] = seen
        emb.close()
    passes = ["embedding_dedup_clear", "embedding_dedup_insert", "embedding_dedup_first"]
    assert sequences[True] == passes + ["hashindex_dedup_output_find", "embedding_init_missing"]
    assert sequences[False] == passes + ["embedding_dedup_output_fixed", "hashindex_find_live",
                                         "embedding_init_missing"]


def _grow_between(where: str, emb, opt, launch, batches, monkeypatch):
    """Steps W and A, then B looked up with A's put (which grows the store's index) made at
    ``where`` -> (B's rows, the index capacities before and after A's put, exported table).
    "cpu": the serial order, A's put before B's lookup. Device: before_the_probe (after the
    dedup's first passes, before the lookup's version is recorded), after_the_probe (after the
    fused output pass probed the old index), before_use (a prefetched batch waiting)."""
    from one_embedding.kernels import device_unique

    rng = np.random.default_rng(9)
    grads = [rng.standard_normal((b.size, E)).astype(np.float32) for b in batches]
    shard = emb._owner()
    capacity = lambda: shard._chain.tiers[0]._index.capacity if launch != "cpu" else 0  # noqa: E731
    out = emb(batches[0])
    emb.backward(emb.xp.asarray(grads[0].reshape(out.shape)))
    opt.step()
    opt.zero_grad()
    out = emb(batches[1])
    emb.backward(emb.xp.asarray(grads[1].reshape(out.shape)))
    grown = []

    def put_a():
        grown.append(capacity())
        opt.step()
        opt.zero_grad()
        grown.append(capacity())

    def once(real):
        def wrapped(*args, **kwargs):
            result = real(*args, **kwargs)
            if not grown:
                put_a()
            return result
        return wrapped

    if where == "cpu":
        put_a()
    elif where == "before_the_probe":
        monkeypatch.setattr(device_unique, "dedup_passes_fixed",
                            once(device_unique.dedup_passes_fixed))
    elif where == "after_the_probe":
        monkeypatch.setattr(shard._chain, "lookup_deduped", once(shard._chain.lookup_deduped))
    state = emb.prepare(batches[2])
    monkeypatch.undo()
    if where == "before_use":
        put_a()
    rows = _host(emb.embed(state)).copy()
    emb.backward(emb.xp.asarray(grads[2].reshape(rows.shape)))
    opt.step()
    return rows, grown, emb.export()


@pytest.mark.stress_seeds
@pytest.mark.filterwarnings("ignore:.*exceed capacity")
@pytest.mark.parametrize("where", ["before_the_probe", "after_the_probe", "before_use"])
def test_a_put_that_grows_the_index_around_the_fused_find_leaves_no_stale_row(launch, tmp_path,
                                                                              where, monkeypatch):
    """The fused dedup + find reads the store's index; a put (the previous step's, on the main
    thread while a prefetch looks up) may grow and rehash that index at any point around it.
    Whether the put lands before the lookup's probe, just after it, or while the looked-up
    batch waits for its step, the batch's rows are those of the serial order (the put first),
    bit for bit: the probe runs after the lookup's write version is recorded, under the
    chain's lock, so a put either precedes it or is logged and patched in by the refresh."""
    from one_embedding.kernels import device_unique

    batches = _batches(3)
    # A: 900 new keys, more than the index W's put grew takes at 0.7 (1,024 buckets: W's keys
    # and room for two more batches of its size, cache/device.py's HEADROOM_BATCHES)
    batches[1] = np.arange(900, dtype=np.int64).reshape(300, 3) * 13 + 100_003
    batches[2] = np.concatenate([batches[0][:20], batches[1][:20]])   # B: W's and A's keys
    runs = {}
    for device in ("cpu", launch):
        store = oe.make_device_mem_store_options(str(tmp_path / str(device == "cpu")),
                                                 capacity=8, size_factor=2)
        emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(), store, seed=5,
                                     device=device)
        opt = oe.Optimizer(_optimizer("adagrad"), embeddings=[emb])
        monkeypatch.setattr(device_unique, "FIND_IN_DEDUP", True)   # off by default
        runs[device == "cpu"] = _grow_between("cpu" if device == "cpu" else where, emb, opt,
                                              device, batches, monkeypatch)
        emb.close()
    (rows, grown, table), (want_rows, _, want_table) = runs[False], runs[True]
    assert grown[1] > grown[0], f"the put did not grow the index: {grown}"
    _same_bits(rows, want_rows)
    _same_bits(table[0], want_table[0])
    _same_bits(table[1], want_table[1])


def _fused_run(launch, device_fused, make_opt, steps=4, second_backward=False, lr=None):
    """A device (or "cpu") embedding trained ``steps`` steps with the fusion on or off ->
    (exported lines, the launcher's kernels)."""
    from one_embedding.kernels import fused_update

    fused_update.ENABLED, before = device_fused, fused_update.ENABLED
    try:
        device = EmulatedLauncher(launch.lib, cm.EMBEDDING_FAMILIES, seed=launch.seed) \
            if launch is not None else "cpu"
        emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                     oe.make_device_mem_store_options(None, capacity=None,
                                                                      size_factor=3), seed=5,
                                     device=device)
        opt = oe.Optimizer(make_opt(emb), embeddings=[emb])
        rng = np.random.default_rng(9)
        for batch in _batches(steps):
            out = emb(batch)
            grad = rng.standard_normal(out.shape).astype(np.float32)
            state = emb._last
            emb.backward(emb.xp.asarray(grad), state=state)
            if second_backward:                   # a second backward through the same lookup
                emb.backward(emb.xp.asarray(grad[::-1].copy()), state=state)
            opt.step()
            opt.zero_grad()
        lines = emb.export()[1]
        emb.close()
        return lines, (device.launched if launch is not None else set())
    finally:
        fused_update.ENABLED = before


@pytest.mark.parametrize("case", ["clipping", "second_backward"])
def test_fused_gradient_update_steps_aside_where_the_sums_are_needed(launch, case):
    """Clipping needs the per-key sums for its norm and a second backward through one lookup adds
    sums: there the two kernels run, and the rows equal the CPU embedding's bit for bit."""
    if case == "clipping":
        def make(emb):
            return oe.optim.Adam([{"params": [emb], "clip_grad_max_norm": 0.5}], lr=0.01)
    else:
        def make(emb):
            return oe.optim.Adam(lr=0.01)
    kwargs = dict(second_backward=case == "second_backward")
    want, _ = _fused_run(None, True, make, **kwargs)
    got, launched = _fused_run(launch, True, make, **kwargs)
    _same_bits(got, want)
    assert {"embedding_segment_sum", "optim_adam"} <= launched
    assert "optim_summed_adam" not in launched


@pytest.mark.parametrize("deferred", [False, True])
def test_fused_gradient_update_reports_a_non_finite_row_as_the_two_kernels_do(launch, deferred):
    """An update that overflows a row: the same error, naming the key and its summed gradient's
    largest |g|, with the fusion on (the row summed by ``optim_summed_row``) and off."""
    from one_embedding import host_sync
    from one_embedding.errors import InputError

    messages = []
    for fused in (True, False):
        def make(emb):
            return oe.optim.SGD(lr=3e38)
        checks = host_sync.DeferredChecks()
        with pytest.raises(InputError) as err:
            if deferred:
                with host_sync.deferring(checks):
                    _fused_run(launch, fused, make, steps=1)
                checks.read(np)
            else:
                _fused_run(launch, fused, make, steps=1)
        messages.append(str(err.value))
    assert "makes the row of key" in messages[0] and "gradient max |g| = " in messages[0]
    assert messages[0] == messages[1]


def test_apply_gradients_sums_inside_the_update_too(launch, tmp_path):
    """``emb.apply_gradients`` (no Optimizer, so no clipping) takes the fused path as well: the
    CPU embedding's rows, optim_summed_sgd launched, no segment sum."""
    device = EmulatedLauncher(launch.lib, cm.EMBEDDING_FAMILIES, seed=launch.seed)
    rows = {}
    for where in ("cpu", device):
        emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                     _store("device_mem", tmp_path / str(where == "cpu"), 1),
                                     seed=5, device=where)
        rng = np.random.default_rng(3)
        for step, batch in enumerate(_batches(3), start=1):
            out = emb(batch)
            emb.backward(emb.xp.asarray(rng.standard_normal(out.shape).astype(np.float32)))
            emb.apply_gradients(oe.optim.SGD(lr=0.1), step)
        rows[where == "cpu"] = emb.export()[1]
        emb.close()
    _same_bits(rows[False], rows[True])
    assert "optim_summed_sgd" in device.launched and "embedding_segment_sum" not in device.launched


class _StreamRecorder(EmulatedLauncher):
    """The emulated launcher with pretend CUDA streams: ``stream()`` names a stream current for
    the calling thread, and every record / wait is logged, so the order the pipeline and the
    chain ask for can be checked (the emulator itself runs everything in issue order)."""

    def __init__(self, inner: EmulatedLauncher):
        super().__init__(inner.lib, cm.EMBEDDING_FAMILIES, seed=inner.seed)
        import threading

        self._local = threading.local()
        self.log: list[tuple] = []
        self._seq = 0

    def current(self) -> str:
        return getattr(self._local, "stream", "main")

    def stream(self):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self._local.stream = "prefetch"
            try:
                yield
            finally:
                self._local.stream = "main"
        return scope()

    def record(self):
        self._seq += 1
        event = (self.current(), self._seq)
        self.log.append(("record", event))
        return event

    def wait(self, event) -> None:
        if event is not None:
            self.log.append(("wait", self.current(), event))


@pytest.mark.stress_seeds
def test_device_prefetch_orders_the_streams_with_events(launch, tmp_path):
    rec = _StreamRecorder(launch)
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, _tables(),
                                 _store("cached_host_mem", tmp_path, 2), device=rec)
    opt = oe.Optimizer(_optimizer("adagrad"), embeddings=[emb])
    prepared = {}
    prepare = emb.prepare

    def tracked_prepare(ids, table_ids=None, **kw):
        state = prepare(ids, table_ids, **kw)
        assert rec.current() == "prefetch"                 # the background thread's own stream
        prepared[id(state)] = rec._seq                     # its work so far ends at this event
        return state

    emb.prepare = tracked_prepare
    embeds = 0
    for _, state in Prefetcher(_batches(6), emb, depth=2, ids=lambda b: b):
        # the main stream waited for an event the prefetch stream recorded after this prepare
        waited = [e for kind, *rest in rec.log if kind == "wait" and rest[0] == "main"
                  for e in rest[1:] if e[0] == "prefetch"]
        assert waited and max(seq for _, seq in waited) >= prepared[id(state)]
        out = emb.embed(state)
        emb.backward(np.ones(out.shape, np.float32))
        opt.step()
        embeds += 1
    assert embeds == 6
    # the chain's calls form one sequence across both streams: each waits for the previous one
    records = [e for kind, *rest in rec.log if kind == "record" for e in rest]
    cross = [(rest[0], rest[1]) for kind, *rest in rec.log if kind == "wait" and rest[0] != rest[1][0]]
    assert {s for s, _ in records} == {"main", "prefetch"}
    assert any(stream == "main" for stream, _ in cross) and any(s == "prefetch" for s, _ in cross)
    emb.close()


@pytest.mark.stress_seeds
@pytest.mark.parametrize("world", [1, 3, 8])
def test_device_partition_by_owner_equals_the_cpu_partition(launch, world):
    """The ID shuffle's local half for several ranks (the exchange itself needs MPI)."""
    from one_embedding.parallel.shuffle import partition_ids
    from one_embedding.parallel.unique import first_occurrence, unique_ids

    rng = np.random.default_rng(world)
    keys = rng.zipf(1.2, 3000).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    tables = rng.integers(0, 26, keys.size).astype(np.int32)
    got, want = partition_ids(keys, tables, world, launch), partition_ids(keys, tables, world)
    for field in ("unique_keys", "unique_table_ids", "inverse", "counts_per_rank"):
        _same_bits(getattr(got, field), getattr(want, field))
    uniq, inverse = unique_ids(keys)
    _same_bits(first_occurrence(inverse, uniq.size, launch), first_occurrence(inverse, uniq.size))
