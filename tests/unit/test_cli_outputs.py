"""What the CLI writes never lands on a file of the user's it was not asked to replace: train's
--metrics (appended to) is refused when it is a --data file or holds something other than
records; plot's --out when it is an input or not a PNG; bench's --out when it is a file, and an
earlier bench's records in its folder are replaced, not appended to (found by a fault campaign:
each damaged a file or mixed two runs)."""
import hashlib
import json

import pytest

from one_embedding import cli
from one_embedding.config import TrainConfig
from one_embedding.errors import ConfigError
from one_embedding.plot import plot_runs
from one_embedding.training import train


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_metrics_that_is_a_data_file_or_not_records_is_refused_before_writing(tmp_path):
    data = tmp_path / "day_0.tsv"
    data.write_text("0\t1\t2\n")
    before = digest(data)
    with pytest.raises(ConfigError, match="is also a --data file"):
        cli._check_metrics_path(str(data), (str(data),))
    with pytest.raises(ConfigError, match="does not hold metrics records"):
        cli._check_metrics_path(str(data), ("synthetic",))
    assert digest(data) == before
    parquet = tmp_path / "x.parquet"
    parquet.write_bytes(b"PAR1\x00\x01binary")
    with pytest.raises(ConfigError, match="does not hold metrics records"):
        cli._check_metrics_path(str(parquet))
    records = tmp_path / "run.jsonl"
    records.write_text(json.dumps({"event": "config"}) + "\n")
    cli._check_metrics_path(str(records))            # an earlier run's records: appended to
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cli._check_metrics_path(str(empty))
    cli._check_metrics_path(str(tmp_path / "new.jsonl"))


def test_cli_train_with_metrics_on_its_data_leaves_the_data_intact(tmp_path, capsys):
    data = tmp_path / "in.tsv"
    data.write_text("\t".join(["1"] + ["5"] * 13 + ["0a"] * 26) + "\n")
    before = digest(data)
    assert cli.main(["train", "--data", str(data), "--metrics", str(data), "--steps", "1",
                     "--no-progress"]) == 2
    assert "is also a --data file" in capsys.readouterr().err
    assert digest(data) == before


def _metrics(tmp_path, name="m.jsonl"):
    path = tmp_path / name
    train(TrainConfig(steps=3, batch_size=64, synthetic_rows=2000, eval_batches=1),
          metrics_path=str(path), progress=False)
    return path


def test_plot_out_is_never_an_input_nor_a_file_that_is_not_a_png(tmp_path):
    metrics = _metrics(tmp_path)
    before = digest(metrics)
    with pytest.raises(ConfigError, match="is also one of the metrics files"):
        plot_runs([metrics], metrics)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not a PNG image"):
        plot_runs([metrics], notes)
    with pytest.raises(ConfigError, match="plot writes PNG; name the file .png"):
        plot_runs([metrics], tmp_path / "curves.jpg")
    assert digest(metrics) == before and notes.read_text() == "mine"
    out = tmp_path / "curves.png"
    plot_runs([metrics], out)
    plot_runs([metrics], out)                        # an earlier plot is replaced
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_out_that_is_a_file_is_refused_and_a_rerun_replaces_the_records(tmp_path):
    from one_embedding.bench import run_bench

    cfg = TrainConfig(steps=2, batch_size=64, synthetic_rows=2000, eval_batches=1,
                      prefetch_depth=0)
    afile = tmp_path / "afile.txt"
    afile.write_text("mine")
    with pytest.raises(ConfigError, match="is a file: name a folder"):
        run_bench(cfg, str(afile), stores=["device_mem"])
    assert afile.read_text() == "mine"
    out = tmp_path / "bench"
    run_bench(cfg, str(out), stores=["device_mem"])
    first = len((out / "metrics.jsonl").read_text().splitlines())
    run_bench(cfg, str(out), stores=["device_mem"])
    assert len((out / "metrics.jsonl").read_text().splitlines()) == first


def test_out_of_memory_is_an_error_line_not_a_traceback(monkeypatch, capsys):
    """`train --embedding-dim 100000000` ended in numpy's _ArrayMemoryError traceback."""
    def too_big(args):  # what numpy raises when it cannot allocate
        raise MemoryError("Unable to allocate 23.8 GiB for an array with shape (100000000, 32) "
                          "and data type float64")

    monkeypatch.setattr(cli, "cmd_plan", too_big)
    assert cli.main(["plan", "--rows", "10", "--embedding-dim", "8", "--cache-mb", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("one-embedding plan: error: out of memory (Unable to allocate"), err
    assert "Traceback" not in err
