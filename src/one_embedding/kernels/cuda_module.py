"""Loading the CUDA kernel sources, and the launch geometry the kernels expect.

Each op family has one source, ``cuda/<family>.cu``, that includes ``cuda/common.cuh``. Its
kernels are templates on the float type, named ``<family>_<what>`` (so profiles read well) and
listed at the bottom of the source as ``ONE_EMBEDDING_KERNEL(name)``; that list is the single
record of what a family exports: ``get_module`` turns it into NVRTC ``name_expressions``
(``name<float>``, ``name<double>``) and ``scripts/compile_cuda.sh`` into explicit instantiations
for nvcc.

A module is compiled by ``cupy.RawModule`` on first use and memoised per (device, family).
Everything else here is pure Python/numpy, so the index tables and launch shapes can be tested
without a GPU; ``import cupy`` happens only inside ``get_module`` / ``sm_count`` /
``device_pair_table``.
"""
from __future__ import annotations

import hashlib
import re
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
#: The dense layers' kernels (launched by cuda_ops) and the embedding side's (device_ops,
#: cache/device.py): the device hash index, the set-associative cache, unique / segment sum /
#: gather / init, the row optimizers and the row codecs.
DENSE_FAMILIES = ("mlp", "interaction", "cross", "fm", "loss")
EMBEDDING_FAMILIES = ("hashindex", "cache", "embedding", "optim", "codec")
#: The data side's: the synthetic source's generator (data/device.py).
DATA_FAMILIES = ("synthetic",)
#: The AMP path's fused dense kernels (kernels/dense_ops.py, kernels/gemm.py): launched through a
#: ``device_ops.Launcher``, so the tests run them on the host emulator.
AMP_FAMILIES = ("dense",)
FAMILIES = DENSE_FAMILIES + EMBEDDING_FAMILIES + DATA_FAMILIES + AMP_FAMILIES
#: NVRTC options. --fmad=false keeps a*b+c two roundings, as in numpy, so elementwise results
#: match the reference bit for bit; these kernels are memory-bound, so FMA contraction buys nothing.
#: (CuPy appends -ftz=true: float32 subnormal results flush to zero, the one place where an
#: elementwise float32 result can differ from numpy.)
COMPILE_OPTIONS = ("-std=c++17", "--fmad=false")
#: C++ spelling of each supported dtype, in the order the templates are instantiated.
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}

#: Threads per block of the 1-D kernels (a multiple of 32: warp-per-row and ballot kernels rely on it).
BLOCK = 256
#: Row threads of the (32, COLUMN_BLOCK_ROWS) blocks of column reductions (oe::COLUMN_BLOCK_ROWS).
COLUMN_BLOCK_ROWS = 8
#: Grid-stride kernels launch this many blocks per SM at most: one full wave of 256-thread blocks
#: on sm_80/sm_90 (2048 resident threads per SM); more blocks would only add scheduling.
BLOCKS_PER_SM = 8
#: Column reductions aim at this many blocks per SM, and give each chunk at least this many rows,
#: so that a thread sums enough rows to hide the latency of its loads.
REDUCTION_BLOCKS_PER_SM = 4
MIN_ROWS_PER_CHUNK = 64
#: the bias + activation kernels (mlp.cu, dense.cu) load several mask words (forward) or rows
#: (backward) ahead of their stores (common.cuh's FORWARD_AHEAD, BACKWARD_AHEAD): a warp keeps
#: that many loads in flight where it had one. False: one at a time, the kernels before (a
#: benchmark's baseline, bench_gpu part 6). The same bits either way
LOADS_AHEAD = True
MAX_GRID_Y = 65535

_KERNEL_LINE = re.compile(r"^\s*ONE_EMBEDDING_KERNEL\((\w+)\)\s*$", re.MULTILINE)
_INCLUDE_LINE = re.compile(r'^\s*#include\s+"([\w.]+)"', re.MULTILINE)

_lock = threading.Lock()
_modules: dict = {}        # (device id, family) -> cupy.RawModule
_kernels: dict = {}        # (device id, family, name, ctype) -> cupy.RawKernel
_sm_counts: dict = {}      # device id -> multiprocessor count
_pair_tables: dict = {}    # (device id, F, self_interaction) -> cupy (P, 2) int32


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}: use one of {FAMILIES}")


def source_path(family: str) -> Path:
    _check_family(family)
    return CUDA_DIR / f"{family}.cu"


def kernel_names(family: str) -> tuple[str, ...]:
    """The kernels ``cuda/<family>.cu`` exports, from its ``ONE_EMBEDDING_KERNEL(name)`` lines."""
    return tuple(_KERNEL_LINE.findall(source_path(family).read_text()))


def name_expressions(family: str) -> tuple[str, ...]:
    """Every template instantiation of a family: ``("mlp_bias_act_forward<float>", ...)``."""
    return tuple(f"{name}<{ctype}>" for name in kernel_names(family) for ctype in CTYPES.values())


def source_code(family: str) -> str:
    """The source handed to NVRTC: the .cu text under a digest of the headers it includes.

    CuPy's on-disk kernel cache keys on the code and options only, so without the digest an edit
    of common.cuh alone would keep serving the binary built from the old header.
    """
    text = source_path(family).read_text()
    digest = hashlib.sha256()
    for header in sorted(set(_INCLUDE_LINE.findall(text))):
        digest.update(header.encode() + b"\0" + (CUDA_DIR / header).read_bytes())
    return f"// headers sha256 {digest.hexdigest()}\n{text}"


