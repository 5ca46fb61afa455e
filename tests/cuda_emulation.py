"""CUDA kernel families executed on the host: compiled with g++ against
``kernels/cuda/host_emulation.cuh`` (threads as fibers, warp primitives through barriers) and
launched through a ``device_ops.Launcher`` on numpy arrays, so the device glue (``device_ops``,
``cache/device.py``) runs unchanged on a machine without a GPU.

Every launch is checked against the kernel's parameter list parsed from its source: the argument
count, each pointer's element type (``T*`` is the instantiation's dtype, ``oe::u64*`` uint64, ...)
and each scalar's numpy type. A wrong argument would silently corrupt memory on a GPU; here it
fails the launch with the kernel and parameter named.

Stress mode: with ``ONE_EMBEDDING_CUDA_EMULATION_SEED=<int>`` in the environment (or
``EmulatedLauncher(..., seed=<int>)``) every launch runs adversarially, deterministic per seed
(the header's comment has the details): threads interleave at random between barriers, up to 8
blocks run interleaved, shared memory starts as 0xFF bytes, every shared index is bounds-checked,
a read of unwritten shared memory or two threads touching one shared element with no barrier
between them fails the launch, and each array argument runs on a copy against a guard page, so an
out-of-bounds global access fails the launch naming the argument, element and thread. Arrays the
device glue allocates uninitialised (``launch.xp.empty``, ``empty_like``, ``host_empty``) come
filled with garbage: NaN for floats, 0xFF bytes or random bytes for integers. Unset, launches run
the fast deterministic default. A failing launch raises AssertionError naming the kernel, the
seed and the launch number, which reproduce it.

For the stress mode's shared-memory checks, ``build`` compiles rewritten copies of the sources:
each ``__shared__ TYPE NAME[A][B];`` becomes per-block storage with checked elements, each array
member of a struct a checked array (``rewrite_for_emulation``). The sources themselves stay plain
CUDA for NVRTC and nvcc.

The shared library of one set of families is built once and kept in pytest's cache folder under a
digest of the sources, this file and the compiler options, so a re-run does not compile again.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import threading
import types
from pathlib import Path

import numpy as np

from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels.device_ops import Launcher

#: hidden visibility and no GNU-unique symbols: every library built here keeps its own kernel
#: registry, shared-memory statics and fiber state, even when a test loads a second build of the
#: same families (a rewritten source) into the process; with default visibility the dynamic
#: linker binds C++'s "unique" statics (the kernel registry among them) process-wide, and the
#: second library's kernels replaced the first's in its registry
GXX_OPTIONS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-fvisibility=hidden",
               "-fvisibility-inlines-hidden", "-fno-gnu-unique", "-Wall", "-Wextra", "-Werror")
#: the stress mode's switch: an integer seed
SEED_ENV = "ONE_EMBEDDING_CUDA_EMULATION_SEED"

_SCALAR_TYPES = {"oe::i64": np.int64, "oe::u64": np.uint64, "int": np.int32, "double": np.float64,
                 "float": np.float32}
_POINTER_DTYPES = {"oe::u64": np.uint64, "oe::i64": np.int64, "int": np.int32, "unsigned": np.uint32,
                   "unsigned char": np.uint8, "signed char": np.int8, "unsigned short": np.uint16,
                   "float": np.float32, "double": np.float64}
_CTYPES = {np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64, np.int32: ctypes.c_int32,
           np.float64: ctypes.c_double, np.float32: ctypes.c_float}
_MASK64 = (1 << 64) - 1


def seed_from_environment() -> int | None:
    """The stress seed in ``$ONE_EMBEDDING_CUDA_EMULATION_SEED``, or None when it is unset or empty."""
    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        return None
    try:
        return int(text, 0)
    except ValueError:
        raise ValueError(f"{SEED_ENV}={text!r} is not an integer: set a seed such as 1, or unset "
                         "it for the default emulation") from None


def _source_file(family: str, source_dir: Path | None) -> Path:
    if source_dir is not None and (Path(source_dir) / f"{family}.cu").exists():
        return Path(source_dir) / f"{family}.cu"
    return cm.source_path(family)


def kernel_parameters(family: str, source_dir: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """{kernel: [(type, name), ...]} parsed from ``<family>.cu`` (types without const), found in
    ``source_dir`` first, then in the package's ``cuda/``."""
    text = _source_file(family, source_dir).read_text()
    kernels = {}
    for name, params in re.findall(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)", text):
        row = []
        for param in params.split(","):
            param = " ".join(param.replace("const ", " ").split())
            pointer = "*" in param
            declared, arg = param.replace("*", " ").rsplit(None, 1)
            row.append((" ".join(declared.split()) + ("*" if pointer else ""), arg))
        kernels[name] = row
    return kernels


