"""Dry-run the GPU tests on a machine without a GPU: a pytest plugin that puts a stand-in
``cupy`` module (numpy underneath) into ``sys.modules`` and makes the CuPy launcher the host
emulator (tests/cuda_emulation.py), so that ``@pytest.mark.gpu`` tests run their whole logic —
test code, device glue, the embedding's device path, the CUDA kernels (emulated) — here:

    PYTHONPATH=tests python -m pytest -p gpu_dry_run -m gpu tests/test_device_embedding_gpu.py

What a dry run cannot check: CuPy's own functions and their numerics (numpy computes them),
NVRTC, flush-to-zero, streams and concurrency, timing.

CUDA graphs (``Stream.begin_capture`` / ``end_capture``, ``one_embedding.cuda_graph``) are
emulated: a capture runs its code at once (numpy) and records a trace of the kernels it launches
(the emulator's launches, and the calls of the numpy kernels of ``kernels.reference`` and
``kernels.cpu_ops`` that stand in for CUDA kernels here: name, scalar arguments, array shapes and
dtypes). ``Graph.verify`` compares a replay's trace with the capture's, so a Python scalar that
changed between calls, which a real replay would keep at its captured value, fails the dry run. It sets ONE_EMBEDDING_GPU_DRY_RUN=1, which
the GPU tests read to shrink their sizes (the emulator runs kernels one thread at a time). With
ONE_EMBEDDING_CUDA_EMULATION_SEED=<int> the emulator runs in its stress mode (tests/cuda_emulation.py).
Never load it in a normal run: every array "on the GPU" is a numpy array.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
import types
from pathlib import Path

import numpy as np


#: per thread: the trace of the capture in progress, or None
_capture = threading.local()


def _describe(value):
    """A launch argument as the trace keeps it: arrays by shape and dtype (their addresses
    differ from call to call on numpy), scalars by type and value."""
    if isinstance(value, np.ndarray):
        return ("array", value.shape, value.dtype.str)
    if isinstance(value, (np.dtype, type)):
        return ("dtype", str(np.dtype(value)))
    if isinstance(value, (bool, int, float, complex, str, np.generic)) or value is None:
        return (type(value).__name__, repr(value))
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    return (type(value).__name__,)


def record_launch(name: str, *args, **kwargs) -> None:
    """Append one kernel launch to this thread's capture trace, when it captures."""
    trace = getattr(_capture, "trace", None)
    if trace is not None:
        trace.append((name, _describe(args), tuple((k, _describe(v)) for k, v in sorted(kwargs.items()))))


class GraphReplayMismatch(AssertionError):
    """An emulated replay launched other kernels or arguments than its capture."""


class Graph:
    """An emulated CUDA graph: the trace of its capture (``one_embedding.cuda_graph`` re-runs
    the captured function for a replay and hands the new capture to ``verify``)."""

    emulated = True

    def __init__(self, trace: list):
        self.trace = trace

    def launch(self, stream=None):
        raise RuntimeError("an emulated graph holds a trace, not kernels: cuda_graph.StepGraph "
                           "replays it by running the function again and calling verify()")

    def verify(self, replay: "Graph", name: str = "graph") -> None:
        """Raise GraphReplayMismatch naming the first launch where ``replay`` differs."""
        for i, (mine, theirs) in enumerate(zip(self.trace, replay.trace)):
            if mine != theirs:
                raise GraphReplayMismatch(
                    f"{name}: launch {i} of the replay differs from the capture (a real replay "
                    f"would run the captured one): captured {mine}, now {theirs}")
        if len(self.trace) != len(replay.trace):
            raise GraphReplayMismatch(f"{name}: the replay launched {len(replay.trace)} kernels, "
                                      f"the capture {len(self.trace)}")


#: per thread: the streams made current by ``with stream:``, innermost last
_current = threading.local()
_stream_ids = itertools.count(1)


