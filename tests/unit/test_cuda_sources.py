"""The CUDA sources without a GPU: they compile (nvcc for sm_80/sm_90, NVRTC as CuPy runs it),
every kernel is instantiated and named by its family, the device hash is the initializers' hash,
and the pure-Python launch helpers (pair tables, row chunks, mask layout) are right.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from one_embedding.initializers import counter_hash, uniform01
from one_embedding.kernels import cuda_module as cm

import helpers
from helpers import close_at_dtype

ROOT = helpers.ROOT
SCRIPT = ROOT / "scripts" / "compile_cuda.sh"
_TEMPLATE_KERNEL = re.compile(r"template\s*<\s*typename\s+T\s*>\s*__global__\s+void\s+(\w+)\s*\(")


# ---------------------------------------------------------------- compilers


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_compile_script_builds_every_source_for_sm80_and_sm90():
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    sources = sorted(p.name for p in cm.CUDA_DIR.glob("*.cu"))
    assert len(lines) == 2 * len(sources)
    for name in sources:
        family = name[:-3]
        for arch in ("sm_80", "sm_90"):
            expected = f"ok   {name} {arch}: {2 * len(cm.kernel_names(family))} kernels"
            assert any(line.startswith(expected) for line in lines), (expected, run.stdout)


def _find_nvrtc():
    """libnvrtc from $ONE_EMBEDDING_NVRTC, the nvidia-cuda-nvrtc wheel, or the system; else None."""
    candidates = [os.environ.get("ONE_EMBEDDING_NVRTC")]
    try:
        import nvidia.cuda_nvrtc as wheel  # pip install nvidia-cuda-nvrtc-cu12 (or -cu13)

        lib_dir = Path(list(wheel.__path__)[0]) / "lib"
        candidates += sorted(str(p) for p in lib_dir.glob("libnvrtc.so*") if ".alt." not in p.name)
    except ImportError:
        pass
    candidates.append(ctypes.util.find_library("nvrtc"))
    for path in candidates:
        if path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _nvrtc_compile(lib, family, arch):
    """Compile like cupy.RawModule -> ({name expression: lowered name}, log); raises on error."""
    prog = ctypes.c_void_p()
    src = cm.source_code(family).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{family}.cu".encode(), 0, None, None) == 0
    try:
        for expr in cm.name_expressions(family):
            assert lib.nvrtcAddNameExpression(prog, expr.encode()) == 0
        # CuPy adds -arch=compute_XX and -ftz=true to the options the module asks for
        opts = [o.encode() for o in cm.COMPILE_OPTIONS + (f"-I{cm.CUDA_DIR}", f"-arch={arch}", "-ftz=true")]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        log = log.value.decode(errors="replace")
        assert status == 0, f"NVRTC failed on {family}.cu for {arch}:\n{log}"
        lowered = {}
        for expr in cm.name_expressions(family):
            name = ctypes.c_char_p()
            assert lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(name)) == 0
            lowered[expr] = name.value.decode()
        return lowered, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("family", cm.FAMILIES)
def test_nvrtc_compiles_every_family_as_cupy_does(family, arch):
    lib = _find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, or set ONE_EMBEDDING_NVRTC)")
    lowered, log = _nvrtc_compile(lib, family, arch)
    assert "warning" not in log.lower(), log
    for expr, mangled in lowered.items():
        name, ctype = re.fullmatch(r"(\w+)<(\w+)>", expr).groups()
        # Itanium mangling: _Z <len><name> I <f|d> E ...
        assert mangled.startswith(f"_Z{len(name)}{name}I{'f' if ctype == 'float' else 'd'}E"), (expr, mangled)


# ---------------------------------------------------------------- source conventions


def test_every_source_is_a_family_and_lists_all_its_kernels():
    sources = {p.name[:-3] for p in cm.CUDA_DIR.glob("*.cu")}
    assert sources == set(cm.FAMILIES)
    for family in cm.FAMILIES:
        text = cm.source_path(family).read_text()
        defined = _TEMPLATE_KERNEL.findall(text)
        listed = cm.kernel_names(family)
        assert sorted(defined) == sorted(listed), family          # nothing left uninstantiated
        assert len(set(listed)) == len(listed)
        assert all(name.startswith(family + "_") for name in listed)
        assert "__global__" not in _TEMPLATE_KERNEL.sub("", text), f"non-template kernel in {family}.cu"


def test_sources_include_no_host_headers():
    # NVRTC has no host standard library: <cstdint>, <cmath>, ... would fail at run time. Checked:
    # every .cu and every header they include (host_emulation.cuh is for host builds only).
    seen = set()
    for family in cm.FAMILIES:
        text = cm.source_path(family).read_text()
        seen.add(family + ".cu")
        seen.update(re.findall(r'^\s*#\s*include\s*"([\w.]+)"', text, re.MULTILINE))
    assert "host_emulation.cuh" not in seen
    for name in seen:
        text = (cm.CUDA_DIR / name).read_text()
        assert not re.search(r"^\s*#\s*include\s*<", text, re.MULTILINE), name


def test_source_code_carries_a_digest_of_its_headers():
    # CuPy's disk cache keys on the code string: an edit of an included header must change it
    import hashlib

    for family in cm.FAMILIES:
        text = cm.source_path(family).read_text()
        headers = sorted(set(re.findall(r'^\s*#include\s+"([\w.]+)"', text, re.MULTILINE)))
        assert "common.cuh" in headers
        digest = hashlib.sha256()
        for header in headers:
            digest.update(header.encode() + b"\0" + (cm.CUDA_DIR / header).read_bytes())
        code = cm.source_code(family)
        assert code.splitlines()[0] == f"// headers sha256 {digest.hexdigest()}"
        assert code.endswith(text)
    # and the digest moves with a header's bytes: precision.cuh is in dense.cu's
    assert "precision.cuh" in cm.source_path("dense").read_text()


# ---------------------------------------------------------------- the device hash, run on the host

_HOST_SHIM = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct HostDim { unsigned x, y, z; };
static HostDim threadIdx, blockDim, blockIdx, gridDim;
static void __syncthreads() {}
template <typename T> T __shfl_xor_sync(unsigned, T v, int) { return v; }
static unsigned __ballot_sync(unsigned, bool) { return 0; }
static unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, 4); return u; }
static long long __double_as_longlong(double v) { long long u; memcpy(&u, &v, 8); return u; }
#include "common.cuh"
int main(int argc, char** argv) {
  const unsigned long long seed = strtoull(argv[1], 0, 10), key = strtoull(argv[2], 0, 10);
  const unsigned long long first = strtoull(argv[3], 0, 10), count = strtoull(argv[4], 0, 10);
  const unsigned stream = (unsigned)strtoul(argv[5], 0, 10);
  const unsigned long long state = oe::counter_key_state(seed, key);
  for (unsigned long long c = first; c < first + count; ++c) {
    const unsigned long long h = oe::counter_hash(state, c, stream);
    printf("%llu %a\n", h, oe::uniform01(h));
  }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_common_cuh_hash_is_bit_identical_to_initializers(tmp_path):
    # the C++ of common.cuh, compiled for the host (uint64 arithmetic is the same on the device),
    # against the numpy counter_hash / uniform01 that dropout's reference uses
    src = tmp_path / "hash.cpp"
    src.write_text(_HOST_SHIM)
    exe = tmp_path / "hash"
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", str(cm.CUDA_DIR), str(src), "-o", str(exe)],
                   check=True, capture_output=True, timeout=120)
    for seed, key, first, stream in [(0, 0, 0, 0), (12345, 17, 0, 0), (2**63 + 5, 2**40, 0, 0),
                                     (2**64 - 1, 3, 2**40, 0), (7, 1, 1000, 3)]:
        count = 257
        out = subprocess.run([str(exe), str(seed), str(key), str(first), str(count), str(stream)],
                             check=True, capture_output=True, text=True, timeout=60).stdout.split()
        hashes = np.array([int(v) for v in out[0::2]], dtype=np.uint64)
        uniforms = np.array([float.fromhex(v) for v in out[1::2]])
        columns = np.arange(first, first + count, dtype=np.uint64)
        expected = counter_hash(np, seed, np.asarray([key], dtype=np.uint64), columns, stream)[0]
        np.testing.assert_array_equal(hashes, expected)
        np.testing.assert_array_equal(uniforms, uniform01(np, expected))


# ---------------------------------------------------------------- pure launch helpers


@pytest.mark.parametrize("self_interaction", [False, True])
def test_pair_table_is_the_reference_order(self_interaction):
    from one_embedding.kernels import reference

    rng = np.random.default_rng(0)
    for f in range(0, 30):
        table = cm.pair_table(f, self_interaction)
        rows, cols = reference.interaction_pairs(f, self_interaction)
        assert table.dtype == np.int32 and table.shape == (rows.shape[0], 2)
        np.testing.assert_array_equal(table[:, 0], rows)
        np.testing.assert_array_equal(table[:, 1], cols)
        if f:
            # and through the reference forward itself: out[C + p] = x[r] . x[c]
            x = rng.standard_normal((1, f, 3))
            out = reference.dot_interaction_forward(x, np.ones((1, 2)), self_interaction, 1)
            z = x[0] @ x[0].T
            np.testing.assert_allclose(out[0, 2:2 + len(table)], z[table[:, 0], table[:, 1]], rtol=1e-12)
    assert cm.pair_table(4, False).tolist() == [[1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2]]
    assert cm.pair_table(27, False).shape == (351, 2)         # DLRM: 27 features -> 351 pairs


def test_column_chunks_cover_every_row_once():
    for rows in [0, 1, 7, 63, 64, 65, 1000, 4097, 55296, 10**6, 10**8]:
        for cols in [1, 3, 32, 33, 1024, 5000]:
            for sms in [1, 108, 132]:
                n_chunks, per_chunk = cm.column_chunks(rows, cols, sms)
                assert 1 <= n_chunks <= cm.MAX_GRID_Y and per_chunk >= 1
                if rows:
                    assert n_chunks * per_chunk >= rows > (n_chunks - 1) * per_chunk
                    assert per_chunk >= min(rows, cm.MIN_ROWS_PER_CHUNK)
                else:
                    assert n_chunks == 1


def test_grid_sizes_are_bounded():
    assert cm.grid_stride_blocks(0, 132) == 1
    assert cm.grid_stride_blocks(1, 132) == 1
    assert cm.grid_stride_blocks(256 * 5 + 1, 132) == 6
    assert cm.grid_stride_blocks(10**9, 132) == 132 * cm.BLOCKS_PER_SM
    assert cm.warp_blocks(8, 132) == 1 and cm.warp_blocks(9, 132) == 2   # 8 warps per block
    assert cm.BLOCK % 32 == 0
    assert [cm.mask_words(n) for n in (0, 1, 32, 33, 64)] == [0, 1, 1, 2, 2]


def test_mask_layout_is_bit_i_of_word_i_over_32():
    rng = np.random.default_rng(3)
    for shape in [(1, 1), (3, 37), (64, 32), (5, 7, 11)]:
        mask = rng.random(shape) < 0.4
        words = cm.pack_mask(mask)
        assert words.dtype == np.uint32 and words.shape == (cm.mask_words(mask.size),)
        flat = mask.reshape(-1)
        for i in range(flat.size):
            assert bool((int(words[i // 32]) >> (i % 32)) & 1) == flat[i]
        assert int(words[-1]) >> (flat.size - 32 * (words.size - 1)) == 0 or flat.size % 32 == 0
        np.testing.assert_array_equal(cm.unpack_mask(words, shape), mask)


def test_importing_the_cuda_modules_does_not_import_cupy():
    code = ("import sys, one_embedding.kernels.cuda_ops, one_embedding.kernels.cuda_module; "
            "sys.exit('cupy' in sys.modules)")
    assert subprocess.run(["python", "-c", code], cwd=ROOT, timeout=120).returncode == 0


# ---------------------------------------------------------------- the kernels, executed on the host
#
# The dense families are compiled with g++ against cuda/host_emulation.cuh (tests/cuda_emulation.py:
# CUDA threads as fibers, warp primitives through barriers) and launched with the argument tuples
# and launch shapes of cuda_ops, on a pretend GPU of EMULATED_SMS multiprocessors so that grids are
# small and every grid-stride loop and row-chunking path runs more than once. The results are
# compared with the numpy reference. This checks index arithmetic, loop bounds, mask words,
# reductions and warp convergence without a GPU; timing, memory coalescing and the cupy glue are
# left to the GPU tests. Each test also runs in the emulator's stress mode (seeds 1, 2, 3): the
# shared memory of block_sum and column_block_sum checked for races and unwritten reads, every
# shared and global index bounds-checked, threads and blocks interleaved at random.

EMULATED_SMS = 1


@pytest.fixture(scope="module")
def dense_lib(request, tmp_path_factory):
    from cuda_emulation import build

    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("cuda_emulation") if cache is not None else tmp_path_factory.mktemp("emu")
    return build(cm.DENSE_FAMILIES, Path(folder))


@pytest.fixture
def emulate(dense_lib, emulation_seed):
    """``emulate(kernel, dtype, grid, block, args)``: the dense families on the host emulator (in
    its stress mode when ``emulation_seed`` is set), every launch checked against the kernel's
    parameter list."""
    from cuda_emulation import EmulatedLauncher

    launcher = EmulatedLauncher(dense_lib, cm.DENSE_FAMILIES, seed=emulation_seed)

    def launch(kernel, dtype, grid, block, args):
        family, name = kernel.split("_", 1)
        launcher.run(family, name, dtype, grid, block, args)

    return launch


def _warp_grid(n_items):
    return (cm.warp_blocks(n_items, EMULATED_SMS),), (cm.BLOCK,)


def _flat_grid(n):
    return (cm.grid_stride_blocks(n, EMULATED_SMS),), (cm.BLOCK,)


def _column_grid(rows, cols):
    n_chunks, per_chunk = cm.column_chunks(rows, cols, EMULATED_SMS)
    return (max(1, -(-cols // 32)), n_chunks), (32, cm.COLUMN_BLOCK_ROWS), n_chunks, per_chunk


@pytest.mark.stress_seeds
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_emulated_mlp_kernels_match_reference(emulate, dtype):
    from one_embedding.kernels import reference as ref

    rng = np.random.default_rng(1)
    # 300 x 70: the forward's words and the backward's rows loaded ahead (FORWARD_AHEAD,
    # BACKWARD_AHEAD in common.cuh), and the rests after them
    for rows, cols in [(1, 1), (37, 45), (300, 7), (129, 70), (300, 70)]:
        h = rng.standard_normal((rows, cols)).astype(dtype)
        b = rng.standard_normal(cols).astype(dtype)
        dy = rng.standard_normal((rows, cols)).astype(dtype)
        y_ref, mask_ref = ref.bias_act_forward(h.copy(), b, True)
        dh_ref, db_ref = ref.bias_act_backward(dy, mask_ref)
        partials = []
        for ahead in (1, 0):   # loads ahead of the stores (cuda_module.LOADS_AHEAD), and not
            y, words = h.copy(), np.full(cm.mask_words(h.size), 0xDEADBEEF, dtype=np.uint32)
            emulate("mlp_bias_act_forward", dtype, *_warp_grid(words.size),
                    (y, b, np.int64(rows), np.int32(cols), np.int32(1), y, words,
                     np.int32(ahead)))
            np.testing.assert_array_equal(y, y_ref)
            np.testing.assert_array_equal(words, cm.pack_mask(mask_ref))

            grid, block, n_chunks, per_chunk = _column_grid(rows, cols)
            dh, partial = np.empty_like(dy), np.full((n_chunks, cols), np.nan, dtype=dtype)
            emulate("mlp_bias_act_backward", dtype, grid, block,
                    (dy, words, np.int32(1), np.int64(rows), np.int32(cols), np.int64(per_chunk),
                     dh, partial, np.int32(ahead)))
            np.testing.assert_array_equal(dh, dh_ref)
            close_at_dtype(partial.sum(axis=0), db_ref, dtype)
            partials.append(partial)
        np.testing.assert_array_equal(partials[0], partials[1])     # the same sums, bit for bit

        rate, seed, step = 0.3, 2**63 + 11, 5
        x = rng.standard_normal((rows, cols)).astype(dtype)
        out, keep = np.empty_like(x), np.zeros(cm.mask_words(x.size), dtype=np.uint32)
        scale = np.dtype(dtype).type(1.0 / (1.0 - rate))
        emulate("mlp_dropout_forward", dtype, *_warp_grid(keep.size),
                (x, np.int64(x.size), np.float64(rate), scale, np.uint64(seed), np.uint64(step), out, keep))
        out_ref, keep_ref = ref.dropout_forward(x, rate, seed, step)
        np.testing.assert_array_equal(keep, cm.pack_mask(keep_ref))
        np.testing.assert_array_equal(out, out_ref)
        dx = np.empty_like(dy)
        emulate("mlp_dropout_backward", dtype, *_flat_grid(dy.size),
                (dy, keep, np.int64(dy.size), scale, dx))
        np.testing.assert_array_equal(dx, ref.dropout_backward(dy, keep_ref, rate))


@pytest.mark.stress_seeds
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_emulated_interaction_kernels_match_reference(emulate, dtype):
    from one_embedding.kernels import reference as ref

    rng = np.random.default_rng(2)
    for batch, f, d, n_concat, self_interaction, pad in [(3, 5, 4, 2, False, 1), (40, 6, 3, 0, True, 0),
                                                         (9, 27, 8, 8, False, 1)]:
        x = rng.standard_normal((batch, f, d)).astype(dtype)
        concat = rng.standard_normal((batch, n_concat)).astype(dtype)
        pairs = np.ascontiguousarray(cm.pair_table(f, self_interaction))
        n_pairs = pairs.shape[0]
        width = n_concat + n_pairs + pad
        z = np.ascontiguousarray(np.matmul(x, x.transpose(0, 2, 1)))
        out = np.full((batch, width), np.nan, dtype=dtype)
        emulate("interaction_gather_forward", dtype, *_flat_grid(out.size),
                (z, concat if n_concat else x, pairs, np.int64(batch), np.int32(f), np.int32(n_concat),
                 np.int32(n_pairs), np.int32(width), out))
        close_at_dtype(out, ref.dot_interaction_forward(x, concat if n_concat else None,
                                                       self_interaction, pad), dtype)

        dout = rng.standard_normal((batch, width)).astype(dtype)
        dsym = np.zeros((batch, f, f), dtype=dtype)
        dconcat = np.full((batch, n_concat), np.nan, dtype=dtype)
        emulate("interaction_scatter_backward", dtype, *_flat_grid(batch * (n_concat + n_pairs)),
                (dout, pairs, np.int64(batch), np.int32(f), np.int32(n_concat), np.int32(n_pairs),
                 np.int32(width), dsym, dconcat if n_concat else dsym))
        dx_ref, dconcat_ref = ref.dot_interaction_backward(dout, x, n_concat, self_interaction)
        close_at_dtype(np.matmul(dsym, x), dx_ref, dtype)
        if n_concat:
            np.testing.assert_array_equal(dconcat, dconcat_ref)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_emulated_cross_kernels_match_reference(emulate, dtype):
    from one_embedding.kernels import reference as ref

    rng = np.random.default_rng(3)
    for rows, dim in [(1, 1), (70, 16), (300, 40), (5, 70)]:
        x0, xl, dnext = (rng.standard_normal((rows, dim)).astype(dtype) for _ in range(3))
        w, b = rng.standard_normal(dim).astype(dtype), rng.standard_normal(dim).astype(dtype)
        W = (rng.standard_normal((dim, dim)) * dim ** -0.5).astype(dtype)

        out = np.empty_like(x0)
        emulate("cross_vector_forward", dtype, *_warp_grid(rows),
                (x0, xl, w, b, np.int64(rows), np.int32(dim), out))
        close_at_dtype(out, ref.cross_vector_forward(x0, xl, w, b), dtype)

        dx0, dxl, ds = np.empty_like(x0), np.empty_like(x0), np.empty(rows, dtype=dtype)
        emulate("cross_vector_backward_rows", dtype, *_warp_grid(rows),
                (dnext, x0, xl, w, np.int64(rows), np.int32(dim), dx0, dxl, ds))
        grid, block, n_chunks, per_chunk = _column_grid(rows, dim)
        dw_partial = np.full((n_chunks, dim), np.nan, dtype=dtype)
        db_partial = np.full((n_chunks, dim), np.nan, dtype=dtype)
        emulate("cross_vector_backward_params", dtype, grid, block,
                (dnext, xl, ds, np.int64(rows), np.int32(dim), np.int64(per_chunk), dw_partial, db_partial))
        for got, want in zip((dx0, dxl, dw_partial.sum(0), db_partial.sum(0)),
                             ref.cross_vector_backward(dnext, x0, xl, w)):
            close_at_dtype(got, want, dtype)

        t = np.ascontiguousarray(xl @ W.T)
        emulate("cross_matrix_forward_epilogue", dtype, *_flat_grid(t.size),
                (t.copy(), b, x0, xl, np.int64(rows), np.int32(dim), t))
        close_at_dtype(t, ref.cross_matrix_forward(x0, xl, W, b), dtype)

        t = np.ascontiguousarray(xl @ W.T)
        du, db_partial = np.empty_like(x0), np.full((n_chunks, dim), np.nan, dtype=dtype)
        emulate("cross_matrix_backward_elementwise", dtype, grid, block,
                (dnext, x0, t, b, np.int64(rows), np.int32(dim), np.int64(per_chunk), t, du, db_partial))
        dx0_ref, dxl_ref, dW_ref, db_ref = ref.cross_matrix_backward(dnext, x0, xl, W, b)
        close_at_dtype(t, dx0_ref, dtype)
        close_at_dtype(du @ W + dnext, dxl_ref, dtype)
        close_at_dtype(du.T @ xl, dW_ref, dtype)
        close_at_dtype(db_partial.sum(0), db_ref, dtype)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_emulated_fm_and_loss_kernels_match_reference(emulate, dtype):
    from one_embedding.kernels import reference as ref

    rng = np.random.default_rng(4)
    for batch, f, d in [(1, 1, 1), (70, 39, 16), (3, 4, 40)]:
        x = rng.standard_normal((batch, f, d)).astype(dtype)
        dout = rng.standard_normal(batch).astype(dtype)
        out = np.full(batch, np.nan, dtype=dtype)
        emulate("fm_forward", dtype, *_warp_grid(batch), (x, np.int64(batch), np.int32(f), np.int32(d), out))
        close_at_dtype(out, ref.fm_forward(x), dtype)
        dx = np.empty_like(x)
        emulate("fm_backward", dtype, *_warp_grid(batch),
                (dout, x, np.int64(batch), np.int32(f), np.int32(d), dx))
        close_at_dtype(dx, ref.fm_backward(dout, x), dtype)

    for n in [1, 100, 5000]:
        logits = (rng.standard_normal(n) * 4).astype(dtype)
        logits[:2] = [60.0, -60.0][:n] if n > 1 else [60.0]
        labels = (rng.random(n) < 0.3).astype(dtype)
        (blocks,), block = _flat_grid(n)
        sums = np.full(blocks, np.nan)
        emulate("loss_bce_forward", dtype, (blocks,), block, (logits, labels, np.int64(n), sums))
        want = ref.bce_with_logits_forward(logits.astype(np.float64), labels.astype(np.float64))
        assert abs(sums.sum() / n - want) <= 1e-6 * max(1.0, abs(want))
        grad = np.empty_like(logits)
        emulate("loss_bce_backward", dtype, *_flat_grid(n), (logits, labels, np.int64(n), grad))
        close_at_dtype(grad, ref.bce_with_logits_backward(logits, labels), dtype)


# ---------------------------------------------------------------- cuda_ops launches vs kernel signatures

_PARAM_KIND = [("*", "pointer"), ("oe::i64", "i64"), ("oe::u64", "u64"), ("double", "double"),
               ("int", "int"), ("T", "T")]
_NUMPY_KIND = {"int64": "i64", "int32": "int", "uint64": "u64", "float64": "double"}


def _kernel_parameter_kinds(family):
    """{kernel name: [kind of each parameter]} parsed from the .cu source."""
    text = cm.source_path(family).read_text()
    kinds = {}
    for name, params in re.findall(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)", text):
        row = []
        for param in params.split(","):
            declared = param.strip().rsplit(None, 1)[0]          # the type, without the name
            row.append(next(kind for token, kind in _PARAM_KIND if token in declared.split()
                            or (token == "*" and "*" in param)))
        kinds[name] = row
    return kinds


def _is_scalar_call(node):
    import ast

    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "np"
            or isinstance(func, ast.Name) and func.id == "_dropout_scale")


def _argument_kind(node, assigned):
    """pointer | i64 | int | u64 | double | T for one argument expression of a launch in cuda_ops."""
    import ast

    if isinstance(node, ast.Name) and node.id in assigned and _is_scalar_call(assigned[node.id]):
        return _argument_kind(assigned[node.id], {})
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "np":
            return _NUMPY_KIND[func.attr]
        if isinstance(func, ast.Name) and func.id == "_dropout_scale":
            return "T"
        raise AssertionError(f"unclassified launch argument {ast.dump(node)}")
    return "pointer"    # array names, and `a if cond else b` between arrays


def test_cuda_ops_launch_arguments_match_kernel_signatures():
    # every launch in cuda_ops passes as many arguments as the kernel takes, each of the kind the
    # kernel declares (a pointer where it takes a pointer, np.int64 for oe::i64, ...): a mismatch
    # would silently corrupt memory on the GPU, so it is checked here, statically, without one
    import ast

    source = (helpers.PACKAGE / "kernels" / "cuda_ops.py").read_text()
    signatures = {}
    for family in cm.DENSE_FAMILIES:     # the embedding families: tests/test_device_cache_emulation.py
        signatures.update(_kernel_parameter_kinds(family))
    checked = set()
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, ast.FunctionDef):
            continue
        assigned = {t.id: n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
                    for t in n.targets if isinstance(t, ast.Name)}
        for call in ast.walk(func):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            if isinstance(f, ast.Name) and f.id in ("_launch_1d", "_launch_warps"):
                family, name, args = call.args[0].value, call.args[1].value, call.args[4]
            elif (isinstance(f, ast.Call) and isinstance(f.func, ast.Attribute)
                  and f.func.attr == "get_kernel" and isinstance(f.args[0], ast.Constant)):
                family, name, args = f.args[0].value, f.args[1].value, call.args[2]
            else:
                continue
            kernel = f"{family}_{name}"
            assert kernel in signatures, f"{func.name} launches unknown kernel {kernel}"
            got = [_argument_kind(a, assigned) for a in args.elts]
            assert got == signatures[kernel], (func.name, kernel, got, signatures[kernel])
            checked.add(kernel)
    assert checked == set(signatures), set(signatures) - checked      # every kernel is used
