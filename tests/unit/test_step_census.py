"""``scripts/step_census.py`` on the dry run (in a process of its own: it replaces ``cupy`` in
``sys.modules``): a steady-state DLRM step's device operations, by thread, stay within a budget
(a per-parameter or per-table loop creeping back into the step would pass it), and the dense
step runs inside the CUDA graph."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import helpers

#: device operations per steady-state step outside the CUDA graph, measured 118 (main thread:
#: the backward's sums, the update, the patch, the graph's inputs) and 40 (prefetch thread: the
#: data, dedup and find) on 2026-11-28; the budgets leave room for a few more, not for a loop
MAIN_BUDGET, PREFETCH_BUDGET = 160, 60


@pytest.mark.slow
def test_a_steady_step_issues_its_device_work_within_the_budget():
    script = helpers.ROOT / "scripts" / "step_census.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "4", "8", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    per_step = json.loads(done.stdout.strip().splitlines()[-1])
    print(per_step)
    assert 0 < per_step["main"]["eager"] <= MAIN_BUDGET, per_step
    assert 0 < per_step["prefetch"]["eager"] <= PREFETCH_BUDGET, per_step
    assert per_step["main"]["graph"] > 0, per_step          # the dense step, captured
