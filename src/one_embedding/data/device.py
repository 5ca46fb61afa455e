"""Data at the device's pace: synthetic rows generated on the device, file batches staged ahead.

* ``DeviceSynthetic`` runs ``kernels/cuda/synthetic.cu`` (one thread per row) over a
  ``SyntheticCriteo``'s constants, uploaded once: for the same seed its rows are the CPU
  generator's, bit for bit (``synthetic_math`` explains why). Only the rows' positions cross to
  the device (8 bytes a row, against 264 bytes of generated row).
* ``DeviceSyntheticLoader`` yields exactly the batches of a ``BatchLoader`` over a
  ``SyntheticCriteo`` (no shuffle; any split, rank or start batch), generated on the device: the
  host computes only which positions each batch holds (the split's hash per row).
* ``DeviceBatches`` feeds any ``BatchLoader`` (TSV, Parquet, synthetic) to the device: a worker
  thread copies each decoded batch into page-locked buffers (a ring of ``depth + 1``) and issues
  its upload on its own stream, ``depth`` batches ahead; the consumer's stream waits on the
  upload's event, so the step never blocks the host on a copy.

Every class takes a ``kernels.device_ops.Launcher``: ``CupyLauncher`` on a GPU; on a machine
without one, the base ``Launcher`` (numpy arrays, no streams) runs the same code path with plain
host buffers, and the tests' g++ emulator runs the CUDA kernel itself.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import numpy as np

from ..errors import ConfigError
from ..kernels import cuda_module as cm
from ..kernels.device_ops import Launcher, resolve
from .loader import BatchLoader, split_mask
from .schema import Batch
from .synthetic import SyntheticCriteo

_END = object()


class DeviceSynthetic:
    """A ``SyntheticCriteo``'s rows generated on the device of ``launcher`` (None: CuPy's
    current device). ``rows_at(positions)`` -> (dense (N, 13) float32, ids (N, F) int64, labels
    (N,) float32, logits (N,) float64) device arrays."""

    def __init__(self, source: SyntheticCriteo, launcher: Launcher | None = None):
        if not isinstance(source, SyntheticCriteo):
            raise ConfigError(f"DeviceSynthetic generates SyntheticCriteo rows, not "
                              f"{type(source).__name__}: stage file sources with DeviceBatches")
        self.source = source
        self.launcher = resolve(launcher)
        k = source.kernel_constants()
        up = self.launcher.to_device
        self._arrays = {
            name: up(np.ascontiguousarray(k[name], dtype))
            for name, dtype in (("cards", np.int64), ("offsets", np.int64), ("mults", np.int64),
                                ("shifts", np.int64), ("zipf_cdf", np.float64),
                                ("zipf_guide", np.int32), ("zipf_params", np.float64),
                                ("zipf_ids", np.int64), ("zipf_terms", np.float64),
                                ("amp", np.float64), ("normal_coeffs", np.float64),
                                ("dense_thresholds", np.float64), ("dense_guide", np.int32),
                                ("dense_values", np.float32))}
        self._arrays["dense_consts"] = up(np.concatenate(
            [k["mu"], k["sigma"], k["missing"], k["weights"]]).astype(np.float64))
        self._k = k
        self.num_dense = len(k["mu"])

    def rows_at(self, positions):
        """The rows at ``positions`` ((N,) int64, host or device array), generated on the device."""
        xp = self.launcher.xp
        if isinstance(positions, xp.ndarray):
            positions = xp.ascontiguousarray(positions, dtype=np.int64)
        else:
            positions = self.launcher.to_device(np.ascontiguousarray(positions, np.int64))
        n = int(positions.shape[0])
        f, j = self.source.num_features, self.num_dense
        dense = xp.empty((n, j), np.float32)
        ids = xp.empty((n, f), np.int64)
        labels = xp.empty(n, np.float32)
        logits = xp.empty(n, np.float64)
        if n:
            a, k = self._arrays, self._k
            args = (positions, np.int64(n), np.int32(f), np.int32(j),
                    np.int32(len(k["weights"])), np.uint64(k["row_salt"]),
                    np.uint64(k["effect_salt"]), a["cards"], a["offsets"], a["mults"],
                    a["shifts"], a["zipf_cdf"], a["zipf_guide"], a["zipf_params"], a["zipf_ids"],
                    a["zipf_terms"], np.int32(k["zipf_cdf"].shape[1]), np.float64(k["alpha"]),
                    np.float64(k["head_rank"]), a["amp"], np.float64(k["bias"]),
                    a["dense_consts"], a["normal_coeffs"], a["dense_thresholds"],
                    a["dense_guide"], a["dense_values"], np.int32(k["dense_values"].shape[1]),
                    dense, ids, labels, logits)
            grid = cm.grid_stride_blocks(n, self.launcher.n_sms, self.launcher.block)
            self.launcher.run("synthetic", "rows", np.float32, (grid,), (self.launcher.block,),
                              args)
        return dense, ids, labels, logits

    def rows(self, start: int, count: int):
        """Rows start..start+count-1 (the positions made on the device)."""
        if start < 0 or count < 0:
            raise ConfigError(f"rows(start={start}, count={count}): both must be >= 0")
        return self.rows_at(self.launcher.xp.arange(start, start + count, dtype=np.int64))

    def batch(self, batch_size: int, index: int = 0) -> Batch:
        """``SyntheticCriteo.batch(batch_size, index)`` on the device."""
        dense, ids, labels, _ = self.rows(index * batch_size, batch_size)
        return Batch(dense, ids, labels)


class DeviceSyntheticLoader:
    """The batches ``loader`` (a ``BatchLoader`` over a ``SyntheticCriteo``, shuffle off) yields,
    generated on the device: same rows, same order, same split, rank and ``start_batch``."""

    def __init__(self, loader: BatchLoader, launcher: Launcher | None = None):
        if not isinstance(loader.source, SyntheticCriteo):
            raise ConfigError("DeviceSyntheticLoader needs a BatchLoader over SyntheticCriteo; "
                              "stage file sources with DeviceBatches")
        if loader.shuffle:
            raise ConfigError("DeviceSyntheticLoader: the loader shuffles, which runs on the "
                              "host; use shuffle=False (synthetic rows are i.i.d. already)")
        self.loader = loader
        self.generator = DeviceSynthetic(loader.source, launcher)

    def batch_positions(self) -> Iterator[np.ndarray]:
        """The row positions of each batch the loader yields: (B,) int64 each."""
        ld, src = self.loader, self.loader.source
        skip = ld.start_batch * ld.batch_size
        pending: list[np.ndarray] = []
        held = 0
        for unit in ld.my_units():
            positions = src.chunk_positions(unit)[0]
            if ld.split is not None:
                is_eval = split_mask(positions, ld.eval_fraction, ld.split_seed)
                positions = positions[is_eval if ld.split == "eval" else ~is_eval]
            if skip:
                drop = min(skip, len(positions))
                skip -= drop
                positions = positions[drop:]
            pending.append(positions)
            held += len(positions)
            while held >= ld.batch_size:
                merged = np.concatenate(pending)
                yield merged[:ld.batch_size]
                rest = merged[ld.batch_size:]
                pending, held = [rest], len(rest)
        if held and not ld.drop_last:
            yield np.concatenate(pending)

    def __iter__(self) -> Iterator[Batch]:
        for positions in self.batch_positions():
            dense, ids, labels, _ = self.generator.rows_at(positions)
            yield Batch(dense, ids, labels)


class DeviceBatches:
    """``loader``'s batches on the device of ``launcher``, uploaded ``depth`` batches ahead.

    A worker thread takes each host batch (decoded by the loader's own read-ahead thread), copies
    it into the next of ``depth + 1`` page-locked buffer sets (waiting first for that set's
    previous upload to finish), issues the upload on its own stream and records an event; the
    consumer's stream waits on that event (no host synchronization) before the batch is handed
    out. Before each upload the worker's stream waits for the consumer's stream to reach the
    point where it last asked for a batch (no host synchronization either): memory of batches
    the consumer dropped is reused only after the work it issued on them. Errors of the loader
    are re-raised in the consumer; leaving the loop early stops the worker."""

    def __init__(self, loader: BatchLoader, launcher: Launcher | None = None, depth: int = 3):
        if depth < 1:
            raise ConfigError(f"depth={depth}: stage at least 1 batch ahead")
        self.loader = loader
        self.launcher = resolve(launcher)
        self.depth = int(depth)

    def _staging(self, batch: Batch, ring: list, slot: int):
        """Host buffers of slot ``slot`` holding ``batch`` (reallocated when shapes change)."""
        bufs = ring[slot]
        shapes = [(a.shape, a.dtype) for a in (batch.dense, batch.ids, batch.labels)]
        if bufs is None or [(b.shape, b.dtype) for b in bufs[:3]] != shapes:
            bufs = [self.launcher.host_empty(s, d) for s, d in shapes] + [None]
        else:
            self.launcher.synchronize(bufs[3])     # its last upload has finished
        for buf, a in zip(bufs, (batch.dense, batch.ids, batch.labels)):
            np.copyto(buf, a)
        ring[slot] = bufs
        return bufs

    def __iter__(self) -> Iterator[Batch]:
        out: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        launcher = self.launcher

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        # the consumer's stream position each time it asks for a batch: its work on the batches
        # before has been issued by then. The worker's stream waits on it before allocating,
        # so device memory the consumer freed (CuPy's pool hands it to the stream that
        # allocated it, the worker's) is not overwritten under the consumer's queued kernels.
        consumer_at = [None]

        def work():
            ring: list = [None] * (self.depth + 1)
            uploaded = None
            try:
                with launcher.stream():
                    try:
                        for i, batch in enumerate(self.loader):
                            if stop.is_set():
                                return
                            bufs = self._staging(batch, ring, i % len(ring))
                            launcher.wait(consumer_at[0])
                            device = [launcher.to_device(b) for b in bufs[:3]]
                            bufs[3] = uploaded = launcher.record()
                            if not put((device, bufs[3])):
                                return
                    finally:
                        # the ring's page-locked buffers go back to CuPy's pinned pool with
                        # this thread, which hands them to the next host_empty at once: not
                        # before the last upload out of them has run (once per pass)
                        launcher.synchronize(uploaded)
                put(_END)
            except BaseException as error:     # handed to the consumer, which re-raises it
                put(error)

        thread = threading.Thread(target=work, name="one_embedding-device-batches", daemon=True)
        thread.start()
        try:
            while True:
                consumer_at[0] = launcher.record()
                item = out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                (dense, ids, labels), event = item
                launcher.wait(event)     # the consumer's stream runs after the upload
                yield Batch(dense, ids, labels)
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    out.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()
