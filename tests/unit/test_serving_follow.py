"""The Predictor follows the run it serves: a checkpoint saved again under its name is checked
against the files the served one reads (where its lease holds them), and a run started over
(``--overwrite``) is followed even though its steps start again from 0."""
import json
import os

import numpy as np
import pytest

from one_embedding.config import TrainConfig
from one_embedding.errors import SnapshotError
from one_embedding.serving import Predictor
from one_embedding.training import train


def _run(path, steps, **kw):
    cfg = TrainConfig(steps=steps, batch_size=128, synthetic_rows=5000, store="cached_ssd",
                      engine="slots", cache_mb=0.1, persistent_path=str(path), eval_batches=1,
                      **kw)
    train(cfg, metrics_path=os.devnull, progress=False)


def _segment_ids(snapshot_folder) -> set:
    layout = json.loads((snapshot_folder / "slots.json").read_text())
    return {seg["id"] for seg in layout["segments"]}


def _flip_byte(path, at=100):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_final_saved_again_with_damaged_new_segments_is_refused(tmp_path):
    """Training resumes and saves `final` again while `final` is served: the served folder is
    renamed to `.old-final-*` and the name holds the new snapshot. Its new slot segments are
    checked against those the served `final` reads (found through the lease, not the name,
    which would count the new segments as already served and check none)."""
    path = tmp_path / "run"
    _run(path, 4)
    snaps = path / "0-1" / "snapshots"
    with Predictor(path, cache_mb=0) as p:
        keys = np.arange(5000)
        served = p.lookup(keys)
        before = _segment_ids(snaps / "final")
        _run(path, 8, resume=True)
        new = _segment_ids(snaps / "final") - before
        assert new, "the resumed run's final shares every segment with the served one"
        for seg in new:
            _flip_byte(path / "0-1" / "slots" / "segments" / f"{seg:016x}.rows")
        with pytest.raises(SnapshotError, match="fails its checksum"):
            p.refresh()
        assert p.snapshot == "final"
        np.testing.assert_array_equal(p.lookup(keys), served)


def test_a_run_started_over_is_followed_from_its_first_checkpoint(tmp_path):
    """`train --overwrite` deletes the served run's checkpoints and starts again from step 0:
    the served `final` (step 8) is deleted, the new run's `final` (step 4) is older by step but
    it is what the run holds; refresh switches to it."""
    path = tmp_path / "run"
    _run(path, 8)
    with Predictor(path, cache_mb=0) as p:
        keys = np.arange(5000)
        old = p.lookup(keys)
        _run(path, 4, overwrite=True, seed=7)
        assert p.refresh() is True
        with Predictor(path, cache_mb=0) as fresh:
            now = fresh.lookup(keys)
        assert not np.array_equal(now, old)
        np.testing.assert_array_equal(p.lookup(keys), now)
        assert p.refresh() is False


def test_an_older_checkpoint_does_not_replace_the_served_newer_one(tmp_path):
    """A refresh never goes back in steps while the served checkpoint still exists: here the
    newest listed is `step-4` (followed by name) while `final` (step 8, not deleted) is
    served, and `final` stays."""
    path = tmp_path / "run"
    _run(path, 8, snapshot_interval=4, keep_snapshots=0)
    with Predictor(path, cache_mb=0) as p:
        assert p.snapshot == "final"
        p.requested = "step-4"  # now only step-4 (older) is listed; final is not deleted
        assert p.refresh() is False
        assert p.snapshot == "final"


def test_the_metrics_count_each_switch_once_and_never_go_back():
    """A switch is counted when the follower makes it (even to a checkpoint of the same name:
    `final` saved again); a request the old checkpoint answers after the switch moves nothing."""
    import types

    pytest.importorskip("prometheus_client")
    from one_embedding.serving.service import Metrics

    m = Metrics(types.SimpleNamespace(ready=True, snapshot="step-100"))
    m.switched("step-200")   # the follower, after refresh()
    m.served("step-200")     # GET /metrics reads the predictor's
    m.switched("step-200")   # final saved again under its name: a second switch
    text = m.exposition().decode()
    lines = [line for line in text.splitlines() if line.startswith("one_embedding_snapshot")]
    assert "one_embedding_snapshot_switches_total 2.0" in lines, lines
    assert 'one_embedding_snapshot_info{snapshot="step-200"} 1.0' in lines, lines
    assert not any('snapshot="step-100"' in line for line in lines), lines


def test_a_predictor_waiting_for_its_run_serves_the_first_checkpoint_published(tmp_path):
    """wait=True before the run has started (its folder does not exist): not ready, each call
    a NotReadyError naming the path, until a refresh finds the first checkpoint; then its rows,
    those a fresh Predictor reads. Without wait the missing folder is refused, as before."""
    from one_embedding.errors import ConfigError
    from one_embedding.serving.predictor import NotReadyError

    path = tmp_path / "later"
    with pytest.raises(ConfigError, match="does not exist"):
        Predictor(path)
    with Predictor(path, cache_mb=0, wait=True) as p:
        assert not p.ready and p.refresh() is False
        for call in (lambda: p.lookup(np.arange(3)), lambda: p.snapshot, p.check_ready):
            with pytest.raises(NotReadyError, match=r"not ready: .*later.* no complete checkpoint"):
                call()
        _run(path, 4)
        assert p.refresh() is True and p.ready and p.snapshot == "final"
        with Predictor(path, cache_mb=0) as fresh:
            np.testing.assert_array_equal(p.lookup(np.arange(5000)), fresh.lookup(np.arange(5000)))
        assert p.refresh() is False


def test_the_first_checkpoint_of_a_waiting_server_is_not_a_switch(tmp_path):
    """The follower's first load of a predictor that waited goes to ``on_first`` (served, not
    a switch); later ones to ``on_switch``, whatever a /metrics scrape read in between (it
    named the first checkpoint before the follower's call, which then counted as a switch)."""
    pytest.importorskip("prometheus_client")
    from one_embedding.serving.server import Follower
    from one_embedding.serving.service import Metrics

    path = tmp_path / "run"
    with Predictor(path, cache_mb=0, wait=True) as p:
        m = Metrics(p)
        follower = Follower(p, 3600, on_switch=m.switched, on_first=m.served)
        follower.poll()
        assert not p.ready
        _run(path, 4, snapshot_interval=2, keep_snapshots=0)
        p.requested = "step-2"
        follower.poll()                  # the first checkpoint
        m.served(p.snapshot)             # a scrape
        p.requested = "final"
        follower.poll()                  # a switch
        lines = m.exposition().decode().splitlines()
        assert "one_embedding_snapshot_switches_total 1.0" in lines, lines
        assert 'one_embedding_snapshot_info{snapshot="final"} 1.0' in lines, lines


def test_a_waiting_predictor_outlives_a_damaged_first_checkpoint(tmp_path):
    """Started (wait=True) when the newest checkpoint is damaged, it waits for the next instead
    of failing at start (a restarted server beside a live run would crash-loop); a refresh says
    why, once the same way each time."""
    path = tmp_path / "run"
    _run(path, 4)
    _flip_byte(path / "0-1" / "snapshots" / "final" / "trainer" / "arrays.npz", at=200)
    with Predictor(path, cache_mb=0, wait=True) as p:
        assert not p.ready
        with pytest.raises(SnapshotError, match="fails its checksum"):
            p.refresh()
    with Predictor(path / "later", cache_mb=0, wait=True) as p:
        (path / "later").write_text("x")   # made a file meanwhile: never a run, say so
        with pytest.raises(SnapshotError, match="is a file, not a training run's folder"):
            p.refresh()
