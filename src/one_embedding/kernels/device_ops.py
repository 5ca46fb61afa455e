"""The embedding side's operations on device arrays, launching the CUDA kernels of
``cuda/{embedding,optim}.cu``: the device twins of ``reference.gather_rows`` and the row
optimizers' numba kernels (those of ``parallel.unique``, unique + inverse and segment sums, are
in ``device_unique``; of ``parallel.codec`` in ``codec_ops``; the initial values' in
``device_init``), and the launchers every device module takes.

Every function takes ``launch``, a ``Launcher``: the array module that holds the arrays (``xp``)
and a way to run a kernel. The default, ``cupy_launcher()``, runs the kernels with CuPy on the
current device. The tests pass a launcher that runs the same kernels on numpy arrays through the
host emulator (``cuda/host_emulation.cuh``), so everything here except CuPy itself also runs on a
machine without a GPU. Sorting, prefix sums and compaction use the array module's own functions
(``argsort``, ``cumsum``, ``flatnonzero``), which numpy and CuPy define alike.

Results are deterministic and equal their CPU twins bit for bit, with the exceptions each
docstring states. CuPy compiles with ``-ftz=true``: a float32 operation whose input or result is
subnormal (below 1.18e-38 in magnitude) gives 0 on the GPU. That touches segment sums and int8
codec arithmetic of such tiny values, and the final float64 -> float32 rounding of an optimizer
or initializer result that small; float64 arithmetic, copies and the fp16 codec (integer bit
operations) are unaffected.

``import cupy`` happens only inside ``cupy_launcher``: importing this module needs no GPU.
"""
from __future__ import annotations

import collections
import contextlib

import numpy as np

from .. import host_sync
from ..errors import ConfigError, InputError
from ..optim.base import _check_step
from ..optim.row_optimizers import SGD, Adagrad, Adam, Ftrl
from ..optim.smart_decay_adam import SmartDecayAdam
from . import cuda_module as cm

MASK64 = (1 << 64) - 1


class Launcher:
    """Where kernels run: ``xp`` holds the arrays, ``run`` launches one kernel.

    ``block`` is the threads per block of every launch (a multiple of 32), ``n_sms`` the
    multiprocessors the grid sizes are computed for.

    A launcher is also the embedding's handle on its device (``MultiTableEmbedding(device=...)``):
    the copies between device and host memory that the tier chain makes (``to_device``,
    ``to_host``, host staging buffers from ``host_empty``), and the stream order of work issued
    from several threads (``stream``, ``record``, ``wait``). This base class is the host emulation
    of all that: arrays are numpy, a copy is a copy, and there are no streams (every event is
    ``None`` and complete), so the device path runs unchanged, on one timeline, without a GPU.
    """

    xp = np
    block = cm.BLOCK
    n_sms = 1
    #: the CUDA device index, or None for a host launcher
    device = None

    def run(self, family: str, name: str, dtype, grid: tuple, block: tuple, args: tuple) -> None:
        """Launch kernel ``name`` of source ``family``; each launcher kind has its own way."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot launch kernel {family}.{name}: kernels run through a "
            "launcher that compiles them (CupyLauncher on a GPU, the tests' g++ EmulatedLauncher "
            "on the host); the base Launcher only provides the copies and stream order")

    # --- copies between device and host memory (the tier chain's crossings)
    def to_device(self, host: np.ndarray):
        """A device copy of host array ``host`` (issued on the current stream)."""
        return self.xp.array(host, copy=True)

    def to_host(self, a, out: np.ndarray | None = None,
                reason: str = "launcher.to_host") -> np.ndarray:
        """A host copy of device array ``a``, into ``out`` (same shape and dtype) when given;
        complete when it returns. Counted by ``host_sync`` under ``reason``."""
        return host_sync.to_host(a, reason, out)

    def host_empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised host array for staging copies (page-locked on a GPU)."""
        return np.empty(shape, dtype)

    def to_host_async(self, a, out: np.ndarray) -> None:
        """Start copying device array ``a`` into ``out`` (page-locked: ``host_empty``) on the
        current stream, without waiting; ``out`` holds the values once an event recorded after
        this call is ``done`` (``host_sync.copy_async``)."""
        host_sync.copy_async(a, out)

    # --- stream order
    def stream(self):
        """A context manager that makes a new stream current for the calling thread while it is
        entered (a background thread issues its work there)."""
        return contextlib.nullcontext()

    def record(self):
        """An event recorded on the current stream: it completes when everything issued there so
        far has run (None here: host work is complete when issued)."""
        return None

    def wait(self, event) -> None:
        """Work issued on the current stream from now on runs after ``event`` (None: no wait)."""

    def synchronize(self, event, reason: str = "launcher.synchronize") -> None:
        """Block the calling thread until ``event`` completed (None: at once). Host work is
        complete when issued: nothing to wait for, but a wait on an event is counted (under
        ``reason``) as on a GPU, so that the dry run counts what the device would do."""
        if event is not None:
            host_sync.flag(True, reason)

    def done(self, event) -> bool:
        """True when ``event`` completed (None always has)."""
        return True

    def wait_for_copies(self, reason: str) -> None:
        """Block until the copies to the host queued so far on the current stream
        (``to_host_async``) have landed: one read, counted under ``reason`` on every launcher
        (here the copies landed when queued; counted as on a GPU, which waits here once for them
        all)."""
        event = self.record()
        if event is None:
            host_sync.flag(True, reason)
        else:
            self.synchronize(event, reason)


