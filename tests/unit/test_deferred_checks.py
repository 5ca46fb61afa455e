"""Checks kept on the device until the metrics read (issue 30 item 2): ``host_sync.check``,
``DeferredChecks`` and the optimizer's masked dense update. The machinery is backend-agnostic, so
numpy runs it here exactly as CuPy does on a GPU (the trainer turns it on for its device path)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import one_embedding as oe
from one_embedding import host_sync
from one_embedding.config import TrainConfig
from one_embedding.errors import InputError
from one_embedding.optimizer import masked_update
from one_embedding.training import Trainer


def _bad_labels_message(at, value):
    return f"labels[{int(at)}] is {value}"


def test_check_reads_at_once_outside_deferring_and_raises_with_details():
    labels = np.array([0.0, 1.0, 2.5], np.float32)
    bad = (labels < 0) | (labels > 1)
    with host_sync.counting() as reads:
        with pytest.raises(InputError, match=r"labels\[2\] is 2.5"):
            host_sync.check(bad.any(), _bad_labels_message, "t: labels",
                            details=lambda: (np.argmax(bad), labels[np.argmax(bad)]))
    assert reads.by_reason["t: labels"] == 1 and reads.by_reason["t: labels (details)"] == 2
    with host_sync.counting() as reads:  # a passing check: one read, no details computed
        host_sync.check(np.bool_(False), _bad_labels_message, "t: labels",
                        details=lambda: pytest.fail("details of a passing check"))
    assert dict(reads.by_reason) == {"t: labels": 1}


def test_deferred_checks_read_once_with_the_values_and_name_the_step():
    checks = host_sync.DeferredChecks()
    labels = np.array([0.0, 1.0, -3.0], np.float32)
    with host_sync.counting() as reads, host_sync.deferring(checks):
        for step, bad in ((1, np.bool_(False)), (2, np.bool_(True)), (3, np.bool_(True))):
            checks.step = step
            host_sync.check(bad, _bad_labels_message, "t: labels",
                            details=lambda: (np.int64(2), labels[2]))
        assert host_sync.deferred_checks() is checks and len(checks) == 3
    assert reads.total == 0  # nothing read while the steps ran
    with host_sync.counting() as reads:
        with pytest.raises(InputError, match=r"^step 2: labels\[2\] is -3.0$"):  # the oldest
            checks.read(np, [np.float32(0.5), np.float32(0.25)], "losses")
    # one read for the values and flags, one for the failed check's details
    assert dict(reads.by_reason) == {"losses": 1, "t: labels (details)": 2}
    assert len(checks) == 0 and host_sync.deferred_checks() is None
    values = checks.read(np, [np.float32(0.5)], "losses")  # nothing pending: the values alone
    assert values.tolist() == [0.5]


def test_deferring_does_not_nest():
    with host_sync.deferring(host_sync.DeferredChecks()):
        with pytest.raises(RuntimeError, match="already active"):
            with host_sync.deferring(host_sync.DeferredChecks()):
                pass


@pytest.mark.parametrize("make", [lambda: oe.optim.Adam(lr=0.01), lambda: oe.optim.Adagrad(lr=0.05),
                                  lambda: oe.optim.SGD(lr=0.1, momentum=0.9)])
def test_masked_update_equals_the_host_decision_bit_for_bit(make):
    """A zero gradient leaves weight and state alone, a non-zero one updates them: the same
    bits as deciding on the host (the CPU path)."""
    rng = np.random.default_rng(0)
    opt = make()
    bound = opt.for_group(opt.param_groups[0], 1.0) if opt.param_groups else opt
    for g in (np.zeros((4, 3), np.float32), rng.standard_normal((4, 3)).astype(np.float32)):
        w_host = rng.standard_normal((4, 3)).astype(np.float32)
        s_host = [s + 0.25 for s in opt.new_states(w_host)]
        w_dev, s_dev = w_host.copy(), [s.copy() for s in s_host]
        if g.any():
            bound.update(w_host, s_host, g, 3)
        masked_update(bound, w_dev, s_dev, g, 3)
        assert w_dev.tobytes() == w_host.tobytes()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(s_dev, s_host))


def _trainer(tmp_path, **kw):
    cfg = TrainConfig(steps=12, batch_size=128, synthetic_rows=20_000, embedding_dim=8,
                      eval_batches=1, log_interval=10, persistent_path=str(tmp_path), **kw)
    return Trainer(cfg, metrics_path=os.devnull, progress=False)


def test_the_device_paths_deferred_checks_train_bit_identically(tmp_path):
    """The trainer with its checks deferred (as on a GPU) trains the same bits as with checks
    read at once, and reads nothing per step for them."""
    plain = _trainer(tmp_path / "a", optimizer="adam")
    with host_sync.counting() as plain_reads:
        plain_final = plain.run()
    deferred = _trainer(tmp_path / "b", optimizer="adam")
    deferred.checks = host_sync.DeferredChecks()
    with host_sync.counting() as reads:
        deferred_final = deferred.run()
    assert deferred.progress.losses == plain.progress.losses
    assert deferred_final["auc"] == plain_final["auc"]
    # the 12 steps' checks are gone; the final evaluation still checks its inputs at once
    input_checks = "model: input check"
    assert reads.by_reason[input_checks] == plain_reads.by_reason[input_checks] - 12
    assert plain_reads.by_reason["loss: labels outside [0, 1]"] == 12
    assert "loss: labels outside [0, 1]" not in reads.by_reason
    assert plain_reads.by_reason["optimizer: dense grad nonzero"] >= 12
    assert "optimizer: dense grad nonzero" not in reads.by_reason


def test_a_nan_input_raises_at_the_next_metrics_read_naming_its_step(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.checks = host_sync.DeferredChecks()
    step_fn = trainer.train_step
    seen = []

    def poisoned(batch, state=None):
        seen.append(len(seen) + 1)
        if len(seen) == 3:
            batch.dense[5, 7] = np.nan
        return step_fn(batch, state)

    trainer.train_step = poisoned
    with pytest.raises(InputError, match=r"step 3: dense\[5, 7\] is nan: the dense input must be finite"):
        trainer.run()
    assert seen[-1] == 10  # raised at step 10's metrics read (--log-interval 10), not before


def test_a_deferred_checks_64_bit_detail_is_read_exactly():
    checks = host_sync.DeferredChecks()
    key = np.uint64(2**63 + 1)  # not a float64
    with host_sync.deferring(checks):
        host_sync.check(np.bool_(True), lambda k: f"key {k}", "t: key", details=lambda: (key,))
    with pytest.raises(InputError, match=rf"^step 0: key {2**63 + 1}$"):
        checks.read(np)


@pytest.mark.parametrize("case", ["admission", "all_padding"])
def test_a_step_with_no_row_passes_its_deferred_checks(case):
    """Deferred (the device trainer's mode), a check takes its details when it is registered:
    an update of no key (admission let none in: every device run with --admit-min-count 2
    died at step 1) or a backward of padding only took an argmax of nothing (found by a fault
    campaign). Such steps have nothing to check."""
    lifecycle = oe.make_lifecycle_options(admit_min_count=2) if case == "admission" else None
    store = oe.make_device_mem_store_options(None, 100, lifecycle=lifecycle)
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None, store,
                                 padding_idx=0 if case == "all_padding" else None)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    ids = np.zeros((3, 2), np.int64) if case == "all_padding" else np.array([[1, 2], [3, 4]])
    checks = host_sync.DeferredChecks()
    with host_sync.deferring(checks):
        out = emb(ids)
        emb.backward(np.ones(out.shape, np.float32))
        opt.step()
        checks.read(np)
    assert len(emb) == 0
    emb.close()


def test_a_non_finite_gradient_names_its_row_of_grad_out_padding_included():
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                                 oe.make_device_mem_store_options(None, 100), padding_idx=0)
    ids = np.array([[0, 5], [0, 6], [7, 0]])    # rows 0, 2, 5 padding
    out = emb(ids)
    grad = np.ones(out.shape, np.float32)
    grad[2, 0, 1] = np.nan                      # row 4 of the (6, E) grad_out
    with pytest.raises(InputError, match=r"non-finite value \(nan\) at row 4:"):
        emb.backward(grad)
