"""Prefetch: the next batches' ID shuffle and row lookups run while the current batch computes.

    for batch, state in Prefetcher(loader, emb, depth=2):
        logits = model(batch.dense, state)      # or emb.embed(state) in a loop of your own
        ...                                     # backward, Optimizer.step as usual

A background thread takes batches from the iterator in order and calls ``emb.prepare`` on each
(validate ids, ID shuffle, owner lookup through the tier chain, initial values of new keys), up to
``depth`` batches ahead of the one the main thread uses. The compiled kernels behind ``prepare``
release the GIL, so this work overlaps with the main thread's matrix products.

Ordering: a row that step i updates must be read by step i+1 only after
step i's put. The mechanism is the shard's write version: every lookup records it, and
``emb.embed(state)`` first patches in each line put since (the shard keeps those puts in a short
log while any prefetched lookup is outstanding). So a prefetched step uses exactly the rows a
lookup made at that moment would give; prefetch depth changes no result, on any store, whatever
the cache size. The prefetched rows are held by the step itself (its ``StepState``), not by the
cache: they stay available until used even when the cache is far smaller than a batch.

``depth=0`` prepares each batch on the calling thread, right before it is used.

Ranks: each ``prepare`` runs the ID shuffle, a collective every rank must enter for the same
batch. So stopping early (``close``, or leaving the loop) cannot simply abandon the thread where
it happens to be: one rank's thread may have entered batch k's shuffle while another's stopped
before it, and both would wait for ever. With more than one rank the thread therefore goes on to
a point every rank computes alike from what its consumer took, ``consumed + depth + 1`` batches
prepared (the most a thread can have begun, or the end of the batches), then stops. Those extra
preparations change nothing (unused steps are dropped) and cost a few lookups; a loop that knows
its length (``itertools.islice``) has none.

A rank that raises mid-step cannot stop that way: its peers wait in the step's collectives, or
their threads in an ID shuffle this rank's thread will never begin. So with more than one rank,
an exception leaving the ``with Prefetcher(...)`` block ends the whole job at once
(``comm.abort``: MPI_Abort, after printing the traceback and the rank), unless
``ONE_EMBEDDING_ABORT_ON_ERROR=0``. (A bare ``for`` loop cannot see its body raise: use the
``with`` form.) And ``close`` waits at most ``close_timeout`` seconds for the thread: past that,
with several ranks, it is waiting for a peer that will not come, and the job is aborted the
same way; otherwise (or with the abort off) ``PrefetchTimeout`` says so.

On a GPU (an embedding built with ``device="cuda"``) the background thread issues its work on a
CUDA stream of its own, so the next batches' kernels and copies overlap the current step's on
the device as well. Two events keep the order: the thread records one after preparing each
batch, and the consuming thread's stream waits on it before the batch is yielded (so ``embed``
and everything after it see the prepared rows); the tier chain orders its own calls across the
two streams the same way (``chain.TierChain``). A yielded batch and its state stay referenced
here until the consumer's stream has run past them (an event recorded when the next batch is
asked for), so their device memory cannot be handed to the prefetch stream while the main
stream still reads it: CuPy's pool gives a freed block back to the stream that allocated it,
and a device data source (``data.device.DeviceSyntheticLoader``) makes each batch's arrays on
the prefetch thread, which iterates the batches.
"""
from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator

from .errors import ConfigError, OneEmbeddingError
from .kernels import device_ops
from .parallel.comm import abort_enabled, end_job

_DONE = object()

#: seconds ``close`` waits for the prefetch thread by default: the prepare it is in, and with
#: several ranks up to ``depth + 1`` more, each an ID shuffle its peers must join
CLOSE_TIMEOUT = 300.0


class PrefetchTimeout(OneEmbeddingError, TimeoutError):
    """The prefetch thread did not stop within ``close_timeout`` seconds."""


def _batch_ids(batch):
    return batch.ids


#: the Prefetchers whose thread is running: stopped at interpreter exit (_stop_at_exit)
_RUNNING = weakref.WeakSet()
#: the most seconds the interpreter's exit waits for each prefetch thread's prepare to return
EXIT_JOIN_S = 5.0


def _stop_at_exit() -> None:
    """At interpreter exit, before daemon threads are killed: a prefetch thread left running (a
    generator the program never closed) is stopped between two prepares. Killed inside one, it
    could die in the SSD engine's native code, which cannot unwind the thread (RocksDB: "FATAL:
    exception not rethrown", SIGABRT, 4 exits in 16 here)."""
    for prefetcher in list(_RUNNING):
        prefetcher._stop.set()
        thread = prefetcher._thread
        if thread is not None:
            thread.join(EXIT_JOIN_S)


atexit.register(_stop_at_exit)