class HeldUntil:
    """Objects kept referenced until the device has passed an event given with each: what a
    host thread lets go of while work queued on a stream may still read its device memory (CuPy's
    pool gives a freed block back to the stream that allocated it, at once). ``hold(obj, event)``,
    then ``collect()`` drops those whose events have completed (``launch.done``: no wait)."""

    def __init__(self, launch: Launcher):
        self._launch = launch
        self._held: collections.deque = collections.deque()  # (obj, event), events in order

    def hold(self, obj, event) -> None:
        self._held.append((obj, event))
        self.collect()

    def collect(self) -> None:
        while self._held and self._launch.done(self._held[0][1]):
            self._held.popleft()

    @property
    def last_event(self):
        """The event of the newest object held (None when nothing is)."""
        return self._held[-1][1] if self._held else None

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


class CupyLauncher(Launcher):
    """Kernels compiled by ``cuda_module`` (NVRTC, memoised per device) on CuPy arrays."""

    def __init__(self):
        import cupy

        self.xp = cupy
        self.block = cm.BLOCK
        self.n_sms = cm.sm_count()
        self.device = cupy.cuda.Device().id

    def run(self, family, name, dtype, grid, block, args):
        # the launcher's device, whichever is current: a tier keeps its launcher and its arrays
        with self.xp.cuda.Device(self.device):
            cm.get_kernel(family, name, dtype)(grid, block, args)

    def to_device(self, host):
        with self.xp.cuda.Device(self.device):
            out = self.xp.empty(host.shape, dtype=host.dtype)
            out.set(np.ascontiguousarray(host))   # from page-locked memory: asynchronous
            return out

    def to_host(self, a, out=None, reason: str = "launcher.to_host"):
        with self.xp.cuda.Device(self.device):
            return host_sync.to_host(a, reason, out)   # blocking: complete when it returns

    def to_host_async(self, a, out: np.ndarray) -> None:
        with self.xp.cuda.Device(self.device):
            host_sync.copy_async(a, out)

    def host_empty(self, shape, dtype):
        import cupyx

        return cupyx.empty_pinned(shape, dtype)

    def stream(self):
        return _StreamScope(self.xp, self.device)

    def record(self):
        return self.xp.cuda.get_current_stream().record()

    def wait(self, event) -> None:
        if event is not None:
            self.xp.cuda.get_current_stream().wait_event(event)

    def synchronize(self, event, reason: str = "launcher.synchronize") -> None:
        host_sync.wait(event, reason)

    def done(self, event) -> bool:
        return event is None or bool(event.done)


