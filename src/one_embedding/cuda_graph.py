"""Capture a fixed-shape function of device arrays once as a CUDA graph and replay it (issue 30
item 3, DESIGN.md decision 14): the trainer's dense segment (forward, loss, backward to the
embeddings) becomes one ``cudaGraphLaunch`` per step instead of a few hundred kernel launches.

``StepGraph(fn, xp)`` wraps ``fn(*arrays) -> tuple of arrays``. Its first ``warmup`` calls with
one signature (the inputs' shapes and dtypes, and the caller's ``key``) run ``fn`` as it is: CuPy
compiles its kernels and cuBLAS picks its plans there. The next call copies the inputs into static
buffers and captures one call of ``fn`` on them, on a stream of its own, with a private
``cupy.cuda.MemoryPool`` (what ``fn`` allocates while captured stays reserved for the graph:
the pool lives as long as the graph, as PyTorch's private graph pools do), then launches the graph
on the caller's stream. Every later call with that signature copies its inputs into the static
buffers and launches the graph again; the outputs returned are the same arrays every time (the
captured ones), valid until the next call: a caller copies what it keeps longer. A call with
another signature (a short last batch, another key) runs ``fn`` uncaptured; a signature seen
``warmup`` times in a row replaces the graph.

What a replay cannot see, and the caller must keep fixed (a graph replays exactly the kernels,
pointers and scalar arguments of its capture):

- Python scalars that reach kernels (a loss scale, a learning rate, a dropout counter): constant
  while the graph lives, or part of ``key`` (a new value makes a new signature).
- The memory of the arrays ``fn`` reads or updates in place besides its inputs (weights,
  gradients): ``persistent()`` lists them; a replay checks that they are still the same arrays
  at the same addresses, and captures again when not (an optimizer that rebinds a weight, a
  checkpoint load).
- Host reads: while capturing, every ``host_sync`` read raises ``HostReadInCapture``, and a
  ``host_sync.check`` inside ``host_sync.deferring`` keeps its flag for the graph: after each
  launch a copy of each such check (its flag and details recomputed by the graph) is queued
  for the next metrics read, at the step then running.

A capture that fails (a host read, a CUDA library that refuses stream capture, a CUDA error) is
abandoned with a logged warning: the call and every later one run ``fn`` uncaptured
(``status`` says why), never a wrong result.

On numpy (the CPU backend) there are no graphs: ``fn`` runs as it is. The GPU dry run
(tests/gpu_dry_run.py, numpy standing in for CuPy) has an emulated graph (``emulated = True``):
its capture runs ``fn`` at once (numpy computes as it goes), and a replay runs ``fn`` again
under a new capture and compares the two captures' traces of kernel launches (kernel, geometry,
scalar arguments, array shapes and dtypes): a Python scalar that changed between calls, which a
real replay would silently keep at its captured value, fails the replay there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from . import host_sync

log = logging.getLogger(__name__)

#: calls of one signature run uncaptured before it is captured (kernel compilation, cuBLAS plans)
DEFAULT_WARMUP = 2


class GraphReplayMismatch(RuntimeError):
    """The dry run's emulated replay launched other kernels or scalars than its capture."""


def _address(a) -> int:
    """The device (or host) address of array ``a``'s first element."""
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else int(a.__array_interface__["data"][0])


def _identity(arrays) -> tuple:
    return tuple((id(a), _address(a), tuple(a.shape), str(a.dtype)) for a in arrays)


def _signature(inputs, key) -> tuple:
    return (key, tuple((tuple(a.shape), str(a.dtype)) for a in inputs))


@dataclass
class _Graph:
    """One capture: the graph, what its kernels read and write, and what keeps them alive."""
    signature: tuple
    graph: object
    pool: object                       # the private memory pool of what the capture allocated
    stream: object                     # the capture's stream
    static_inputs: list                # the inputs' copies the graph reads
    outputs: tuple                     # the arrays the graph writes, returned by each replay
    checks: list                       # host_sync checks whose flags the graph recomputes
    persistent: tuple                  # _identity of persistent() at capture
    single: bool = False               # fn returned one array, not a tuple


@dataclass
class GraphStats:
    """What a ``StepGraph`` did: calls captured, replayed and run uncaptured (warmup included)."""
    captures: int = 0
    replays: int = 0
    uncaptured: int = 0
    recaptures: dict = field(default_factory=dict)   # reason -> count


