"""DLRM, DCN and DeepFM take their shared arguments by keyword, under the same names in the same
order, so a positional call fails loudly instead of building a model of other sizes."""
import inspect

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import ConfigError
from one_embedding.models import DCN, DLRM, CTRModel, DeepFM

MODELS = [DLRM, DCN, DeepFM]


def parameters(cls):
    return [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("cls", MODELS)
def test_every_argument_is_keyword_only(cls):
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters(cls))


@pytest.mark.parametrize("cls", MODELS)
def test_positional_construction_raises_type_error_naming_the_keywords(cls):
    with pytest.raises(TypeError, match=rf"{cls.__name__} takes keyword arguments only, got 3 "
                                        r"positional value\(s\): write \w+\(num_tables=2, "
                                        r"embedding_dim=4, dense_features=3\)"):
        cls(2, 4, 3)


def test_shared_arguments_have_the_same_names_in_the_same_order():
    names = [[p.name for p in parameters(cls)] for cls in MODELS]
    shared = [n for n in names[0] if all(n in other for other in names[1:])]
    assert shared == list(CTRModel.SHARED_ARGUMENTS)
    for cls_names in names:
        assert [n for n in cls_names if n in shared] == shared
        assert cls_names[:3] == ["num_tables", "embedding_dim", "dense_features"]


def test_the_embedding_mismatch_message_comes_from_the_model():
    def embedding(dim):
        tables = [oe.make_table_options(oe.make_uniform_initializer(-0.1, 0.1))] * 2
        store = oe.make_device_mem_store_options(None, capacity=16)
        return oe.MultiTableEmbedding("e", dim, np.float32, np.int64, tables, store)

    with pytest.raises(ConfigError, match="must equal the model's embedding_dim and the bottom "
                                          "MLP output"):
        DLRM(num_tables=2, embedding_dim=4, dense_features=3, bottom_mlp=[4], top_mlp=[1],
             embedding=embedding(8))
    with pytest.raises(ConfigError, match=r"must equal the model's embedding_dim\): build"):
        DCN(num_tables=2, embedding_dim=4, dnn=[4], embedding=embedding(8))
