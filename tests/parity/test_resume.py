"""Checkpoints and --resume: a resumed run continues bit for bit; a path holding a run is never
overwritten silently; old interval checkpoints are removed only after newer ones exist."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.checkpoint import load_checkpoint, save_checkpoint
from one_embedding.models import DCN
from one_embedding.nn.loss import BCEWithLogits
from one_embedding.optim.lr_schedules import LinearWarmup

SMALL = ["--synthetic-rows", "40000", "--batch-size", "256", "--eval-interval", "20",
         "--eval-batches", "10", "--snapshot-interval", "10", "--no-progress"]


def cli(path, metrics, *args, check=True):
    cmd = [sys.executable, "-m", "one_embedding", "train", *SMALL, "--persistent-path", str(path),
           "--metrics", str(metrics), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def results(metrics):
    """{(event, step): the values that must not change} of a metrics file."""
    out = {}
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r["event"] == "train":
            out[("train", r["step"])] = r["loss"]
        elif r["event"] == "eval":
            out[("eval", r["step"])] = (r["auc"], r["logloss"])
        elif r["event"] == "final":
            out[("final", r["steps"])] = (r["auc"], r["logloss"], r["loss_first_10pct"],
                                          r["loss_last_10pct"], r["rows_stored"], r["samples"])
    return out


def lookups(metrics) -> int:
    """The top tier's lookups (hits + misses) the final record counts: the run's, not only its
    resumed part's (a fault campaign found the counts started again from 0 on resume)."""
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if r["event"] == "final":
            top = r["store_stats"][0]
            out = top["hits"] + top["misses"]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One 60-step run (DCN with dropout and Adam: dropout counters and Adam's step count must
    survive the checkpoint too), for every test to compare with."""
    tmp = tmp_path_factory.mktemp("full")
    args = ["--model", "dcn", "--dropout", "0.2", "--optimizer", "adam", "--lr", "0.01",
            "--warmup-steps", "15"]
    cli(tmp / "run", tmp / "m.jsonl", "--steps", 60, *args)
    return results(tmp / "m.jsonl"), args, lookups(tmp / "m.jsonl")


def test_resume_after_a_finished_run_continues_bit_for_bit(uninterrupted, tmp_path):
    full, args, full_lookups = uninterrupted
    cli(tmp_path / "run", tmp_path / "a.jsonl", "--steps", 30, *args)
    # the per-step losses are kept binary: as a JSON list in state.json every checkpoint grew
    # with the run (18 MB and 5 s a save at a million steps, found by a soak campaign)
    trainer = tmp_path / "run" / "0-1" / "snapshots" / "final" / "trainer"
    assert "losses" not in json.loads((trainer / "state.json").read_text())["state"]["progress"]
    with np.load(trainer / "arrays.npz") as arrays:
        assert arrays["state/losses"].shape == (30,)
    cli(tmp_path / "run", tmp_path / "b.jsonl", "--steps", 60, "--resume", *args)
    resumed = results(tmp_path / "b.jsonl")
    assert min(step for _, step in resumed) == 40  # nothing before the checkpoint was redone
    assert resumed == {k: v for k, v in full.items() if k[1] > 30}
    assert lookups(tmp_path / "b.jsonl") == full_lookups
    snaps = sorted(os.listdir(tmp_path / "run" / "0-1" / "snapshots"))
    assert snaps == ["final", "step-40", "step-50", "step-60"]  # --keep-snapshots 3 + final


def test_resume_after_sigkill_continues_bit_for_bit(uninterrupted, tmp_path):
    full, args, full_lookups = uninterrupted
    path = tmp_path / "run"
    cmd = [sys.executable, "-m", "one_embedding", "train", *SMALL, "--persistent-path", str(path),
           "--metrics", str(tmp_path / "a.jsonl"), "--steps", "60", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    # step-20 or a later checkpoint (--keep-snapshots may have pruned step-20 already)
    while not any(n.startswith("step-") and int(n[5:]) >= 20
                  and (path / "0-1" / "snapshots" / n / "manifest.json").is_file()
                  for n in (os.listdir(path / "0-1" / "snapshots")
                            if (path / "0-1" / "snapshots").is_dir() else [])):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cli(path, tmp_path / "b.jsonl", "--steps", 60, "--resume", *args)
    first = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[1])
    assert first["event"] == "resume" and first["step"] >= 20
    resumed = results(tmp_path / "b.jsonl")
    assert resumed == {k: v for k, v in full.items() if k[1] > first["step"]}
    # a kill mid-run: the checkpoint's counts hold what the prefetch had looked up ahead of it
    # (--prefetch-depth 1: one batch of 256 x 26 ids at most), looked up again after the resume
    extra = lookups(tmp_path / "b.jsonl") - full_lookups
    assert 0 <= extra <= 256 * 26, extra


def test_a_path_holding_a_run_is_never_overwritten_silently(tmp_path):
    cli(tmp_path / "run", tmp_path / "a.jsonl", "--steps", 10)
    before = sorted(os.listdir(tmp_path / "run" / "0-1" / "snapshots"))
    stamp = os.path.getmtime(tmp_path / "run" / "0-1" / "snapshots" / "final" / "manifest.json")
    proc = cli(tmp_path / "run", tmp_path / "b.jsonl", "--steps", 10, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--resume" in proc.stderr and "--overwrite" in proc.stderr
    assert not (tmp_path / "b.jsonl").exists()  # stopped before training started
    assert sorted(os.listdir(tmp_path / "run" / "0-1" / "snapshots")) == before
    assert os.path.getmtime(tmp_path / "run" / "0-1" / "snapshots" / "final" / "manifest.json") == stamp
    cli(tmp_path / "run", tmp_path / "c.jsonl", "--steps", 5, "--overwrite")  # explicit: allowed
    assert sorted(os.listdir(tmp_path / "run" / "0-1" / "snapshots")) == ["final"]


def test_resume_refuses_a_config_that_changes_results(tmp_path):
    # a store with a cache, whose size a resume may change (device_mem has none: --cache-mb
    # there is refused, where it was ignored)
    store = ["--store", "cached_host_mem"]
    cli(tmp_path / "run", tmp_path / "a.jsonl", "--steps", 10, *store)
    proc = cli(tmp_path / "run", tmp_path / "b.jsonl", "--steps", 20, "--resume", "--lr", "0.1",
               "--embedding-dim", "8", "--bottom-mlp", "64,32,8", *store, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "lr: 0.05 -> 0.1" in proc.stderr and "embedding_dim: 16 -> 8" in proc.stderr
    # what changes only speed or length is allowed
    cli(tmp_path / "run", tmp_path / "c.jsonl", "--steps", 20, "--resume", "--cache-mb", "8",
        "--prefetch-depth", "2", "--eval-interval", "0", *store)


def test_resume_with_nothing_to_resume_and_past_the_end(tmp_path):
    proc = cli(tmp_path / "empty", tmp_path / "a.jsonl", "--steps", 10, "--resume", check=False)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr
    cli(tmp_path / "run", tmp_path / "b.jsonl", "--steps", 10)
    proc = cli(tmp_path / "run", tmp_path / "c.jsonl", "--steps", 10, "--resume", check=False)
    assert proc.returncode == 2 and "already at step 10" in proc.stderr


def _dcn(path):
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64,
                                 [oe.make_table_options(oe.make_normal_initializer(0, 0.1))] * 3,
                                 oe.make_device_mem_store_options(str(path), 1000, size_factor=3))
    model = DCN(num_tables=3, embedding_dim=4, dense_features=2, cross_layers=2, dnn=(8,),
                dropout=0.3, embedding=emb, seed=1)
    opt = oe.Optimizer(oe.optim.Adam(lr=0.05), embeddings=[emb], parameters=list(model.parameters()))
    return emb, model, opt, LinearWarmup(opt, 0.05, warmup_steps=5)


def test_python_checkpoint_continues_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((16, 2)).astype(np.float32), rng.integers(0, 50, (16, 3)),
             (rng.random(16) < 0.5).astype(np.float32)) for _ in range(8)]
    loss_fn = BCEWithLogits()

    def steps(model, opt, sched, batches):
        out = []
        for dense, ids, labels in batches:
            out.append(float(loss_fn(model(dense, ids), labels)))
            model.backward(loss_fn.backward())
            opt.step()
            opt.zero_grad()
            sched.step()
        return out

    emb, model, opt, sched = _dcn(tmp_path / "a")
    want = steps(model, opt, sched, data)
    emb.close()
    emb, model, opt, sched = _dcn(tmp_path / "b")
    steps(model, opt, sched, data[:4])
    save_checkpoint("half", emb, model=model, optimizer=opt, lr_schedule=sched, state={"step": 4})
    emb.close()
    emb, model, opt, sched = _dcn(tmp_path / "b")  # a new process would start like this
    record = load_checkpoint("half", emb, model=model, optimizer=opt, lr_schedule=sched)
    assert record["state"] == {"step": 4}
    assert steps(model, opt, sched, data[4:]) == want[4:]
    emb.close()


def test_resume_finishes_a_run_killed_after_its_last_interval_checkpoint(tmp_path):
    """Killed after step-20 was published but before `final`: --resume writes `final` (the same
    evaluation an uninterrupted run ends with) and exits 0; once finished, it says so."""
    from one_embedding.store.snapshots import SnapshotDirectory

    path = tmp_path / "run"
    cli(path, tmp_path / "a.jsonl", "--steps", 20)
    want = results(tmp_path / "a.jsonl")[("final", 20)]
    assert SnapshotDirectory(str(path / "0-1")).delete("final")  # as if killed before it
    proc = cli(path, tmp_path / "b.jsonl", "--steps", 20, "--resume")
    assert proc.returncode == 0
    assert results(tmp_path / "b.jsonl") == {("final", 20): want}
    assert "final" in os.listdir(path / "0-1" / "snapshots")
    again = cli(path, tmp_path / "c.jsonl", "--steps", 20, "--resume", check=False)
    assert again.returncode == 2 and "already at step 20" in again.stderr
