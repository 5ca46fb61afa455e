"""The row optimizer kernels' 16-byte path (issue 32 item 3): ``optim_<rule>`` and
``optim_summed_<rule>`` take ``int vector``, which the glue sets (``device_ops.row_update_vector``)
where the embedding dim and the line size are multiples of 4 floats and the lines (and
``update_lines``' gradient rows) start on 16-byte boundaries; a thread then updates 4 consecutive
columns, loading and storing the weight's and each state's as one vector. On the host emulator
(default mode and stress seeds), for every row optimizer setting and SmartDecayAdam: the same bits
as the one-element path (the kernels run again with ``vector`` forced to 0) over dims 4, 8, 12 and
128, with NaN, infinities and -0.0 among the weights, states and gradients, plain and summed
gradients; which path the glue chose (dims of 6, lines with extra columns off the multiple of 4 and
arrays off the boundary: the element path); and the emulator's refusal of the vector path on
arrays off the boundary, which the glue's check keeps away."""
from __future__ import annotations

import numpy as np
import pytest
from cuda_emulation import EmulatedLauncher

from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels import device_ops, fused_update
from one_embedding.optim import SmartDecayAdam
from one_embedding.parallel.unique import unique_ids

import helpers
from helpers import LineCopies

pytestmark = pytest.mark.stress_seeds

DIMS = [4, 8, 12, 128]


def _cases() -> dict:
    cases = dict(helpers.row_optimizer_cases())
    cases["smart_decay_adam"] = lambda: SmartDecayAdam(lr=0.01, weight_decay=0.01)
    return cases


