"""The ``one-embedding`` command line, run as a user runs it (a subprocess)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers

ROOT = helpers.ROOT


def run_cli(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "one_embedding", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.parametrize(
    "model,extra",
    [
        ("dlrm", ["--engine", "slots", "--optimizer", "adagrad", "--lr", "0.05"]),
        ("dcn", ["--engine", "rocksdb", "--optimizer", "adam", "--lr", "0.002"]),
        ("deepfm", ["--engine", "slots", "--host-cache-mb", "1", "--optimizer", "adam", "--lr", "0.002"]),
    ],
)
def test_train_on_synthetic_with_cached_ssd_learns(tmp_path, model, extra):
    metrics = tmp_path / "metrics.jsonl"
    r = run_cli("train", "--model", model, "--data", "synthetic", "--steps", 200, "--batch-size", 512,
                "--store", "cached_ssd", "--cache-mb", 1, "--persistent-path", tmp_path / "table",
                "--eval-interval", 100, "--eval-batches", 10, "--metrics", metrics, "--no-progress", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(metrics)
    final = recs[-1]
    assert final["event"] == "final" and final["steps"] == 200
    assert final["loss_last_10pct"] < final["loss_first_10pct"]
    assert final["auc"] > 0.7, final
    assert any(r["event"] == "eval" for r in recs)
    tiers = [t["tier"] for t in final["store_stats"]]
    assert tiers[0] == "device.lru" and tiers[-1].startswith("ssd.")
    assert final["store_stats"][0]["evictions"] > 0, "a 1 MB cache must spill to the SSD tier"
    # the final snapshot is there and inspect reads it back
    r = run_cli("inspect", tmp_path / "table", "--rows", 2, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info[0]["snapshot"] == "final" and info[0]["row_count"] == final["rows_stored"]
    assert len(info[0]["rows"]) == 2


def test_train_reports_bad_configuration_clearly(tmp_path):
    r = run_cli("train", "--store", "cached_ssd", "--steps", 5, "--no-progress")
    assert r.returncode == 2
    assert "needs --persistent-path" in r.stderr
    r = run_cli("train", "--embedding-dim", 8, "--bottom-mlp", "16,4", "--steps", 5, "--no-progress")
    assert r.returncode == 2 and "must end in embedding_dim=8" in r.stderr


def _bad_tsv(tmp_path):
    good = "0\t1\t2\t\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t" + "\t".join(["68fd1e64"] * 26)
    bad = good.replace("68fd1e64", "zz-not-hex", 1)
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join([good] * 5 + [bad] + [good] * 4) + "\n")
    return path


def test_convert_names_the_bad_line_or_counts_skips(tmp_path):
    src = _bad_tsv(tmp_path)
    r = run_cli("convert", src, tmp_path / "out.parquet")
    assert r.returncode == 2
    assert "day_0.tsv:6:" in r.stderr and "C1" in r.stderr
    r = run_cli("convert", src, tmp_path / "out.parquet", "--on-bad-line", "skip")
    assert r.returncode == 0, r.stderr
    assert '"skipped": 1' in r.stdout or "'skipped': 1" in r.stdout


def test_binary_garbage_is_rejected_with_a_line_number(tmp_path):
    junk = tmp_path / "junk.tsv"
    junk.write_bytes(bytes(range(256)) * 8)
    r = run_cli("train", "--data", junk, "--steps", 2, "--no-progress")
    assert r.returncode == 2
    assert "junk.tsv:1:" in r.stderr


def test_train_and_convert_on_real_criteo_rows(tmp_path, criteo_dir):
    src = criteo_dir / "criteo1tb_day0_head1000.tsv"
    out = tmp_path / "day0.parquet"
    r = run_cli("convert", src, out)
    assert r.returncode == 0, r.stderr
    metrics = tmp_path / "m.jsonl"
    r = run_cli("train", "--data", out, "--steps", 5, "--batch-size", 128, "--eval-fraction", 0.2,
                "--metrics", metrics, "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    assert records(metrics)[-1]["steps"] == 5


def test_bench_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "bench"
    r = run_cli("bench", "--steps", 8, "--batch-size", 256, "--cache-mb", 1, "--out", out,
                "--stores", "device_mem", "cached_ssd:slots", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / "bench.json").read_text())
    assert [x["store"] for x in data["results"]] == ["device_mem", "cached_ssd:slots"]
    assert all(x["samples_per_s"] > 0 for x in data["results"])
    # the same training under both stores: the same model quality
    assert data["results"][0]["auc"] == data["results"][1]["auc"]
    # prefetch on (the default depth) and off per store, each with its time split
    for x in data["results"]:
        assert x["prefetch_depth"] == 1 and x["samples_per_s_prefetch_off"] > 0
        for split in (x["ms_per_step"], x["ms_per_step_prefetch_off"]):
            assert set(split) == {"wait", "embedding", "dense", "update"}
            assert all(v >= 0 for v in split.values()) and split["dense"] > 0
    markdown = (out / "bench.md").read_text()
    assert "| store | samples/s | prefetch off |" in markdown
    assert "| store | prefetch | wait | embedding | dense | update |" in markdown
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--seed", str(2**70)], "seed=1180591620717411303424 (--seed): use a value <= "),
    (["--metrics", "no/such/folder/m.jsonl"], "does not exist: create it"),
    (["--store", "cached_host_mem", "--cache-mb", "1e9"], "of RAM"),
    (["--eval-fraction", "0"], "holds out no rows"),
])
def test_bad_numbers_are_an_error_line_not_a_traceback(argv, message):
    """Each of these ended in a traceback (or a meaningless AUC) before issue 12."""
    r = run_cli("train", "--steps", 2, "--no-progress", *argv, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "one-embedding train: error: " in r.stderr and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


QUICK = ["--synthetic-rows", 20000, "--batch-size", 256, "--steps", 20, "--eval-batches", 2]


def test_train_prints_a_short_named_summary_and_json_only_where_asked(tmp_path):
    """issue 31: a terminal gets the progress bar and a few named lines; the JSON lines go to
    --metrics, and to stdout only with --json (the summary then moves to stderr)."""
    r = run_cli("train", *QUICK)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert 3 <= len(lines) <= 8 and not any(line.startswith("{") for line in lines), r.stdout
    assert "{" not in r.stderr  # the bar alone: no config or records
    text = r.stdout
    assert "AUC" in text and "logloss" in text and "held-out samples" in text
    assert "steady state (steps after the first 2)" in text and "all steps" in text
    assert "mean step loss of the first 10% of steps" in text
    assert "samples/s (all steps)" in r.stderr and "(mean of last" in r.stderr  # the bar

    metrics = tmp_path / "m.jsonl"
    r = run_cli("train", *QUICK, "--metrics", metrics, "--no-progress")
    assert r.returncode == 0 and "AUC" in r.stdout and "{" not in r.stdout + r.stderr
    assert f"metrics:    {metrics}" in r.stdout
    final = records(metrics)[-1]
    assert final["event"] == "final" and final["steady_after_steps"] == 2
    assert final["samples_per_s"] > 0 and final["samples_per_s_all"] > 0
    assert (final["optimizer"], final["lr"]) == ("adagrad", 0.05)

    r = run_cli("train", *QUICK, "--json", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    streamed = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["event"] for x in streamed][:2] == ["config", "train"]
    assert streamed[-1]["event"] == "final" and streamed[-1]["auc"] == final["auc"]
    assert "AUC" in r.stderr