class Prefetcher:
    """Yields ``(batch, state)`` for every batch of ``batches``, ``state = emb.prepare(ids)``.

    batches: any iterable; ids: batch -> ids (default ``batch.ids``); table_ids: batch -> table
    ids or None (default None: column j of ids is table j); depth: batches prepared ahead;
    close_timeout: the most seconds ``close`` waits for the thread (module docstring).
    Use it as a context manager (or call ``close``) to stop the thread early; with several
    ranks, the context manager also ends the job when its block raises.
    """

    def __init__(self, batches: Iterable, embedding, depth: int = 1,
                 ids: Callable = _batch_ids, table_ids: Callable | None = None,
                 close_timeout: float = CLOSE_TIMEOUT):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ConfigError(f"prefetch depth={depth!r} must be an integer >= 0 (0 = off)")
        if not isinstance(close_timeout, (int, float)) or not close_timeout > 0:
            raise ConfigError(f"close_timeout={close_timeout!r} must be a number of seconds > 0")
        self.close_timeout = float(close_timeout)
        self.embedding = embedding
        self.depth = depth
        self._batches = batches
        self._ids = ids
        self._table_ids = table_ids or (lambda batch: None)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the embedding's device launcher (None on the CPU): streams and events
        self._launch = getattr(embedding, "launch", None)
        # the batches and states yielded whose steps have not run on the device yet
        self._in_use = None if self._launch is None else device_ops.HeldUntil(self._launch)
        self._consumed = 0          # batches yielded to the consumer
        self._prepared = 0          # batches whose prepare the thread began
        # after close: the thread stops once it has begun this many (see the module docstring)
        self._stop_after = 0
        #: seconds the consumer's thread spent preparing (depth 0: every lookup runs inside the
        #: iteration), which a caller timing its wait for the next item counts as lookup work
        self.inline_prepare_seconds = 0.0

    def _prepare(self, batch):
        return self.embedding.prepare(self._ids(batch), self._table_ids(batch))

    def __iter__(self) -> Iterator:
        if self.depth == 0:
            for batch in self._batches:
                started = time.perf_counter()
                state = self._prepare(batch)
                self.inline_prepare_seconds += time.perf_counter() - started
                yield batch, state
            return
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._work, name="one_embedding-prefetch",
                                        daemon=True)
        self._thread.start()
        _RUNNING.add(self)
        try:
            while True:
                item = self._queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, state, ready = item
                if self._launch is not None:
                    self._launch.wait(ready)        # the consumer's stream: after the prepare
                self._consumed += 1
                yield batch, state
                # the batch too: a device data source made its arrays on this thread's stream
                self._retire((batch, state))
        finally:
            self.close()

    def _retire(self, item) -> None:
        """Keep ``item`` (a yielded batch and its state) until the work the consumer issued for
        it has run on its stream; let go of the earlier ones that have."""
        if self._launch is None:
            return
        self._in_use.hold(item, self._launch.record())

    def _work(self) -> None:
        launch = self._launch
        try:
            with launch.stream() if launch is not None else contextlib.nullcontext():
                for batch in self._batches:
                    if self._stop.is_set() and self._prepared >= self._stop_after:
                        return
                    self._prepared += 1
                    state = self._prepare(batch)
                    ready = launch.record() if launch is not None else None
                    self._put((batch, state, ready))
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)
            return
        self._put(_DONE)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _several_ranks(self) -> bool:
        return getattr(self.embedding, "world", 1) > 1

    def close(self) -> None:
        """Stop the thread; prepared but unused steps are dropped (they change nothing). With
        more than one rank the thread first reaches ``consumed + depth + 1`` batches begun, the
        same on every rank (module docstring). Waits at most ``close_timeout`` seconds: then,
        with several ranks, the job is aborted; else ``PrefetchTimeout``."""
        if self._several_ranks():
            self._stop_after = self._consumed + self.depth + 1
        self._stop.set()
        _RUNNING.discard(self)
        if self._thread is not None:
            thread, self._thread = self._thread, None
            thread.join(self.close_timeout)
            if thread.is_alive():
                self._timed_out()
        if self._queue is not None:
            while not self._queue.empty():
                self._queue.get_nowait()
        if self._in_use is not None and len(self._in_use):
            self._launch.synchronize(self._in_use.last_event)   # their memory may be reused after
            self._in_use.clear()

    def _timed_out(self) -> None:
        why = (f"the prefetch thread did not stop within {self.close_timeout:g} s (batches "
               f"begun {self._prepared}, used {self._consumed}")
        if self._several_ranks():
            why += (f", stopping after {self._stop_after}): it waits in an ID shuffle another "
                    "rank's thread has not begun (a rank that failed or left its loop elsewhere)")
            comm = getattr(self.embedding, "comm", None)
            if comm is not None and abort_enabled():
                end_job(comm, why)
        else:
            why += "): its prepare (a lookup through the store) has not returned"
        raise PrefetchTimeout(why)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        comm = getattr(self.embedding, "comm", None)
        # Ctrl-C is left to the caller (the CLI names the last checkpoint, then ends every rank);
        # should no one end the job, close()'s timeout still does
        if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt) \
                and self._several_ranks() and comm is not None and abort_enabled():
            # the other ranks wait for this one in a collective it will never enter
            end_job(comm, f"raised {exc_type.__name__} with prefetch on", exc)
        self.close()