def _at(shape, offset: int = 0) -> np.ndarray:
    """A C-contiguous float32 array whose first element lies ``offset`` bytes past a 16-byte
    boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * 4
    raw = np.empty(nbytes + 32 + offset, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset
    a = raw[start:start + nbytes].view(np.float32).reshape(shape)
    assert device_ops.array_address(a) % 16 == offset
    return a


def _width(opt, dim: int, extra: int = 0) -> int:
    """A line of the optimizer's blocks (and step) rounded up to a multiple of 4, plus extra."""
    return -(-opt.required_storage_dim(dim) // 4) * 4 + extra


def _lines(rng, opt, n: int, dim: int, width: int, offset: int = 0) -> np.ndarray:
    """Lines with non-negative accumulators, a few specials (NaN, +-inf, -0.0) in the weights and
    states, and SmartDecayAdam's last steps (rows last updated 0 to 3 steps back)."""
    lines = _at((n, width), offset)
    lines[...] = rng.standard_normal((n, width))
    lines[:, dim:] = np.abs(lines[:, dim:])
    flat = lines[:, :(1 + opt.n_states) * dim].reshape(-1)
    at = rng.choice(flat.size, 8, replace=False)
    flat[at] = [np.nan, np.inf, -np.inf, -0.0, 0.0, -0.0, np.nan, 1e-40]
    if opt.row_columns:
        col = opt.row_column_offset(dim)
        lines[:, col:col + 2] = rng.integers(0, 4, (n, 1)).astype(np.int64).view(np.float32)
    return lines


def _grads(rng, n: int, dim: int, offset: int = 0) -> np.ndarray:
    grads = _at((n, dim), offset)
    grads[...] = rng.standard_normal((n, dim)) * np.exp2(rng.integers(-20, 10, (n, dim)))
    flat = grads.reshape(-1)
    flat[rng.choice(flat.size, 5, replace=False)] = [-0.0, np.inf, np.nan, -np.inf, 0.0]
    return grads


def _same_bits(got, want):
    """Bit for bit, every NaN taken as one (the same positions): which NaN operand an x86
    instruction propagates, so the sign of an emulated NaN result, follows the host compiler's
    operand order, which C++ leaves open; a GPU writes one canonical NaN whatever the order."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    canonical = np.uint32(0x7FC00000)
    np.testing.assert_array_equal(np.where(np.isnan(got), canonical, got.view(np.uint32)),
                                  np.where(np.isnan(want), canonical, want.view(np.uint32)))


def _both_paths(launch, monkeypatch, update, lines, opt=None, dim=None):
    """``update(k, lines)`` (k = 0: the glue's choice of path; k = 1: on a copy of lines, the
    kernels forced onto the element path) -> (the copy, the glue's vector flags). With ``opt``
    and ``dim``: each path's rows flagged non-finite (what ``update`` returned) are the rows
    whose written blocks (the weight and the ``opt.n_states`` states) hold an inf or NaN."""
    other = lines.copy()
    watch = LineCopies(monkeypatch, launch, families=("optim",))
    flagged = [update(0, lines)]
    monkeypatch.undo()
    LineCopies(monkeypatch, launch, force=0, families=("optim",))
    flagged.append(update(1, other))
    monkeypatch.undo()
    if opt is not None:
        written = (1 + opt.n_states) * dim
        for bad, at in zip(flagged, (lines, other)):
            assert bad.dtype == np.bool_ and bad.shape == (at.shape[0],)
            np.testing.assert_array_equal(bad, ~np.isfinite(at[:, :written]).all(axis=1))
    return other, {vector for kernel, _, vector in watch.seen
                   if kernel != "optim_smart_decay_adam_steps"}


def _step(opts, lines, grads, step: int, launch, monkeypatch):
    """update_lines by the glue's choice (opts[0]) and forced onto the element path (opts[1], on
    a copy) -> (the element-path lines, the glue's vector flags)."""
    return _both_paths(launch, monkeypatch, lambda k, at: device_ops.update_lines(
        opts[k], at, grads, step, launch=launch), lines, opts[0], grads.shape[1])


@pytest.mark.parametrize("name", list(_cases()))
def test_vector_update_equals_the_element_update_bit_for_bit(launch, monkeypatch, name):
    make = _cases()[name]
    rng = np.random.default_rng(len(name) + 40)
    for dim in DIMS:
        opts = make(), make()
        n = 24 if dim < 128 else 5
        lines = _lines(rng, opts[0], n, dim, _width(opts[0], dim))
        for step in range(4, 7):     # SmartDecayAdam's rows: last updated at steps 0 to 3
            if step == 6:
                opts[0].grad_scale = opts[1].grad_scale = 0.5
            want, vectors = _step(opts, lines, _grads(rng, n, dim), step, launch, monkeypatch)
            assert vectors == {1}, (dim, vectors)
            _same_bits(lines, want)


def _backward(rng, dim: int, n_keys: int):
    values = (rng.standard_normal((6 * n_keys, dim))
              * np.exp2(rng.integers(-20, 10, (6 * n_keys, dim)))).astype(np.float32)
    values[:2] = -0.0
    values[2, : min(dim, 3)] = [np.inf, np.nan, -np.inf][: min(dim, 3)]
    ids = rng.zipf(1.3, values.shape[0]).astype(np.uint64) % np.uint64(n_keys)
    ids[: 40] = 0                                  # one key past SUM_CHUNK rows: a tree total
    uniq, inverse = unique_ids(ids)
    return values, inverse, uniq.size


@pytest.mark.parametrize("name", list(_cases()))
def test_summed_vector_update_equals_the_element_update_bit_for_bit(launch, monkeypatch, name):
    """The summed kernels' vector path, its gradient groups read as 16-byte vectors of the
    backward's rows (vector bit 1: ``ordered_row_sum_group``) where the rows are 16-byte aligned
    (step 4) and column by column where they are not (step 5: rows 4 bytes off the boundary),
    against the element path: the same bits (NaN, inf and -0.0 among the rows; one key past
    SUM_CHUNK rows, whose total the tree's level kernels sum)."""
    make = _cases()[name]
    rng = np.random.default_rng(len(name) + 80)
    for dim in DIMS:
        opts = make(), make()
        for step, offset, flags in ((4, 0, {3}), (5, 4, {1})):
            values, inverse, u = _backward(rng, dim, 12 if dim < 128 else 4)
            placed = _at(values.shape, offset)
            placed[...] = values
            lines = _lines(rng, opts[0], u, dim, _width(opts[0], dim))
            want, vectors = _both_paths(launch, monkeypatch, lambda k, at: (
                fused_update.update_lines_summed(
                    opts[k], at, fused_update.SummedGradients(placed, inverse, u, launch),
                    step)), lines, opts[0], dim)
            assert vectors == flags, (dim, step, vectors)
            _same_bits(lines, want)


@pytest.mark.parametrize("dim,extra,lines_offset,grads_offset", [
    (6, 0, 0, 0),        # dim not a multiple of 4
    (8, 2, 0, 0),        # a line of two more columns (eviction metadata): blocks off the vector
    (8, 0, 4, 0),        # lines off the 16-byte boundary
    (8, 0, 0, 8),        # gradient rows off the 16-byte boundary
])
@pytest.mark.parametrize("name", ["adam_amsgrad_l2", "ftrl_l1_l2_beta", "smart_decay_adam"])
def test_off_the_vector_the_element_path_runs_with_the_same_bits(launch, monkeypatch, name, dim,
                                                                 extra, lines_offset, grads_offset):
    make = _cases()[name]
    opt, twin = make(), make()
    rng = np.random.default_rng(dim + extra + lines_offset + grads_offset)
    n = 20
    lines = _lines(rng, opt, n, dim, _width(opt, dim, extra), lines_offset)
    for step in range(4, 6):
        grads = _grads(rng, n, dim, grads_offset)
        want, vectors = _step((opt, twin), lines, grads, step, launch, monkeypatch)
        assert vectors == {0}
        _same_bits(lines, want)


def test_the_switch_turns_the_vector_path_off(launch, monkeypatch):
    rng = np.random.default_rng(3)
    opt, twin = (helpers.row_optimizer_cases()["adam"]() for _ in range(2))
    lines = _lines(rng, opt, 10, 8, _width(opt, 8))
    monkeypatch.setattr(device_ops, "VECTOR_ROW_UPDATES", False)
    assert device_ops.row_update_vector(8, lines.shape[1], (lines,)) == 0
    monkeypatch.setattr(device_ops, "VECTOR_ROW_UPDATES", True)
    assert device_ops.row_update_vector(8, lines.shape[1], (lines,)) == 1
    assert device_ops.row_update_vector(0, lines.shape[1], (lines,)) == 0
    assert device_ops.row_update_vector(8, lines.shape[1], (lines[:, 1:],)) == 0


def test_the_emulator_refuses_the_vector_path_off_the_boundary(emulation_lib, monkeypatch):
    """Forced onto the vector path, lines 4, 8 or 12 bytes off the 16-byte boundary fail the
    launch (a GPU faults with "misaligned address"): what the glue's check keeps away; on aligned
    lines the same launch passes. In the default mode, where kernels see the arrays' own
    addresses."""
    launch = EmulatedLauncher(emulation_lib, cm.EMBEDDING_FAMILIES, seed=None)
    rng = np.random.default_rng(4)
    opt = helpers.row_optimizer_cases()["adam"]()
    LineCopies(monkeypatch, launch, force=1, families=("optim",))
    for offset in (0, 4, 8, 12):
        lines = _lines(rng, opt, 6, 8, _width(opt, 8), offset)
        if offset:
            with pytest.raises(AssertionError, match="misaligned vector access"):
                device_ops.update_lines(opt, lines, _grads(rng, 6, 8), 4, launch=launch)
        else:
            device_ops.update_lines(opt, lines, _grads(rng, 6, 8), 4, launch=launch)


def test_the_rows_past_a_live_count_are_never_flagged_non_finite(launch):
    """A fixed-capacity batch's placeholder rows (from its live count on: NaN here) are never
    flagged, whether the plain kernel updates them (wasted work, masked after) or the summed one
    leaves them alone; a row below the count that the update makes non-finite is."""
    from one_embedding.optim import SGD

    n, dim, live = 8, 4, np.array([5], np.int64)
    rng = np.random.default_rng(3)
    for summed in (False, True):
        lines = rng.standard_normal((n, dim)).astype(np.float32)
        lines[live[0]:] = np.nan
        lines[2, 1] = np.inf                      # below the count: flagged
        if summed:
            values = rng.standard_normal((3 * n, dim)).astype(np.float32)
            inverse = np.arange(3 * n, dtype=np.int64) % n
            bad = fused_update.update_lines_summed(
                SGD(lr=0.1), lines, fused_update.SummedGradients(values, inverse, n, launch), 1,
                live=live)
            assert np.isnan(lines[live[0]:]).all()          # left alone
        else:
            bad = device_ops.update_lines(SGD(lr=0.1), lines, rng.standard_normal(
                (n, dim)).astype(np.float32), 1, launch=launch, live=live)
        assert bad.tolist() == [False, False, True, False, False, False, False, False], summed
