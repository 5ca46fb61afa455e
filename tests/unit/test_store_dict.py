"""Store options in OneFlow's dict form (store_dict.py): read as OneFlow scripts do, edited on a
copy (``to_dict``) that builds new options (``from_dict``), round-tripped for every preset,
OneFlow's own dicts accepted by the embedding, bad edits refused. The options themselves are
frozen: an edit through ``store[...]`` raises and neither their value nor their hash changes."""
import copy
import pickle

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError
from one_embedding.options import StoreOptions
from one_embedding.store_dict import to_oneflow_dict


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
        assert StoreOptions.from_dict(to_oneflow_dict(options)) == options
        assert StoreOptions.from_dict(options.to_dict()) == options
        assert set(options.keys()) == {"kv_store", "size_factor", "storage_dim", "one_embedding"}
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


def test_edits_of_the_dict_build_new_options(tmp_path):
    # was test_edits_through_the_dict_change_the_options: edits through store[...] mutated the
    # frozen options in place (issue 34, item 4); now they go to a copy, from_dict builds new ones
    store = oe.make_cached_ssd_store_options(64, str(tmp_path), capacity=1000)
    before, before_hash = copy.deepcopy(store), hash(store)
    d = store.to_dict()
    d["kv_store"]["caches"][0]["cache_memory_budget_mb"] = 1024
    d["kv_store"]["persistent_table"]["physical_block_size"] = 512
    d["size_factor"] = 3
    d["kv_store"]["caches"].append({"policy": "lru", "value_memory_kind": "host",
                                    "cache_memory_budget_mb": 256})
    edited = StoreOptions.from_dict(d)
    assert edited.caches[0].budget_mb == 1024 and edited.physical_block_size == 512
    assert edited.size_factor == 3 and [c.location for c in edited.caches] == ["device", "host"]
    assert edited.kind == "cached_ssd" and edited.engine == "slots"
    # a "full" host cache under the device cache makes it OneFlow's cached_host_mem
    d["kv_store"]["caches"][1] = {"policy": "full", "value_memory_kind": "host"}
    again = StoreOptions.from_dict(d)
    assert again.kind == "cached_host_mem" and again.engine is None
    assert store == before and hash(store) == before_hash          # the original as it was
    assert edited.caches[0].budget_mb == 1024                       # a later edit of d: neither
    assert {store: 1}[before] == 1                                  # still found by its hash


@pytest.mark.parametrize("edit", [
    lambda s: s["kv_store"]["caches"][0].__setitem__("cache_memory_budget_mb", 4096),
    lambda s: s["kv_store"]["persistent_table"].update(physical_block_size=512),
    lambda s: s.__setitem__("size_factor", 3),
    lambda s: s.__delitem__("size_factor"),
    lambda s: s["kv_store"]["caches"].append({"policy": "lru", "value_memory_kind": "host"}),
    lambda s: s["kv_store"]["caches"].pop(),
    lambda s: s["kv_store"]["caches"][0].pop("policy"),
    lambda s: s["kv_store"].__setitem__("caches", []),
])
def test_the_frozen_options_refuse_edits_through_the_view(tmp_path, edit):
    # before issue 34 these edited the frozen options in place, changing their hash while in use
    store = oe.make_cached_ssd_store_options(64, str(tmp_path), capacity=1000)
    before, before_hash = copy.deepcopy(store), hash(store)
    with pytest.raises(TypeError, match=r"frozen.*to_dict\(\).*from_dict"):
        edit(store)
    assert store == before and hash(store) == before_hash
    assert store["kv_store"] == before["kv_store"]


def test_the_view_reads_as_plain_dicts_and_copies_to_plain_ones(tmp_path):
    store = oe.make_cached_host_mem_store_options(16, str(tmp_path), 5000)
    kv = store["kv_store"]
    assert kv == store.to_dict()["kv_store"] and isinstance(kv, dict)
    mine = copy.deepcopy(kv)               # a copy of the view is a plain, editable dict
    mine["caches"][0]["cache_memory_budget_mb"] = 1
    assert store.caches[0].budget_mb == 16 and type(mine["caches"]) is list
    assert pickle.loads(pickle.dumps(kv)) == kv
    with pytest.raises(KeyError, match="kv_store"):
        store["kvstore"]
    assert store.get("kvstore") is None and "size_factor" in store


