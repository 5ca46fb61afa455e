"""MultiTableEmbedding / MultiTableMultiColumnEmbedding: the front end.

One key space for all tables; a table only picks the initializer of a key seen for the first time,
as in OneFlow's OneEmbedding. The front end validates ids, drops padding and forms keys; it reaches
rows only through the shuffles over its communicator and the owner ``EmbeddingShard`` (with one
process the communicator is ``LocalComm`` and every exchange is the identity). A step::

    prepare  ids (…) ──validate──> keys (n,) uint64 ──ID shuffle──> owner keys (v,)
                 ──shard.lookup──> lines (v, line_size) [misses: deterministic init]
    embed    shard.refresh ──embedding shuffle──> rows (u, E) ──gather by inverse──> out (…, E)
    backward grad (…, E) ──segment-sum──> (u, E) ──gradient shuffle──> (v, E), pending
    step     row optimizer on the lines ──shard.put──> top tier (evictions written down)

``forward = embed(prepare(...))``. Each call of ``prepare`` returns its own ``StepState``, so
step i+1 can be prepared (on another thread) while step i computes; ``embed`` makes its lines
current first, so the result is the same as preparing it at that moment.

Nothing is stored by a lookup: a key is created by the first optimizer step that updates it, so
evaluation lookups change nothing.

``device="cuda"``: ids, keys, rows, gradients and row updates stay in GPU memory (CuPy arrays),
and the store presets put their "device" tiers on the GPU; only the tier chain copies rows to and
from host tiers. Every step runs the same path as on the CPU, through the device twins of its
operations (``kernels.device_ops``), and gives the same results.
"""
from __future__ import annotations

import ctypes
import logging
import numbers
import os
import threading
from typing import Sequence

import numpy as np

from .backend import as_array, default_embedding_device, is_cupy_array, to_numpy
from .embedding_inputs import EmbeddingInputs, dtype_name, keys_as_uint64, resolve_key_type
from .errors import ClosedError, ConfigError, InputError
from .kernels import device_ops, device_unique, fused_update
from .options import StoreOptions, TableOptions
from .parallel import Communicator, segment_sum, shuffle_grads, shuffle_ids, shuffle_rows
from .parallel.codec import resolve_exchange_dtype
from .parallel.comm import default_comm, differing_settings
from .parallel.shuffle import IdExchange, LocalIds, Traffic
from .shard import EmbeddingShard
from .shard_snapshots import complete_set
from .step import LineLayout, StepState
from . import host_sync

log = logging.getLogger(__name__)

class TakenRows(tuple):
    """``take_gradients``' (keys, lines, found, grads), with ``live``: None, or the (1,) int64
    device count of a fixed-capacity batch (the rows from it on are placeholders)."""

    live = None


