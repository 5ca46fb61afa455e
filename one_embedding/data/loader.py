"""The batching loader: any Criteo source -> ``Batch`` objects, read ahead in a background thread.

Data flow, all inside one producer thread::

    source.units() -> units[rank::world] --(shuffle their order by (seed, epoch, rank))-->
      -> read_unit(unit) -> Chunk --(row hash vs eval_fraction)--> train | eval rows    split
      -> shuffle buffer (seeded) -> fixed-size Batch -> bounded queue -> consumer

* Sharding is by unit (TSV byte range, Parquet row group, synthetic block), before any shuffle:
  the ranks' rows are disjoint and together cover the source whatever seeds the ranks use. Ranks
  may get a unit's worth of rows more or fewer than each other (see ``drop_last`` and count
  batches per rank when a collective needs equal steps).
* The split hashes each row's position (``splitmix64(position ^ h(split_seed))``), so a row's side
  never depends on batch size, sharding, shuffling or read order.
* Shuffling permutes the unit order per epoch and mixes rows through a buffer of
  ``shuffle_buffer`` rows; everything is reproducible from (seed, epoch, rank).
* Errors raised while reading (``InputError`` of a bad line, I/O) are re-raised in the consumer;
  leaving the loop early (break, exception, garbage collection) stops and joins the thread.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Iterator

import numpy as np

from ..errors import ConfigError
from .parquet import ParquetReader
from .schema import Batch, splitmix64
from .tsv import Chunk, TSVSource

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _is_parquet(path) -> bool:
    path = os.fspath(path)
    if path.endswith(".parquet"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False


def open_source(source, **reader_options):
    """A loader source from paths (Parquet detected by suffix or magic bytes, else raw TSV) or an
    object with ``units(min_units)`` and ``read_unit(unit)`` (ParquetReader, TSVSource,
    SyntheticCriteo) returned unchanged."""
    if hasattr(source, "units") and hasattr(source, "read_unit"):
        if reader_options:
            raise ConfigError(f"reader options {sorted(reader_options)} apply to file paths only; "
                              f"configure the source object {type(source).__name__} instead")
        return source
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not paths:
        raise ConfigError("no input files: pass a path, a list of paths, or a source object")
    kinds = {_is_parquet(p) for p in paths}
    if kinds == {True}:
        return ParquetReader(paths, **reader_options)
    if kinds == {False}:
        return TSVSource(paths, **reader_options)
    raise ConfigError(f"mixed Parquet and TSV inputs {[os.fspath(p) for p in paths]}: "
                      f"convert the TSV files first (convert_tsv_to_parquet) or load them apart")


def split_mask(positions: np.ndarray, eval_fraction: float, split_seed: int) -> np.ndarray:
    """True where a row belongs to the eval split. positions: (N,) int64 -> (N,) bool."""
    salt = splitmix64(np.array([split_seed], np.uint64))[0]
    h = splitmix64(positions.astype(np.uint64) ^ salt)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 < eval_fraction


def _concat(chunks: list[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(*(np.concatenate([getattr(c, k) for c in chunks])
                   for k in ("dense", "ids", "labels", "positions")))


class BatchLoader:
    """Yields ``Batch(dense (B, 13) float32, ids (B, F) int64, labels (B,) float32)``.

    source: path(s) to raw TSV or Parquet files, or a source object (``ParquetReader``,
    ``TSVSource``, ``SyntheticCriteo(num_rows=...)``); batch_size: rows per batch B;
    shuffle / shuffle_buffer / seed: seeded unit-order and buffer shuffle (per epoch, see
    ``set_epoch``); split: None (all rows), "train" or "eval", with eval_fraction and split_seed;
    rank, world: this process's shard; drop_last: drop the final short batch;
    read_ahead: batches queued by the background thread (0 = read in the caller's thread);
    reader_options: passed to the TSV/Parquet reader when ``source`` is paths
    (e.g. has_label, key_scheme, on_bad_line, unit_bytes).
    """

    def __init__(self, source, batch_size: int, *, shuffle: bool = False,
                 shuffle_buffer: int = 1 << 18, seed: int = 0, split: str | None = None,
                 eval_fraction: float = 0.1, split_seed: int = 0, rank: int = 0, world: int = 1,
                 drop_last: bool = False, read_ahead: int = 4, **reader_options):
        if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
            raise ConfigError(f"batch_size={batch_size!r}: use a positive integer")
        if split not in (None, "train", "eval"):
            raise ConfigError(f"split={split!r}: use None, 'train' or 'eval'")
        if not 0.0 <= eval_fraction <= 1.0:
            raise ConfigError(f"eval_fraction={eval_fraction}: use a fraction in [0, 1], e.g. 0.1")
        if not (world >= 1 and 0 <= rank < world):
            raise ConfigError(f"rank={rank}, world={world}: need world >= 1 and 0 <= rank < world")
        if shuffle_buffer < 1 or read_ahead < 0:
            raise ConfigError(f"shuffle_buffer={shuffle_buffer}, read_ahead={read_ahead}: use "
                              f"shuffle_buffer >= 1 and read_ahead >= 0")
        self.source = open_source(source, **reader_options)
        self.source.units(min_units=world)  # an unbounded or empty source fails here, not later
        self.batch_size = int(batch_size)
        self.shuffle, self.shuffle_buffer, self.seed = shuffle, int(shuffle_buffer), int(seed)
        self.split, self.eval_fraction = split, float(eval_fraction)
        self.split_seed = int(split_seed)
        self.rank, self.world = int(rank), int(world)
        self.drop_last, self.read_ahead = drop_last, int(read_ahead)
        self.epoch = 0

    @property
    def skipped(self) -> int:
        """Bad input lines skipped so far (TSV sources with on_bad_line='skip')."""
        return int(getattr(self.source, "skipped", 0))

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle order the next iteration uses."""
        self.epoch = int(epoch)

    def my_units(self) -> list:
        """This rank's units, in reading order."""
        # shard before shuffling: a rank's units never depend on a seed, so ranks that were given
        # different seeds still read disjoint rows
        units = list(self.source.units(min_units=self.world))[self.rank::self.world]
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, self.rank])
            order = rng.permutation(len(units))
            units = [units[i] for i in order]
        return units

    def _rows(self) -> Iterator[Chunk]:
        """This rank's rows of the chosen split, shuffled if asked, as chunks."""
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, 1])
        pool: list[Chunk] = []
        pool_rows = 0
        for unit in self.my_units():
            for chunk in self.source.read_unit(unit):
                if self.split is not None:
                    is_eval = split_mask(chunk.positions, self.eval_fraction, self.split_seed)
                    chunk = chunk.take(is_eval if self.split == "eval" else ~is_eval)
                if not len(chunk):
                    continue
                if not self.shuffle:
                    yield chunk
                    continue
                pool.append(chunk)
                pool_rows += len(chunk)
                if pool_rows >= self.shuffle_buffer:
                    merged = _concat(pool)
                    order = rng.permutation(len(merged))
                    keep = self.shuffle_buffer // 2
                    yield merged.take(order[keep:])
                    pool, pool_rows = [merged.take(order[:keep])], keep
        if pool_rows:
            merged = _concat(pool)
            yield merged.take(rng.permutation(len(merged)))

    def _batches(self) -> Iterator[Batch]:
        pending: list[Chunk] = []
        pending_rows = 0
        for chunk in self._rows():
            pending.append(chunk)
            pending_rows += len(chunk)
            if pending_rows < self.batch_size:
                continue
            merged = _concat(pending)
            n_full = len(merged) // self.batch_size * self.batch_size
            for lo in range(0, n_full, self.batch_size):
                yield merged.take(slice(lo, lo + self.batch_size)).batch()
            rest = merged.take(slice(n_full, None))
            pending, pending_rows = ([rest] if len(rest) else []), len(rest)
        if pending_rows and not self.drop_last:
            yield _concat(pending).batch()

    def __iter__(self) -> Iterator[Batch]:
        if self.read_ahead == 0:
            yield from self._batches()
            return
        slots: queue.Queue = queue.Queue(maxsize=self.read_ahead)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    slots.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                for batch in self._batches():
                    if not put(batch):
                        return
                put(_END)
            except BaseException as error:  # handed to the consumer, which re-raises it
                put(_Failure(error))

        thread = threading.Thread(target=produce, name="one_embedding-read-ahead", daemon=True)
        thread.start()
        try:
            while True:
                item = slots.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    slots.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()
