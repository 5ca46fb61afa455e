"""benchmarks/bench_ranks: the 1-rank baseline always runs, first (a run list without it ended in
a bare StopIteration after every measurement), and an untimed warm-up run comes before the timed
ones (the first process of an invocation measured a sixth of what the same run did later)."""
from __future__ import annotations

import sys

import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
bench_ranks = pytest.importorskip("benchmarks.bench_ranks")


def test_the_baseline_runs_first_even_when_ranks_leave_it_out():
    assert bench_ranks.plan([2], ["int8"]) == [(1, "fp32"), (2, "int8")]
    assert bench_ranks.plan([4, 1, 2, 4], ["fp32", "int8"]) == [
        (1, "fp32"), (4, "fp32"), (4, "int8"), (2, "fp32"), (2, "int8")]


def test_rank_counts_below_one_are_refused():
    with pytest.raises(SystemExit, match="at least 1"):
        bench_ranks.plan([0, 2], ["fp32"])


def test_an_untimed_warm_up_runs_before_the_baseline_and_its_figures_are_left_out(
        monkeypatch, tmp_path):
    calls = []

    def fake_run(world, dtype, args, scratch, steps=None, tag=""):
        calls.append((world, dtype, steps, tag))
        sps = 1.0 if tag else 100.0 * world  # the warm-up's figure must not be the baseline
        return {"ranks": world, "exchange": dtype, "samples_per_s": sps,
                "step_ms": 1e3 * args.batch_size / sps, "exchange_bytes_per_step": 0.0,
                "auc": 0.5, "phase_ms": {}}

    saved = {}
    monkeypatch.setattr(bench_ranks, "run", fake_run)
    monkeypatch.setattr(bench_ranks, "unique_per_block", lambda args, worlds: dict.fromkeys(worlds, 10.0))
    monkeypatch.setattr(bench_ranks, "dense_params", lambda dim: 1000)
    monkeypatch.setattr(bench_ranks, "row_bytes", lambda dtype, dim: 4 * dim)
    monkeypatch.setattr(bench_ranks, "save_result", lambda name, payload: saved.update(payload) or "x")
    bench_ranks.main(["--ranks", "2", "--dtypes", "int8", "--steps", "4", "--project", "8",
                      "--warmup-steps", "3"])
    assert calls[0] == (1, "fp32", 3, "warmup_")
    assert [c[:2] for c in calls[1:]] == [(1, "fp32"), (2, "int8")]
    assert all(c[3] == "" for c in calls[1:])
    runs = saved["runs"]
    assert [(r["ranks"], r["vs_1_rank"]) for r in runs] == [(1, 1.0), (2, 2.0)]
    assert saved["config"]["ranks"] == [1, 2]
