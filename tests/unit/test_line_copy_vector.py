"""The device hash index's and the device cache's line copies at 16 bytes per lane (issue 32
item 3): ``hashindex_find``, ``hashindex_find_live``, ``hashindex_dedup_output_find``,
``hashindex_put_rows``, ``cache_find`` and ``cache_insert`` take ``int vector``, which the glue
sets (``device_ops.line_vector``) where the line size is a multiple of 4 floats and the arrays
start on 16-byte boundaries. On the host emulator (default mode and stress seeds): the same bits
as the one-element copies (the kernels run again with ``vector`` forced to 0) and as the CPU
twins, NaN payloads and -0.0 included; which copy the glue chose (lines of 4, 8, 12, 16, 256
floats vectorised, of 6 and 130 not, arrays off the boundary not); and the emulator's refusal
of a 16-byte access off its boundary, which is what the glue's check keeps away."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_emulation import EmulatedLauncher

from one_embedding.cache.device import DeviceCache, DeviceFullStore, DeviceHashIndex
from one_embedding.cache.set_associative import SetAssociativeCache
from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels import device_ops, device_unique
from one_embedding.store.memory import MemoryStore

from helpers import LineCopies

pytestmark = pytest.mark.stress_seeds

LINES = [4, 8, 12, 16, 256, 6, 130]
STORE_KERNELS = {"hashindex_find", "hashindex_find_live", "hashindex_dedup_output_find",
                 "hashindex_put_rows"}


def _at(shape, offset: int = 0, fill=None) -> np.ndarray:
    """A C-contiguous float32 array whose first element lies ``offset`` bytes past a 16-byte
    boundary, filled with ``fill`` (uninitialised when None)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * 4
    raw = np.empty(nbytes + 32 + offset, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset
    a = raw[start:start + nbytes].view(np.float32).reshape(shape)
    assert device_ops.array_address(a) % 16 == offset
    if fill is not None:
        a[...] = fill
    return a


def _lines(rng, shape, offset: int = 0) -> np.ndarray:
    """Random lines with the bit patterns a copy must keep: NaN payloads (quiet and signalling),
    -0.0, infinities, subnormals."""
    a = _at(shape, offset)
    a[...] = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 18, shape))
    flat = a.reshape(-1).view(np.uint32)
    specials = np.array([0x7FC00001, 0x7F800005, 0xFFC12345, 0x80000000, 0x7F800000, 0x00000003],
                        np.uint32)
    at = rng.choice(flat.size, min(flat.size, 4 * specials.size), replace=False)
    flat[at] = np.resize(specials, at.size)
    return a


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def _store_round(launch, line, rng_seed, offset=0):
    """One store's round of the four line-copying kernels on a DeviceFullStore of ``line``:
    a fixed-capacity put (hashindex_put_rows), a find into scattered rows (hashindex_find), the
    fixed-capacity find (hashindex_find_live) and the fused dedup + find
    (hashindex_dedup_output_find); ``offset``: the lines given and the outputs that many bytes
    off the 16-byte boundary. -> (outputs, the MemoryStore twin's outputs)."""
    rng = np.random.default_rng(rng_seed)
    universe = rng.integers(0, 2**64, 120, dtype=np.uint64, endpoint=False)
    dev, cpu = DeviceFullStore(line, capacity=256, launch=launch), MemoryStore(line, capacity=256)
    assert device_ops.array_address(dev._rows) % 16 == 0
    got, want = [], []
    for step in range(2):
        ids = universe[rng.integers(0, 60 + 40 * step, 70)]
        fixed = device_unique.unique_ids_fixed(ids, launch=launch)
        u = int(fixed.count[0])
        lines = _lines(rng, (ids.size, line), offset)
        dev.insert_or_assign(fixed.keys, lines, fixed.count)             # put_rows
        cpu.insert_or_assign(fixed.keys[:u], lines[:u])
        probe = universe[rng.permutation(universe.size)[:50]]            # some held, some not
        out_rows = rng.permutation(53)[:50].astype(np.int64)
        out, twin = _at((53, line), offset, 7.0), np.full((53, line), 7.0, np.float32)
        got.append(dev.find(probe, out, out_rows))                       # hashindex_find
        want.append(cpu.find(probe, twin, out_rows))
        got.append(out)
        want.append(twin)
        ids = universe[rng.integers(0, 120, 64)]
        fixed = device_unique.unique_ids_fixed(ids, launch=launch)
        u = int(fixed.count[0])
        live = _at((ids.size, line), offset, 7.0)
        found = dev.find_found(fixed.keys, live, fixed.count)            # hashindex_find_live
        twin = np.full((ids.size, line), 7.0, np.float32)
        missing = cpu.find(fixed.keys[:u], twin, np.arange(u))
        assert not found[np.asarray(missing, np.int64)].any() and found.sum() == ids.size - len(missing)
        got.append(live)
        want.append(twin)
        fused = _at((ids.size, line), offset, 7.0)
        _, fused_found = dev.dedup_find_found(device_unique.dedup_passes_fixed(ids, launch), fused)
        np.testing.assert_array_equal(fused_found, found)                # dedup_output_find
        got.append(fused)
        want.append(twin)
    return got, want