def test_a_dict_and_its_options_pass_the_same_checks(tmp_path):
    d = oe.make_cached_ssd_store_options(64, str(tmp_path), capacity=1000).to_dict()
    d["kv_store"]["caches"][0]["policy"] = "fifo"
    with pytest.raises(ConfigError, match="'fifo'"):
        StoreOptions.from_dict(d)
    with pytest.raises(ConfigError, match="'fifo'"):
        oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, d)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["kv_store"]["caches"][0].__setitem__("policy", "fifo"), "'fifo'"),
    (lambda d: d["kv_store"]["persistent_table"].__setitem__("physical_block_size", 1000), "1000"),
    (lambda d: d.__setitem__("size_factor", 0), "size_factor=0"),
    (lambda d: d["kv_store"]["caches"][0].pop("value_memory_kind"), "'value_memory_kind'"),
    (lambda d: d["kv_store"].__setitem__("caches", []), "one or two cache dicts"),
    # a fault campaign's (2026-12-07): raw Python errors, silent coercions, misspelt keys
    (lambda d: d.__setitem__("one_embedding", [1]), "'one_embedding' must be a dict"),
    (lambda d: d["kv_store"]["persistent_table"].__setitem__("capacity_hint", "abc"),
     "['capacity_hint'] is 'abc': give a whole number of rows"),
    (lambda d: d["kv_store"]["persistent_table"].__setitem__("capacity_hint", 1.5),
     "['capacity_hint'] is 1.5"),
    (lambda d: d["kv_store"]["caches"][0].__setitem__("cache_memory_budget_mb", "64"),
     "kv_store['caches'][0]['cache_memory_budget_mb'] is '64'"),
    (lambda d: d.__setitem__("size_factr", 2), "the dict has no key 'size_factr'"),
    (lambda d: d["kv_store"]["persistent_table"].__setitem__("capacty", 5),
     "kv_store['persistent_table'] has no key 'capacty'"),
    (lambda d: d["one_embedding"].__setitem__("engne", "rocksdb"),
     "'one_embedding' has no key 'engne'"),
])
def test_bad_edits_are_refused(tmp_path, edit, message):
    # was test_bad_edits_are_refused_and_change_nothing: the check now runs in from_dict, and
    # the options cannot change at all
    store = oe.make_cached_ssd_store_options(64, str(tmp_path), capacity=1000)
    d = store.to_dict()
    edit(d)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        StoreOptions.from_dict(d)


def test_oneflows_top_level_storage_dim_and_per_rank_paths_are_taken(tmp_path):
    """OneFlow's make_*_store_options put storage_dim at the top level, and take a path per
    rank: the first was dropped without a word (storage_dim 18 became the embedding's 5), the
    second refused, though the builders take both (found by a fault campaign)."""
    d = oe.make_device_mem_store_options(str(tmp_path), capacity=100).to_dict()
    d["storage_dim"] = 18
    d["one_embedding"].pop("storage_dim", None)
    assert StoreOptions.from_dict(d).storage_dim == 18
    d["one_embedding"]["storage_dim"] = 12       # the place this library wrote it before
    with pytest.raises(ConfigError, match=r"storage_dim is 18 but one_embedding\['storage_dim'\] "
                                          r"is 12"):
        StoreOptions.from_dict(d)
    old = oe.make_device_mem_store_options(str(tmp_path), capacity=100).to_dict()
    old["one_embedding"]["storage_dim"] = old.pop("storage_dim")   # a dict written before
    assert StoreOptions.from_dict(old) == oe.make_device_mem_store_options(str(tmp_path), 100)
    paths = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    listed = oe.make_cached_ssd_store_options(1, paths)
    assert StoreOptions.from_dict(listed.to_dict()) == listed


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
    # was: the edit went through store[...] into the caller's options; now it goes to a copy
    store = oe.make_cached_host_mem_store_options(1, str(tmp_path), 1000)
    d = store.to_dict()
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, d)
    d["kv_store"]["caches"][0]["cache_memory_budget_mb"] = 64
    assert StoreOptions.from_dict(d).caches[0].budget_mb == 64
    assert emb.store_options.caches[0].budget_mb == 1     # what its tiers were built from
    assert emb.store_options == store
    emb.close()


def test_options_and_store_dict_import_no_cycle(root):
    """options imports store_dict; store_dict imports nothing of options (before issue 34 each
    imported the other inside functions)."""
    import ast

    tree = ast.parse((root / "src" / "one_embedding" / "store_dict.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "options" not in imported and imported <= {"__future__", "errors"}


def test_whole_numbers_given_as_floats_or_numpy_integers_are_stored_as_ints(tmp_path):
    """np.int64(512) was accepted, then failed the snapshot's JSON manifest after training;
    4096.0 failed the slot segments' arithmetic."""
    import json

    for pbs in (np.int64(512), 4096.0):
        store = oe.make_cached_ssd_store_options(1, str(tmp_path / str(pbs)), capacity=np.int64(9),
                                                 physical_block_size=pbs)
        assert type(store.physical_block_size) is int and type(store.capacity) is int
        emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, store)
        emb(np.arange(5))
        emb.save_snapshot("s")
        emb.close()


def test_the_dict_with_a_lifecycle_is_plain_json_and_builds_the_same_options(tmp_path):
    import json

    lifecycle = oe.make_lifecycle_options(admit_min_count=2, steps_to_live=10)
    store = oe.make_cached_host_mem_store_options(16, str(tmp_path), 5000, lifecycle=lifecycle)
    assert StoreOptions.from_dict(json.loads(json.dumps(store.to_dict()))) == store


def test_an_engine_given_to_another_store_in_the_dict_is_refused_not_dropped(tmp_path):
    d = oe.make_device_mem_store_options(str(tmp_path), capacity=10).to_dict()
    d["one_embedding"]["engine"] = "rocksdb"
    with pytest.raises(ConfigError, match="engine"):
        StoreOptions.from_dict(d)
