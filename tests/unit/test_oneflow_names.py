"""OneFlow's public ``oneflow.one_embedding`` names, present in ``one_embedding`` with OneFlow's
argument names (the README's "Coming from OneFlow" lists them and every remaining difference).

The 32 names: the 18 module-level names OneFlow's ``python/oneflow/one_embedding.py`` defines, and
the 14 members of its classes that a training script calls. Read from OneFlow's source (facts
only): each entry gives OneFlow's leading argument names, or None for an attribute.
"""
import inspect

import numpy as np
import pytest

import one_embedding as oe

import helpers

_STORE = ["persistent_path", "capacity", "size_factor", "storage_dim", "physical_block_size"]
_EMBEDDING = ["name", "embedding_dim", "dtype", "key_type", "tables", "store_options",
              "default_initializer", "padding_idx", "seed"]
_TABLE_IO = ["paths", "snapshot_name", "key_type", "value_type", "storage_dim",
             "physical_block_size"]

ONEFLOW_NAMES = {
    # module level
    "Embedding": _EMBEDDING,
    "MultiTableEmbedding": _EMBEDDING,
    "MultiTableMultiColumnEmbedding": _EMBEDDING,
    "make_device_mem_store_options": _STORE,
    "make_cached_host_mem_store_options": ["cache_budget_mb", *_STORE],
    "make_cached_ssd_store_options": ["cache_budget_mb", *_STORE, "host_cache_budget_mb"],
    "make_uniform_initializer": ["low", "high"],
    "make_normal_initializer": ["mean", "std"],
    "make_constant_initializer": ["value"],
    "make_trunc_normal_initializer": ["mean", "std", "a", "b"],
    "make_table_options": ["param"],
    "make_table": ["param"],
    "make_column_options": ["initializer"],
    "make_persistent_table_reader": _TABLE_IO,
    "make_persistent_table_writer": _TABLE_IO,
    "Ftrl": ["params", "lr", "weight_decay", "lr_power", "initial_accumulator_value", "lambda1",
             "lambda2", "beta"],
    "SmartDecayAdam": ["params", "lr", "betas", "eps", "weight_decay", "amsgrad",
                       "do_bias_correction"],
    "Optimizer": ["optimizer", "embeddings"],
    # members scripts use
    "MultiTableEmbedding.forward": ["ids", "table_ids"],
    "MultiTableEmbedding.save_snapshot": ["snapshot_name"],
    "MultiTableEmbedding.load_snapshot": ["snapshot_name"],
    "MultiTableEmbedding.embedding_dim": None,
    "MultiTableEmbedding.dtype": None,
    "MultiTableEmbedding.key_type": None,
    "MultiTableEmbedding.padding_idx": None,
    "MultiTableEmbedding.seed": None,
    "Ftrl.step": ["closure"],
    "Optimizer.step": ["closure"],
    "Optimizer.zero_grad": [],
    "Optimizer.state_dict": [],
    "Optimizer.load_state_dict": ["state_dict"],
    "Optimizer.param_groups": None,
}

#: not provided (the README says why)
MISSING = set()
#: provided, but an argument is named differently (positional calls are the same)
ARGUMENTS_DIFFER = set()

DOC = helpers.ROOT / "README.md"


def test_there_are_32_names_and_the_goal_is_met():
    assert len(ONEFLOW_NAMES) == 32
    present = len(ONEFLOW_NAMES) - len(MISSING)
    with_oneflow_arguments = present - len(ARGUMENTS_DIFFER)
    assert present >= 31 and with_oneflow_arguments >= 29


@pytest.fixture(scope="module")
def embedding():
    store = oe.make_device_mem_store_options(None, capacity=16)
    emb = oe.MultiTableEmbedding("names", 4, np.float32, np.int64, None, store, padding_idx=0)
    yield emb
    emb.close()


def resolve(dotted: str, embedding):
    head, _, member = dotted.partition(".")
    obj = getattr(oe, head)
    if not member:
        return obj
    if head == "MultiTableEmbedding" and not callable(getattr(obj, member, None)):
        return getattr(embedding, member)  # instance attributes
    return getattr(obj, member)


def leading_parameters(obj) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    names = [p.name for p in inspect.signature(target).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [n for n in names if n != "self"]


@pytest.mark.parametrize("name", sorted(set(ONEFLOW_NAMES) - MISSING))
def test_oneflow_name_is_present_with_oneflows_arguments(name, embedding):
    obj = resolve(name, embedding)
    wanted = ONEFLOW_NAMES[name]
    if wanted is None:
        return
    got = leading_parameters(obj)
    if name in ARGUMENTS_DIFFER:
        assert len(got) >= len(wanted), (name, got)  # same positions, other names
        return
    assert got[:len(wanted)] == wanted, f"{name}: OneFlow's arguments {wanted}, ours {got}"


@pytest.mark.parametrize("name", sorted(MISSING))
def test_missing_names_are_really_missing(name):
    assert not hasattr(oe, name)


def test_the_differences_table_names_every_gap():
    text = DOC.read_text()
    for name in sorted(MISSING | ARGUMENTS_DIFFER):
        assert name.rpartition(".")[2] in text, name
    for name in ONEFLOW_NAMES:  # the names list in the document is this list
        assert f"`{name}`" in text, name


def test_oneflow_attribute_names_and_to():
    import numpy as np

    import one_embedding as oe

    assert oe.PersistentTableReader is oe.table_io.PersistentTableReader
    assert oe.PersistentTableWriter is oe.table_io.PersistentTableWriter
    tables = [oe.make_table_options(oe.make_normal_initializer(0, 0.1)) for _ in range(3)]
    with oe.MultiTableEmbedding("sparse", 8, np.float32, np.int64, tables,
                                oe.make_device_mem_store_options(None, 10, size_factor=2)) as emb:
        assert (emb.embedding_name, emb.num_tables, emb.storage_dim) == ("sparse", 3, 16)
        assert emb.to("cpu") is emb
        import pytest

        with pytest.raises(oe.ConfigError, match="build it with device='cuda:0'"):
            emb.to("cuda:0")