@pytest.mark.parametrize("line", LINES)
def test_store_line_copies_by_vector_equal_the_element_copies_and_the_twin(launch, monkeypatch,
                                                                           line):
    """The four kernels, as the glue launches them and with ``vector`` forced to 0: the same
    bits, the twin's; the glue chose the 16-byte copies exactly where the line is a multiple of
    4 floats (the arrays here start on the boundary), and no vector where nothing is copied
    (the slot-only finds)."""
    copies = LineCopies(monkeypatch, launch)
    got, want = _store_round(launch, line, line)
    assert STORE_KERNELS <= copies.kernels()
    assert copies.vectors() == {int(line % 4 == 0)}
    assert copies.vectors(with_lines=False) <= {0}
    copies.force = 0
    scalar, _ = _store_round(launch, line, line)
    for a, b, c in zip(got, scalar, want, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(c))
        np.testing.assert_array_equal(_bits(b), _bits(c))


@pytest.mark.parametrize("offset", [4, 8])
def test_store_line_copies_off_the_boundary_fall_back_to_element_copies(launch, monkeypatch,
                                                                        offset):
    """Lines of 8 floats given, and outputs, 4 or 8 bytes off the 16-byte boundary: every
    line-copying launch runs the one-element copies, with the twin's bits; and rows behind the
    index off the boundary (find_rows and find_live on a caller's rows) do too."""
    copies = LineCopies(monkeypatch, launch)
    got, want = _store_round(launch, 8, 3, offset)
    assert STORE_KERNELS <= copies.kernels()
    assert copies.vectors() == {0}
    for a, c in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(c))
    rng = np.random.default_rng(4)
    index = DeviceHashIndex(launch=launch)
    keys = rng.integers(0, 2**64, 40, dtype=np.uint64, endpoint=False)
    slots, _ = index.find_or_insert(keys, distinct=True)
    rows = _lines(rng, (40, 8), offset)
    copies.seen.clear()
    out = _at((40, 8), 0, 7.0)
    index.find_rows(keys, rows, out, np.arange(40, dtype=np.int64))
    np.testing.assert_array_equal(_bits(out), _bits(rows[slots]))
    live = _at((40, 8), 0, 7.0)
    index.find_live(keys, np.array([40], np.int64), rows, live)
    np.testing.assert_array_equal(_bits(live), _bits(rows[slots]))
    assert copies.kernels() == {"hashindex_find", "hashindex_find_live"}
    assert copies.vectors() == {0}