class StepGraph:
    """A function of device arrays, replayed as a CUDA graph after ``warmup`` calls.

    fn: ``fn(*inputs) -> array or tuple of arrays`` (device arrays of ``xp``); it may keep Python
    references between calls only to arrays it recreates each call (a layer's saved input) or
    lists in ``persistent``. xp: numpy (no graph: ``fn`` runs as it is) or cupy.
    persistent: a callable returning the arrays ``fn`` reads or updates in place besides its
    inputs (weights, gradients). name: what the capture is called in errors and logs.
    enabled: False runs ``fn`` as it is, always (``--no-cuda-graph``).
    """

    def __init__(self, fn, xp, *, warmup: int = DEFAULT_WARMUP, persistent=None,
                 name: str = "step", enabled: bool = True):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup={warmup!r}: pass a count of uncaptured calls >= 0")
        self.fn, self.xp, self.warmup, self.name = fn, xp, warmup, name
        self.persistent = persistent or (lambda: ())
        self.enabled = bool(enabled) and xp is not np
        self.stats = GraphStats()
        self.failure: str | None = None
        self._graph: _Graph | None = None
        self._seen: tuple | None = None   # the signature of the calls counted in _seen_count
        self._seen_count = 0

    @property
    def status(self) -> str:
        """"off", "warming up", "replaying", "uncaptured" (the last call's signature was not the
        graph's) or "failed: <why>"."""
        if not self.enabled:
            return "off"
        if self.failure is not None:
            return f"failed: {self.failure}"
        if self._graph is None:
            return "warming up"
        return "replaying" if self._last_replayed else "uncaptured"

    _last_replayed = False

    def __call__(self, *inputs, key=()):
        """``fn(*inputs)``: replayed, captured, or run as it is (see the class docstring).
        key: hashable Python values the captured kernels depend on (part of the signature)."""
        self._last_replayed = False
        if not self.enabled or self.failure is not None:
            return self._uncaptured(inputs)
        signature = _signature(inputs, key)
        graph = self._graph
        if graph is not None and graph.signature == signature:
            now = _identity(self.persistent())
            if now == graph.persistent:
                return self._replay(graph, inputs)
            self._drop("the persistent arrays moved (rebound or reallocated)")
        if signature == self._seen:
            self._seen_count += 1
        else:
            self._seen, self._seen_count = signature, 1
        if self._seen_count <= self.warmup:
            return self._uncaptured(inputs)
        if self._graph is not None:
            self._drop(f"{self.warmup + 1} calls in a row of another signature")
        return self._capture(signature, inputs)

    # --- the three ways of running fn

    def _uncaptured(self, inputs):
        self.stats.uncaptured += 1
        return self.fn(*inputs)

    def _queue_checks(self, graph: _Graph) -> None:
        queue = host_sync.deferred_checks()
        if queue is not None:
            for check in graph.checks:
                host_sync.requeue(check, queue, self.xp.copy)

    def _launch(self, graph: _Graph, inputs) -> tuple:
        for static, a in zip(graph.static_inputs, inputs):
            static[...] = a
        if getattr(graph.graph, "emulated", False):
            self._replay_emulated(graph)
        else:
            graph.graph.launch(stream=self.xp.cuda.get_current_stream())
        self._queue_checks(graph)
        return graph.outputs

    def _replay(self, graph: _Graph, inputs):
        outputs = self._launch(graph, inputs)
        self.stats.replays += 1
        self._last_replayed = True
        return outputs[0] if graph.single else outputs

    def _capture(self, signature, inputs):
        xp = self.xp
        cuda = xp.cuda
        static = [xp.empty_like(a) for a in inputs]
        for s, a in zip(static, inputs):
            s[...] = a
        stream = cuda.Stream(non_blocking=True)
        stream.wait_event(cuda.get_current_stream().record())   # the copies come first
        pool = cuda.MemoryPool()
        persistent = _identity(self.persistent())
        try:
            outputs, checks, graph = self._record(stream, pool, static)
        except Exception as e:  # noqa: BLE001 -- logged; every later call runs uncaptured
            self.failure = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph of %s: the capture failed, running uncaptured from now on "
                        "(%s)", self.name, self.failure)
            return self._uncaptured(inputs)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        captured = _Graph(signature, graph, pool, stream, static, outputs, checks, persistent,
                          single)
        self._graph = captured
        self.stats.captures += 1
        if getattr(graph, "emulated", False):
            # the dry run's capture computed the call (numpy runs at once): no launch
            self._queue_checks(captured)
        else:
            self._launch(captured, ())   # the inputs are in the static buffers already
        self._last_replayed = True
        log.info("CUDA graph of %s captured for %s", self.name, signature)
        return outputs[0] if single else outputs

    def _record(self, stream, pool, static):
        """fn(*static) captured on ``stream`` -> (outputs, kept checks, graph). Raises what the
        call or the capture raised, the capture ended either way."""
        cuda = self.xp.cuda
        with cuda.using_allocator(pool.malloc), stream, \
                host_sync.capturing(self.name) as checks:
            stream.begin_capture()
            try:
                outputs = self.fn(*static)
            except BaseException:
                self._end_abandoned(stream)
                raise
            graph = stream.end_capture()
        return outputs, checks, graph

    def _end_abandoned(self, stream) -> None:
        """End a capture whose call raised (the stream leaves capture mode; CUDA may refuse the
        invalidated graph, which is dropped anyway)."""
        try:
            stream.end_capture()
        except Exception as e:  # noqa: BLE001 -- the call's own error is the one raised
            log.debug("CUDA graph of %s: ending the abandoned capture: %s: %s", self.name,
                      type(e).__name__, e)

    def _replay_emulated(self, graph: _Graph) -> None:
        """The dry run's replay: ``fn`` again on the static inputs under a new capture, whose
        trace must equal the graph's; its outputs and check flags are copied into the graph's
        arrays, where a real replay writes them."""
        outputs, checks, rerun = self._record(graph.stream, graph.pool, graph.static_inputs)
        graph.graph.verify(rerun, self.name)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outputs) != len(graph.outputs) or len(checks) != len(graph.checks):
            raise GraphReplayMismatch(f"{self.name}: the replay returned {len(outputs)} arrays "
                                      f"and kept {len(checks)} checks; the capture "
                                      f"{len(graph.outputs)} and {len(graph.checks)}")
        # into the captured arrays, as a replay writes them; numpy's 0-d results may be
        # (immutable) scalars, which are replaced instead
        kept = []
        for mine, new in zip(graph.outputs, outputs):
            if isinstance(mine, np.ndarray):
                mine[...] = new
                kept.append(mine)
            else:
                kept.append(new)
        graph.outputs = tuple(kept)
        graph.checks[:] = checks

    def _drop(self, reason: str) -> None:
        self.stats.recaptures[reason] = self.stats.recaptures.get(reason, 0) + 1
        log.info("CUDA graph of %s dropped: %s", self.name, reason)
        self._graph = None