class _StreamScope:
    """A non-blocking CUDA stream of one device, current for the thread while entered (the
    prefetch thread's): its work overlaps the main thread's, ordered against it only by events."""

    def __init__(self, cupy, device: int):
        with cupy.cuda.Device(device):
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._device = cupy.cuda.Device(device)

    def __enter__(self):
        self._device.__enter__()
        self._stream.__enter__()
        return self._stream

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


_cupy_launchers: dict = {}


def cupy_launcher() -> CupyLauncher:
    """The CuPy launcher of the current device (one per device)."""
    import cupy

    device = cupy.cuda.Device().id
    launcher = _cupy_launchers.get(device)
    if launcher is None:
        launcher = _cupy_launchers[device] = CupyLauncher()
    return launcher


def resolve(launch) -> Launcher:
    """``launch``, or the CuPy launcher of the current device when it is None."""
    return cupy_launcher() if launch is None else launch


def device_launcher(device) -> Launcher | None:
    """The launcher of an embedding's ``device``: None for "cpu" (the numpy path); the CuPy
    launcher of device N for "cuda" (the current device) or "cuda:N"; a ``Launcher`` as given
    (the tests run the device path on the host emulator this way). ConfigError for anything
    else, and for "cuda" where CuPy sees no device."""
    if isinstance(device, Launcher):
        return device
    if device is None or device == "cpu":
        return None
    if not isinstance(device, str) or not (device == "cuda" or device.startswith("cuda:")):
        raise ConfigError(f"device={device!r}: use 'cpu', 'cuda' or 'cuda:N'")
    index = None
    if device != "cuda":
        if not device[5:].isdigit():
            raise ConfigError(f"device={device!r}: the device index must be a number, e.g. 'cuda:0'")
        index = int(device[5:])
    try:
        import cupy

        count, why = cupy.cuda.runtime.getDeviceCount(), "no GPU"
    except Exception as e:  # no cupy, no driver, or no device: all mean "no GPU backend"
        count, why = 0, f"{type(e).__name__}: {e}"
    if count == 0:
        raise ConfigError(f"device={device!r}: no CUDA device is visible to CuPy ({why}; not "
                          "installed, no driver, or no GPU): install one_embedding[gpu] on a GPU machine, or use "
                          "device='cpu'")
    if index is None:
        return cupy_launcher()
    if index >= count:
        raise ConfigError(f"device={device!r}: CuPy sees {count} device(s), 0..{count - 1}")
    with cupy.cuda.Device(index):
        return cupy_launcher()


def launch_threads(launch: Launcher, family: str, name: str, dtype, n_threads: int, args: tuple) -> None:
    """A grid-stride kernel over ``n_threads`` items (nothing to launch when there are none)."""
    if n_threads > 0:
        blocks = cm.grid_stride_blocks(n_threads, launch.n_sms, launch.block)
        launch.run(family, name, dtype, (blocks,), (launch.block,), args)


def launch_warps(launch: Launcher, family: str, name: str, dtype, n_items: int, args: tuple) -> None:
    """A kernel where each warp owns one of ``n_items`` items per loop step."""
    if n_items > 0:
        blocks = cm.warp_blocks(n_items, launch.n_sms, launch.block)
        launch.run(family, name, dtype, (blocks,), (launch.block,), args)


# ---------------------------------------------------------------- argument checks


