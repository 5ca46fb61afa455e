"""``mpiexec -n P one-embedding train``: P ranks train like one rank, exchange dtypes, and a
failing or killed rank ends the whole job quickly with the error printed."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from test_ranks import mpiexec

pytestmark = pytest.mark.mpi

SMALL = ["--synthetic-rows", "60000", "--batch-size", "256", "--eval-batches", "30",
         "--no-progress"]


def train(tmp_path, world, *args, name=None, check=True, timeout=300):
    out = tmp_path / f"{name or f'p{world}'}.jsonl"
    cmd = [mpiexec(), "-n", str(world), sys.executable, "-m", "one_embedding", "train", *SMALL,
           "--metrics", str(out), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, records


def losses(records):
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def final(records):
    (rec,) = [r for r in records if r["event"] == "final"]  # rank 0 alone writes metrics
    return rec


def test_two_and_four_ranks_train_like_one(tmp_path):
    sgd = ["--optimizer", "sgd", "--lr", "0.1", "--steps", "30", "--eval-interval", "15"]
    procs = {p: train(tmp_path, p, *sgd) for p in (1, 2, 4)}
    runs = {p: records for p, (_, records) in procs.items()}
    for p, (proc, _) in procs.items():  # rank 0 alone prints the summary
        assert proc.stdout.count("  eval:       AUC") == 1, (p, proc.stdout[-2000:])
    base = losses(runs[1])
    assert len(base) == 4  # steps 1, 10, 20, 30
    for p in (2, 4):
        got = losses(runs[p])
        assert got.keys() == base.keys()
        for step in base:
            assert abs(got[step] - base[step]) <= 1e-4 * abs(base[step]), (p, step)
        assert abs(final(runs[p])["auc"] - final(runs[1])["auc"]) < 1e-3
        assert final(runs[p])["world_size"] == p
        assert final(runs[p])["eval_samples"] == final(runs[1])["eval_samples"]
        assert final(runs[p])["rows_stored"] == final(runs[1])["rows_stored"]
        assert final(runs[p])["exchange_bytes"] > 0 == final(runs[1])["exchange_bytes"]


def test_int8_exchange_sends_a_quarter_and_keeps_the_auc(tmp_path):
    common = ["--embedding-dim", "64", "--steps", "40", "--optimizer", "sgd", "--lr", "0.1"]
    fp32 = final(train(tmp_path, 2, *common, name="fp32")[1])
    int8 = final(train(tmp_path, 2, *common, "--exchange-dtype", "int8", name="int8")[1])
    env_proc = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "one_embedding", "train", *SMALL, *common,
         "--metrics", str(tmp_path / "env.jsonl")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ONEFLOW_ONE_EMBEDDING_ENABLE_QUANTIZED_COMM": "1"})
    assert env_proc.returncode == 0, env_proc.stderr[-2000:]
    env = final([json.loads(x) for x in (tmp_path / "env.jsonl").read_text().splitlines()])
    assert int8["exchange_dtype"] == env["exchange_dtype"] == "int8" and fp32["exchange_dtype"] == "fp32"
    assert int8["exchange_bytes"] <= 0.27 * fp32["exchange_bytes"]
    assert abs(int8["auc"] - fp32["auc"]) < 0.002
    assert env["auc"] == int8["auc"]


def test_an_error_on_one_rank_ends_the_job(tmp_path):
    path = tmp_path / "table"
    path.mkdir()
    (path / "1-2").write_text("not a folder")  # rank 1 cannot create its table folder
    t = time.monotonic()
    proc, _ = train(tmp_path, 2, "--store", "cached_ssd", "--persistent-path", path, "--steps", 20,
                    check=False, timeout=120)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "1-2" in proc.stderr
    assert time.monotonic() - t < 60


@pytest.mark.parametrize("env,flags,differs", [
    ([], ["--steps", "20"], "steps: rank 0 30, rank 1 20"),               # hung in a collective
    ([], ["--steps", "30", "--lr", "0.5"], "lr: rank 0 0.05, rank 1 0.5"),  # trained otherwise
    (["-env", "ONEFLOW_ONE_EMBEDDING_ENABLE_QUANTIZED_COMM", "1"], ["--steps", "30"],
     "exchange_dtype: rank 0 'fp32', rank 1 'int8'"),                   # an MPI error naming nothing
])
def test_ranks_started_with_different_settings_are_refused_naming_them(tmp_path, env, flags,
                                                                       differs):
    """`mpiexec -n 1 A : -n 1 B`, or an environment variable on one machine only (found by a
    fault campaign): refused on every rank before any row is exchanged."""
    train_args = [sys.executable, "-m", "one_embedding", "train", *SMALL, "--optimizer", "sgd"]
    cmd = [mpiexec(), "-n", "1", *train_args, "--steps", "30", ":", "-n", "1", *env,
           *train_args, *flags]
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"the ranks were started with different settings ({differs}" in proc.stderr, \
        proc.stderr[-2000:]
    assert time.monotonic() - t < 60


def test_resume_takes_the_newest_checkpoint_of_any_number_of_ranks(tmp_path):
    """1 rank to step 8, 2 ranks to 16, 1 rank again: it resumed from its own step 8 (the
    2-rank steps discarded), and a run the 2 ranks finished ran again on 1 rank (found by a
    fault campaign)."""
    path = tmp_path / "run"
    args = ["--optimizer", "sgd", "--store", "cached_ssd", "--persistent-path", path,
            "--snapshot-interval", 4]
    train(tmp_path, 1, *args, "--steps", 8, name="a")
    train(tmp_path, 2, *args, "--steps", 16, "--resume", name="b")
    _, records = train(tmp_path, 1, *args, "--steps", 20, "--resume", name="c")
    (resumed,) = [r for r in records if r["event"] == "resume"]
    assert resumed["step"] == 16, resumed
    proc, _ = train(tmp_path, 2, *args, "--steps", 20, "--resume", name="d", check=False)
    assert proc.returncode == 2 and "the run is already at step 20" in proc.stderr, \
        proc.stderr[-2000:]


def test_a_resumed_run_reports_the_exchange_bytes_of_an_uninterrupted_one(tmp_path):
    """exchange_bytes started again from 0 at a resume (found by a fault campaign)."""
    args = ["--optimizer", "sgd", "--snapshot-interval", 4]
    _, whole = train(tmp_path, 2, *args, "--persistent-path", tmp_path / "a", "--steps", 8,
                     name="whole")
    train(tmp_path, 2, *args, "--persistent-path", tmp_path / "b", "--steps", 4, name="half")
    _, resumed = train(tmp_path, 2, *args, "--persistent-path", tmp_path / "b", "--steps", 8,
                       "--resume", name="resumed")
    assert final(resumed)["exchange_bytes"] == final(whole)["exchange_bytes"] > 0


def published_steps(rank_folder) -> set[int]:
    """Steps of the interval checkpoints published in one rank's folder (complete: manifest)."""
    snapshots = rank_folder / "snapshots"
    names = os.listdir(snapshots) if snapshots.is_dir() else []
    return {int(n.split("-")[1]) for n in names
            if n.startswith("step-") and (snapshots / n / "manifest.json").is_file()}


