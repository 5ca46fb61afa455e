"""Parquet row groups decode on worker threads: the batches are those of one thread, in every
mode (ordered, shuffled, split, resumed), and TSV keeps its in-order parse."""
import threading

import numpy as np
import pytest

from one_embedding.data import BatchLoader, ParquetReader, SyntheticCriteo, write_parquet
from one_embedding.errors import ConfigError


class RecordingReader(ParquetReader):
    """A ParquetReader noting the thread that decodes each unit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads = set()

    def read_unit(self, unit):
        self.threads.add(threading.current_thread().name)
        yield from super().read_unit(unit)


@pytest.fixture(scope="module")
def parquet_path(tmp_path_factory):
    src = SyntheticCriteo("kaggle", scale=0.01, seed=2)
    path = tmp_path_factory.mktemp("pq") / "d.parquet"
    write_parquet(path, [src.rows(lo, 3000).batch() for lo in range(0, 30_000, 3000)],
                  row_group_rows=3000)
    return path


def _arrays(batches):
    return [(b.dense.tobytes(), b.ids.tobytes(), b.labels.tobytes()) for b in batches]


@pytest.mark.parametrize("options", [dict(), dict(shuffle=True, shuffle_buffer=4000, seed=3),
                                     dict(split="eval", eval_fraction=0.3)],
                         ids=["ordered", "shuffled", "split"])
def test_worker_threads_give_the_one_thread_batches(parquet_path, options):
    one = BatchLoader([parquet_path], 1000, decode_threads=1, **options)
    reader = RecordingReader([parquet_path])
    many = BatchLoader(reader, 1000, decode_threads=3, **options)
    assert _arrays(many) == _arrays(one) and len(_arrays(one)) > 5
    assert any(name.startswith("one_embedding-decode") for name in reader.threads)
    for start in (0, 4, 11):
        one.set_epoch(1, start_batch=start)
        many.set_epoch(1, start_batch=start)
        assert _arrays(many) == _arrays(one)


def test_parquet_decodes_on_workers_by_default_and_tsv_refuses_them(parquet_path, tmp_path):
    reader = RecordingReader([parquet_path])
    loader = BatchLoader(reader, 1000)
    assert loader.decode_threads >= 1
    tsv = tmp_path / "d.tsv"
    tsv.write_text("1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0000abcd"] * 26) + "\n")
    assert BatchLoader([tsv], 1).decode_threads == 1
    with pytest.raises(ConfigError, match="decode_threads=2 with TSV"):
        BatchLoader([tsv], 1, decode_threads=2)
    with pytest.raises(ConfigError, match="decode_threads=0"):
        BatchLoader([parquet_path], 1, decode_threads=0)


def test_leaving_early_cancels_pending_decodes(parquet_path):
    loader = BatchLoader([parquet_path], 500, decode_threads=2, read_ahead=0)
    for i, batch in enumerate(loader):
        if i == 1:
            break
    assert np.isfinite(batch.dense).all()
    alive = [t for t in threading.enumerate() if t.name.startswith("one_embedding-decode")]
    for t in alive:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in alive)