def device_array(launch: Launcher, name: str, a, dtype, ndim: int | None = None, writable: bool = False):
    """``a`` as a C-contiguous array of ``launch.xp`` with ``dtype``.

    Arrays of another module (numpy on the GPU path) are refused: rows cross between host and
    device only in the tier chain, explicitly. An output (``writable``) must already have the
    dtype and be contiguous, since a converted copy would take the writes.
    """
    xp = launch.xp
    if not isinstance(a, xp.ndarray):
        raise InputError(f"{name} is a {type(a).__module__}.{type(a).__name__}, not a "
                         f"{xp.__name__} array: the device ops take arrays of the device they run on")
    device = getattr(launch, "device", None)
    if device is not None and a.device.id != device:
        raise InputError(f"{name} lives on device {a.device.id} but the kernels run on device {device}: "
                         "keep a tier's arrays on its device")
    if ndim is not None and a.ndim != ndim:
        raise InputError(f"{name} has shape {tuple(a.shape)} but must have {ndim} dimensions")
    if writable:
        if a.dtype != np.dtype(dtype) or not a.flags.c_contiguous:
            raise InputError(f"{name} (dtype {a.dtype}, contiguous {a.flags.c_contiguous}) is written "
                             f"in place: pass a C-contiguous {np.dtype(dtype)} array")
        return a
    return xp.ascontiguousarray(a, dtype=dtype)


def _float_dtype(name: str, a):
    if np.dtype(a.dtype) not in cm.CTYPES:
        raise InputError(f"{name}.dtype={a.dtype}: use float32 (or float64)")
    return np.dtype(a.dtype)


# ---------------------------------------------------------------- gather

#: bytes one thread of the vectorised gathers moves (``embedding_gather_vector``,
#: ``embedding_gather_into_vector``: a float4 / double2)
VECTOR_BYTES = 16