def get_module(family: str):
    """The compiled ``cupy.RawModule`` of ``cuda/<family>.cu`` on the current device (memoised)."""
    import cupy

    _check_family(family)
    key = (cupy.cuda.Device().id, family)
    module = _modules.get(key)
    if module is None:
        with _lock:
            module = _modules.get(key)
            if module is None:
                names = list(name_expressions(family))
                module = cupy.RawModule(
                    code=source_code(family),
                    options=COMPILE_OPTIONS + (f"-I{CUDA_DIR}",),
                    name_expressions=names,
                )
                # the first lookup compiles the module: a source error surfaces here, not mid-step
                module.get_function(names[0])
                _modules[key] = module
    return module


def get_kernel(family: str, name: str, dtype):
    """Kernel ``<family>_<name>`` instantiated for ``dtype`` (float32 or float64) -> cupy.RawKernel."""
    import cupy

    ctype = CTYPES.get(np.dtype(dtype))
    if ctype is None:
        raise TypeError(f"no kernel instantiation for dtype {np.dtype(dtype)}: use float32 or float64")
    key = (cupy.cuda.Device().id, family, name, ctype)
    kernel = _kernels.get(key)
    if kernel is None:
        kernel = get_module(family).get_function(f"{family}_{name}<{ctype}>")
        _kernels[key] = kernel
    return kernel


def sm_count() -> int:
    """Multiprocessors of the current device (memoised)."""
    import cupy

    device = cupy.cuda.Device()
    count = _sm_counts.get(device.id)
    if count is None:
        count = int(device.attributes["MultiProcessorCount"])
        _sm_counts[device.id] = count
    return count


# ---------------------------------------------------------------- launch geometry (pure)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def grid_stride_blocks(n_threads: int, n_sms: int, block: int = BLOCK) -> int:
    """Blocks for a grid-stride loop over ``n_threads`` work items: enough for one wave, at least 1."""
    return max(1, min(_ceil_div(n_threads, block), n_sms * BLOCKS_PER_SM))


def warp_blocks(n_warp_items: int, n_sms: int, block: int = BLOCK) -> int:
    """Blocks for kernels where each warp owns one item per loop step (a row, a sample, a mask word)."""
    return grid_stride_blocks(n_warp_items * 32, n_sms, block)


def mask_words(n: int) -> int:
    """uint32 words of a bit-packed mask over ``n`` elements."""
    return _ceil_div(n, 32)


def pack_mask(mask) -> np.ndarray:
    """The CUDA mask layout in numpy: bool array (any shape) -> (ceil(n / 32),) uint32.

    Element i of the flat array is bit i % 32 of word i // 32; unused high bits of the last word
    are 0. This is the layout the mlp.cu kernels write with __ballot_sync.
    """
    flat = np.asarray(mask, dtype=bool).reshape(-1)
    padded = np.zeros(mask_words(flat.size) * 32, dtype=bool)
    padded[:flat.size] = flat
    return np.packbits(padded, bitorder="little").view("<u4").astype(np.uint32)


def unpack_mask(words, shape) -> np.ndarray:
    """Inverse of ``pack_mask``: (ceil(n / 32),) uint32 -> bool array of ``shape``."""
    n = int(np.prod(shape))
    bytes_le = np.asarray(words, dtype="<u4").view(np.uint8)
    return np.unpackbits(bytes_le, bitorder="little")[:n].astype(bool).reshape(shape)


def column_chunks(rows: int, cols: int, n_sms: int) -> tuple[int, int]:
    """Row chunking of a column reduction -> (n_chunks, rows_per_chunk).

    The kernel runs a (ceil(cols / 32), n_chunks) grid; chunk g sums rows
    [g * rows_per_chunk, min((g + 1) * rows_per_chunk, rows)), writing one partial row, and the
    partials are then summed in a fixed order (deterministic, no atomics). Every row lies in
    exactly one chunk and no chunk is empty (rows == 0 gives one empty chunk that writes zeros).
    """
    if rows <= 0:
        return 1, 1
    column_blocks = _ceil_div(cols, 32)
    wanted = _ceil_div(n_sms * REDUCTION_BLOCKS_PER_SM, max(column_blocks, 1))
    n_chunks = max(1, min(wanted, rows // MIN_ROWS_PER_CHUNK, MAX_GRID_Y))
    rows_per_chunk = _ceil_div(rows, n_chunks)
    return _ceil_div(rows, rows_per_chunk), rows_per_chunk


# ---------------------------------------------------------------- dot-interaction pairs (pure)


@lru_cache(maxsize=64)
def pair_table(num_features: int, self_interaction: bool) -> np.ndarray:
    """(P, 2) int32 (row, col) of the kept entries of Z = X Xᵀ in output order.

    Row-major lower triangle: (1,0), (2,0), (2,1), (3,0), ... (c < r), or with the diagonal,
    (0,0), (1,0), (1,1), ... (c <= r), so pair p of row r has index ``start(r) + c`` with
    start(r) = r(r-1)/2 (r(r+1)/2 with the diagonal).
    """
    r = np.arange(num_features, dtype=np.int64)
    per_row = r + 1 if self_interaction else r                   # pairs in row r
    rows = np.repeat(r, per_row)
    starts = np.cumsum(per_row) - per_row                       # start(r)
    cols = np.arange(rows.shape[0], dtype=np.int64) - starts[rows]
    table = np.stack([rows, cols], axis=1).astype(np.int32)
    table.flags.writeable = False
    return table


def device_pair_table(num_features: int, self_interaction: bool):
    """``pair_table`` on the current device (uploaded once per device)."""
    import cupy

    key = (cupy.cuda.Device().id, num_features, bool(self_interaction))
    table = _pair_tables.get(key)
    if table is None:
        table = cupy.asarray(pair_table(num_features, bool(self_interaction)))
        _pair_tables[key] = table
    return table
