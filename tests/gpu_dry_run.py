"""Dry-run the GPU tests on a machine without a GPU: a pytest plugin that puts a stand-in
``cupy`` module (numpy underneath) into ``sys.modules`` and makes the CuPy launcher the host
emulator (tests/cuda_emulation.py), so that ``@pytest.mark.gpu`` tests run their whole logic —
test code, device glue, the embedding's device path, the CUDA kernels (emulated) — here:

    PYTHONPATH=tests python -m pytest -p gpu_dry_run -m gpu tests/test_device_embedding_gpu.py

What a dry run cannot check: CuPy's own functions and their numerics (numpy computes them),
NVRTC, flush-to-zero, streams and concurrency, timing. It sets ONE_EMBEDDING_GPU_DRY_RUN=1, which
the GPU tests read to shrink their sizes (the emulator runs kernels one thread at a time). With
ONE_EMBEDDING_CUDA_EMULATION_SEED=<int> the emulator runs in its stress mode (tests/cuda_emulation.py).
Never load it in a normal run: every array "on the GPU" is a numpy array.
"""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import numpy as np


def _fake_cupy() -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.__dict__["__getattr__"] = lambda name: getattr(np, name)
    cupy.ndarray = np.ndarray
    cupy.asnumpy = lambda a, *args, **kwargs: np.asarray(a)

    class Event:
        done = True

        def synchronize(self):
            return None

    class Stream:
        ptr = 0

        def __init__(self, non_blocking=False):
            self.ptr = id(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def record(self, event=None):
            return Event()

        def wait_event(self, event):
            return None

        def synchronize(self):
            return None

        def use(self):
            return self

    null = Stream()
    null.ptr = 0

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
            return None

    cuda = types.ModuleType("cupy.cuda")
    cuda.Device = Device
    cuda.Stream = Stream
    cuda.Event = Event
    cuda.get_current_stream = lambda: null
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


def pytest_configure(config):
    install(Path(config.rootpath) / ".pytest_cache" / "cuda_emulation")
