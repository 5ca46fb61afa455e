"""one_embedding: OneEmbedding-compatible multi-table embeddings over tiered caches and SSD stores.

Numpy is the CPU backend and the reference; CuPy the GPU backend. ``import one_embedding`` never
imports cupy.
"""
from ._numba_cache import ensure_writable_numba_cache

ensure_writable_numba_cache()   # before numba is imported: it reads NUMBA_CACHE_DIR once

from . import metrics, models, nn, optim, serving  # noqa: E402
from .embedding import MultiTableEmbedding, MultiTableMultiColumnEmbedding
from .errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    ConventionWarning,
    InputError,
    LockedError,
    OneEmbeddingError,
    SnapshotError,
    StoreError,
)
from .optim import Ftrl, SmartDecayAdam
from .optimizer import Optimizer
from .options import (
    make_cached_host_mem_store_options,
    make_cached_ssd_store_options,
    make_column_options,
    make_constant_initializer,
    make_device_mem_store_options,
    make_lifecycle_options,
    make_normal_initializer,
    make_table,
    make_table_options,
    make_trunc_normal_initializer,
    make_uniform_initializer,
)
from .table_io import (
    PersistentTableReader,
    PersistentTableWriter,
    make_persistent_table_reader,
    make_persistent_table_writer,
)

#: OneFlow's base class of both embeddings; ours is MultiTableMultiColumnEmbedding (same arguments)
Embedding = MultiTableMultiColumnEmbedding

__version__ = "0.1.0"

__all__ = [
    "MultiTableEmbedding", "MultiTableMultiColumnEmbedding", "Embedding", "Optimizer", "Ftrl",
    "SmartDecayAdam",
    "optim", "nn", "models", "serving",
    "metrics",
    "make_uniform_initializer", "make_normal_initializer", "make_constant_initializer",
    "make_trunc_normal_initializer", "make_table_options", "make_table", "make_column_options",
    "make_device_mem_store_options", "make_cached_host_mem_store_options",
    "make_cached_ssd_store_options", "make_lifecycle_options",
    "make_persistent_table_writer", "make_persistent_table_reader", "PersistentTableReader",
    "PersistentTableWriter",
    "OneEmbeddingError", "ConfigError", "InputError", "StoreError", "CapacityError",
    "SnapshotError", "LockedError", "ClosedError", "ConventionWarning",
]