def _stream_stack() -> list:
    stack = getattr(_current, "stack", None)
    if stack is None:
        stack = _current.stack = []
    return stack


def _stream_model():
    model = sys.modules.get("stream_order")
    return None if model is None else model.active_model()


def current_stream_id() -> int:
    """The stream the calling thread's work runs on: its current stream, or the one below it
    while that one captures a graph (a captured graph runs where it is launched: a capture
    here runs its code at once, standing in for the launch that follows it)."""
    for stream in reversed(_stream_stack()):
        if not stream.is_capturing():
            return stream.sid
    return 0


def _fake_cupy() -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.__dict__["__getattr__"] = lambda name: getattr(np, name)
    cupy.ndarray = np.ndarray
    cupy.asnumpy = lambda a, *args, **kwargs: np.asarray(a)

    class Event:
        """An event: complete at once, unless ``stream_order.checked()`` keeps the streams'
        order (then it carries the vector clock of the work issued before it)."""

        def __init__(self, clock=None):
            self.clock = clock

        @property
        def done(self):
            model = _stream_model()
            return True if model is None else model.event_done(self)

        def record(self, stream=None):
            self.clock = (stream or cuda.get_current_stream())._snapshot()

        def synchronize(self):
            model = _stream_model()
            if model is not None:
                model.host_knows(self.clock)

    class Stream:
        """A stream, current for the thread inside ``with stream:`` (a stack per thread)."""

        ptr = 0

        def __init__(self, non_blocking=False):
            self.ptr = id(self)
            self.sid = next(_stream_ids)
            model = _stream_model()
            if model is not None:
                model.names[self.sid] = (f"stream {self.sid} (made on thread "
                                         f"{threading.current_thread().name})")

        def _snapshot(self):
            model = _stream_model()
            return None if model is None else model.snapshot(self.sid)

        def __enter__(self):
            _stream_stack().append(self)
            return self

        def __exit__(self, *exc):
            stack = _stream_stack()
            if stack and stack[-1] is self:
                stack.pop()
            return None

        def record(self, event=None):
            event = event or Event()
            event.clock = self._snapshot()
            return event

        def wait_event(self, event):
            model = _stream_model()
            if model is not None:
                model.wait(self.sid, event.clock)

        def synchronize(self):
            model = _stream_model()
            if model is not None:
                model.host_syncs_stream(self.sid)

        def use(self):
            stack = _stream_stack()
            stack[:] = [self]
            return self

        def begin_capture(self, mode=None):
            if self.ptr == 0:
                raise RuntimeError("cannot capture on the default (legacy) stream")
            if getattr(_capture, "trace", None) is not None:
                raise RuntimeError("this thread captures already")
            _capture.trace, _capture.stream = [], self

        def end_capture(self):
            if getattr(_capture, "stream", None) is not self:
                raise RuntimeError("end_capture on a stream that does not capture")
            trace, _capture.trace, _capture.stream = _capture.trace, None, None
            return Graph(trace)

        def is_capturing(self):
            return getattr(_capture, "stream", None) is self

    class MemoryPool:
        """CuPy's pool, for a private graph pool: numpy allocates as it always does."""

        def malloc(self, size):
            raise RuntimeError("the dry run allocates with numpy, never through a pool")

        def used_bytes(self):
            return 0

        def free_all_blocks(self):
            return None

    null = Stream()
    null.ptr, null.sid = 0, 0

    class Device:
        def __init__(self, index=0):
            self.id = 0 if index is None else int(index)
            self.attributes = {"MultiProcessorCount": 1}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def use(self):
            return None

        def synchronize(self):
            model = _stream_model()
            if model is not None:
                model.host_syncs_device()

    cuda = types.ModuleType("cupy.cuda")
    cuda.Device = Device
    cuda.Stream = Stream
    cuda.Event = Event
    cuda.Graph = Graph
    cuda.MemoryPool = MemoryPool
    cuda.using_allocator = lambda allocator=None: contextlib.nullcontext()
    cuda.get_current_stream = lambda: (_stream_stack() or [null])[-1]
    cuda.runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, runtimeGetVersion=lambda: 0,
        getDeviceProperties=lambda index: {"name": b"dry run (numpy + emulator)",
                                           "multiProcessorCount": 1, "totalGlobalMem": 0})
    cupy.__version__ = "dry-run"
    cupy.cuda = cuda
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=np.float64: np.empty(shape, dtype)
    return cupy, cuda, cupyx


