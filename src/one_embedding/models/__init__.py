"""Reference recommender models built from ``one_embedding.nn`` layers and an embedding.

    >>> import numpy as np
    >>> from one_embedding.models import DLRM
    >>> m = DLRM(dense_features=3, embedding_dim=4, num_tables=2, bottom_mlp=[8, 4],
    ...          top_mlp=[8, 1], table_sizes=[10, 10])
    >>> logits = m(np.zeros((5, 3), np.float32), np.array([[0, 10]] * 5))
    >>> logits.shape
    (5,)
    >>> m.backward(np.ones(5, np.float32)).shape      # gradient handed to m.embedding
    (5, 2, 4)
"""
from .base import CTRModel, table_initializer
from .dcn import DCN
from .deepfm import DeepFM
from .dlrm import CRITEO_1TB_TABLE_SIZES, DLRM

__all__ = ["CTRModel", "DLRM", "DCN", "DeepFM", "CRITEO_1TB_TABLE_SIZES", "table_initializer"]