def test_the_emulator_refuses_16_byte_line_copies_off_the_boundary(emulation_lib, monkeypatch):
    """A 16-byte copy forced onto outputs (or lines given) 4 bytes off the boundary fails the
    launch, as a GPU faults ("misaligned address"), in each of the six kernels: the glue's check
    is what keeps it away. The same launches on aligned outputs pass (so the failure is the
    alignment's). In the default mode, where kernels see the arrays' own addresses."""
    launch = EmulatedLauncher(emulation_lib, cm.EMBEDDING_FAMILIES, seed=None)
    copies = LineCopies(monkeypatch, launch, force=1)
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 2**64, 20, dtype=np.uint64, endpoint=False)
    for offset in (0, 4):
        store = DeviceFullStore(8, capacity=64, launch=launch)
        store.insert_or_assign(keys, _lines(rng, (20, 8)))
        out = _at((20, 8), offset, 7.0)
        cache = DeviceCache(8, 32, 4, "lru", launch=launch)
        cache.insert_or_assign(keys, _lines(rng, (20, 8)))
        fixed = device_unique.unique_ids_fixed(keys, launch=launch)
        calls = [lambda: store.find(keys, out, np.arange(20, dtype=np.int64)),
                 lambda: store.find_found(fixed.keys, out, fixed.count),
                 lambda: store.dedup_find_found(device_unique.dedup_passes_fixed(keys, launch),
                                                out),
                 lambda: store.insert_or_assign(fixed.keys, _lines(rng, (20, 8), offset),
                                                fixed.count),
                 lambda: cache.find(keys, out, np.arange(20, dtype=np.int64)),
                 lambda: cache.insert_or_assign(keys, _lines(rng, (20, 8), offset))]
        for call in calls:
            if offset:
                with pytest.raises(AssertionError, match="misaligned vector access"):
                    call()
            else:
                call()
    assert copies.vectors() == {0, 1}        # the glue itself chose 0 off the boundary


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("line", [4, 8, 12, 6])
def test_cache_line_copies_by_vector_equal_the_element_copies_and_the_cpu_cache(
        launch, monkeypatch, line, policy):
    """cache_find's copies of hit lines and cache_insert's writes and evicted lines, on a small
    cache that evicts: the 16-byte copies (lines of 4, 8, 12 floats) and the forced one-element
    copies give the CPU cache's lines and evictions, bit for bit; the glue chose the vector
    exactly where the line allows it, and not for outputs off the boundary."""
    copies = LineCopies(monkeypatch, launch)

    def trace(offset=0):
        rng = np.random.default_rng(line)
        universe = rng.integers(0, 2**64, 90, dtype=np.uint64, endpoint=False)
        dev = DeviceCache(line, 24, 4, policy, launch=launch)
        cpu = SetAssociativeCache(line, 24, 4, policy)
        assert device_ops.array_address(dev._rows) % 16 == 0
        results = []
        for step in range(6):
            keys = np.unique(universe[rng.integers(0, universe.size, 30)])
            rng.shuffle(keys)
            if step % 2:
                out = _at((keys.size + 2, line), offset, 7.0)
                twin = np.full(out.shape, 7.0, np.float32)
                out_rows = rng.permutation(keys.size + 2)[:keys.size].astype(np.int64)
                np.testing.assert_array_equal(dev.find(keys, out, out_rows),
                                              cpu.find(keys, twin, out_rows))
                results.append((out, twin))
            else:
                lines = _lines(rng, (keys.size, line), offset)
                (ev_keys, ev_lines), (want_keys, want_lines) = \
                    dev.insert_or_assign(keys, lines), cpu.insert_or_assign(keys, lines)
                np.testing.assert_array_equal(ev_keys, want_keys)
                results.append((ev_lines, want_lines))
        assert sum(ev.shape[0] for ev, _ in results[::2]) > 0            # it evicted
        return results

    vectorised = trace()
    assert copies.kernels() == {"cache_find", "cache_insert"}
    assert copies.vectors() == {int(line % 4 == 0)}
    copies.force = 0
    scalar = trace()
    for (got, want), (forced, _) in zip(vectorised, scalar, strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))
        np.testing.assert_array_equal(_bits(forced), _bits(want))
    if line % 4 == 0:
        copies.force = None
        copies.seen.clear()
        for got, want in trace(offset=4):
            np.testing.assert_array_equal(_bits(got), _bits(want))
        assert copies.vectors() == {0}
