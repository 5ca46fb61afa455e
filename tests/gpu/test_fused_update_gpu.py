"""Issue 32 item 3 on a GPU: the backward's per-key gradient sum fused with the row update
(``kernels/fused_update.py``, ``optim_summed_<rule>``) against the two kernels it replaces
(``segment_sum`` then ``update_lines``) on the same device, bit for bit (both flush subnormals
alike, so any input may be used), and against the CPU twins (inputs without float32
subnormals; Ftrl with lr_power -0.7 within 1 ulp: CUDA's pow). A DLRM trained by the CLI's
Trainer gives the same losses and rows with the fusion on and forced off, and launched it.

Needs CuPy and a CUDA device; runs on the dry run too (``-p gpu_dry_run``, smaller sizes).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from one_embedding.backend import cupy_available

import helpers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a CUDA device"),
]

DRY = bool(os.environ.get("ONE_EMBEDDING_GPU_DRY_RUN"))


def _cp():
    import cupy

    return cupy


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(_cp().asnumpy(a)).view(np.int32)


def _ulps(a, b):
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


# (rows, dim, key range); the sanitizer run of scripts/gpu_check.sh deselects the id 200000
SIZES = {2000: (2000, 13, 500), 200000: (200_000, 128, 50_000)}


@pytest.mark.parametrize("size", list(SIZES), ids=str)
@pytest.mark.parametrize("name", list(helpers.row_optimizer_cases()))
def test_fused_update_is_the_two_kernel_update_on_the_gpu(name, size):
    from one_embedding.kernels import device_ops, device_unique, fused_update
    from one_embedding.parallel.unique import segment_sum, unique_ids

    cp = _cp()
    make = helpers.row_optimizer_cases()[name]
    fused_opt, two_opt, cpu_opt = make(), make(), make()
    rng = np.random.default_rng(len(name))
    n, dim, n_keys = (600, 13, 150) if DRY else SIZES[size]
    ids = rng.zipf(1.2, n).astype(np.uint64) % np.uint64(n_keys)
    uniq, inverse = unique_ids(ids)
    u = uniq.size
    width = fused_opt.required_storage_dim(dim) + 3
    want = rng.uniform(-1, 1, (u, width)).astype(np.float32)
    want[:, dim:] = np.abs(want[:, dim:]) + 0.01          # accumulators: positive, normal
    fused_lines, two_lines = cp.array(want), cp.array(want)
    values_d, inverse_d = cp.empty((n, dim), cp.float32), cp.asarray(inverse)
    for step in range(1, 4):
        values = rng.uniform(-1, 1, (n, dim)).astype(np.float32)
        if step == 2:
            fused_opt.grad_scale = two_opt.grad_scale = cpu_opt.grad_scale = 1.0 / 512.0
        values_d[...] = cp.asarray(values)
        fused_update.update_lines_summed(fused_opt, fused_lines,
                                         fused_update.SummedGradients(values_d, inverse_d, u,
                                                                      device_ops.cupy_launcher()),
                                         step)
        device_ops.update_lines(two_opt, two_lines, device_unique.segment_sum(values_d, inverse_d, u),
                                step)
        states = [want[:, (k + 1) * dim:(k + 2) * dim] for k in range(cpu_opt.n_states)]
        cpu_opt.update(want[:, :dim], states, segment_sum(values, inverse, u), step)
    np.testing.assert_array_equal(_bits(fused_lines), _bits(two_lines))
    if name == "ftrl_power":
        assert _ulps(_cp().asnumpy(fused_lines), want).max() <= 1
    else:
        np.testing.assert_array_equal(_bits(fused_lines), want.view(np.int32))


def test_trainer_fused_gradient_update_gives_the_two_kernel_run(tmp_path, monkeypatch):
    """The CLI's training path (DLRM, device_mem, one rank) with the fusion on and forced off:
    the same losses and rows; the fused kernel launched in the first run only."""
    from one_embedding.config import TrainConfig
    from one_embedding.kernels import device_ops, fused_update
    from one_embedding.training import Trainer

    launcher = device_ops.cupy_launcher()
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(fused_update, "ENABLED", fused)
        launched = set()
        run = launcher.run

        def recording(family, name, dtype, grid, block, args, run=run, launched=launched):
            launched.add(f"{family}_{name}")
            return run(family, name, dtype, grid, block, args)

        monkeypatch.setattr(launcher, "run", recording)
        cfg = TrainConfig(steps=4, batch_size=128 if DRY else 8192, synthetic_rows=20_000,
                          embedding_dim=16, store="device_mem", optimizer="adam",
                          eval_batches=1, device="cuda", prefetch_depth=1, log_interval=2,
                          persistent_path=str(tmp_path / f"fused{fused}"))
        trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
        rows, close = [], trainer.close

        def close_after_export(rows=rows, close=close, trainer=trainer):
            rows.append(trainer.embedding.export())   # (keys sorted, lines), before run closes
            close()

        trainer.close = close_after_export
        final = trainer.run()
        (keys, lines), = rows
        runs[fused] = list(trainer.progress.losses), final["auc"], keys, lines, launched
        monkeypatch.setattr(launcher, "run", run)
    (losses_on, auc_on, keys_on, lines_on, launched_on), \
        (losses_off, auc_off, keys_off, lines_off, launched_off) = runs[True], runs[False]
    assert losses_on == losses_off and len(losses_on) == 4 and auc_on == auc_off
    np.testing.assert_array_equal(keys_on, keys_off)
    np.testing.assert_array_equal(lines_on.view(np.int32), lines_off.view(np.int32))
    assert "optim_summed_adam" in launched_on and "embedding_segment_sum" not in launched_on
    assert "optim_adam" in launched_off and "optim_summed_adam" not in launched_off


def test_fused_smart_decay_adam_and_the_summed_row_on_the_gpu():
    """The two fused kernels the test above leaves out: SmartDecayAdam's (with the rows' last
    steps read, then written by the steps kernel) against update_lines on a sparse schedule, and
    ``optim_summed_row`` (a failed check's gradient) against the materialized sums."""
    from one_embedding.kernels import device_ops, fused_update
    from one_embedding.optim import SmartDecayAdam
    from one_embedding.parallel.unique import unique_ids

    cp = _cp()
    launch = device_ops.cupy_launcher()
    fused_opt, two_opt = (SmartDecayAdam(lr=0.01, weight_decay=0.01) for _ in range(2))
    rng = np.random.default_rng(7)
    n_rows, dim = (80, 7) if DRY else (50_000, 64)
    start = np.zeros((n_rows, fused_opt.required_storage_dim(dim)), np.float32)
    start[:, :dim] = rng.uniform(-1, 1, (n_rows, dim))
    fused_table, two_table = cp.array(start), cp.array(start)
    for step in range(1, 6):
        ids = rng.integers(0, n_rows, 3 * n_rows).astype(np.uint64)[: rng.integers(1, 3 * n_rows)]
        keys, inverse = unique_ids(ids)
        rows = cp.asarray(keys.astype(np.int64))
        values = cp.asarray(rng.uniform(-1, 1, (ids.size, dim)).astype(np.float32))
        summed = fused_update.SummedGradients(values, cp.asarray(inverse), keys.size, launch)
        lines = cp.ascontiguousarray(fused_table[rows])
        fused_update.update_lines_summed(fused_opt, lines, summed, step)
        fused_table[rows] = lines
        lines = cp.ascontiguousarray(two_table[rows])
        sums = summed.materialize()
        device_ops.update_lines(two_opt, lines, sums, step)
        two_table[rows] = lines
        for at in (0, keys.size - 1):
            np.testing.assert_array_equal(_bits(summed.row(cp.asarray(at))), _bits(sums[at]))
    np.testing.assert_array_equal(_bits(fused_table), _bits(two_table))


def test_fused_update_of_long_keys_with_placeholders_on_the_gpu():
    """A fixed-capacity batch (unique_ids_fixed, the count on the device) whose keys have 1 to
    10^5 rows: the fused update (short keys summed inline, long keys' totals from the tree's
    level kernels) equals the CPU's tree-order sums then update_lines on the live lines, bit for
    bit; the placeholder lines past the count are left as they were; no counted host read."""
    from one_embedding import host_sync
    from one_embedding.kernels import device_ops, device_unique, fused_update
    from one_embedding.optim import Adam
    from one_embedding.parallel.unique import segment_sum

    cp = _cp()
    launch = device_ops.cupy_launcher()
    rng = np.random.default_rng(43)
    lengths = [1, 31, 32, 33, 1024, 1025, 40_000] + ([] if DRY else [100_000])
    inverse = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    rng.shuffle(inverse)
    keys = (np.arange(len(lengths), dtype=np.uint64) * np.uint64(7919) + np.uint64(3))[inverse]
    dim = 8 if DRY else 64
    values = rng.uniform(-1, 1, (keys.size, dim)).astype(np.float32)
    fused_opt, two_opt = Adam(lr=0.01), Adam(lr=0.01)
    n, u = keys.size, len(lengths)
    start = rng.uniform(-1, 1, (n, fused_opt.required_storage_dim(dim))).astype(np.float32)
    start[:, dim:] = np.abs(start[:, dim:]) + 0.01
    lines = cp.array(start)
    with host_sync.counting() as reads:
        fixed = device_unique.unique_ids_fixed(cp.asarray(keys), launch)
        summed = fused_update.SummedGradients(cp.asarray(values), fixed.inverse, n, launch,
                                              live=fixed.count)
        fused_update.update_lines_summed(fused_opt, lines, summed, 1)
    assert reads.total == 0, dict(reads.by_reason)
    got = cp.asnumpy(lines)
    cpu_inverse = cp.asnumpy(fixed.inverse)
    want = cp.array(start[:u])
    device_ops.update_lines(two_opt, want, cp.asarray(segment_sum(values, cpu_inverse, u)), 1)
    np.testing.assert_array_equal(got[:u].view(np.int32), _bits(want))
    np.testing.assert_array_equal(got[u:].view(np.int32), start[u:].view(np.int32))


def _row_update_cases() -> dict:
    from one_embedding.optim import SmartDecayAdam

    cases = dict(helpers.row_optimizer_cases())
    cases["smart_decay_adam"] = lambda: SmartDecayAdam(lr=0.01, weight_decay=0.01)
    return cases


@pytest.mark.parametrize("dim", [4, 8, 12, 128, 6])
@pytest.mark.parametrize("name", list(_row_update_cases()))
def test_row_updates_by_vector_equal_the_element_updates_on_the_gpu(name, dim, monkeypatch):
    """The row optimizer kernels' 16-byte path (``vector`` = 1, chosen by
    device_ops.row_update_vector on CuPy's device pointers where dim and the line are multiples
    of 4 floats, and 3 for the summed kernels, which then also read the backward's rows 16
    bytes at a time; dim 6 takes the element path) against the same kernels with ``vector`` forced
    to 0, bit for bit, plain (update_lines) and summed (update_lines_summed), with NaN, +-inf and
    -0.0 among the weights and gradients; SmartDecayAdam's rows last updated 0 to 3 steps back."""
    from one_embedding.kernels import device_ops, fused_update
    from one_embedding.parallel.unique import unique_ids

    cp = _cp()
    make = _row_update_cases()[name]
    rng = np.random.default_rng(len(name) + dim)
    n_keys = 300 if DRY else 50_000
    ids = rng.zipf(1.2, 4 * n_keys).astype(np.uint64) % np.uint64(n_keys)
    uniq, inverse = unique_ids(ids)
    u = uniq.size
    probe = make()
    width = -(-probe.required_storage_dim(dim) // 4) * 4
    start = rng.uniform(-1, 1, (u, width)).astype(np.float32)
    start[:, dim:] = np.abs(start[:, dim:]) + 0.01
    start[:3, :4] = [[np.nan, np.inf, -np.inf, -0.0]] * 3
    if probe.row_columns:
        col = probe.row_column_offset(dim)
        start[:, col:col + 2] = rng.integers(0, 4, (u, 1)).astype(np.int64).view(np.float32)
    inputs = []                                 # per step: the backward's rows, the sums
    for _ in range(3):
        values = rng.uniform(-1, 1, (inverse.size, dim)).astype(np.float32)
        values[:2] = -0.0
        values[2, :3] = [np.inf, np.nan, -np.inf]
        inputs.append((cp.asarray(values), cp.asarray(rng.uniform(-1, 1, (u, dim)),
                                                      dtype=cp.float32)))
    inverse_d = cp.asarray(inverse)
    launcher = device_ops.cupy_launcher()
    results = []
    for force in (None, 0):
        watch = helpers.LineCopies(monkeypatch, launcher, force=force, families=("optim",))
        opt_plain, opt_summed = make(), make()
        plain, summed = cp.array(start), cp.array(start)
        for step, (values_d, grads) in zip(range(4, 7), inputs):
            device_ops.update_lines(opt_plain, plain, grads, step)
            fused_update.update_lines_summed(
                opt_summed, summed,
                fused_update.SummedGradients(values_d, inverse_d, u, launcher), step)
        if force is None:                       # the glue's choice, on CuPy's device pointers
            chosen = {v for k, _, v in watch.seen if k != "optim_smart_decay_adam_steps"}
        monkeypatch.undo()
        results.append((plain, summed))
    # the plain kernels' vector 1; the summed ones' 3 (their gradient groups read as 16-byte
    # vectors of the backward's rows too, on CuPy's aligned allocations)
    assert chosen == ({1, 3} if dim % 4 == 0 else {0}), chosen
    for got, want in zip(results[0], results[1], strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))


#: DLRM's dense parameter shapes (bottom 512-256-128, top 1024-1024-512-256-1 on 480 inputs)
DLRM_DENSE_SHAPES = [(512, 13), (512,), (256, 512), (256,), (128, 256), (128,), (1024, 480),
                     (1024,), (1024, 1024), (1024,), (512, 1024), (512,), (256, 512), (256,),
                     (1, 256), (1,)]


@pytest.mark.parametrize("name", list(helpers.row_optimizer_cases()))
def test_dense_parameters_by_one_launch_equal_the_cpu_update_on_the_gpu(name):
    """``kernels.dense_update``: DLRM's 16 dense parameters laid end to end on the GPU and
    updated by one ``optim_dense_<rule>`` per step against numpy's update of each parameter,
    bit for bit (no float32 subnormals among the inputs; Ftrl's lr_power -0.7 within 1 ulp:
    CUDA's pow), over 3 steps; the parameter whose gradient is all zero (-0.0) keeps its bits,
    the one with a NaN in its gradient is updated."""
    from one_embedding.kernels import dense_update, device_ops
    from one_embedding.nn.module import Parameter

    cp = _cp()
    make = helpers.row_optimizer_cases()[name]
    shapes = [tuple(max(1, d // 16) for d in s) for s in DLRM_DENSE_SHAPES] if DRY \
        else DLRM_DENSE_SHAPES
    rng = np.random.default_rng(len(name))
    cpu_opt, gpu_opt = make(), make()
    host_w = [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]
    host_states = [[np.full(s, v, np.float32) + rng.uniform(0.01, 1, s).astype(np.float32)
                    for v in cpu_opt.initial_state()] for s in shapes]
    params = [Parameter(cp.asarray(w), f"p{i}") for i, w in enumerate(host_w)]
    states = [[cp.asarray(s) for s in own] for own in host_states]
    flat = dense_update.FlatDense(params, states, gpu_opt.n_states, device_ops.cupy_launcher())
    for t in range(1, 4):
        grads = [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]
        grads[3][...] = -0.0
        grads[6].reshape(-1)[5] = np.nan
        for p, g in zip(params, grads):
            p.grad[...] = cp.asarray(g)
        flat.find_nonzero()
        flat.update(gpu_opt, t)
        for w, own, g in zip(host_w, host_states, grads):
            if g.any():
                cpu_opt.update(w, own, g, t)
    got = [cp.asnumpy(p.data) for p in params] + [cp.asnumpy(s) for own in states for s in own]
    want = host_w + [s for own in host_states for s in own]
    for i, (a, b) in enumerate(zip(got, want)):
        if name == "ftrl_power":
            assert _ulps(a, b).max() <= 1, i
        else:
            np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32), err_msg=str(i))
    assert cp.asnumpy(flat.nonzero).tolist() == [0 if i == 3 else 1 for i in range(len(shapes))]
