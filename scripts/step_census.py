"""Counts the device operations a steady-state training step issues from the host, on the CPU dry
run of the device path (``tests/gpu_dry_run.py``: numpy standing in for CuPy, the host emulator
for the CUDA kernels), by thread and call site: each kernel launch through a device launcher,
each call of a ``cupy`` function and each array operation a CuPy array would launch a kernel for
(ufuncs, ``astype``, ``copy``, ``fill``, item assignment, indexing by an array). On a GPU each is
some microseconds of the launching thread's time; work inside the CUDA graph is listed apart (on
the dry run an emulated replay runs the step's Python again; on a GPU a replay is one launch).

A steady step's count is a long run's minus a short run's (the same start-up and end), divided by
the difference in steps: what the GPU check cannot show per call site, and what tells whether the
host can keep up with the device (no GPU needed).

    python scripts/step_census.py [--steps 10 30] [--depth 1] [--top 25] [--json]

A lower bound: ``ascontiguousarray`` of an array already contiguous launches nothing on CuPy
but is counted, and so are cupy calls that only allocate (``empty``); CuPy's own internal
launches (a reduction's two passes) count once.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: the package's source directory: a frame is the package's when its file lies there
PACKAGE_DIR = str(ROOT / "src" / "one_embedding") + os.sep


class Census:
    """Counts (thread, "graph" or "eager", what, call site) while installed."""

    def __init__(self, capture_state):
        self.counts = collections.Counter()
        self._lock = threading.Lock()
        self._capture = capture_state
        self._paused = threading.local()

    def record(self, what: str) -> None:
        if getattr(self._paused, "on", False):
            return
        frames = [f for f in traceback.extract_stack()[:-2]
                  if f.filename.startswith(PACKAGE_DIR)]
        where = (f"one_embedding/{frames[-1].filename[len(PACKAGE_DIR):]}:{frames[-1].lineno} "
                 f"{frames[-1].name}"
                 if frames else "?")
        phase = "graph" if getattr(self._capture, "trace", None) is not None else "eager"
        thread = "main" if threading.current_thread() is threading.main_thread() else "prefetch"
        with self._lock:
            self.counts[(thread, phase, what, where)] += 1

    def paused(self, fn):
        """``fn`` with nothing recorded inside (a one-time layout, not a step's work)."""
        def run(*args, **kwargs):
            self._paused.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._paused.on = False
        return run


def install(census: Census) -> None:
    """Route the stand-in cupy's functions and the emulated launcher through ``census``."""
    import cupy
    from hidden_syncs import WrappedNamespace

    from one_embedding.kernels import dense_update, device_ops

    record = census.record

    class Counted(np.ndarray):
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            record(f"ufunc {ufunc.__name__}.{method}")
            inputs = [x.view(np.ndarray) if isinstance(x, Counted) else x for x in inputs]
            outs = kwargs.get("out")
            if outs:
                kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, Counted) else x
                                      for x in outs)
            result = getattr(ufunc, method)(*inputs, **kwargs)
            if outs:        # in place: the caller's own arrays, as CuPy returns them
                return outs[0] if len(outs) == 1 else outs
            return result.view(Counted) if isinstance(result, np.ndarray) else result

        def astype(self, *args, **kwargs):
            record("astype")
            return super().astype(*args, **kwargs)

        def copy(self, *args, **kwargs):
            record("copy")
            return super().copy(*args, **kwargs)

        def fill(self, value):
            record("fill")
            return super().fill(value)

        def __setitem__(self, key, value):
            record("item assignment")
            super().__setitem__(key, value)

        def __getitem__(self, key):
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, np.ndarray) for k in keys):
                record("indexing by an array")
            return super().__getitem__(key)

    def counted(value):
        if type(value) is np.ndarray:
            return value.view(Counted)
        if isinstance(value, tuple):
            return tuple(counted(v) for v in value)
        return value

    def counting(name, fn):
        def call(*args, **kwargs):
            record(f"cupy.{name}")
            return counted(fn(*args, **kwargs))
        return call

    cupy.__dict__["__getattr__"] = lambda name: getattr(WrappedNamespace(np, counting), name)
    launcher = device_ops.cupy_launcher()
    launcher.xp = WrappedNamespace(launcher.xp, counting)
    run = launcher.run

    def launch(family, name, *args, **kwargs):
        record(f"kernel {family}_{name}")
        return run(family, name, *args, **kwargs)

    launcher.run = launch
    dense_update.FlatDense.__init__ = census.paused(dense_update.FlatDense.__init__)


def train(steps: int, depth: int, folder: str) -> None:
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    cfg = TrainConfig(steps=steps, batch_size=256, synthetic_rows=50_000, embedding_dim=16,
                      store="device_mem", cache_mb=1.0, optimizer="adagrad", eval_batches=1,
                      device="cuda", prefetch_depth=depth, log_interval=10,
                      persistent_path=os.path.join(folder, f"run{steps}"))
    Trainer(cfg, metrics_path=os.devnull, progress=False).run()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs=2, default=(10, 30), metavar=("SHORT", "LONG"))
    parser.add_argument("--depth", type=int, default=1, help="prefetch depth (default 1)")
    parser.add_argument("--top", type=int, default=25, help="call sites listed (default 25)")
    parser.add_argument("--json", action="store_true",
                        help="print {thread: {phase: operations per step}} as JSON instead")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]
    import gpu_dry_run

    gpu_dry_run.install(ROOT / ".pytest_cache" / "cuda_emulation")
    census = Census(gpu_dry_run._capture)
    install(census)
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for steps in args.steps:
            census.counts.clear()
            train(steps, args.depth, folder)
            runs.append(collections.Counter(census.counts))
    short, long = args.steps
    per_step = runs[1].copy()
    per_step.subtract(runs[0])
    span = long - short
    totals = collections.Counter()
    for (thread, phase, _, _), n in per_step.items():
        totals[(thread, phase)] += n
    if args.json:
        by_thread: dict = {}
        for (thread, phase), n in totals.items():
            by_thread.setdefault(thread, {})[phase] = n / span
        print(json.dumps(by_thread))
        return
    print(f"device operations per steady-state step (runs of {long} and {short} steps, prefetch "
          f"depth {args.depth}, DLRM on the CLI's synthetic data, the dry run):")
    for (thread, phase), n in sorted(totals.items()):
        print(f"  {thread} thread, {phase}: {n / span:.1f}")
    print(f"\nthe {args.top} most frequent (per step, thread, phase, what, call site):")
    for (thread, phase, what, where), n in per_step.most_common(args.top):
        if n > 0:
            print(f"{n / span:6.1f}  {thread:8s} {phase:5s} {what:32s} {where}")


if __name__ == "__main__":
    main()
