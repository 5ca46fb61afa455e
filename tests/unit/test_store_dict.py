"""Store options in OneFlow's dict form (store_dict.py): read and edited as OneFlow scripts do,
round-tripped for every preset, OneFlow's own dicts accepted by the embedding, bad edits refused
with the options left as they were."""
import dataclasses

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError
from one_embedding.store_dict import from_oneflow_dict, to_oneflow_dict


def _presets(tmp_path):
    lifecycle = oe.make_lifecycle_options(admit_min_count=2)
    return [
        oe.make_device_mem_store_options(str(tmp_path / "d"), capacity=1000, size_factor=2),
        oe.make_cached_host_mem_store_options(16, str(tmp_path / "h"), 5000, lifecycle=lifecycle),
        oe.make_cached_ssd_store_options(8, str(tmp_path / "s"), capacity=None, engine="rocksdb",
                                         host_cache_budget_mb=32, physical_block_size=512),
        oe.make_cached_ssd_store_options(8, str(tmp_path / "s2"), 10, cache_policy="lfu",
                                         storage_dim=12),
    ]


def test_every_preset_round_trips_through_the_oneflow_dict(tmp_path):
    for options in _presets(tmp_path):
        assert from_oneflow_dict(to_oneflow_dict(options)) == options
        assert set(options.keys()) == {"kv_store", "size_factor", "one_embedding"}
        assert options["size_factor"] == options.size_factor


def test_oneflow_layout_is_read_as_oneflow_writes_it(tmp_path):
    ssd = oe.make_cached_ssd_store_options(cache_budget_mb=64, persistent_path=str(tmp_path),
                                           capacity=1000, host_cache_budget_mb=128)
    kv = ssd["kv_store"]
    assert kv["caches"] == [
        {"policy": "lru", "value_memory_kind": "device", "cache_memory_budget_mb": 64},
        {"policy": "lru", "value_memory_kind": "host", "cache_memory_budget_mb": 128}]
    assert kv["persistent_table"] == {"path": str(tmp_path), "physical_block_size": 4096,
                                      "capacity_hint": 1000}
    device = oe.make_device_mem_store_options(str(tmp_path), capacity=77)
    assert device["kv_store"]["caches"] == [{"policy": "full", "value_memory_kind": "device",
                                             "capacity": 77}]


def test_edits_through_the_dict_change_the_options(tmp_path):
    store = oe.make_cached_ssd_store_options(64, str(tmp_path), capacity=1000)
    store["kv_store"]["caches"][0]["cache_memory_budget_mb"] = 1024
    store["kv_store"]["persistent_table"]["physical_block_size"] = 512
    store["size_factor"] = 3
    store["kv_store"]["caches"].append({"policy": "lru", "value_memory_kind": "host",
                                        "cache_memory_budget_mb": 256})
    assert store.caches[0].budget_mb == 1024 and store.physical_block_size == 512
    assert store.size_factor == 3 and [c.location for c in store.caches] == ["device", "host"]
    assert store.kind == "cached_ssd" and store.engine == "slots"
    # a "full" host cache under the device cache makes it OneFlow's cached_host_mem
    store["kv_store"]["caches"][1] = {"policy": "full", "value_memory_kind": "host"}
    assert store.kind == "cached_host_mem" and store.engine is None


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["kv_store"]["caches"][0].__setitem__("policy", "fifo"), "'fifo'"),
    (lambda s: s["kv_store"]["persistent_table"].__setitem__("physical_block_size", 1000), "1000"),
    (lambda s: s.__setitem__("size_factor", 0), "size_factor=0"),
    (lambda s: s["kv_store"]["caches"][0].pop("value_memory_kind"), "'value_memory_kind'"),
    (lambda s: s["kv_store"]["persistent_table"].__setitem__("path", ["/a", "/b"]), "one per rank"),
    (lambda s: s["kv_store"].__setitem__("caches", []), "one or two cache dicts"),
])
def test_bad_edits_are_refused_and_change_nothing(tmp_path, edit, message):
    store = oe.make_cached_ssd_store_options(64, str(tmp_path), capacity=1000)
    before = dataclasses.replace(store)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        edit(store)
    assert store == before and store["kv_store"] == before["kv_store"]


def test_the_embedding_takes_oneflows_own_dict(tmp_path):
    # literally what OneFlow's make_cached_host_mem_store_options returns (capacity in the full cache)
    oneflow = {"kv_store": {"caches": [
        {"policy": "lru", "cache_memory_budget_mb": 1, "value_memory_kind": "device"},
        {"policy": "full", "capacity": 5000, "value_memory_kind": "host"}],
        "persistent_table": {"path": str(tmp_path), "physical_block_size": 512,
                             "capacity_hint": 5000}}, "size_factor": 1}
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, oneflow)
    assert emb.store_options.kind == "cached_host_mem" and emb.store_options.capacity == 5000
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    want = oe.MultiTableEmbedding("u", 4, np.float32, np.int64, None,
                                  oe.make_cached_host_mem_store_options(1, str(tmp_path / "u"), 5000))
    np.testing.assert_array_equal(np.asarray(emb(ids)), np.asarray(want(ids)))
    with pytest.raises(ConfigError, match="no 'kv_store'"):
        oe.MultiTableEmbedding("v", 4, np.float32, np.int64, None, {"size_factor": 1})


def test_an_edit_after_the_embedding_is_built_leaves_it_as_built(tmp_path):
    store = oe.make_cached_host_mem_store_options(1, str(tmp_path), 1000)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, store)
    store["kv_store"]["caches"][0]["cache_memory_budget_mb"] = 64
    assert store.caches[0].budget_mb == 64
    assert emb.store_options.caches[0].budget_mb == 1     # what its tiers were built from
    emb.close()
