"""Host reads of the device path's lookup + update (issue 30 item 2), counted by ``host_sync`` on
the emulated launcher (numpy standing in for CuPy, the CUDA kernels emulated): a device_mem
embedding's steady-state step makes only the reads listed here, each by its reason."""
from __future__ import annotations

import numpy as np
import one_embedding as oe
from one_embedding import host_sync

E, TABLES, BATCH = 8, 3, 40

# the bottom layer's reads in one steady step: none (the unique count, the store's missing
# rows, the new rows' initial values, their count and the new keys' slots stay on the device:
# one rank over device_mem dedups into fixed-capacity arrays, device_unique.unique_ids_fixed)
BOTTOM_READS: set = set()
# the checks, read at once outside the trainer (which defers them to its metrics read)
CHECKS = {"embedding: gradient check", "update: finite rows check"}


def _embedding(tmp_path, launch):
    tables = [oe.make_table_options(oe.make_uniform_initializer(-0.1, 0.1)),
              oe.make_table_options(oe.make_normal_initializer(0.0, 0.05)),
              oe.make_table_options(oe.make_trunc_normal_initializer(0.0, 0.2, -0.3, 0.3))]
    store = oe.make_device_mem_store_options(str(tmp_path), capacity=1000)
    return oe.MultiTableEmbedding("t", E, np.float32, np.int64, tables, store, seed=5,
                                  device=launch)


def _step(emb, opt, ids, grad):
    out = emb(ids)
    emb.backward(emb.xp.asarray(grad))
    opt.step()
    opt.zero_grad()
    return out


def test_device_mem_steady_step_reads_by_reason(tmp_path, launch):
    emb = _embedding(tmp_path, launch)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    rng = np.random.default_rng(3)
    grad = rng.standard_normal((BATCH, TABLES, E)).astype(np.float32)
    batches = [(rng.zipf(1.2, size=(BATCH, TABLES)) % (30 + 20 * k)).astype(np.int64) * 7 + 1
               for k in range(4)]
    for ids in batches[:2]:                                # warm: keys created
        _step(emb, opt, ids, grad)
    per_step = []
    for ids in batches[2:]:
        with host_sync.counting() as reads:
            _step(emb, opt, ids, grad)
        per_step.append(reads.by_reason)
    emb.close()
    for reads in per_step:
        # the checks alone (read at once outside the trainer); no unique count, missing count,
        # per-table count, new row or new key count, range check, nonzero or unique read
        assert dict(reads) == {reason: 1 for reason in BOTTOM_READS | CHECKS}, dict(reads)


def test_deferred_checks_leave_only_the_bottom_reads(tmp_path, launch):
    """Inside ``host_sync.deferring`` (the trainer's device path) the checks read nothing."""
    emb = _embedding(tmp_path, launch)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.1), embeddings=[emb])
    rng = np.random.default_rng(4)
    grad = rng.standard_normal((BATCH, TABLES, E)).astype(np.float32)
    ids = (rng.zipf(1.2, size=(BATCH, TABLES)) % 40).astype(np.int64) * 3 + 1
    checks = host_sync.DeferredChecks()
    _step(emb, opt, ids, grad)
    with host_sync.counting() as reads, host_sync.deferring(checks):
        _step(emb, opt, ids, grad)
    assert dict(reads.by_reason) == {reason: 1 for reason in BOTTOM_READS}, dict(reads.by_reason)
    assert len(checks) == len(CHECKS)
    checks.read(emb.xp)  # all passed: no error
    emb.close()