# ---------------------------------------------------------------- the shared-memory rewrite

_SHARED = re.compile(r"__shared__\s+(?P<type>[\w:<>, ]+?)\s+(?P<name>\w+)\s*"
                     r"(?P<dims>(?:\[[^\[\];]+\]\s*)+);")
_STRUCT = re.compile(r"\bstruct\s+\w+\s*\{")
_MEMBER_ARRAY = re.compile(r"^(?P<indent>\s*)(?P<type>[A-Za-z_][\w:]*(?:\s+[A-Za-z_][\w:]*)*?)\s+"
                           r"(?P<name>\w+)\s*(?P<dims>(?:\[[^\[\];]+\]\s*)+);", re.M)


def _array_type(element: str, dims: str, tag: str | None = None) -> str:
    """``oe_emulation::Array`` nesting for ``element NAME<dims>``; the outermost carries ``tag``."""
    extents = re.findall(r"\[([^\]]+)\]", dims)
    out = element.strip()
    for depth, extent in enumerate(reversed(extents)):
        outermost = depth == len(extents) - 1
        named = f", struct oe_member_{tag}" if tag and outermost else ""
        out = f"oe_emulation::Array<{out}, ({extent.strip()}){named}>"
    return out


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def rewrite_for_emulation(text: str, filename: str = "source") -> str:
    """``text`` (a .cu or .cuh) with every ``__shared__`` array made per-block checked storage
    and every array member of a struct a checked array, for the stress mode of
    ``host_emulation.cuh``. Raises ValueError on a ``__shared__`` it cannot rewrite."""

    def shared(m: re.Match) -> str:
        name = m["name"]
        return (f"static {_array_type(m['type'], m['dims'])} {name}_oe_static; "
                f"auto& {name} = oe_emulation::shared({name}_oe_static, \"{name}\");")

    out = _SHARED.sub(shared, text)
    left = [line for line in _strip_comments(out).splitlines() if "__shared__" in line]
    if left:
        raise ValueError(f"{filename}: the emulator rewrites `__shared__ TYPE NAME[N]...;` arrays "
                         f"only (no scalars, no extern dynamic shared memory): {left[0].strip()!r}")
    pieces, pos = [], 0
    for m in _STRUCT.finditer(out):
        if m.start() < pos:
            continue
        depth, end = 1, m.end()
        while depth and end < len(out):
            depth += {"{": 1, "}": -1}.get(out[end], 0)
            end += 1
        body = out[m.end():end - 1]
        if "{" not in body:   # a plain data struct: rewrite its array members
            body = _MEMBER_ARRAY.sub(
                lambda a: f"{a['indent']}{_array_type(a['type'], a['dims'], a['name'])} {a['name']};",
                body)
        pieces += [out[pos:m.end()], body, "}"]
        pos = end
    return "".join(pieces) + out[pos:]


# ---------------------------------------------------------------- building

#: the emulators keep their fibers in process-wide state, and the stress mode installs a SIGSEGV
#: handler: one launch at a time in the process, from any thread (a prefetch thread launches beside
#: the main thread; ctypes releases the GIL), whichever launcher or library
_ONE_LAUNCH_AT_A_TIME = threading.Lock()

#: libraries built in this process, by digest: test modules without pytest's cache folder (run
#: with -p no:cacheprovider) share one build instead of compiling again each
_built: dict[str, ctypes.CDLL] = {}


