"""The fused gradient sum + row update (``kernels/fused_update.py``, ``optim_summed_<rule>`` of
``cuda/optim.cu``) on the host emulator, against the two kernels it replaces: ``segment_sum``
then ``update_lines``, bit for bit, for every row optimizer setting, the grad factor (grad_scale,
a loss scale's 1/scale), weight decay and new rows' reset states. Every test also runs in the
emulator's stress mode (seeds 1, 2, 3: tests/conftest.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from one_embedding.errors import InputError
from one_embedding.kernels import device_ops, device_unique, fused_update
from one_embedding.optim import SGD, SmartDecayAdam
from one_embedding.parallel.unique import unique_ids

import helpers

pytestmark = pytest.mark.stress_seeds


def _backward(rng, n: int, dim: int, n_keys: int):
    """(values (n, dim) float32 over a wide range, with -0.0 and a duplicate-heavy inverse (n,),
    u): the rows of a backward and the keys they belong to."""
    scale = 10.0 ** rng.integers(-5, 6, (n, dim))
    values = (rng.standard_normal((n, dim)) * scale).astype(np.float32)
    values[: min(n, 2)] = -0.0
    ids = rng.zipf(1.3, n).astype(np.uint64) % np.uint64(n_keys)
    uniq, inverse = unique_ids(ids)
    return values, inverse, uniq.size


def _lines(rng, n: int, width: int, dim: int):
    lines = rng.standard_normal((n, width)).astype(np.float32)
    lines[:, dim:] = np.abs(lines[:, dim:])            # accumulators are non-negative
    return lines


def _same_bits(got, want):
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))


@pytest.mark.parametrize("name", list(helpers.row_optimizer_cases()))
def test_fused_update_is_segment_sum_then_update_lines_bit_for_bit(launch, name):
    make = helpers.row_optimizer_cases()[name]
    fused_opt, two_opt = make(), make()
    rng = np.random.default_rng(len(name) + 100)
    dim = 13
    width = (1 + fused_opt.n_states) * dim + 3
    for step in range(1, 5):
        values, inverse, u = _backward(rng, 400, dim, 90)
        fused_lines = _lines(rng, u, width, dim)
        two_lines = fused_lines.copy()
        if step == 3:                           # a loss scale's 1/scale, as Optimizer.step binds it
            fused_opt.grad_scale = two_opt.grad_scale = 1.0 / 1024.0
        summed = fused_update.SummedGradients(values, inverse, u, launch)
        fused_update.update_lines_summed(fused_opt, fused_lines, summed, step)
        grads = device_unique.segment_sum(values, inverse, u, launch=launch)
        device_ops.update_lines(two_opt, two_lines, grads, step, launch=launch)
        _same_bits(fused_lines, two_lines)
        _same_bits(summed.materialize(), grads)
    assert "optim_summed_" + device_ops.optimizer_kernel(fused_opt, 0.1, 1)[0] in launch.launched


def test_fused_smart_decay_adam_reads_and_writes_the_rows_steps(launch):
    """SmartDecayAdam's rows carry their last step: the fused kernel reads it, the steps kernel
    writes it afterwards, as with update_lines; rows updated on a sparse schedule."""
    dim = 7
    fused_opt, two_opt = (SmartDecayAdam(lr=0.01, weight_decay=0.01) for _ in range(2))
    rng = np.random.default_rng(5)
    n_rows = 60
    table = np.zeros((n_rows, fused_opt.required_storage_dim(dim)), np.float32)
    table[:, :dim] = rng.uniform(-1, 1, (n_rows, dim))
    want = table.copy()
    for step in range(1, 7):
        rows = np.flatnonzero(rng.random(n_rows) < 0.4)
        values, inverse, u = _backward(rng, 3 * rows.size, dim, rows.size)
        keys = rows[:u]
        fused_lines = np.ascontiguousarray(table[keys])
        fused_update.update_lines_summed(fused_opt, fused_lines, fused_update.SummedGradients(
            values, inverse, u, launch), step)
        table[keys] = fused_lines
        two_lines = np.ascontiguousarray(want[keys])
        grads = device_unique.segment_sum(values, inverse, u, launch=launch)
        device_ops.update_lines(two_opt, two_lines, grads, step, launch=launch)
        want[keys] = two_lines
    _same_bits(table, want)
    assert "optim_summed_smart_decay_adam" in launch.launched


def test_summed_row_is_the_materialized_row(launch):
    """What a failed finite-rows check reports about a key: its summed gradient, as summed by the
    fused update (no host read)."""
    rng = np.random.default_rng(6)
    values, inverse, u = _backward(rng, 500, 9, 70)
    summed = fused_update.SummedGradients(values, inverse, u, launch)
    full = summed.materialize()
    assert summed.shape == full.shape == (u, 9)
    for at in [0, u // 2, u - 1]:
        _same_bits(summed.row(np.int64(at)), full[at])


def test_fused_update_argument_checks(launch):
    values, inverse = np.ones((5, 4), np.float32), np.array([0, 1, 1, 2, 0])
    summed = fused_update.SummedGradients(values, inverse, 3, launch)
    with pytest.raises(InputError, match="must hold 3 rows"):
        fused_update.update_lines_summed(SGD(lr=0.1), np.zeros((4, 4), np.float32), summed, 1)
    with pytest.raises(InputError, match="step"):
        fused_update.update_lines_summed(SGD(lr=0.1), np.zeros((3, 4), np.float32), summed, 0)
    with pytest.raises(InputError):             # not an array of the launcher's module
        fused_update.SummedGradients([[1.0]], np.array([0]), 1, launch)
    empty = fused_update.SummedGradients(np.zeros((0, 4), np.float32), np.zeros(0, np.int64), 0,
                                         launch)
    fused_update.update_lines_summed(SGD(lr=0.1), np.zeros((0, 4), np.float32), empty, 1)
