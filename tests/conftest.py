"""Shared set-up of the test suite.

Layout: ``unit/`` (one component against its specification), ``parity/`` (the same training or
computation two ways: float64 or PyTorch references, stores, prefetch depths, resume, the device
path under emulation), ``system/`` (the CLI, examples, benchmarks, crash and size tests as a user
runs them), ``gpu/`` (``@pytest.mark.gpu``: CuPy on a device), ``mpi/`` (``@pytest.mark.mpi``:
ranks under mpiexec). Modules shared by them live here: ``helpers.py``, ``cuda_emulation.py``,
``gpu_dry_run.py``.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # the shared modules import from every subfolder
    sys.path.insert(0, str(TESTS))

import helpers  # noqa: E402


@pytest.fixture
def criteo_dir() -> Path:
    """The real Criteo rows of ``../shared/data/criteo`` (the test skips where they are absent)."""
    if not helpers.CRITEO_DIR.is_dir():
        pytest.skip("real Criteo rows live in ../shared/data/criteo (absent)")
    return helpers.CRITEO_DIR


@pytest.fixture
def root() -> Path:
    """The repository."""
    return helpers.ROOT


def pytest_configure(config):
    """ONE_EMBEDDING_CUPY_POOL=0 (scripts/gpu_check.sh sets it under compute-sanitizer): CuPy's
    device and pinned memory pools off, so that every array is its own allocation and an access
    past its end is one the sanitizer sees (inside a pooled chunk it is not)."""
    import os

    if os.environ.get("ONE_EMBEDDING_CUPY_POOL") != "0":
        return
    from one_embedding.backend import cupy_available

    if cupy_available():
        import cupy

        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)


def pytest_collection_modifyitems(config, items):
    """RocksDB is a dependency, but a machine may lack its wheel (the GPU image does): there its
    tests skip, named, instead of failing."""
    if importlib.util.find_spec("rocksdict") is not None:
        return
    skip = pytest.mark.skip(reason="rocksdict is not installed: the RocksDB engine cannot run")
    for item in items:
        if "rocksdb" in item.nodeid.lower() or item.get_closest_marker("rocksdb"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def emulation_folder(request, tmp_path_factory) -> Path:
    """Where the emulator's libraries are built and kept (pytest's cache between runs, else a
    session folder); the test skips where g++ is missing."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("cuda_emulation") if cache is not None
                else tmp_path_factory.mktemp("emu"))


def _emulation_build(request, families):
    """``families``' CUDA sources compiled for the host with g++ (built once, in the
    ``emulation_folder``)."""
    from cuda_emulation import build

    return build(families, request.getfixturevalue("emulation_folder"))


@pytest.fixture(scope="session")
def emulation_lib(request):
    """The CUDA sources of the embedding path on the host emulator."""
    from one_embedding.kernels import cuda_module as cm

    return _emulation_build(request, cm.EMBEDDING_FAMILIES)


@pytest.fixture(scope="session")
def amp_lib(request):
    """The dense and AMP kernels' CUDA sources (``cuda_module.AMP_FAMILIES``) on the emulator."""
    from one_embedding.kernels import cuda_module as cm

    return _emulation_build(request, cm.AMP_FAMILIES)


#: the emulator's stress seeds that tests marked ``stress_seeds`` run under in every run, beside
#: the default mode (where ONE_EMBEDDING_CUDA_EMULATION_SEED is set, its seed alone runs instead)
STRESS_SEEDS = (1, 2, 3)


def pytest_generate_tests(metafunc):
    """Tests marked ``stress_seeds`` that use the emulator (the ``emulation_seed`` fixture, through
    ``launch`` or ``emulate``) run in its default mode and under each of STRESS_SEEDS."""
    if "emulation_seed" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("stress_seeds") is None:
        return
    from cuda_emulation import seed_from_environment

    if seed_from_environment() is not None:
        return
    metafunc.parametrize("emulation_seed", [None, *STRESS_SEEDS], scope="session",
                         ids=["default"] + [f"seed{s}" for s in STRESS_SEEDS])


@pytest.fixture(scope="session")
def emulation_seed():
    """The emulator's stress seed (None: the default mode): ONE_EMBEDDING_CUDA_EMULATION_SEED, or
    each of STRESS_SEEDS for tests marked ``stress_seeds``."""
    from cuda_emulation import seed_from_environment

    return seed_from_environment()


@pytest.fixture
def launch(emulation_lib, emulation_seed):
    """The host emulator as the GPU: 256-thread blocks on a pretend device of one multiprocessor
    (at most 8 blocks, so every grid-stride loop runs several rounds on the larger inputs), in the
    stress mode when ``emulation_seed`` is set. One per test, so that a stress schedule depends on
    the test alone: a failure reproduces by running that test with the seed it names."""
    from cuda_emulation import EmulatedLauncher

    from one_embedding.kernels import cuda_module as cm

    return EmulatedLauncher(emulation_lib, cm.EMBEDDING_FAMILIES, seed=emulation_seed)
