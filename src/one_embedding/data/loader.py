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
  never depends on batch size, sharding, shuffling or read order. A position holds the file's
  index in the list (and a TSV row's byte offset, a Parquet row's index): the same files listed
  in another order, another file put before them, or a TSV converted to Parquet hold out other
  rows, so evaluate on the files, in the order, the run trained on.
* Shuffling permutes the unit order per epoch and mixes rows through a buffer of
  ``shuffle_buffer`` rows; everything is reproducible from (seed, epoch, rank).
* Errors raised while reading (``InputError`` of a bad line, I/O) are re-raised in the consumer;
  leaving the loop early (break, exception, garbage collection) stops and joins the thread.

Resuming (``set_epoch(epoch, start_batch=k)``) yields exactly the batches k, k+1, ... that an
uninterrupted iteration of that epoch yields: batch j is rows ``j*B .. (j+1)*B - 1`` of the epoch's
row stream, so resuming skips the first ``k * B`` rows of it, and the same pipeline runs, only
work whose result would be thrown away is left out. The shuffle buffer's random draws depend on
row counts only (``permutation(n)``), never on the data. What a resume costs, before its first
batch:

* sources that know each chunk's row positions unread (``chunk_positions``: ``SyntheticCriteo``,
  ``ParquetReader``, from their block numbers or the Parquet footer):
  - no shuffle: the units wholly before the start are counted (one split hash per row), not read;
    the unit holding the start is read and its head dropped.
  - shuffle: the epoch up to the start runs on rows without data (positions only: one split hash
    per row and the buffer's permutations over 16-byte rows), then the rows still in the buffer
    are read for real from the units that hold any (a row survives each buffer turn with
    probability 1/2, so these are the units read during the last ~log2(rows per unit) turns)
    and the unit under way is read again: about ``shuffle_buffer / 2 * log2(rows per unit)``
    rows, whatever ``k``. Measured on the 2-core dev machine, synthetic, 500k rows in 4096-row
    blocks, shuffle_buffer 2**14: the last batch after 1.4 s (28 of 123 blocks read), against
    5.8 s for the whole epoch; with the default 2**18-row buffer, half that epoch, nearly every
    block still has rows in the buffer and it takes 4.5 s.
* TSV sources (only parsing finds the bad lines that drop rows, so positions are not known
  unread): the epoch is replayed from its start, every unit up to the point read, parsed,
  split and buffered as before; only the batches before ``k`` (and buffer outputs wholly before
  the start) are not cut, copied or queued. This costs about as much as reading that part of the
  epoch again (~0.2 M rows/s per core).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import queue
import threading
from typing import Iterator

import numpy as np

from ..errors import ConfigError
from .parquet import ParquetReader, is_parquet_file
from .parquet_inputs import expand_paths
from .schema import Batch, splitmix64
from .tsv import Chunk, TSVSource

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


# bad lines exist only in TSV; Parquet inputs accept and ignore this option, so one set of reader
# options serves any input, whatever the files are called (a damaged Parquet file always raises)
_TSV_LINE_OPTIONS = ("on_bad_line",)
_PARQUET_OPTIONS = {"batch_rows", "layout", "keys"}


def open_source(source, **reader_options):
    """A loader source from paths (Parquet told by its content, the ``PAR1`` magic bytes, never by
    its name; anything else is raw TSV) or an object with ``units(min_units)`` and
    ``read_unit(unit)`` (ParquetReader, TSVSource, SyntheticCriteo) returned unchanged.

    reader_options go to ``TSVSource`` or ``ParquetReader``; ``on_bad_line`` is ignored for
    Parquet paths. A missing path or a folder raises InputError."""
    if hasattr(source, "units") and hasattr(source, "read_unit"):
        if reader_options:
            raise ConfigError(f"reader options {sorted(reader_options)} apply to file paths only; "
                              f"configure the source object {type(source).__name__} instead")
        return source
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not paths:
        raise ConfigError("no input files: pass a path, a list of paths, or a source object")
    paths = expand_paths(paths)
    kinds = {is_parquet_file(p) for p in paths}
    if kinds == {True}:
        for name in _TSV_LINE_OPTIONS:
            reader_options.pop(name, None)
        others = sorted(set(reader_options) - _PARQUET_OPTIONS)
        if others:
            raise ConfigError(f"reader options {others} apply to TSV files, but "
                              f"{[os.fspath(p) for p in paths]} are Parquet: drop them (Parquet "
                              f"takes {sorted(_PARQUET_OPTIONS)})")
        return ParquetReader(paths, **reader_options)
    if kinds == {False}:
        parquet_only = sorted(set(reader_options) & _PARQUET_OPTIONS)
        if parquet_only:
            raise ConfigError(f"reader options {parquet_only} apply to Parquet files, but "
                              f"{paths} are TSV: drop them")
        return TSVSource(paths, **reader_options)
    raise ConfigError(f"mixed Parquet and TSV inputs {[os.fspath(p) for p in paths]}: "
                      f"convert the TSV files first (one-embedding convert, or "
                      f"convert_tsv_to_parquet) or load them apart")


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
    decode_threads: Parquet row groups decoded at once on worker threads (None: one per core,
    at most 4, for Parquet; 1 for TSV, whose units are parsed in order, and synthetic data);
    reader_options: passed to the TSV/Parquet reader when ``source`` is paths
    (e.g. has_label, key_scheme, on_bad_line, unit_bytes).

    Resuming: ``set_epoch(epoch, start_batch=k)`` makes iterations start at batch k of that
    epoch, exactly as an uninterrupted one continues (cost: module docstring);
    ``state_dict()`` / ``load_state_dict()`` carry that position and the skipped-line record.
    """

    def __init__(self, source, batch_size: int, *, shuffle: bool = False,
                 shuffle_buffer: int = 1 << 18, seed: int = 0, split: str | None = None,
                 eval_fraction: float = 0.1, split_seed: int = 0, rank: int = 0, world: int = 1,
                 drop_last: bool = False, read_ahead: int = 4, decode_threads: int | None = None,
                 **reader_options):
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
        if decode_threads is not None and not (isinstance(decode_threads, (int, np.integer))
                                               and decode_threads >= 1):
            raise ConfigError(f"decode_threads={decode_threads!r}: use a count >= 1, or None "
                              f"for one per core on file sources")
        self.source = open_source(source, **reader_options)
        if decode_threads is None:
            # synthetic rows are generated on every core already (numba); Parquet row groups
            # decode one per thread
            parquet = isinstance(self.source, ParquetReader)
            decode_threads = min(os.cpu_count() or 1, 4) if parquet else 1
        if decode_threads > 1 and isinstance(self.source, TSVSource):
            raise ConfigError(f"decode_threads={decode_threads} with TSV input: its units are "
                              f"parsed in order, so that the skipped-line count follows the "
                              f"batches handed out; use decode_threads=1 (the parser is "
                              f"compiled; its read-ahead thread keeps it off the caller)")
        self.decode_threads = int(decode_threads)
        self.source.units(min_units=world)  # an unbounded or empty source fails here, not later
        self.batch_size = int(batch_size)
        self.shuffle, self.shuffle_buffer, self.seed = shuffle, int(shuffle_buffer), int(seed)
        self.split, self.eval_fraction = split, float(eval_fraction)
        self.split_seed = int(split_seed)
        self.rank, self.world = int(rank), int(world)
        self.drop_last, self.read_ahead = drop_last, int(read_ahead)
        self.epoch = 0
        self.start_batch = 0
        self.next_batch = 0
        self._skip_state = self._source_skip_state()

    # --- position ------------------------------------------------------------------------------

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Choose the epoch whose shuffle order the next iterations use, and the batch index
        within it they start at: from then on an iteration yields exactly batches
        ``start_batch, start_batch + 1, ...`` of what a full iteration of ``epoch`` yields
        (resuming a run; the cost is in the module docstring)."""
        for name, value in (("epoch", epoch), ("start_batch", start_batch)):
            if not (isinstance(value, (int, np.integer)) and value >= 0):
                raise ConfigError(f"set_epoch {name}={value!r}: use an integer >= 0")
        self.epoch, self.start_batch = int(epoch), int(start_batch)
        self.next_batch = self.start_batch

    @property
    def skipped(self) -> int:
        """Bad input lines skipped (TSV sources with on_bad_line='skip'), each counted once
        however many epochs read it, in the input read to produce the batches handed out so far
        (so the count does not depend on how far the read-ahead thread got)."""
        state = self._skip_state
        return sum(state.values()) if isinstance(state, dict) else int(state)

    def state_dict(self) -> dict:
        """Where this loader stands, JSON-serialisable: ``{"epoch", "batch": index of the next
        batch to hand out in that epoch, "skipped_by_unit": [[unit, bad lines], ...]}``.

        A consumer that pulls batches ahead of its use (a prefetcher) should store the index of
        its next unused batch instead of ``batch``."""
        state = self._skip_state if isinstance(self._skip_state, dict) else {}
        return {"epoch": self.epoch, "batch": self.next_batch,
                "skipped_by_unit": [[list(u) if isinstance(u, tuple) else u, int(n)]
                                    for u, n in state.items()]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``: the next iteration yields ``state["batch"]`` on of
        ``state["epoch"]``, and ``skipped`` counts the bad lines recorded there."""
        try:
            epoch, batch = state["epoch"], state["batch"]
            counts = {tuple(u) if isinstance(u, list) else u: int(n)
                      for u, n in state.get("skipped_by_unit", [])}
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"loader state {state!r} is not a BatchLoader.state_dict() ({e})") \
                from e
        self.set_epoch(epoch, batch)
        if counts:
            if not hasattr(self.source, "skipped_by_unit"):
                raise ConfigError(f"loader state counts skipped lines but the source "
                                  f"{type(self.source).__name__} has none: a different input?")
            self.source.skipped_by_unit = {**self.source.skipped_by_unit, **counts}
        self._skip_state = self._source_skip_state()

    def _source_skip_state(self):
        """The source's skipped-line record now: its (never mutated) per-unit dict, or a count."""
        by_unit = getattr(self.source, "skipped_by_unit", None)
        return by_unit if isinstance(by_unit, dict) else int(getattr(self.source, "skipped", 0))

    # --- the pipeline ----------------------------------------------------------------------------

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

    def _split_keep(self, positions: np.ndarray) -> np.ndarray:
        """(N,) bool: the rows of the chosen split among rows at ``positions`` (N,) int64."""
        is_eval = split_mask(positions, self.eval_fraction, self.split_seed)
        return is_eval if self.split == "eval" else ~is_eval

    def _rows(self, skip: int = 0) -> Iterator[Chunk]:
        """This rank's rows of the chosen split, shuffled if asked, as chunks, less the first
        ``skip`` rows of that stream (resuming: see the module docstring for what is skipped)."""
        if self.shuffle:
            yield from self._shuffled_rows(skip)
        else:
            yield from self._ordered_rows(skip)

    def _split_chunk(self, chunk: Chunk) -> Chunk:
        return chunk if self.split is None else chunk.take(self._split_keep(chunk.positions))

    def _ordered_rows(self, skip: int) -> Iterator[Chunk]:
        # a unit's rows go out in order, so a source that knows its rows' positions unread lets
        # whole units before the start be counted instead of read
        positions_of = getattr(self.source, "chunk_positions", None)
        units = self.my_units()
        first = 0
        while skip and positions_of is not None and first < len(units):
            positions = np.concatenate(positions_of(units[first]))
            rows = int(self._split_keep(positions).sum()) if self.split else len(positions)
            if rows > skip:
                break
            skip -= rows
            first += 1
        for chunk in self._read_units(units[first:]):
            if skip and self.split is not None:
                keep = self._split_keep(chunk.positions)
                if skip >= (kept := int(keep.sum())):
                    skip -= kept  # wholly before the start: no copy
                    continue
                chunk = chunk.take(keep)
            else:
                chunk = self._split_chunk(chunk)
            if skip:
                drop = min(skip, len(chunk))
                skip -= drop
                chunk = chunk.take(slice(drop, None))
            if len(chunk):
                yield chunk

    def _read_units(self, units: list) -> Iterator[Chunk]:
        """The chunks of ``units``, in order (``_unit_reads``)."""
        for chunks in self._unit_reads(units):
            yield from chunks

    def _unit_reads(self, units: list) -> Iterator:
        """Each unit's chunks, unit by unit in order. File units are decoded ``decode_threads``
        at a time on worker threads (pyarrow and the TSV parser release the GIL), each unit's
        chunks gathered (a list) before they go out; with one thread, read as they are used."""
        if self.decode_threads <= 1 or len(units) <= 1:
            for unit in units:
                yield self.source.read_unit(unit)
            return

        def read(unit):
            return list(self.source.read_unit(unit))

        with concurrent.futures.ThreadPoolExecutor(
                self.decode_threads, thread_name_prefix="one_embedding-decode") as pool:
            todo = iter(units)
            pending = collections.deque(pool.submit(read, unit)
                                        for unit in itertools.islice(todo, self.decode_threads))
            try:
                while pending:
                    chunks = pending.popleft().result()
                    pending.extend(pool.submit(read, unit) for unit in itertools.islice(todo, 1))
                    yield chunks
            finally:
                for future in pending:
                    future.cancel()

    def _shuffled_rows(self, skip: int) -> Iterator[Chunk]:
        """Units in shuffled order through the shuffle buffer: whenever it holds
        ``shuffle_buffer`` rows, a random half goes out and the other half stays."""
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, 1])
        units = self.my_units()
        # resuming on a source that knows its chunks' positions unread, the buffer first runs on
        # rows without data: the draws depend on row counts only, so they are the same; at the
        # start the rows still in the buffer are read for real (``_fill``)
        hollow = bool(skip) and hasattr(self.source, "chunk_positions")
        pool: list[Chunk] = []
        pool_rows = 0
        reads = None if hollow else self._unit_reads(units)
        for index, unit in enumerate(units):
            if hollow:
                chunks = self._hollow_chunks(unit)
            else:   # after the hollow part of a resume, the rest is read here, unit by unit
                chunks = iter(next(reads)) if reads is not None else self.source.read_unit(unit)
            done = 0  # chunks of this unit taken so far
            while (chunk := next(chunks, None)) is not None:
                done += 1
                chunk = self._split_chunk(chunk)
                if not len(chunk):
                    continue
                pool.append(chunk)
                pool_rows += len(chunk)
                if pool_rows < self.shuffle_buffer:
                    continue
                merged = _concat(pool)
                order = rng.permutation(len(merged))
                keep_rows = self.shuffle_buffer // 2
                out = order[keep_rows:]
                if skip:  # the same draws, but rows before the start are never gathered
                    drop = min(skip, len(out))
                    skip -= drop
                    out = out[drop:]
                if hollow and not skip:  # the start: real rows from here on
                    merged = self._fill(merged, units[:index + 1])
                    chunks = itertools.islice(self.source.read_unit(unit), done, None)
                    hollow = False
                if len(out):
                    yield merged.take(out)
                pool, pool_rows = [merged.take(order[:keep_rows])], keep_rows
        if pool_rows:
            merged = _concat(pool)
            out = rng.permutation(len(merged))[skip:]
            if len(out):
                if hollow:
                    merged = self._fill(merged, units)
                yield merged.take(out)

    def _hollow_chunks(self, unit) -> Iterator[Chunk]:
        """The chunks ``read_unit(unit)`` would yield, with positions but no data (zero-width
        dense and ids): what the shuffle buffer needs to make its draws."""
        for positions in self.source.chunk_positions(unit):
            n = len(positions)
            yield Chunk(np.empty((n, 0), np.float32), np.empty((n, 0), np.int64),
                        np.zeros(n, np.float32), positions)

    def _fill(self, hollow: Chunk, units: list) -> Chunk:
        """The real rows at ``hollow.positions`` (N,), in that order, read from those of
        ``units`` that hold any of them (in a shuffle buffer: the last few read)."""
        wanted = hollow.positions
        by_position = np.argsort(wanted, kind="stable")
        sorted_wanted = wanted[by_position]
        found = np.zeros(len(wanted), bool)
        parts = []
        for unit in units:
            positions = np.concatenate(self.source.chunk_positions(unit))
            if not len(positions):
                continue
            lo, hi = np.searchsorted(sorted_wanted, [positions.min(), positions.max() + 1])
            mine = by_position[lo:hi][np.isin(sorted_wanted[lo:hi], positions)]
            if not len(mine):
                continue
            rows = _concat(list(self.source.read_unit(unit)))
            at = np.searchsorted(rows.positions, wanted[mine])  # a unit's positions increase
            at = np.minimum(at, len(rows) - 1)
            if not (len(rows) and (rows.positions[at] == wanted[mine]).all()):
                raise RuntimeError(f"resume: unit {unit!r} of {type(self.source).__name__} did "
                                   f"not yield the positions chunk_positions announced")
            found[mine] = True
            parts.append((mine, rows.take(at)))
        if not found.all():
            raise RuntimeError(f"resume: {int((~found).sum())} buffered rows were in no unit")
        out = Chunk(*(np.empty((len(wanted),) + getattr(parts[0][1], k).shape[1:],
                               getattr(parts[0][1], k).dtype)
                      for k in ("dense", "ids", "labels", "positions")))
        for mine, rows in parts:
            for k in ("dense", "ids", "labels", "positions"):
                getattr(out, k)[mine] = getattr(rows, k)
        return out

    def _batches(self) -> Iterator[Batch]:
        """Batches ``start_batch, ...`` of the epoch: consecutive ``batch_size`` slices of the row
        stream, so skipping ``k`` batches is skipping ``k * batch_size`` rows."""
        pending: list[Chunk] = []
        pending_rows = 0
        for chunk in self._rows(skip=self.start_batch * self.batch_size):
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

    def _produced(self) -> Iterator[tuple]:
        """(batch, the source's skipped-line record right after producing it)."""
        for batch in self._batches():
            yield batch, self._source_skip_state()

    def __iter__(self) -> Iterator[Batch]:
        self.next_batch = self.start_batch
        items = self._read_ahead() if self.read_ahead else self._produced()
        try:
            for batch, skip_state in items:
                self._skip_state = skip_state
                self.next_batch += 1
                yield batch
            self._skip_state = self._source_skip_state()  # the epoch was read to its end
        finally:
            items.close()  # leaving early stops and joins the read-ahead thread now

    def _read_ahead(self) -> Iterator[tuple]:
        """``_produced()`` run by a background thread, at most ``read_ahead`` items ahead."""
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
                for item in self._produced():
                    if not put(item):
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
