"""Criteo data: raw TSV and Parquet readers, a synthetic generator, and the batching loader.

Every source yields rows as ``dense (N, 13) float32`` (``log(max(x, 0) + 1)``, missing -> 0),
``ids (N, 26) int64`` globally unique keys (column c feeds table c; scheme in ``schema``) and
``labels (N,) float32``; ``BatchLoader`` turns any of them into fixed-size ``Batch`` objects.
``one_embedding.data.device`` puts them on a GPU: the synthetic rows generated there (the same
bits as on the CPU), file batches staged through page-locked buffers on their own stream.

>>> from one_embedding.data import SyntheticCriteo, BatchLoader
>>> data = SyntheticCriteo("kaggle", scale=0.001, seed=0, num_rows=10_000)
>>> batch = next(iter(BatchLoader(data, batch_size=256)))
>>> batch.dense.shape, batch.ids.shape, batch.labels.shape
((256, 13), (256, 26), (256,))
"""

from .loader import BatchLoader, open_source, split_mask
from .parquet import (ParquetReader, convert_tsv_to_parquet, detect_schema, is_parquet_file,
                      parquet_schema, write_parquet)
from .schema import (CRITEO_CARDINALITIES, DENSE_COLUMNS, LABEL_COLUMN, NUM_DENSE, NUM_SPARSE,
                     SPARSE_COLUMNS, Batch, KeyScheme, dense_log, resolve_cardinalities,
                     xxh64_u64)
from .synthetic import SyntheticCriteo, ZipfSampler
from .tsv import Chunk, CriteoTSVReader, TSVSource, parse_lines, read_criteo_tsv

__all__ = [
    "Batch", "BatchLoader", "Chunk", "CRITEO_CARDINALITIES", "CriteoTSVReader", "DENSE_COLUMNS",
    "KeyScheme", "LABEL_COLUMN", "NUM_DENSE", "NUM_SPARSE", "ParquetReader", "SPARSE_COLUMNS",
    "SyntheticCriteo", "TSVSource", "ZipfSampler", "convert_tsv_to_parquet", "dense_log",
    "detect_schema", "is_parquet_file", "open_source", "parquet_schema", "parse_lines",
    "read_criteo_tsv", "resolve_cardinalities", "split_mask", "write_parquet", "xxh64_u64",
]