def _keep_for_good(shard) -> None:
    """In a process forked from the embedding's: the store is the parent's, still in use, so
    the child's copy is never closed (closing it unlocked the parent's path and deleted its live
    segment files) nor freed (freeing a RocksDB handle waits for background threads a fork does
    not copy: the child hung at its exit, and its parent in waitpid). A leak of the child's copy,
    for the child's life."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(shard))


class MultiTableMultiColumnEmbedding(EmbeddingInputs):
    """Many tables in one key space; each row is several columns stored in one line.

    ``embedding_dim`` is an int (one column) or a list of column dims; the output concatenates the
    columns: ``ids.shape + (sum(embedding_dim),)``. ``tables`` lists ``make_table_options`` results
    (each with one column option per column); ``None`` means one table initialised with
    ``default_initializer`` (normal(0, 0.05) when not given).

    Threads: one thread drives an embedding (forward, backward, the optimizer's step and
    zero_grad); ``prepare`` alone may run on another (the ``Prefetcher``'s). Two threads training
    one embedding are not refused, and lose gradients (a ``zero_grad`` clears the other's); a
    process forked from this one may not use it at all (ClosedError).

    Ranks: under ``mpiexec`` the embedding takes rank and world from MPI (``comm=None``; pass a
    ``parallel.Communicator`` to choose). Each key lives on rank ``XXH64(key, 1) % world``; every
    rank must call forward / backward / ``Optimizer.step`` / save_snapshot in the same order.
    ``exchange_dtype`` ("fp32", "fp16", "int8"; default fp32, or int8 when
    ``ONEFLOW_ONE_EMBEDDING_ENABLE_QUANTIZED_COMM=1``) is how rows and gradients cross ranks.

    ``device``: "cpu" (numpy), "cuda" or "cuda:N" (CuPy: ids, rows, gradients and the "device"
    tiers of the store in GPU memory; outputs are CuPy arrays); None takes
    ``backend.embedding_device``'s default ("cpu"). A ``kernels.device_ops.Launcher`` runs the
    device path on its own arrays (the tests use the host emulator this way).
    """

    def __init__(
        self,
        name: str,
        embedding_dim: int | Sequence[int],
        dtype,
        key_type,
        tables: Sequence[TableOptions] | None,
        store_options: StoreOptions,
        default_initializer=None,
        padding_idx: int | None = None,
        seed: int = 0,
        *,
        comm: Communicator | None = None,
        exchange_dtype: str | None = None,
        device=None,
    ):
        self.name = str(name)
        dims = [embedding_dim] if isinstance(embedding_dim, (int, np.integer)) else list(embedding_dim)
        if not dims or any(int(d) != d or d <= 0 for d in dims):
            raise ConfigError(f"embedding_dim={embedding_dim!r} must be a positive int or a list of them")
        self.column_dims = tuple(int(d) for d in dims)
        self.embedding_dim = sum(self.column_dims)
        if dtype_name(dtype) != "float32":
            raise ConfigError(f"dtype={dtype!r}: rows are stored and returned as float32; pass np.float32")
        self.dtype = np.dtype(np.float32)
        self.key_type = resolve_key_type(key_type)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ConfigError(f"seed={seed!r} must be an integer (the initializers' seed): pass an "
                              "int, e.g. seed=0")
        self.seed = int(seed)
        self._owner_pid = os.getpid()  # a forked child may neither use nor close the store
        if isinstance(store_options, dict):          # OneFlow's dict form (store_dict.py)
            store_options = StoreOptions.from_dict(store_options)
        if not isinstance(store_options, StoreOptions):
            raise ConfigError(
                f"store_options={store_options!r}: build it with make_device_mem_store_options, "
                "make_cached_host_mem_store_options or make_cached_ssd_store_options (or pass "
                "OneFlow's store options dict)"
            )
        # frozen (store_dict.py): no later edit of the caller's can make them disagree with the
        # tiers built from them
        self.store_options = store_options
        self.tables = self._check_tables(tables, default_initializer)
        self.padding_idx = None if padding_idx is None else self._check_padding(padding_idx)
        if comm is not None and not isinstance(comm, Communicator):
            raise ConfigError(f"comm={comm!r} is not a Communicator (LocalComm or MpiComm)")
        self.comm = comm if comm is not None else default_comm()
        self.rank, self.world = self.comm.rank, self.comm.world
        self.exchange_dtype = exchange_dtype
        #: bytes this rank sent to the other ranks (ids, rows, gradients)
        self.traffic = Traffic()
        # the ID shuffle may run on a prefetch thread: its collectives get their own communicator
        self._id_comm = self.comm.dup()
        self.layout = LineLayout.from_store_options(self.column_dims, store_options)
        self.line_size = self.layout.line_size
        self._check_ranks_agree()
        self._shard = None
        #: where rows live: None on the CPU, else the device's ``kernels.device_ops.Launcher``
        self.launch = device_ops.device_launcher(default_embedding_device() if device is None
                                                 else device)
        self.xp = self.launch.xp if self.launch is not None else np
        self._shard = EmbeddingShard(self.name, self.layout, self.tables, self.seed, store_options,
                                     self.rank, self.world, self.launch)
        # the last forward / embed of each thread: a backward() without a state takes the calling
        # thread's, so an evaluation lookup on another thread between a training forward and its
        # backward cannot hand that backward its own keys
        self._last_by_thread = threading.local()
        self._pending: list[StepState] = []

    @property
    def _last(self) -> StepState | None:
        return getattr(self._last_by_thread, "state", None)

    @_last.setter
    def _last(self, state: StepState | None) -> None:
        self._last_by_thread.state = state

    def _check_ranks_agree(self) -> None:
        """ConfigError on every rank when the ranks built this embedding differently (a
        collective call): rows of another width or codec cannot cross the all-to-all (an MPI
        error naming nothing, or rows of uninitialised memory), other tables or seeds give the
        ranks' keys other rows."""
        shown = differing_settings(self.comm, {
            "embedding_dims": list(self.column_dims), "storage_dim": self.line_size,
            "exchange_dtype": self.exchange_dtype, "key_type": self.key_type.name,
            "num_tables": len(self.tables), "seed": self.seed,
            "padding_idx": self.padding_idx})
        if shown is not None:
            raise ConfigError(
                f"embedding {self.name!r} was built differently on the ranks ({shown}): build "
                "it with the same arguments and environment (ONEFLOW_ONE_EMBEDDING_ENABLE_"
                "QUANTIZED_COMM too) on every rank")

    # ---------------------------------------------------------------- OneFlow's attribute names
    @property
    def embedding_name(self) -> str:
        """OneFlow's name for ``name``."""
        return self.name

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def storage_dim(self) -> int:
        """Floats per stored line (OneFlow's ``storage_dim``: ``line_size``)."""
        return self.line_size

    def to(self, device) -> "MultiTableMultiColumnEmbedding":
        """OneFlow's ``module.to(device)``: the embedding itself when it already lives there.
        Its rows live in the store's tiers, built for one device when the embedding is built,
        so another device is a ConfigError naming the fix."""
        name = str(getattr(device, "type", device))
        here = "cpu" if self.launch is None else "cuda"
        if name.split(":")[0] != here:
            raise ConfigError(f"to({device!r}): this embedding was built on {here!r} and its rows "
                              f"live in that device's store tiers; build it with "
                              f"device={name!r} (and load_snapshot to bring its rows over)")
        return self

    @property
    def exchange_dtype(self) -> str:
        """How rows and gradients cross the all-to-all: "fp32", "fp16" or "int8" (per row)."""
        return self._exchange_dtype

    @exchange_dtype.setter
    def exchange_dtype(self, value: str | None) -> None:
        self._exchange_dtype = resolve_exchange_dtype(value)

    # ---------------------------------------------------------------- forward / backward
    def prepare(self, ids, table_ids=None, *, background: bool = True) -> StepState:
        """ids: (...) integers -> the ``StepState`` of one lookup: ID shuffle and owner lookup.

        background=True: may run on a background thread while the main thread computes an
        earlier step (one thread at a time: its ID shuffles run in call order on every rank, on
        a communicator of their own). background=False: runs its ID shuffle on the main
        communicator, as ``forward`` does, so the calling (main) thread may use it beside a
        ``Prefetcher`` that prepares later batches.
        """
        return self._prepare(ids, table_ids, self._id_comm if background else self.comm)

    def _prepare(self, ids, table_ids, comm) -> StepState:
        self._owner()  # a closed embedding says so before it validates or exchanges anything
        if self.launch is not None:
            return self._prepare_on_device(ids, table_ids, comm)
        on_gpu = is_cupy_array(ids)
        ids = self._validate_ids(to_numpy(ids, "ids"))
        tables = self._resolve_table_ids(ids, table_ids).reshape(-1)
        keys = keys_as_uint64(ids.reshape(-1), self.key_type)
        keep = None
        if self.padding_idx is not None:
            pad_key = keys_as_uint64(np.array([self.padding_idx]), self.key_type)[0]
            is_pad = keys == pad_key
            if is_pad.any():
                keep = ~is_pad
                keys, tables = keys[keep], tables[keep]
        exchange = shuffle_ids(comm, keys, tables, self.traffic)
        owner = self._owner().lookup(exchange.owner_keys, exchange.owner_table_ids)
        return StepState(ids.shape, keep, exchange, owner, on_gpu=on_gpu)

    def _prepare_on_device(self, ids, table_ids, comm) -> StepState:
        """``_prepare`` with every array on the device (host ids are copied there first)."""
        xp = self.xp
        ids = self._validate_ids(ids, xp)
        tables = self._resolve_table_ids(ids, table_ids, xp).reshape(-1)
        keys = keys_as_uint64(ids.reshape(-1), self.key_type)
        keep = None
        if self.padding_idx is not None:
            pad_key = keys_as_uint64(np.array([self.padding_idx]), self.key_type)[0]
            is_pad = keys == pad_key
            if host_sync.flag(is_pad.any(), "embedding: padding ids"):
                keep = ~is_pad
                keys, tables = keys[keep], tables[keep]
        shard = self._owner()
        # a device store: the owner's keys in fixed-capacity arrays, their count on the device
        # (one rank reads nothing; several read the per-rank counts their messages need)
        fixed = shard.takes_live_counts
        if fixed and comm.world == 1 and device_unique.FIND_IN_DEDUP:
            # the dedup's output pass probes the store's index too, under the chain's lock (the
            # ID shuffle of one rank is the identity: nothing crosses, nothing to count)
            unique, unique_tables, owner = shard.lookup_ids(keys, tables)
            n = np.array([unique.keys.shape[0]], np.int64)
            local = LocalIds(unique.keys, unique_tables, unique.inverse, n, unique.count)
            exchange = IdExchange(local, n, unique.keys, unique_tables, None, unique.count)
            return StepState(tuple(ids.shape), keep, exchange, owner, on_gpu=True)
        exchange = shuffle_ids(comm, keys, tables, self.traffic, self.launch, fixed_capacity=fixed)
        live = exchange.owner_count
        owner = shard.lookup(exchange.owner_keys, exchange.owner_table_ids) if live is None \
            else shard.lookup(exchange.owner_keys, exchange.owner_table_ids, live=live)
        return StepState(tuple(ids.shape), keep, exchange, owner, on_gpu=True)

    def embed(self, state: StepState):
        """The rows of a prepared step: ``(*ids.shape, embedding_dim)`` float32 (CuPy when the ids
        were). Keeps ``state`` for the next ``backward``."""
        self._owner().refresh(state.owner)
        if self.launch is not None:
            return self._embed_on_device(state)
        e = self.embedding_dim
        rows = shuffle_rows(self.comm, state.exchange, state.owner.lines[:, :e], self.exchange_dtype,
                            self.traffic)
        inverse = state.exchange.local.inverse
        n = int(np.prod(state.ids_shape, dtype=np.int64))
        if state.keep is not None:
            out = np.zeros((n, e), np.float32)
            out[state.keep] = rows[inverse]
        else:
            out = rows[inverse]
        self._last = state
        out = out.reshape(state.ids_shape + (e,))
        if state.on_gpu:
            import cupy

            return cupy.asarray(out)
        return out

    def _rows_to_gather(self, state: StepState):
        """(rows, columns) that the device gathers read: the owner's whole lines, their first E
        columns read in place (``columns`` = E), where the embedding shuffle is the identity (one
        rank, fp32: no copy of the (v, E) embedding columns first, v being a fixed-capacity
        batch's capacity); else the shuffled (u, E) rows (``columns`` None)."""
        e = self.embedding_dim
        if self.comm.world == 1 and self.exchange_dtype == "fp32" and \
                state.exchange.owner_inverse is None:
            return state.owner.lines, e
        return shuffle_rows(self.comm, state.exchange, state.owner.lines[:, :e],
                            self.exchange_dtype, self.traffic, self.launch), None

    def _embed_on_device(self, state: StepState):
        """``embed`` on device arrays: the embedding shuffle, then the gather kernel."""
        e, xp, launch = self.embedding_dim, self.xp, self.launch
        rows, columns = self._rows_to_gather(state)
        out = device_ops.gather_rows(rows, state.exchange.local.inverse, launch, check_index=False,
                                     columns=columns)
        if state.keep is not None:
            n = int(np.prod(state.ids_shape, dtype=np.int64))
            full = xp.zeros((n, e), dtype=xp.float32)
            full[state.keep] = out
            out = full
        self._last = state
        return out.reshape(state.ids_shape + (e,))

    def embed_into(self, state: StepState, target, first_slot: int) -> None:
        """Write the rows of a prepared step straight into a dot interaction's input:
        ``target`` is a ``kernels.layout_ops.InteractionInput`` (data (B, S, E), float32 or the
        fp16 / bf16 patterns of its precision) and the ids have shape (B, F); row (b, f) lands at
        ``target.data[b, first_slot + f]``, cast to the target's storage (padding: a zero row).
        The same values as ``embed`` (rounded as the interaction rounds them), without its
        (B, F, E) float32 result. Keeps ``state`` for the next ``backward``, as ``embed``."""
        from .kernels import layout_ops

        if len(state.ids_shape) != 2:
            raise InputError(f"embed_into takes ids of shape (B, F); these have {state.ids_shape}")
        self._owner().refresh(state.owner)
        launch = self.launch
        if launch is not None:
            rows, columns = self._rows_to_gather(state)
        else:
            rows, columns = shuffle_rows(self.comm, state.exchange,
                                         state.owner.lines[:, :self.embedding_dim],
                                         self.exchange_dtype, self.traffic), None
        xp = self.xp
        index = state.exchange.local.inverse
        if state.keep is not None:   # padding positions read no row (-1: a zero row)
            if index.shape[0] == 0:
                index = xp.full(state.keep.shape, -1, dtype=xp.int64)
            else:                    # kept position j holds index[j-th kept]: no host read
                rank = xp.maximum(xp.cumsum(state.keep) - 1, 0)
                index = xp.where(state.keep, index[rank], -1).astype(xp.int64, copy=False)
        layout_ops.gather_into(rows, index.reshape(state.ids_shape), target, first_slot, launch,
                               columns)
        self._last = state

    def forward(self, ids, table_ids=None):
        """ids: (...) integers -> (..., embedding_dim) float32. Keeps what backward needs.

        Runs on the calling thread; its ID shuffle uses the main communicator, so it may run
        while a ``Prefetcher`` prepares later batches (e.g. an evaluation during training)."""
        return self.embed(self._prepare(ids, table_ids, self.comm))

    __call__ = forward

    def backward(self, grad_out, state: StepState | None = None) -> None:
        """grad_out: (..., embedding_dim) float32, the gradient of the output of ``state`` (by
        default the last forward / embed of the calling thread).

        Sums the gradient per unique key (duplicates summed, padding ignored), sends it to the
        key's owner and keeps it there for the next ``Optimizer.step``. Several lookups may feed
        one loss: pass each one's state; a second backward through the same state adds to it.

        On a GPU with one rank (fp32 exchange) the sum is left to the step, whose update kernel
        adds each key's rows itself (``kernels.fused_update``): the rows of ``grad_out`` are read
        then, so leave it unchanged until ``Optimizer.step``.
        """
        self._owner()
        if state is None:
            state = self._last
        if state is None:
            raise InputError("backward() without a forward() on this thread: look the ids up first "
                             "(or pass the state of the lookup: backward(grad, state))")
        xp = self.xp
        grad = to_numpy(grad_out, "grad_out") if xp is np else as_array(xp, grad_out, "grad_out")
        want = state.ids_shape + (self.embedding_dim,)
        if grad.shape != want:
            raise InputError(f"grad_out has shape {grad.shape}; the last forward returned {want}")
        if grad.dtype.kind != "f":
            raise InputError(f"grad_out has dtype {grad.dtype}; pass float32 gradients")
        grad = grad.reshape(-1, self.embedding_dim).astype(np.float32, copy=False)
        if state.keep is not None:
            grad = grad[state.keep]
        self._check_finite_grad(grad, state.keep)
        local = state.exchange.local
        n_keys = local.unique_keys.shape[0]
        if self._sum_at_update(state):   # the gradient shuffle would be the identity
            grads = fused_update.SummedGradients(grad, local.inverse, n_keys, self.launch,
                                                 live=local.unique_count)
        else:
            summed = segment_sum(grad, local.inverse, n_keys, self.launch)
            grads = shuffle_grads(self.comm, state.exchange, summed, self.exchange_dtype,
                                  self.traffic, self.launch)
        if state.grads is None:
            state.grads = grads
            self._pending.append(state)
        else:  # a second backward through the same lookup
            state.grads = fused_update.materialized(state.grads) + fused_update.materialized(grads)
        if self._last is state:
            self._last = None

    def _sum_at_update(self, state: StepState) -> bool:
        """True when the per-key sum of ``state``'s gradient may wait for the update kernel: on
        the device, with one rank exchanging fp32 (the gradient shuffle is then the identity)."""
        return (fused_update.ENABLED and self.launch is not None and self.comm.world == 1
                and self.exchange_dtype == "fp32" and state.exchange.owner_inverse is None)

    def zero_grad(self) -> None:
        self._owner()
        self._pending.clear()

    # ---------------------------------------------------------------- optimizer step
    def check_optimizer(self, optimizer) -> None:
        """Raise ConfigError when the line cannot hold the optimizer's state (OneFlow only
        catches this deep inside a kernel)."""
        self.layout.require(optimizer)

    def bind_optimizer(self, optimizer) -> None:
        """Record the row optimizer whose state the lines hold (snapshots name it, and a snapshot
        of another optimizer's state is refused)."""
        self.check_optimizer(optimizer)
        self._owner().bind_optimizer(optimizer)

    @property
    def has_gradients(self) -> bool:
        """True when a backward ran since the last step (or zero_grad). On one rank a backward
        that reached no row (an empty batch) does not count, so that its step leaves the
        optimizer's step count alone; over several ranks every backward counts (a rank that owns
        none of a batch's rows steps with the others, their step counts stay equal)."""
        self._owner()
        return any(self.comm.world > 1 or st.owner.keys.shape[0] > 0 for st in self._pending)

    def take_gradients(self, lazy_sums: bool = False):
        """Remove the gradients received since the last step (or zero_grad), merged per key:
        (keys (v,) uint64, lines (v, stored_size), found (v,) bool, grads (v, E) float32) of the
        rows this rank owns, or None when there was no backward. ``lazy_sums``: grads may be a
        ``fused_update.SummedGradients`` (the sums not computed yet) that ``stage_gradients``
        sums inside the update kernel. A ``TakenRows`` tuple: its ``live`` is the device count of
        a fixed-capacity batch (rows from it on are placeholders), or None."""
        self._owner()
        if not self._pending:
            return None
        if len(self._pending) == 1:
            owner, grads = self._pending[0].owner, self._pending[0].grads
            if not lazy_sums:
                grads = fused_update.materialized(grads)
            taken = TakenRows((owner.keys, owner.lines, owner.found, grads))
            taken.live = owner.live
        else:
            taken = self._owner().merge([(st.owner, fused_update.materialized(st.grads))
                                         for st in self._pending])
        self._pending.clear()
        return taken

    def stage_gradients(self, optimizer, step: int, taken=None):
        """Compute the updated lines of every row that received a gradient since the last step
        (or of ``taken``, what ``take_gradients`` returned), without storing them;
        ``commit_gradients`` stores them. Raises InputError (the table unchanged) when an update
        would make a row non-finite."""
        self._owner()
        if taken is None:
            taken = self.take_gradients(lazy_sums=True)   # summed inside the update kernel
        if taken is None:
            return None
        live = getattr(taken, "live", None)
        if live is None:
            return self._owner().stage_update(*taken, optimizer, step)
        return self._owner().stage_update(*taken, optimizer, step, live=live)

    def commit_gradients(self, staged) -> int:
        """Store what ``stage_gradients`` computed; returns rows updated."""
        self._owner()
        if staged is None:
            return 0
        return self._owner().put(*staged)

    def apply_gradients(self, optimizer, step: int) -> int:
        """Update every row that received a gradient since the last step; returns rows updated."""
        return self.commit_gradients(self.stage_gradients(optimizer, step))

    # ---------------------------------------------------------------- snapshots
    def save_snapshot(self, snapshot_name: str, extra_files=None, extra_fields=None) -> None:
        """Flush every cache level down, then record the table under snapshots/<name>/.

        Durable when it returns; a crash midway leaves the previous snapshot of that name.
        ``extra_files(folder)`` may write more files into the snapshot (a training checkpoint's
        state), published atomically with the rows under the same manifest (``extra_fields``
        are added to it) and covered by its checksums.
        """
        self._owner().save_snapshot(snapshot_name, {"key_type": self.key_type.name,
                                           "embedding_name": self.name, "rank": self.rank,
                                           "world_size": self.world, **(extra_fields or {})},
                                    extra_files)
        self.comm.barrier()  # a snapshot is complete once every rank has written its part

    def load_snapshot(self, snapshot_name: str, saved_by: int | None = None) -> dict:
        """Clear the caches and restore exactly the state saved under ``name``; returns its
        manifest (with ``"folder"``, where extra files saved with it are).

        A snapshot saved by another number of ranks is re-sharded on load: each rank keeps the
        saved rows of the keys it owns now. saved_by: the number of ranks whose snapshot to
        load, where several sets hold the name (default: this world's, else the newest other).
        Over several ranks the default is decided together: where only some of this world's
        ranks hold the name (a run killed while it saved), every rank loads the newest complete
        other set, or every rank raises SnapshotError naming the ranks that lack it (each rank
        deciding from its own folder loaded a mix of two training states)."""
        shard = self._owner()
        if saved_by is None and self.comm.world > 1:
            saved_by = complete_set(self.comm, shard, snapshot_name)
        manifest = shard.load_snapshot(snapshot_name, {"key_type": self.key_type.name},
                                       saved_by=saved_by)
        self._pending.clear()
        self._last = None
        return manifest

    def delete_snapshot(self, snapshot_name: str) -> bool:
        """Delete snapshot ``snapshot_name`` (every rank its own part) and reclaim the disk that
        only it used; an unknown name raises SnapshotError listing the snapshots there are.
        Returns False when a reader in another process still holds the snapshot open: the name
        is gone at once, its files stay until that reader lets go."""
        gone = self._owner().delete_snapshot(snapshot_name)
        self.comm.barrier()
        return gone

    def snapshot_names(self) -> list[str]:
        return self._owner().snapshot_names()

    # ---------------------------------------------------------------- inspection / lifetime
    def _owner(self) -> EmbeddingShard:
        """The owner shard; every public method goes through here first, so any use after
        ``close()`` raises ClosedError (not an AttributeError from deep inside)."""
        if self._shard is None:
            raise ClosedError(
                f"embedding {self.name!r} is closed: build a new one (on the same persistent_path "
                "and load_snapshot(name) to continue from a snapshot)"
            )
        if os.getpid() != self._owner_pid:
            raise ClosedError(
                f"embedding {self.name!r} belongs to process {self._owner_pid}, and this is a "
                "process forked from it: its store, threads and lock stay the parent's; build an "
                "embedding of this process's own (on another persistent_path), or use it in the "
                "parent only")
        return self._shard

    def store_stats(self) -> list[dict]:
        """Per tier, top first: rows, hits, misses, evictions, writes, memory and disk bytes."""
        return self._owner().stats()

    def __len__(self) -> int:
        """Keys stored. Flushes the cache levels first: a new key may so far live only in a cache."""
        return len(self._owner())

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored (keys (n,) uint64 sorted, lines (n, stored_size) float32), after a flush:
        ``line_size`` floats, then, with eviction on, the lifecycle's last-seen step (int32 bits)
        and frequency (``layout.stored_size``)."""
        return self._owner().export()

    def close(self) -> None:
        """Release the store (and the path's lock). Closing twice is fine; any other use after
        it raises ClosedError."""
        if getattr(self, "_shard", None) is not None:
            if os.getpid() == getattr(self, "_owner_pid", os.getpid()):
                self._shard.close()
            else:
                _keep_for_good(self._shard)
            self._shard = None
            self._pending.clear()
            self._last = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception as e:  # garbage collection cannot raise: the reason is logged
            log.warning("embedding %r was not closed, and closing it at garbage collection "
                        "failed: %r (call close() to see the error)", self.name, e)


class MultiTableEmbedding(MultiTableMultiColumnEmbedding):
    """Many tables, one key space, one column: ``embedding_dim`` is an int."""

    def __init__(self, name, embedding_dim: int, dtype, key_type, tables, store_options,
                 default_initializer=None, padding_idx=None, seed=0, **kwargs):
        if not isinstance(embedding_dim, (int, np.integer)):
            raise ConfigError(
                f"MultiTableEmbedding takes one embedding_dim, got {embedding_dim!r}: "
                "use MultiTableMultiColumnEmbedding for several columns"
            )
        super().__init__(name, embedding_dim, dtype, key_type, tables, store_options,
                         default_initializer, padding_idx, seed, **kwargs)