def install(cache_folder: Path) -> None:
    """Put the stand-in cupy into ``sys.modules`` and make the emulator the CuPy launcher (its
    library built in, or reused from, ``cache_folder``). Also usable outside pytest, e.g. to
    dry-run ``benchmarks.bench_gpu``'s GPU branch."""
    os.environ["ONE_EMBEDDING_GPU_DRY_RUN"] = "1"
    cupy, cuda, cupyx = _fake_cupy()
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupyx": cupyx})

    from cuda_emulation import EmulatedLauncher, build

    from one_embedding.kernels import cuda_module as cm
    from one_embedding.kernels import device_ops

    # the step's kernels, the device data, and the fused dense kernels that the dense model's
    # device path launches (the loss fused with the last layer: Trainer.train_step)
    families = cm.EMBEDDING_FAMILIES + cm.DATA_FAMILIES + cm.AMP_FAMILIES
    launcher = EmulatedLauncher(build(families, cache_folder), families)
    device_ops.cupy_launcher = lambda: launcher
    device_ops._cupy_launchers.clear()
    _trace_launches(launcher)


def _traced(name: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        record_launch(name, *args, **kwargs)
        return fn(*args, **kwargs)

    run.__traced__ = True
    return run


def _trace_launches(launcher) -> None:
    """Graph captures record the emulator's kernel launches, and the calls of the numpy kernels
    that stand in for the dense CUDA kernels on the dry run (``kernels.reference``'s OPS and
    ``kernels.cpu_ops``' public functions: numpy model arrays take those paths)."""
    from one_embedding.kernels import OPS, cpu_ops, reference

    launcher.run = _traced("launch", launcher.run)
    for module, names in ((reference, OPS), (cpu_ops, [n for n in dir(cpu_ops)
                                                        if not n.startswith("_")])):
        for name in names:
            fn = getattr(module, name)
            if callable(fn) and getattr(fn, "__module__", None) == module.__name__ \
                    and not getattr(fn, "__traced__", False) and not isinstance(fn, type):
                setattr(module, name, _traced(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", fn))


def pytest_configure(config):
    install(Path(config.rootpath) / ".pytest_cache" / "cuda_emulation")


#: ONE_EMBEDDING_DRY_RUN_STREAM_ORDER=1: every test runs inside ``stream_order.checked()`` and
#: fails where the device path races between streams (tests/stream_order.py); =slow: with events
#: that answer "not yet" up to 5 times (other paths: tests that count host reads may differ)
STREAM_ORDER_ENV = "ONE_EMBEDDING_DRY_RUN_STREAM_ORDER"


def pytest_runtest_call(item):
    pace = os.environ.get(STREAM_ORDER_ENV)
    if pace not in ("1", "slow") or item.get_closest_marker("gpu") is None:
        return
    import stream_order

    item.runtest = _checked(item.runtest, stream_order, 5 if pace == "slow" else 0)


def _checked(runtest, stream_order, max_lag: int):
    def run():
        # 1: every event done when first asked, the paths (and host reads) of an ordinary dry
        # run, which tests counting reads expect
        with stream_order.checked(max_lag=max_lag) as hazards:
            runtest()
        if hazards:
            raise AssertionError("races between CUDA streams (tests/stream_order.py):\n"
                                 + "\n".join(f"{n} x {h}" for h, n in hazards.items()))
    return run