def array_address(a) -> int:
    """The address of array ``a``'s first element: CuPy's device pointer, or numpy's host
    address (the emulator runs the kernels on numpy arrays in place)."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    return int(ptr) if ptr is not None else int(a.__array_interface__["data"][0])


def vector_lanes(dtype, counts, arrays, bits=None) -> int:
    """The values of ``dtype`` that one 16-byte vector holds (4 float32, 2 float64) when the
    vectorised gathers may run: every count in ``counts`` (row lengths and strides, in elements)
    a multiple of it, every array in ``arrays`` (of ``dtype``) at an address that is a multiple
    of 16 and ``bits`` (the fp16 / bf16 output, or None) at a multiple of the lanes' patterns'
    size (8 bytes for float32); else 0: the scalar kernels run. Rows then start on vector
    boundaries too (an offset of whole rows is a multiple of the lanes)."""
    lanes = VECTOR_BYTES // np.dtype(dtype).itemsize
    if any(int(c) % lanes for c in counts):
        return 0
    if any(array_address(a) % VECTOR_BYTES for a in arrays):
        return 0
    if bits is not None and array_address(bits) % (lanes * bits.itemsize):
        return 0
    return lanes


#: whether the kernels that copy whole lines may copy 16 bytes per lane (``line_vector``); False
#: runs their one-element copies always (the benchmark's baseline, bench_gpu_lookup). Same bits.
VECTOR_LINE_COPIES = True


def line_vector(dtype, line_size: int, arrays) -> np.int32:
    """The ``vector`` argument of the kernels that copy whole lines of ``line_size`` values of
    ``dtype`` (``hashindex_find``, ``hashindex_find_live``, ``hashindex_dedup_output_find``,
    ``hashindex_put_rows``, ``cache_find``, ``cache_insert``): 1 (16 bytes per lane, a warp moves
    512 bytes per step) when ``vector_lanes`` allows it for line_size and every array in
    ``arrays`` (the lines' sources and destinations, of ``dtype``), else 0 (one element per lane);
    0 when line_size is 0 (nothing is copied: the arrays are placeholders) and while
    ``VECTOR_LINE_COPIES`` is False."""
    return np.int32(VECTOR_LINE_COPIES and line_size > 0
                    and vector_lanes(dtype, (line_size,), arrays) != 0)


def gather_rows(src, index, launch: Launcher | None = None, check_index: bool = True,
                columns: int | None = None, vector: bool = True):
    """src: (R, E) float, index: (...) int64 -> (..., E): ``src[index]``, zero rows where index < 0.

    The twin of ``reference.gather_rows`` (copies, so bit-identical). ``check_index=False`` skips
    the index's range check (a host read) for an index that lies in src by construction.
    ``columns``: gather the first ``columns`` of each row of a wider src, read in place (the
    embedding columns of whole lines: no copy of them first) -> (..., columns).

    Kernel: ``embedding_gather_vector`` (16 bytes per thread) where ``vector_lanes`` allows it
    (columns and src's row length multiples of 4 float32 / 2 float64, src and the result at
    16-byte aligned addresses), else ``embedding_gather`` (one element per thread);
    ``vector=False`` runs the latter always (the benchmark's baseline). Same bits either way.
    """
    launch = resolve(launch)
    xp = launch.xp
    src = device_array(launch, "src", src, None, ndim=2)
    dtype = _float_dtype("src", src)
    index = device_array(launch, "index", index, np.int64)
    flat = index.reshape(-1)
    stride = src.shape[1]
    dim = stride if columns is None else int(columns)
    if not 0 <= dim <= stride:
        raise InputError(f"columns={columns} but src rows have {stride}")
    if check_index and flat.size and host_sync.flag(flat.max() >= src.shape[0], "gather_rows: index range check"):
        raise InputError(f"index holds {int(flat.max())} but src has {src.shape[0]} rows")
    out = xp.empty((flat.shape[0], dim), dtype=dtype)
    lanes = vector_lanes(dtype, (dim, stride), (src, out)) if vector else 0
    if lanes:
        launch_threads(launch, "embedding", "gather_vector", dtype, flat.shape[0] * (dim // lanes),
                       (src, np.int32(dim // lanes), np.int32(stride // lanes), flat,
                        np.int64(flat.shape[0]), out))
    else:
        launch_threads(launch, "embedding", "gather", dtype, flat.shape[0] * dim,
                       (src, np.int32(dim), np.int32(stride), flat, np.int64(flat.shape[0]), out))
    return out.reshape(tuple(index.shape) + (dim,))


# ---------------------------------------------------------------- row optimizers


def optimizer_kernel(optimizer, lr: float, t: int) -> tuple[str, tuple]:
    """(kernel name in optim.cu, its scalar arguments) for one step: the scalars each optimizer's
    ``_kernel`` hands its numba kernel (optim/kernels.py), in the same order."""
    factor = optimizer._grad_factor()
    l2 = optimizer._l2()
    if isinstance(optimizer, SGD):
        if not optimizer.n_states:
            return "sgd", (np.float64(factor), np.float64(lr), np.float64(optimizer.weight_decay))
        return "momentum", (np.float64(factor), np.float64(l2), np.float64(lr),
                            np.float64(optimizer.momentum), np.float64(1.0 - optimizer.dampening),
                            np.int32(optimizer.nesterov), np.float64(lr * optimizer._decoupled()))
    if isinstance(optimizer, Adagrad):
        clr = optimizer._clr(lr, t)
        return "adagrad", (np.float64(factor), np.float64(l2), np.float64(clr),
                           np.float64(optimizer.eps), np.float64(clr * optimizer._decoupled()))
    if isinstance(optimizer, SmartDecayAdam):   # rows: the step column follows (update_lines)
        b1, b2 = optimizer.betas
        return "smart_decay_adam", (np.float64(factor), np.float64(l2), np.float64(b1),
                                    np.float64(b2), np.float64(lr), np.float64(optimizer.eps),
                                    np.int64(t))
    if isinstance(optimizer, Adam):
        step_size, inv_sqrt_bc2 = optimizer._corrections(lr, t)
        b1, b2 = optimizer.betas
        return "adam", (np.float64(factor), np.float64(l2), np.float64(b1), np.float64(b2),
                        np.float64(step_size), np.float64(inv_sqrt_bc2), np.float64(optimizer.eps),
                        np.float64(lr * optimizer._decoupled()), np.int32(optimizer.amsgrad))
    if isinstance(optimizer, Ftrl):
        power, quad_l2, closed = optimizer.kernel_constants()
        return "ftrl", (np.float64(factor), np.float64(l2), np.float64(1.0 / lr),
                        np.float64(power), np.float64(optimizer.lambda1), np.float64(quad_l2),
                        np.float64(optimizer.beta), np.int32(closed),
                        np.float64(lr * optimizer._decoupled()))
    raise ConfigError(f"no device kernel for {type(optimizer).__name__}: use SGD, Adagrad, Adam, "
                      "Ftrl or SmartDecayAdam")


#: whether the row optimizer kernels may update 16 bytes of each block per thread
#: (``row_update_vector``); False runs their one-element path always (the benchmark's baseline,
#: bench_gpu_lookup). Same bits.
VECTOR_ROW_UPDATES = True


def row_update_vector(dim: int, line_size: int, arrays) -> np.int32:
    """The ``vector`` argument of the row optimizer kernels (``optim_<rule>``,
    ``optim_summed_<rule>``) for float32 lines of ``line_size`` holding blocks of ``dim``: 1 (a
    thread updates 4 consecutive columns, reading and writing the weight's and each state's as
    one 16-byte vector) when ``vector_lanes`` allows it for dim and line_size and every array in
    ``arrays`` (the lines, and the gradient rows read as vectors), else 0 (one element per
    thread); 0 while ``VECTOR_ROW_UPDATES`` is False. Same bits either way."""
    return np.int32(VECTOR_ROW_UPDATES and dim > 0
                    and vector_lanes(np.float32, (dim, line_size), arrays) != 0)


def update_lines(optimizer, lines, grads, step: int, launch: Launcher | None = None,
                 live=None):
    """One optimizer step on whole lines, in place, fused in one kernel.

    lines: (n, L) float32, C-contiguous, each ``[w (E) | state 1 (E) | ...]`` (SmartDecayAdam's
    with its int64 step per row after the blocks); grads: (n, E). Computes what
    ``optimizer.update(lines[:, :E], [state views], grads, step)`` computes on numpy (float64
    intermediates, one rounding per stored value): bit-identical, except Ftrl with lr_power
    other than +-0.5, whose pow may differ in the last float64 ulp. live: the (1,) int64
    device count of a fixed-capacity batch: its lines from ``live`` on are placeholders (this
    kernel updates them too, wasted work; nothing reads them). -> (n,) bool device array: the
    rows the update made hold an inf or NaN (``run_update``; False from ``live`` on).
    """
    launch = resolve(launch)
    grads = device_array(launch, "grads", grads, np.float32, ndim=2)
    bad = run_update(optimizer, lines, grads.shape, step, launch, "", (grads,), live, (grads,))
    if live is not None:   # the placeholders past the count hold whatever: never flagged
        xp = launch.xp
        bad &= xp.arange(bad.shape[0], dtype=xp.int64) < live
    return bad


def run_update(optimizer, lines, grad_shape: tuple, step: int, launch: Launcher, variant: str,
               grad_args: tuple, live=None, vector_reads: tuple = (),
               group_reads: tuple = ()):
    """The launches of ``update_lines`` for a gradient of ``grad_shape`` (n, E) that kernel
    ``optim_<variant><rule>`` reads from ``grad_args`` (``update_lines``: the (n, E) rows;
    ``fused_update``: a backward's rows, their grouping and the live count, summed in the
    kernel). live: a fixed-capacity batch's (1,) int64 device count (the rows' last steps are
    checked below it only). vector_reads: the arrays of grad_args the kernel reads 16 bytes at a
    time on its vector path (``row_update_vector``: ``update_lines``' gradient rows; none for
    the summed kernels, which sum per element). group_reads: arrays the summed kernels' vector
    path reads a row's group of columns of as one 16-byte vector where every one is 16-byte
    aligned (the ``vector`` argument's bit 1; else they sum column by column: the same bits).

    -> (n,) bool device array, True for a row where a value the update stored is inf or NaN
    (the step's finite-rows check, noted by the kernel as it stores: ``NonFiniteRows`` of
    optim_rules.cuh), for the row updates (``variant`` "" and "summed_"); None for the dense
    parameters' ("dense_"), which note nothing."""
    t = _check_step(step)
    lr = optimizer._current_lr()
    lines = device_array(launch, "lines", lines, np.float32, ndim=2, writable=True)
    n, dim = grad_shape
    need = optimizer.required_storage_dim(dim)
    if lines.shape[0] != n or lines.shape[1] < need:
        per_row = "".join(f" + {c}" for c in optimizer.row_columns)
        raise InputError(f"lines {tuple(lines.shape)} must hold {n} rows of at least {need} floats "
                         f"(weight + {optimizer.n_states} states of dim {dim}{per_row})")
    name, scalars = optimizer_kernel(optimizer, lr, t)
    head = (lines, np.int32(lines.shape[1]), *grad_args, np.int64(n), np.int32(dim))
    bad = None if variant == "dense_" else launch.xp.zeros(n, dtype=launch.xp.uint8)
    flags = () if bad is None else (bad,)
    vector = row_update_vector(dim, lines.shape[1], (lines, *vector_reads))
    threads = n * dim // 4 if vector else n * dim      # a thread per 4 columns on the vector path
    if vector and group_reads and all(array_address(a) % VECTOR_BYTES == 0 for a in group_reads):
        vector = np.int32(vector | 2)
    if not optimizer.row_columns:
        launch_threads(launch, "optim", variant + name, np.float32, threads,
                       head + scalars + flags + (vector,))
        return None if bad is None else bad.view(launch.xp.bool_)
    step_col = optimizer.row_column_offset(dim)
    xp = launch.xp
    steps = lines[:, step_col:step_col + 2].view(xp.uint32)
    if live is not None:   # placeholders past the count hold whatever: step 0 there
        steps = xp.where((xp.arange(n, dtype=xp.int64) < live)[:, None], steps, xp.uint32(0))
    optimizer.check_last_steps(xp, steps, t)
    launch_threads(launch, "optim", variant + name, np.float32, threads,
                   head + scalars + (np.int32(step_col),) + flags + (vector,))
    # the rows' new step, once every thread has read the old one
    launch_threads(launch, "optim", "smart_decay_adam_steps", np.float32, n,
                   (lines, np.int32(lines.shape[1]), np.int64(n), np.int64(t), np.int32(step_col)))
    return None if bad is None else bad.view(launch.xp.bool_)


# ---------------------------------------------------------------- counted compaction


def count_true(xp, mask, reason: str) -> int:
    """The number of True entries of device array ``mask``: one host read, counted."""
    return int(host_sync.scalar(xp.count_nonzero(mask), reason))


def count_each(xp, masks, reason: str) -> list[int]:
    """The number of True entries of each device array of ``masks``: one host read for them
    all, counted once."""
    counts = xp.stack([xp.asarray(xp.count_nonzero(m), dtype=xp.int64) for m in masks])
    return [int(c) for c in host_sync.to_host(counts, reason)]


def positions_of(xp, mask, n: int):
    """mask: (N,) bool with ``n`` True entries -> (n,) int64 ascending positions of them, without
    reading anything back and without CuPy's nonzero kernel: each True entry scatters its
    position to its rank (a cumulative sum); the False entries all land on a spare slot n."""
    mask = mask.reshape(-1)
    rank = xp.cumsum(mask, dtype=xp.int64) - 1
    target = xp.where(mask, rank, n)
    out = xp.empty(n + 1, dtype=xp.int64)
    out[target] = xp.arange(mask.shape[0], dtype=xp.int64)
    return out[:n]


def flatnonzero(xp, mask, reason: str):
    """``xp.flatnonzero(mask)`` with its one size read counted under ``reason``."""
    return positions_of(xp, mask, count_true(xp, mask, reason))