def build(families, cache_dir: Path, source_dir: Path | None = None) -> ctypes.CDLL:
    """The emulation library of ``families`` (one translation unit, from rewritten copies of the
    sources: ``source_dir``'s .cu/.cuh over the package's), from ``cache_dir`` when an identical
    build is there. It runs in both modes."""
    if shutil.which("g++") is None:
        raise FileNotFoundError("g++ not on PATH")
    sources = {p.name: p for p in sorted(cm.CUDA_DIR.glob("*.cu*"))}
    if source_dir is not None:
        sources.update({p.name: p for p in sorted(Path(source_dir).glob("*.cu*"))})
    unit = ('#define ONE_EMBEDDING_EMULATION_REWRITTEN 1\n#include "host_emulation.cuh"\n'
            '#define ONE_EMBEDDING_INSTANTIATE\n' + "".join(f'#include "{f}.cu"\n' for f in families))
    digest = hashlib.sha256(unit.encode() + "\0".join(GXX_OPTIONS).encode())
    digest.update(Path(__file__).read_bytes())       # the rewrite
    texts = {name: path.read_text() for name, path in sources.items()}
    for name, text in texts.items():
        digest.update(name.encode() + b"\0" + text.encode())
    version = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
    digest.update(version.encode())
    key = digest.hexdigest()
    if key in _built:     # built by another test module of this process
        return _built[key]
    lib = Path(cache_dir) / f"emulation-{key[:24]}.so"
    if not lib.exists():
        work = Path(cache_dir) / f"emulation-{key[:24]}-src"
        work.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            if not name.startswith("host_emulation"):     # the emulator's own headers stay
                text = rewrite_for_emulation(text, name)
            (work / name).write_text(text)
        src = work / "unit.cpp"
        src.write_text(unit)
        tmp = lib.with_suffix(f".so.{os.getpid()}.tmp")
        run = subprocess.run(["g++", *GXX_OPTIONS, "-I", str(work), str(src), "-o", str(tmp)],
                             capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise RuntimeError(f"g++ failed on {families} (rewritten sources in {work}):\n{run.stderr}")
        tmp.replace(lib)
    _built[key] = ctypes.CDLL(str(lib))
    return _built[key]


# ---------------------------------------------------------------- garbage in fresh buffers

def fill_garbage(a: np.ndarray, seed: int) -> np.ndarray:
    """``a`` overwritten with garbage: NaN (all bits set) for floats; for other dtypes all bits
    set (odd ``seed``) or bytes drawn from ``seed`` and the size (even), the same whichever thread
    allocates first."""
    raw = a.reshape(-1).view(np.uint8)
    if a.dtype.kind in "fc" or seed % 2:
        raw[...] = 0xFF
    else:
        raw[...] = np.random.default_rng([seed, raw.size]).integers(0, 256, raw.size, np.uint8)
    return a


class GarbageNumpy(types.ModuleType):
    """numpy, except that ``empty`` and ``empty_like`` return garbage-filled arrays, as fresh
    device memory is: a kernel or glue step that reads an element nobody wrote gives NaN (or an
    implausible integer) instead of a lucky zero."""

    def __init__(self, seed: int):
        super().__init__("numpy")
        self._seed = seed

    def __getattr__(self, name):
        return getattr(np, name)

    def _garbage(self, a: np.ndarray) -> np.ndarray:
        return fill_garbage(a, self._seed)

    def empty(self, shape, dtype=float, order="C", **kwargs):
        return self._garbage(np.empty(shape, dtype, order, **kwargs))

    def empty_like(self, prototype, dtype=None, order="K", subok=True, shape=None, **kwargs):
        return self._garbage(np.empty_like(prototype, dtype, order, subok, shape, **kwargs))


# ---------------------------------------------------------------- the launcher

#: EmulatedLauncher's default seed: read ONE_EMBEDDING_CUDA_EMULATION_SEED when it is built
FROM_ENVIRONMENT = "environment"


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class EmulatedLauncher(Launcher):
    """Runs kernels on numpy arrays through the host emulator; records each launch's kernel.

    ``seed``: an int runs every launch in the stress mode, the k-th launch from a thread with a
    schedule drawn from the seed and k (so a prefetch thread's launches do not shift the main
    thread's); None runs the default mode; by default the environment decides
    (``ONE_EMBEDDING_CUDA_EMULATION_SEED``). ``source_dir`` holds extra families (tests' own
    kernels) that the library was built with."""

    xp = np

    def __init__(self, lib: ctypes.CDLL, families, block: int = cm.BLOCK, n_sms: int = 1,
                 seed: int | None | str = FROM_ENVIRONMENT, source_dir: Path | None = None):
        self.lib = lib
        lib.oe_emulate_launch.restype = ctypes.c_int
        lib.oe_emulate_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 4 + [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_int]
        lib.oe_emulate_launch_stress.restype = ctypes.c_int
        lib.oe_emulate_launch_stress.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 4 + [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.POINTER(ctypes.c_longlong),
            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_char_p), ctypes.c_ulonglong,
            ctypes.c_char_p, ctypes.c_int]
        self.block = block
        self.n_sms = n_sms
        self.seed = seed_from_environment() if seed == FROM_ENVIRONMENT else seed
        if self.seed is not None:
            self.seed = int(self.seed)
            self.xp = GarbageNumpy(self.seed)
        self.signatures = {}
        for family in families:
            self.signatures.update(kernel_parameters(family, source_dir))
        self.launched: set[str] = set()
        self._thread_launches = threading.local()

    def host_empty(self, shape, dtype) -> np.ndarray:
        # host memory (page-locked on a GPU): a plain ndarray, even where the dry run's xp hands
        # out device stand-ins, so that the host's reads of it are not taken for device reads
        return self.xp.empty(shape, dtype).view(np.ndarray)

    def _check(self, kernel: str, dtype, args) -> None:
        params = self.signatures.get(kernel)
        assert params is not None, f"no kernel {kernel} in the emulated families"
        assert len(args) == len(params), f"{kernel}: {len(args)} arguments for {len(params)} parameters"
        t = np.dtype(dtype)
        for value, (declared, name) in zip(args, params):
            where = f"{kernel} parameter {declared} {name}"
            if declared.endswith("*"):
                base = declared[:-1].strip()
                want = t if base == "T" else np.dtype(_POINTER_DTYPES[base])
                assert isinstance(value, np.ndarray), f"{where}: got {type(value).__name__}, not an array"
                assert value.dtype == want, f"{where}: array of {value.dtype}, expected {want}"
                assert value.flags.c_contiguous, f"{where}: array not C-contiguous"
            else:
                want = t.type if declared == "T" else _SCALAR_TYPES[declared]
                assert type(value) is want, f"{where}: got {type(value).__name__}, expected {want.__name__}"

    def run(self, family, name, dtype, grid, block, args):
        kernel = f"{family}_{name}"
        self._check(kernel, dtype, args)
        grid = tuple(grid) + (1,) * (2 - len(grid))
        block = tuple(block) + (1,) * (2 - len(block))
        values = []
        for a in args:
            if isinstance(a, np.ndarray):
                values.append(ctypes.c_void_p(a.ctypes.data))
            else:
                values.append(_CTYPES[type(a)](a.item()))
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        error = ctypes.create_string_buffer(1024)
        label = f"{kernel}<{cm.CTYPES[np.dtype(dtype)]}>".encode()
        launch = getattr(self._thread_launches, "count", 0)
        self._thread_launches.count = launch + 1
        with _ONE_LAUNCH_AT_A_TIME:
            if self.seed is None:
                status = self.lib.oe_emulate_launch(label, *grid, *block, params, error, len(error))
            else:
                n = len(args)
                arrays = [isinstance(a, np.ndarray) for a in args]
                sizes = (ctypes.c_longlong * n)(*[a.nbytes if is_array else -1
                                                  for a, is_array in zip(args, arrays)])
                itemsizes = (ctypes.c_int * n)(*[a.itemsize if is_array else 0
                                                 for a, is_array in zip(args, arrays)])
                names = (ctypes.c_char_p * n)(*[p_name.encode() for _, p_name in self.signatures[kernel]])
                schedule = _splitmix64((self.seed * 0x100000001B3 + launch) & _MASK64)
                status = self.lib.oe_emulate_launch_stress(label, *grid, *block, params, n, sizes,
                                                           itemsizes, names, schedule, error,
                                                           len(error))
        where = "" if self.seed is None else (
            f" [{SEED_ENV}={self.seed}, launch {launch} of this launcher in this thread]")
        assert status == 0, f"{kernel}: {error.value.decode()}{where}"
        self.launched.add(kernel)