def test_a_killed_rank_ends_the_job_and_snapshots_stay_intact(tmp_path):
    path = tmp_path / "table"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "one_embedding", "train", *SMALL,
           "--steps", "100000", "--snapshot-interval", "5", "--persistent-path", str(path),
           "--metrics", str(tmp_path / "m.jsonl")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # wait for rank 1's second interval checkpoint or a later one (--keep-snapshots prunes
        # older ones, so step-10 itself may already be gone when we look)
        while max(published_steps(path / "1-2"), default=0) < 10:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        victim = int((path / "1-2" / "LOCK").read_text())  # rank 1's pid, from its lock file
        os.kill(victim, signal.SIGKILL)
        t = time.monotonic()
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert time.monotonic() - t < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    # every published snapshot reloads, here re-sharded to one rank
    import one_embedding as oe

    emb = oe.MultiTableEmbedding("t", 16, np.float32, np.int64, [oe.make_table_options(
        oe.make_normal_initializer(0, 0.05))] * 26, oe.make_device_mem_store_options(
        str(path), None, size_factor=2))
    # the newest checkpoint both ranks had published when rank 1 died (pruning removes an old one
    # only once a newer one exists on every rank, so there is one)
    newest = max(published_steps(path / "0-2") & published_steps(path / "1-2"))
    assert newest >= 5
    emb.load_snapshot(f"step-{newest}")
    assert len(emb) > 0
    emb.close()


