"""The host emulator's stress mode (``ONE_EMBEDDING_CUDA_EMULATION_SEED``, tests/cuda_emulation.py)
catches the bugs the default mode cannot see: each planted bug below passes the default mode
silently (with a wrong result, or a right one by luck) and fails every stress seed with a message
that names the bug, the array and element, and the thread. The same kernels without their bug
pass the stress mode. (The real kernels run under stress seeds through the tests marked
``stress_seeds``, tests/conftest.py.)
"""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from cuda_emulation import (SEED_ENV, EmulatedLauncher, GarbageNumpy, build, rewrite_for_emulation,
                            seed_from_environment)

from one_embedding.cache.device import DeviceCache
from one_embedding.cache.set_associative import SetAssociativeCache
from one_embedding.kernels import cuda_module as cm

SEEDS = (1, 2, 3)

_PLANTED = r"""
// Kernels with planted bugs, each switched on by an argument, for the emulator's stress mode.
#include "common.cuh"

// Inclusive prefix sum of each block's values (Hillis-Steele): a step reads a neighbour, then
// adds to its own element. with_barrier == 0 plants the bug: no __syncthreads between the reads
// and the writes, so a thread may read a neighbour that already added. x, out: (grid threads,)
template <typename T>
__global__ void planted_scan(const T* x, int with_barrier, T* out) {
  __shared__ T s[256];
  const int t = threadIdx.x;
  s[t] = x[oe::grid_thread()];
  __syncthreads();
  for (int offset = 1; offset < (int)blockDim.x; offset <<= 1) {
    const T add = t >= offset ? s[t - offset] : T(0);
    if (with_barrier) __syncthreads();
    s[t] += add;
    __syncthreads();
  }
  out[oe::grid_thread()] = s[t];
}

// Sum of the first n values of each block's chunk. zero_rest == 0 plants the bug: threads past n
// leave their slot unwritten, and thread 0 sums every slot. x: (grid threads,); out: (gridDim.x,)
template <typename T>
__global__ void planted_partial_sum(const T* x, int n, int zero_rest, T* out) {
  __shared__ T s[256];
  const int t = threadIdx.x;
  if (t < n) {
    s[t] = x[oe::grid_thread()];
  } else if (zero_rest) {
    s[t] = T(0);
  }
  __syncthreads();
  if (t == 0) {
    T total = T(0);
    for (int k = 0; k < (int)blockDim.x; ++k) total += s[k];
    out[blockIdx.x] = total;
  }
}

// out[i] = 2 x[i] over a grid-stride loop. inclusive != 0 plants the bug: i <= n reads x[n].
// x, out: (n,)
template <typename T>
__global__ void planted_double(const T* x, oe::i64 n, int inclusive, T* out) {
  for (oe::i64 i = oe::grid_thread(); inclusive ? i <= n : i < n; i += oe::grid_threads()) {
    out[i] = T(2) * x[i];
  }
}

// out[i] = x[i] - x[i - 1], out[0] = x[0]. shift == 1 plants the bug: each result lands one
// element early, so thread 0 writes out[-1]. x, out: (n,)
template <typename T>
__global__ void planted_difference(const T* x, oe::i64 n, oe::i64 shift, T* out) {
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    out[i - shift] = i > 0 ? x[i] - x[i - 1] : x[0];
  }
}

// Each warp smooths its 32 values in a shared row: out[k] = v[k] + v[k + 1] for k + 1 < width,
// else v[k]. width == 33 plants the bug: lane 31 reads element 32 of its row, past the row's end
// (the next row's first element, in memory). x, out: (grid threads,); blockDim.x <= 256.
template <typename T>
__global__ void planted_smooth(const T* x, int width, T* out) {
  __shared__ T rows[8][32];
  const int lane = threadIdx.x & 31;
  const int w = threadIdx.x >> 5;
  rows[w][lane] = x[oe::grid_thread()];
  __syncwarp();
  out[oe::grid_thread()] = lane + 1 < width ? rows[w][lane] + rows[w][lane + 1] : rows[w][lane];
}

// out[i] += x[i]: the caller must zero out (the planted bug is in a caller that does not).
// x, out: (n,)
template <typename T>
__global__ void planted_accumulate(const T* x, oe::i64 n, T* out) {
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) out[i] += x[i];
}

// out[b] = b for every block b, except that block 1 derives its value from block 0's: planted
// reliance on block 0 running first, which no GPU promises. out: (gridDim.x,)
template <typename T>
__global__ void planted_block_order(T* out) {
  if (threadIdx.x == 0) out[blockIdx.x] = blockIdx.x == 1 ? out[0] + T(1) : T(blockIdx.x);
}

namespace planted {
// depth frames of about 1 KiB each
__device__ int deep(int depth) {
  volatile char frame[1024];
  frame[depth % 1024] = (char)depth;
  return depth == 0 ? 0 : deep(depth - 1) + frame[depth % 1024];
}
}  // namespace planted

// Recursion through `depth` frames of 1 KiB: 1000 overflows the emulator's 256 KiB fiber stack.
// out: (1,)
template <typename T>
__global__ void planted_recursion(int depth, T* out) {
  if (threadIdx.x == 0) out[0] = T(planted::deep(depth));
}

// Thread 0 writes through a pointer made from an integer (a wild pointer): address 64, in no
// mapping. out: (1,)
template <typename T>
__global__ void planted_wild_pointer(oe::u64 address, T* out) {
  if (threadIdx.x == 0) *(T*)address = out[0];
}

// The block sum of common.cuh, as the loss kernel uses it (shared memory, two barriers, warp
// shuffles): correct. x: (n,); out: (gridDim.x,)
template <typename T>
__global__ void planted_block_sum(const T* x, oe::i64 n, T* out) {
  T acc = T(0);
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) acc += x[i];
  const T total = oe::block_sum(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = total;
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(planted_scan)
ONE_EMBEDDING_KERNEL(planted_partial_sum)
ONE_EMBEDDING_KERNEL(planted_double)
ONE_EMBEDDING_KERNEL(planted_difference)
ONE_EMBEDDING_KERNEL(planted_smooth)
ONE_EMBEDDING_KERNEL(planted_accumulate)
ONE_EMBEDDING_KERNEL(planted_block_order)
ONE_EMBEDDING_KERNEL(planted_recursion)
ONE_EMBEDDING_KERNEL(planted_wild_pointer)
ONE_EMBEDDING_KERNEL(planted_block_sum)
#endif
"""


