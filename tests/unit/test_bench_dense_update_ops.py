"""benchmarks/dense_update_ops has options: --help lists the sizes and exits (it ran the whole
count before, having no argument parser), and the sizes reach the model."""
from __future__ import annotations

import sys

import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
dense_update_ops = pytest.importorskip("benchmarks.dense_update_ops")


def test_help_lists_the_sizes_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr(dense_update_ops, "per_parameter_ops",
                        lambda *a: pytest.fail("--help ran the benchmark"))
    with pytest.raises(SystemExit) as e:
        dense_update_ops.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--num-tables", "--embedding-dim", "--bottom-mlp", "--top-mlp", "--optimizers"):
        assert option in out


def test_the_sizes_reach_the_model():
    rows = dense_update_ops.main(["--num-tables", "2", "--embedding-dim", "4", "--top-mlp", "8",
                                  "1", "--optimizers", "sgd"])
    assert [r["optimizer"] for r in rows] == ["sgd"]
    # bottom 13-512-256-4 and top 8-1: five layers, a weight and a bias each
    assert rows[0]["per parameter (before)"] / rows[0]["per parameter, each"] == 10


def test_a_bottom_mlp_that_does_not_end_in_the_embedding_dim_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        dense_update_ops.parse_args(["--embedding-dim", "16", "--bottom-mlp", "64", "32"])
    assert e.value.code == 2 and "--bottom-mlp must end in" in capsys.readouterr().err