def test_admission_and_eviction_across_rank_counts(tmp_path):
    """Each key is counted and aged by its owner rank: with the sketch far larger than the keys
    (no collisions), one, two and four ranks admit and evict the same rows, and train alike;
    the row limit holds for the whole table (each rank keeps its share)."""
    rules = ["--optimizer", "sgd", "--lr", "0.1", "--steps", "30", "--eval-interval", "0",
             "--admit-min-count", "2", "--steps-to-live", "6", "--evict-interval", "2"]
    runs = {p: train(tmp_path, p, *rules)[1] for p in (1, 2)}
    one = final(runs[1])
    assert one["not_admitted_lookups"] > 0 and one["evicted_rows"] > 0
    for key in ("rows_stored", "admitted_rows", "not_admitted_lookups", "evicted_rows"):
        assert final(runs[2])[key] == one[key], key
    base, got = losses(runs[1]), losses(runs[2])
    for step in base:
        assert abs(got[step] - base[step]) <= 1e-4 * abs(base[step]), step
    capped = final(train(tmp_path, 2, *rules, "--max-rows", "2000", name="capped")[1])
    assert 0 < capped["rows_stored"] <= 2000 < one["rows_stored"]


def test_a_two_rank_run_is_served_from_both_rank_folders(tmp_path):
    """The served table routes each key to the rank that owns it, as training did."""
    import one_embedding as oe

    path = tmp_path / "run"
    train(tmp_path, 2, "--steps", "10", "--store", "cached_ssd", "--cache-mb", "0.5",
          "--persistent-path", path)
    folders = sorted(str(f) for f in path.iterdir() if f.is_dir())
    assert [os.path.basename(f) for f in folders] == ["0-2", "1-2"]
    with oe.make_persistent_table_reader(folders, "final", np.int64, np.float32, 32) as reader:
        keys, lines = map(np.concatenate, zip(*reader))
    with oe.serving.Predictor(path) as p:
        np.testing.assert_array_equal(p.lookup(keys), lines[:, :16])
        assert p.snapshot == "final"


SCRIPT_RAISES = """
import threading
import numpy as np, one_embedding as oe
emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                             oe.make_device_mem_store_options(None, 100))
if emb.rank == 1:
    if WHERE == "thread":
        t = threading.Thread(target=lambda: 1 / 0)
        t.start()
        t.join()
        threading.Event().wait(120)  # the main thread would go on waiting
    raise ValueError("a bad batch on rank 1")
emb(np.arange(8))  # rank 0 waits in the ID shuffle's collective for ever without the abort
print("unreachable")
"""


@pytest.mark.parametrize("where", ["main", "thread"])
def test_an_uncaught_exception_on_one_rank_ends_a_python_job(tmp_path, where):
    script = tmp_path / "job.py"
    script.write_text(f"WHERE = {where!r}\n" + SCRIPT_RAISES)
    t0 = time.monotonic()
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 60
    assert proc.returncode != 0
    assert "unreachable" not in proc.stdout
    assert ("ValueError: a bad batch" if where == "main" else "ZeroDivisionError") in proc.stderr
    assert "ending the job" in proc.stderr


