"""Bad arguments to the public API raise ConfigError / InputError / CapacityError naming the
argument and the value, never a raw ValueError / TypeError / OverflowError / OSError from deep
inside, and no setting is silently truncated or dropped (found by a fault campaign)."""
import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import CapacityError, ConfigError, InputError

NAN, INF = float("nan"), float("inf")


def _tables(n=3):
    return [oe.make_table_options(oe.make_uniform_initializer(-0.05, 0.05)) for _ in range(n)]


def _emb(**kw):
    args = {"name": "e", "embedding_dim": 8, "dtype": np.float32, "key_type": np.int64,
            "tables": _tables(), "store_options": oe.make_device_mem_store_options(None, 1000)}
    args.update(kw)
    return oe.MultiTableEmbedding(**args)


def _raises(exc, fn, *parts):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


@pytest.mark.parametrize("value,shown", [(NAN, "nan"), (INF, "inf"), (-INF, "-inf")])
def test_padding_idx_not_a_finite_integer(value, shown):
    _raises(ConfigError, lambda: _emb(padding_idx=value), f"padding_idx={shown}")


@pytest.mark.parametrize("value,shown", [("abc", "'abc'"), (NAN, "nan"), (1.7, "1.7"),
                                         (INF, "inf"), (True, "True")])
def test_seed_must_be_an_integer(value, shown):
    _raises(ConfigError, lambda: _emb(seed=value), f"seed={shown}", "integer")


def test_integer_seeds_still_work():
    assert _emb(seed=np.int64(7)).seed == 7
    assert _emb(seed=-1).seed == -1


@pytest.mark.parametrize("value,shown", [(5, "5"), (oe.make_table_options(oe.make_normal_initializer()),
                                                     "TableOptions")])
def test_tables_not_a_list(value, shown):
    _raises(ConfigError, lambda: _emb(tables=value), "tables=", shown, "make_table_options")


@pytest.mark.parametrize("make,shown", [
    (lambda: oe.make_device_mem_store_options(None, NAN), "capacity=nan"),
    (lambda: oe.make_device_mem_store_options(None, INF), "capacity=inf"),
    (lambda: oe.make_device_mem_store_options(None, 10, size_factor=NAN), "size_factor=nan"),
    (lambda: oe.make_device_mem_store_options(None, 10, size_factor=INF), "size_factor=inf"),
    (lambda: oe.make_device_mem_store_options(None, 10, storage_dim=NAN), "storage_dim=nan"),
])
def test_store_sizes_not_finite(make, shown):
    _raises(ConfigError, make, shown)


@pytest.mark.parametrize("make,shown", [
    (lambda: oe.make_cached_host_mem_store_options("abc", None, 100), "cache_budget_mb='abc'"),
    (lambda: oe.make_cached_host_mem_store_options(INF, None, 100), "cache_budget_mb=inf"),
    (lambda: oe.make_cached_host_mem_store_options(NAN, None, 100), "cache_budget_mb=nan"),
    (lambda: oe.make_cached_ssd_store_options(4, "/x", host_cache_budget_mb=-5),
     "host_cache_budget_mb=-5"),
    (lambda: oe.make_cached_ssd_store_options(4, "/x", host_cache_budget_mb=NAN),
     "host_cache_budget_mb=nan"),
    (lambda: oe.make_cached_ssd_store_options(4, "/x", host_cache_budget_mb=INF),
     "host_cache_budget_mb=inf"),
    (lambda: oe.make_cached_ssd_store_options(4, "/x", host_cache_budget_mb="8"),
     "host_cache_budget_mb='8'"),
])
def test_cache_budgets_refused_not_dropped(make, shown):
    _raises(ConfigError, make, shown, "MiB")


def test_host_cache_budget_zero_means_none():
    assert len(oe.make_cached_ssd_store_options(4, "/x", host_cache_budget_mb=0).caches) == 1
    assert len(oe.make_cached_ssd_store_options(4, "/x", host_cache_budget_mb=8).caches) == 2


@pytest.mark.parametrize("kw,shown", [
    ({"admit_min_count": NAN}, "admit_min_count=nan"),
    ({"max_rows": INF}, "max_rows=inf"),
    ({"steps_to_live": -INF}, "steps_to_live=-inf"),
])
def test_lifecycle_counts_not_finite(kw, shown):
    _raises(ConfigError, lambda: oe.make_lifecycle_options(**kw), shown, "integer")


@pytest.mark.parametrize("path,shown", [(123, "persistent_path=123"), (b"/tmp/x", "persistent_path=b"),
                                        (["/a", 5], "persistent_path=")])
def test_persistent_path_not_a_path(path, shown):
    _raises(ConfigError, lambda: oe.make_cached_ssd_store_options(4, path), shown, "os.PathLike")


def test_persistent_path_pathlike_accepted(tmp_path):
    assert oe.make_cached_ssd_store_options(4, tmp_path).persistent_path == tmp_path


def test_huge_device_mem_store_is_a_capacity_error():
    # 1000 rows of 10**12 floats: far beyond any address space
    _raises(CapacityError, lambda: _emb(embedding_dim=10**12), "cannot reserve", "MB",
            "capacity")


def test_huge_cache_keeps_its_budget_message():
    store = oe.make_cached_host_mem_store_options(1e9, None, 100)
    _raises(CapacityError, lambda: _emb(store_options=store), "cache_budget_mb")


@pytest.mark.parametrize("given,shown", [("one", "embeddings=<"), (5, "embeddings=5"),
                                         ("list_of_int", "embeddings[0]=5")])
def test_optimizer_embeddings_must_be_a_list_of_embeddings(given, shown):
    emb = _emb()
    value = {"one": emb, "list_of_int": [5]}.get(given, given)
    _raises(ConfigError, lambda: oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=value), shown,
            "embeddings=[")


@pytest.mark.parametrize("call,shown", [
    (lambda e: e(np.array([[1, 2, 3]]), table_ids=[[0, 1], [2]]), "table_ids"),
    (lambda e: e([[1, 2, 3], [4, 5]]), "ids"),
    (lambda e: e.forward([[1, 2, 3], [4]]), "ids"),
])
def test_ragged_ids(call, shown):
    emb = _emb()
    msg = _raises(InputError, lambda: call(emb), f"{shown}=", "same length")
    assert "[" in msg