@pytest.fixture(scope="module")
def planted_lib(tmp_path_factory):
    """(library, source folder) of the planted family."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    folder = tmp_path_factory.mktemp("planted")
    (folder / "planted.cu").write_text(_PLANTED)
    return build(["planted"], folder / "build", source_dir=folder), folder


@pytest.fixture
def planted(planted_lib):
    """``planted(seed)``: a launcher of the planted family (seed None: the default mode)."""
    lib, folder = planted_lib
    return lambda seed: EmulatedLauncher(lib, ["planted"], seed=seed, source_dir=folder)


def _run(launcher, name, grid, block, args, dtype=np.float32):
    launcher.run("planted", name, dtype, grid, block, args)


def _fails(planted, seed, name, grid, block, args, dtype=np.float32) -> str:
    with pytest.raises(AssertionError) as caught:
        _run(planted(seed), name, grid, block, args, dtype)
    message = str(caught.value)
    assert f"planted_{name}:" in message and f"{SEED_ENV}={seed}" in message, message
    return message


def test_stress_catches_a_planted_missing_syncthreads(planted):
    x = np.random.default_rng(0).standard_normal(512).astype(np.float32)
    want = np.concatenate([np.cumsum(x[:256]), np.cumsum(x[256:])])
    out = np.zeros_like(x)
    _run(planted(None), "scan", (2,), (256,), (x, np.int32(0), out))    # the default: no error...
    assert np.abs(out - want).max() > 1.0                                 # ...and a wrong sum
    for seed in SEEDS:
        message = _fails(planted, seed, "scan", (2,), (256,), (x, np.int32(0), out))
        assert "shared-memory race on `s[" in message and "a missing barrier" in message, message
        assert "thread (" in message and "of block (" in message, message


def test_stress_catches_a_planted_uninitialised_shared_read(planted):
    x = np.random.default_rng(1).standard_normal(512).astype(np.float32)
    want = np.array([x[:100].sum(), x[256:356].sum()], np.float32)
    out = np.zeros(2, np.float32)
    # the default mode's shared memory is a zeroed static: the bug hides behind a right answer
    _run(planted(None), "partial_sum", (2,), (256,), (x, np.int32(100), np.int32(0), out))
    np.testing.assert_allclose(out, want, rtol=1e-5)
    for seed in SEEDS:
        message = _fails(planted, seed, "partial_sum", (2,), (256,),
                         (x, np.int32(100), np.int32(0), out))
        assert ("read of uninitialised shared memory: thread (0,0) of block (" in message
                and "reads `s[100]`, which no thread of the block wrote" in message), message


def test_stress_catches_a_planted_out_of_bounds_global_index(planted):
    n = 100
    x = np.arange(n + 1, dtype=np.float32)
    out = np.zeros(n + 1, np.float32)
    # the default mode reads x[n] and writes out[n] past the arrays it was given, silently
    _run(planted(None), "double", (1,), (64,), (x[:n], np.int64(n), np.int32(1), out[:n]))
    assert out[n] == 2 * n
    for seed in SEEDS:
        out[:] = 0
        message = _fails(planted, seed, "double", (1,), (64,), (x[:n], np.int64(n), np.int32(1), out[:n]))
        assert ("out-of-bounds global read: thread (36,0) of block (0,0) reads element 100 (byte "
                "offset 400) of argument `x`, which has 100 elements") in message, message
        assert not out.any()     # a failed launch copies nothing back


def test_stress_catches_a_planted_write_before_a_global_array(planted):
    n = 100
    x = (np.arange(n, dtype=np.float32) + 1) ** 2
    out = np.zeros(n + 1, np.float32)
    _run(planted(None), "difference", (1,), (64,), (x, np.int64(n), np.int64(1), out[1:]))
    assert out[0] == 1.0                     # the default mode wrote out[-1] of the view, silently
    for seed in SEEDS:
        message = _fails(planted, seed, "difference", (1,), (64,), (x, np.int64(n), np.int64(1), out[1:]))
        assert ("out-of-bounds global write: some thread wrote byte offset -4 of argument `out` "
                "(400 bytes), before its start") in message, message


def test_stress_catches_a_planted_out_of_bounds_shared_index(planted):
    x = np.random.default_rng(2).standard_normal(256).astype(np.float32)
    out = np.zeros_like(x)
    # 4 warps: in the default mode, lane 31 of rows 0-2 reads the next row, of row 3 the row
    # that no warp uses: no error, and results that are wrong only there
    _run(planted(None), "smooth", (2,), (128,), (x, np.int32(33), out))
    for seed in SEEDS:
        message = _fails(planted, seed, "smooth", (2,), (128,), (x, np.int32(33), out))
        # lane 31 of some warp
        assert re.search(r"shared-memory index out of bounds: thread \((31|63|95|127),0\) of block "
                         r"\([01],0\) indexes `rows\[[0-3]\]\[32\]`, extent 32", message), message


def test_stress_fills_fresh_buffers_with_garbage_planted_missing_zero(planted):
    # the glue's bug: a buffer that a kernel accumulates into comes from empty(), not zeros().
    # The default mode's empty() is numpy's, often zeros (fresh pages): the bug may hide there.
    n = 4096
    x = np.ones(n)
    assert planted(None).xp is np
    for seed in SEEDS:
        launcher = planted(seed)
        out = launcher.xp.empty(n)
        _run(launcher, "accumulate", (8,), (256,), (x, np.int64(n), out), np.float64)
        assert np.isnan(out).all()                      # the launch passes; the result shows it


def test_stress_interleaves_blocks_planted_block_order(planted):
    def block_one(seed):
        out = np.full(4, -1, np.float32)
        _run(planted(seed), "block_order", (4,), (32,), (out,))
        return out[1]

    assert block_one(None) == 1.0                   # the default runs block 0 first, always
    seen = {seed: block_one(seed) for seed in range(1, 9)}
    assert set(seen.values()) == {0.0, 1.0}, seen   # some seeds run block 1 before block 0
    assert all(block_one(seed) == value for seed, value in seen.items())    # each seed repeats


def test_stress_reports_planted_faults_outside_the_arguments(planted):
    # (the default mode would crash the process on both)
    out = np.zeros(1, np.float32)
    _run(planted(1), "recursion", (1,), (32,), (np.int32(100), out))
    message = _fails(planted, 1, "recursion", (1,), (32,), (np.int32(1000), out))
    assert "stack overflow (fiber stacks are 256 KiB): thread (0,0) of block (0,0)" in message
    message = _fails(planted, 2, "wild_pointer", (1,), (32,), (np.uint64(64), out))
    assert ("invalid global write: thread (0,0) of block (0,0) writes address 0x40, in no "
            "argument nor next to one") in message, message


def test_stress_passes_the_planted_kernels_without_their_bugs(planted):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(512).astype(np.float32)
    for seed in (None, *SEEDS):
        launch = planted(seed)
        out = np.zeros_like(x)
        _run(launch, "scan", (2,), (256,), (x, np.int32(1), out))
        np.testing.assert_allclose(out, np.concatenate([np.cumsum(x[:256]), np.cumsum(x[256:])]),
                                   rtol=1e-4, atol=1e-4)
        sums = np.zeros(2, np.float32)
        _run(launch, "partial_sum", (2,), (256,), (x, np.int32(100), np.int32(1), sums))
        np.testing.assert_allclose(sums, [x[:100].sum(), x[256:356].sum()], rtol=1e-5)
        out = np.zeros(100, np.float32)
        _run(launch, "double", (1,), (64,), (x[:100].copy(), np.int64(100), np.int32(0), out))
        np.testing.assert_array_equal(out, 2 * x[:100])
        out = np.zeros(100, np.float32)
        _run(launch, "difference", (1,), (64,), (x[:100].copy(), np.int64(100), np.int64(0), out))
        np.testing.assert_array_equal(out[1:], x[1:100] - x[:99])
        out = np.zeros(256, np.float32)
        _run(launch, "smooth", (2,), (128,), (x[:256].copy(), np.int32(32), out))
        rows = x[:256].reshape(8, 32)
        np.testing.assert_array_equal(out.reshape(8, 32)[:, :31], rows[:, :31] + rows[:, 1:])
        values = rng.standard_normal(5000)
        block_sums = np.full(8, np.nan)
        _run(launch, "block_sum", (8,), (256,), (values, np.int64(5000), block_sums), np.float64)
        assert abs(block_sums.sum() - values.sum()) < 1e-9


# ---------------------------------------------------------------- a bug planted in a real kernel

def test_stress_catches_a_barrier_planted_out_of_the_cache_kernel(tmp_path):
    # cache_insert without the __syncwarp before its victim scan: the scan may read a way that
    # its owner lane is rewriting. The default mode gives the CPU cache's results all the same.
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    barrier = "        __syncwarp();  // every owner's update of an earlier key is visible to the scan\n"
    source = cm.source_path("cache").read_text()
    assert source.count(barrier) == 1
    (tmp_path / "cache.cu").write_text(source.replace(barrier, ""))
    lib = build(cm.EMBEDDING_FAMILIES, tmp_path / "build", source_dir=tmp_path)
    rng = np.random.default_rng(5)
    keys = [rng.integers(0, 2**64, size=40, dtype=np.uint64) for _ in range(4)]
    lines = [rng.standard_normal((40, 3)).astype(np.float32) for _ in range(4)]

    def trace(seed):
        dev = DeviceCache(3, 32, 4, "lru", launch=EmulatedLauncher(lib, cm.EMBEDDING_FAMILIES, seed=seed))
        cpu = SetAssociativeCache(3, 32, 4, "lru")
        for k, v in zip(keys, lines):
            got, want = dev.insert_or_assign(k, v), cpu.insert_or_assign(k, v)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])

    trace(None)
    for seed in SEEDS:
        with pytest.raises(AssertionError) as caught:
            trace(seed)
        message = str(caught.value)
        assert message.startswith("cache_insert: shared-memory race on `states[") and \
            "a missing barrier" in message, message


def test_two_builds_in_one_process_keep_their_own_kernels(tmp_path, emulation_lib):
    """A second build of the embedding families (a changed source, as the test above loads) must
    not take over the first's kernels: C++'s GNU-unique statics (the kernel registry) are bound
    process-wide unless the builds hide them, and then every later launch of the first library ran
    the second's code with the first's scheduler state (seen in the full suite: a segfault)."""
    from one_embedding.kernels import codec_ops
    from one_embedding.parallel import codec

    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    line = "      out[c] = (unsigned char)(signed char)(int)q;\n"
    source = cm.source_path("codec").read_text()
    assert source.count(line) == 1
    (tmp_path / "codec.cu").write_text(source.replace(line, "      out[c] = 7;\n"))
    changed = build(cm.EMBEDDING_FAMILIES, tmp_path / "build", source_dir=tmp_path)
    rows = np.random.default_rng(3).standard_normal((5, 40)).astype(np.float32)
    original = EmulatedLauncher(emulation_lib, cm.EMBEDDING_FAMILIES)
    other = EmulatedLauncher(changed, cm.EMBEDDING_FAMILIES, source_dir=tmp_path)
    assert (codec_ops.encode(rows, "int8", launch=other)[:, :40] == 7).all()
    np.testing.assert_array_equal(codec_ops.encode(rows, "int8", launch=original),
                                  codec.encode(rows, "int8"))


# ---------------------------------------------------------------- the switch and the rewrite

def test_seed_comes_from_the_environment(monkeypatch, planted_lib):
    lib, folder = planted_lib
    monkeypatch.delenv(SEED_ENV, raising=False)
    assert seed_from_environment() is None
    assert EmulatedLauncher(lib, ["planted"], source_dir=folder).seed is None
    monkeypatch.setenv(SEED_ENV, "7")
    assert seed_from_environment() == 7
    launcher = EmulatedLauncher(lib, ["planted"], source_dir=folder)
    assert launcher.seed == 7 and isinstance(launcher.xp, GarbageNumpy)
    assert EmulatedLauncher(lib, ["planted"], seed=None, source_dir=folder).seed is None
    monkeypatch.setenv(SEED_ENV, "seven")
    with pytest.raises(ValueError, match=f"{SEED_ENV}='seven' is not an integer"):
        seed_from_environment()


def test_garbage_numpy_fills_only_uninitialised_arrays():
    xp = GarbageNumpy(2)
    assert np.isnan(xp.empty((3, 4), np.float32)).all() and np.isnan(xp.empty_like(np.ones(5))).all()
    assert (xp.empty(4, np.uint8) != 0).any()        # random bytes for an even seed
    assert (GarbageNumpy(1).empty(4, np.int64) == -1).all()     # all bits set for an odd seed
    assert (xp.zeros(3) == 0).all() and xp.ndarray is np.ndarray and xp.__name__ == "numpy"


def test_rewrite_makes_shared_arrays_per_block_and_rejects_what_it_cannot_check():
    text = ("struct S {\n  int keys[4];\n  float w;\n};\n"
            "__device__ void f() {\n  __shared__ float a[2][32];  // rows\n}\n")
    out = rewrite_for_emulation(text)
    assert "oe_emulation::Array<int, (4), struct oe_member_keys> keys;" in out
    assert ("static oe_emulation::Array<oe_emulation::Array<float, (32)>, (2)> a_oe_static; "
            "auto& a = oe_emulation::shared(a_oe_static, \"a\");  // rows") in out
    for bad in ("__shared__ int count;", "extern __shared__ float dynamic[];"):
        with pytest.raises(ValueError, match="rewrites `__shared__ TYPE NAME"):
            rewrite_for_emulation(f"__device__ void f() {{ {bad} }}", "bad.cu")
