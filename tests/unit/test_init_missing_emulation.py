"""``device_init.init_missing`` (issue 30 item 2): the initial lines of a lookup's missing rows in
one masked launch, without the per-table count read back before it. It must write exactly what
the per-(table, column) ``fill_initial_values`` launches wrote, and leave every other row alone.
Runs on the emulator (and under its stress seeds)."""
from __future__ import annotations

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.errors import InputError
from one_embedding.kernels import device_init

pytestmark = pytest.mark.stress_seeds

# three tables of two columns (16 + 1 elements, as DeepFM's row), then two states of 17
COLUMNS = [(0, 16), (16, 1)]
LINE = 17 * 3
TABLES = [
    [oe.make_uniform_initializer(-0.05, 0.05), oe.make_constant_initializer(0.25)],
    [oe.make_normal_initializer(0.0, 0.02), oe.make_uniform_initializer(0.0, 1.0)],
    [oe.make_trunc_normal_initializer(0.0, 0.5, -0.3, 0.4), oe.make_normal_initializer(1.0, 2.0)],
]


def _per_table(launch, lines, missing, table_ids, keys, seed):
    """The launches the masked kernel replaces: states zeroed, then each (table, column)."""
    for t, inits in enumerate(TABLES):
        rows = np.flatnonzero(missing & (table_ids == t)).astype(np.int64)
        lines[rows, 17:] = 0.0
        for (offset, dim), init in zip(COLUMNS, inits):
            device_init.fill_initial_values(lines, rows, keys[rows], init, seed, offset, dim, offset,
                                           launch=launch)


@pytest.mark.parametrize("n", [1, 37, 700])
def test_init_missing_writes_the_per_table_launches_values_and_nothing_else(launch, n):
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 2**63, size=n, dtype=np.int64).astype(np.uint64)
    table_ids = rng.integers(0, len(TABLES), size=n).astype(np.int32)
    missing = rng.random(n) < 0.4
    missing[0] = True
    lines = rng.standard_normal((n, LINE)).astype(np.float32)
    want = lines.copy()
    _per_table(launch, want, missing, table_ids, keys, seed=11)
    spec = device_init.init_spec(COLUMNS, TABLES, launch)
    device_init.init_missing(lines, missing, table_ids, keys, spec, 11, launch)
    assert lines.tobytes() == want.tobytes()
    before = rng.standard_normal((n, LINE)).astype(np.float32)  # rows not missing: untouched
    kept = before.copy()
    device_init.init_missing(before, np.zeros(n, bool), table_ids, keys, spec, 11, launch)
    assert before.tobytes() == kept.tobytes()


def test_init_missing_refuses_mismatched_arrays(launch):
    spec = device_init.init_spec(COLUMNS, TABLES, launch)
    lines = np.zeros((4, LINE), np.float32)
    with pytest.raises(InputError, match="must all have the 4 rows of lines"):
        device_init.init_missing(lines, np.ones(3, bool), np.zeros(4, np.int32),
                                np.arange(4, dtype=np.uint64), spec, 0, launch)
    with pytest.raises(InputError, match="cover 17 columns; lines have 8"):
        device_init.init_missing(np.zeros((4, 8), np.float32), np.ones(4, bool),
                                np.zeros(4, np.int32), np.arange(4, dtype=np.uint64), spec, 0, launch)
