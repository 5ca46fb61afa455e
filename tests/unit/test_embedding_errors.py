"""Bad input raises an exception naming the value and the fix, and leaves the table unchanged."""
import numpy as np
import pytest

import one_embedding as oe


@pytest.fixture
def trained():
    tables = [oe.make_table_options(oe.make_uniform_initializer(-1, 1)) for _ in range(3)]
    store = oe.make_device_mem_store_options(None, capacity=100, size_factor=2)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.uint32, tables, store)
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb])
    out = emb(np.array([[1, 2, 3], [4, 5, 6]], np.uint32))
    emb.backward(np.ones_like(out))
    opt.step()
    return emb, opt


def _same(a, b):
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize(
    "ids,table_ids,match",
    [
        (np.array([[1.0, 2.0, 3.0]]), None, r"dtype float64.*integers"),
        (np.array([[1, 2, 3, 4]]), None, r"shape \(1, 4\) with 3 tables.*table_ids"),
        (np.array([[1, 2, 3]]), np.array([[0, 1, 3]]), r"table id 3 is out of range.*0\.\.2"),
        (np.array([[1, 2, 3]]), np.array([[0, -1, 2]]), r"table id -1 is out of range"),
        (np.array([[1, 2, 3]]), np.array([0, 1]), r"do not broadcast"),
        (np.array([[1, -2, 3]], np.int64), None, r"id -2 does not fit key_type=uint32.*signed"),
        (np.array([[1, 2**40, 3]], np.int64), None, r"id 1099511627776 does not fit.*wider"),
        (np.int64(3), None, r"scalar"),
    ],
)
def test_bad_ids_raise_and_leave_table_unchanged(trained, ids, table_ids, match):
    emb, opt = trained
    before = emb.export()
    with pytest.raises(oe.InputError, match=match):
        emb(ids, table_ids=table_ids)
    opt.step()
    _same(before, emb.export())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_gradient_raises_and_leaves_table_unchanged(trained, bad):
    emb, opt = trained
    before = emb.export()
    out = emb(np.array([[1, 2, 3]], np.uint32))
    g = np.ones_like(out)
    g[0, 1, 2] = bad
    with pytest.raises(oe.InputError, match=r"non-finite value \((nan|inf)\) at row 1.*unchanged"):
        emb.backward(g)
    opt.step()
    _same(before, emb.export())


def test_gradient_shape_and_order_errors(trained):
    emb, _ = trained
    with pytest.raises(oe.InputError, match="without a forward"):
        emb.backward(np.ones((1, 3, 4), np.float32))
    emb(np.array([[1, 2, 3]], np.uint32))
    with pytest.raises(oe.InputError, match=r"shape \(1, 3, 5\).*\(1, 3, 4\)"):
        emb.backward(np.ones((1, 3, 5), np.float32))


@pytest.mark.parametrize(
    "opt,size_factor,fix",
    [
        (lambda: oe.optim.Adam(lr=0.1), 2, "size_factor=3"),
        (lambda: oe.optim.Adagrad(lr=0.1), 1, "size_factor=2"),
        (lambda: oe.optim.Ftrl(lr=0.1, convention="oneflow"), 2, "size_factor=3"),
        (lambda: oe.optim.SGD(lr=0.1, momentum=0.9), 1, "size_factor=2"),
    ],
)
def test_size_factor_too_small_names_the_fix(opt, size_factor, fix):
    store = oe.make_device_mem_store_options(None, capacity=10, size_factor=size_factor)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, store)
    with pytest.raises(oe.ConfigError, match=rf"size_factor={size_factor} gives line_size.*use {fix}"):
        oe.Optimizer(opt(), embeddings=[emb])


def test_storage_dim_too_small_is_named():
    store = oe.make_device_mem_store_options(None, capacity=10, storage_dim=6)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, store)
    with pytest.raises(oe.ConfigError, match=r"storage_dim=6 gives line_size=6.*size_factor=2"):
        oe.Optimizer(oe.optim.Adagrad(lr=0.1), embeddings=[emb])


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: oe.make_uniform_initializer(1, 0), "low < high"),
        (lambda: oe.make_normal_initializer(0, -1), "std >= 0"),
        (lambda: oe.make_trunc_normal_initializer(0, 1, 2, -2), "a < b"),
        (lambda: oe.make_constant_initializer(float("nan")), "finite"),
        (lambda: oe.make_table_options("normal"), "pass an initializer"),
        (lambda: oe.make_device_mem_store_options(None, capacity=-5), "capacity=-5"),
        (lambda: oe.make_device_mem_store_options(None, 10, size_factor=0), "size_factor=0"),
        (lambda: oe.make_cached_ssd_store_options(0, "/tmp/x"), "cache_budget_mb > 0"),
        (lambda: oe.make_cached_ssd_store_options(8, "/tmp/x", engine="leveldb"), "engine='leveldb'"),
        (lambda: oe.make_device_mem_store_options(None, 10, physical_block_size=1000), "1000"),
    ],
)
def test_bad_options_raise_config_errors(build, match):
    with pytest.raises(oe.ConfigError, match=match):
        build()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(embedding_dim=0), "embedding_dim=0"),
        (dict(dtype=np.float64), "float32"),
        (dict(key_type=np.int16), "key_type=<class 'numpy.int16'>"),
        (dict(tables=[]), "tables is empty"),
        (dict(tables=["t"]), r"tables\[0\]"),
        (dict(embedding_dim=[4, 1]), "MultiTableMultiColumnEmbedding"),
        (dict(store_options={"kind": "device_mem"}), r"no 'kv_store'.*make_\*_store_options"),
        (dict(store_options="device_mem"), "make_device_mem_store_options"),
        (dict(padding_idx=-1, key_type=np.uint64), "padding_idx=-1"),
    ],
)
def test_bad_embedding_arguments(kwargs, match):
    args = dict(name="t", embedding_dim=4, dtype=np.float32, key_type=np.int64, tables=None,
                store_options=oe.make_device_mem_store_options(None, 10))
    args.update(kwargs)
    with pytest.raises(oe.ConfigError, match=match):
        oe.MultiTableEmbedding(**args)


def test_column_count_must_match_tables():
    # a table of one initializer initialises every column (OneFlow's rule); two columns for
    # three are refused
    init = oe.make_normal_initializer()
    tables = [oe.make_table_options([oe.make_column_options(init)] * 2)]
    with pytest.raises(oe.ConfigError, match=r"2 column\(s\) but embedding_dim=\[4, 1, 2\] has 3"):
        oe.MultiTableMultiColumnEmbedding("t", [4, 1, 2], np.float32, np.int64, tables,
                                          oe.make_device_mem_store_options(None, 10))


def test_key_types_round_trip_and_table_ids_broadcast():
    for kt, ids in [(np.int32, [-5, 7]), (np.int64, [-(2**40), 2**40]), (np.uint32, [2**32 - 1, 0]),
                    (np.uint64, [2**64 - 1, 1])]:
        store = oe.make_device_mem_store_options(None, 10)
        tables = [oe.make_table_options(oe.make_constant_initializer(c)) for c in (1.0, 2.0)]
        emb = oe.MultiTableEmbedding("t", 2, np.float32, kt, tables, store)
        arr = np.array([ids, ids], dtype=kt)
        out = emb(arr, table_ids=np.array([[0], [1]]))  # broadcasts along the last dim
        assert out.shape == (2, 2, 2)
        assert (out[0] == 1.0).all() and (out[1] == 1.0).all()  # first occurrence: table 0
