"""A run of one part of bench_scale (--part a|b) or bench_lifecycle (--part real|zipf) replaces
that part's figures only: the other part's stay as the result file held them (before, the file was
rewritten with the run's part alone), and ``measured_by`` names the run behind each part."""
from __future__ import annotations

import json
import sys

import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
common = pytest.importorskip("benchmarks.common")
bench_scale = pytest.importorskip("benchmarks.bench_scale")
bench_lifecycle = pytest.importorskip("benchmarks.bench_lifecycle")

OLD_MACHINE = {"cpu": "earlier", "date_utc": "2026-11-26 01:36"}


@pytest.fixture
def results(monkeypatch, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    monkeypatch.setattr(common, "RESULTS", str(folder))
    return folder


def test_bench_scale_part_b_keeps_part_a(results, tmp_path, monkeypatch):
    old_a = {"rows": [{"engine": "slots", "figure": "RAM/key"}], "codes": {"new": "."}}
    (results / "bench_scale.json").write_text(json.dumps(
        {"machine": OLD_MACHINE, "config": {"part": "both"}, "a": old_a, "b": {"runs": "old"}}))
    monkeypatch.setattr(bench_scale, "part_b", lambda args, root: {"runs": "new"})
    monkeypatch.setattr(bench_scale, "b_tables", lambda b: "")
    monkeypatch.setattr(bench_scale, "plot", lambda a, path: pytest.fail("(a) did not run"))
    bench_scale.main(["--part", "b", "--dir", str(tmp_path / "work")])
    data = json.loads((results / "bench_scale.json").read_text())
    assert data["a"] == old_a and data["b"] == {"runs": "new"}
    by = data["measured_by"]
    assert by["a"] == {"machine": OLD_MACHINE, "config": {"part": "both"}}
    assert by["b"]["config"]["part"] == "b" and by["b"]["machine"] == data["machine"]


def test_bench_scale_part_a_with_no_earlier_file_writes_its_part(results, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_scale, "part_a", lambda args, root: {
        "rows": [], "codes": {"new": "."}, "baseline_ref": "none", "baseline_note": "",
        "mid_keys": 1})
    plotted = []
    monkeypatch.setattr(bench_scale, "plot", lambda a, path: plotted.append(path))
    bench_scale.main(["--part", "a", "--dir", str(tmp_path / "work"), "--baseline-ref", "none"])
    data = json.loads((results / "bench_scale.json").read_text())
    assert "a" in data and "b" not in data and list(data["measured_by"]) == ["a"]
    assert plotted


def _record(part, rules, auc):
    return {"part": part, "rules": rules, "rows_stored": 10, "rows_vs_baseline": 1.0,
            "disk_vs_baseline": 1.0, "not_admitted_lookups": 0, "evicted_rows": 0, "auc": auc,
            "auc_change": 0.0}


def test_bench_lifecycle_part_zipf_keeps_the_real_rows(results, monkeypatch):
    old = [_record("real", "min-count 1 (baseline)", 0.7), _record("real", "min-count 2", 0.69),
           _record("zipf", "min-count 1 (baseline)", 0.5)]
    (results / "lifecycle.json").write_text(json.dumps(
        {"machine": OLD_MACHINE, "rows": 4_000_000, "results": old}))
    new = [_record("zipf", "min-count 1 (baseline)", 0.6), _record("zipf", "min-count 2", 0.61)]
    monkeypatch.setattr(bench_lifecycle, "run_part", lambda part, args: new)
    plotted = []
    monkeypatch.setattr(bench_lifecycle, "plot", lambda res, out: plotted.append(res))
    bench_lifecycle.main(["--part", "zipf", "--rows", "40000"])
    data = json.loads((results / "lifecycle.json").read_text())
    assert data["results"] == old[:2] + new and data["rows"] == 40000
    assert plotted == [old[:2] + new]  # the plot keeps the real part's panel
    assert data["measured_by"]["real"]["machine"] == OLD_MACHINE
    assert data["measured_by"]["zipf"]["config"]["parts"] == ["zipf"]


def test_bench_lifecycle_merge_keeps_the_zipf_rows_figure_of_the_run_that_measured_it():
    previous = {"rows": 4_000_000, "results": [_record("zipf", "min-count 1 (baseline)", 0.5)],
                "machine": OLD_MACHINE}
    real = [_record("real", "min-count 1 (baseline)", 0.7)]
    payload = bench_lifecycle.merge_parts(previous, ["real"], real, {"cpu": "now"}, {}, 1000)
    assert payload["rows"] == 4_000_000
    assert [r["part"] for r in payload["results"]] == ["real", "zipf"]
    assert bench_lifecycle.merge_parts({}, ["real"], real, {}, {}, 1000)["results"] == real