SCRIPT_EARLY_BREAK = """
import time
import numpy as np, one_embedding as oe
from one_embedding.pipeline import Prefetcher

emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                             oe.make_device_mem_store_options(None, 1000))

def batches():
    for i in range(50):
        if emb.rank == 0 and i >= 1:
            time.sleep(0.3)  # rank 0's thread lags: it has not begun batch 1 when its loop ends
        yield np.arange(8) + 8 * i

with Prefetcher(batches(), emb, depth=2, ids=lambda ids: ids) as prefetcher:
    for ids, state in prefetcher:
        if emb.rank == 1:
            time.sleep(0.5)  # rank 1's thread has begun batch 1's ID shuffle and waits in it
        break
rows = emb(np.arange(8))  # a collective of the main communicator on both ranks
print(f"rank {emb.rank}: prepared {prefetcher._prepared}, rows {rows.shape}", flush=True)
"""


def test_leaving_a_prefetched_loop_early_on_two_ranks_does_not_hang(tmp_path):
    """A loop left early stops both ranks' prefetch threads after the same batch: before, rank 1's
    thread waited for ever in an ID shuffle rank 0's thread never began (the 2-rank training CLI
    hung this way at its last step, about one run in ten)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT_EARLY_BREAK)
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # consumed 1 + depth 2 + 1: the most any rank's thread can have begun, on both ranks
    for rank in (0, 1):
        assert f"rank {rank}: prepared 4, rows (8, 4)" in proc.stdout, proc.stdout


def _start(tmp_path, path, *args):
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "one_embedding", "train", *SMALL,
           "--snapshot-interval", "5", "--persistent-path", str(path), "--metrics",
           str(tmp_path / f"{path.name}.jsonl"), *map(str, args)]
    return cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_a_checkpoint(proc, path):
    deadline = time.monotonic() + 120
    while not all(published_steps(path / f) for f in ("0-2", "1-2")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def test_ctrl_c_ends_every_rank_and_names_the_checkpoint_and_resume_command(tmp_path):
    """issue 29: Ctrl-C of mpiexec (it passes SIGINT to every rank) -> exit 130, one message
    with the last checkpoint and the mpiexec command that resumes, which then finishes; SIGINT
    to one rank alone (the other goes on into a collective) still ends the job, with the
    message."""
    import re
    import shlex

    path = tmp_path / "run"
    cmd, proc = _start(tmp_path, path, "--steps", 100)
    try:
        _wait_for_a_checkpoint(proc, path)
        proc.send_signal(signal.SIGINT)
        t = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    found = re.findall(r"the last checkpoint saved is '(step-\d+)' \(step \d+\) under '.*'\. "
                       r"Continue from it with:\n  (.*)\n", err)
    assert len(found) == 1, err  # rank 0 alone reports
    name, command = found[0]
    assert name == f"step-{max(published_steps(path / '0-2') & published_steps(path / '1-2'))}"
    argv = shlex.split(command)
    assert argv[:3] == ["mpiexec", "-n", "2"] and argv[3:] == cmd[3:] + ["--resume"]
    resumed = subprocess.run([mpiexec(), *argv[1:]], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["checkpoint"] for r in records if r["event"] == "resume"] == [name]
    assert final(records)["steps"] == 100
    # SIGINT to rank 1 only: rank 0 is left waiting in the next collective; rank 1 reports
    # and MPI_Abort ends both
    other = tmp_path / "other"
    _, proc = _start(tmp_path, other, "--steps", 100_000)
    try:
        _wait_for_a_checkpoint(proc, other)
        os.kill(int((other / "1-2" / "LOCK").read_text()), signal.SIGINT)
        t = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "the last checkpoint saved is 'step-" in err and "--resume" in err, err
