"""--resume over a damaged newest checkpoint: the damage is named, never taken for another run's
configuration (whose advice, --overwrite, would delete the good checkpoints), and a checkpoint
left out because its manifest is damaged is said so (found by a fault campaign, 2026-12-07)."""
import logging
import os
import shutil

import pytest

from one_embedding.config import TrainConfig
from one_embedding.errors import SnapshotError
from one_embedding.training import train


def _run(path, steps, **kw):
    cfg = TrainConfig(steps=steps, batch_size=64, synthetic_rows=2000, eval_batches=1,
                      snapshot_interval=5, keep_snapshots=0, persistent_path=str(path), **kw)
    return train(cfg, metrics_path=os.devnull, progress=False)


@pytest.mark.parametrize("damage", ["truncate", "one digit", "delete"])
def test_a_damaged_state_file_is_named_not_called_another_runs_config(tmp_path, damage):
    path = tmp_path / "run"
    _run(path, 10)
    snaps = path / "0-1" / "snapshots"
    shutil.rmtree(snaps / "final")          # as if killed after step-10, before final
    state = snaps / "step-10" / "trainer" / "state.json"
    text = state.read_text()
    if damage == "truncate":
        state.write_text(text[: len(text) // 2])
    elif damage == "one digit":               # still valid JSON, another batch size
        assert '"batch_size": 64' in text
        state.write_text(text.replace('"batch_size": 64', '"batch_size": 65'))
    else:
        state.unlink()
    with pytest.raises(SnapshotError, match=r"checkpoint 'step-10' is damaged: .*state\.json"
                                            r".*move .*step-10.* out of the way") as e:
        _run(path, 15, resume=True)
    assert "differs" not in str(e.value) and "overwrite" not in str(e.value)
    # the advice works: with step-10 moved away, the run resumes from step-5
    shutil.move(str(snaps / "step-10"), str(tmp_path / "step-10.damaged"))
    assert _run(path, 15, resume=True)["steps"] == 15


def test_a_checkpoint_with_a_damaged_manifest_left_out_is_said_so(tmp_path, caplog):
    path = tmp_path / "run"
    _run(path, 10)
    snaps = path / "0-1" / "snapshots"
    shutil.rmtree(snaps / "final")
    manifest = snaps / "step-10" / "manifest.json"
    data = bytearray(manifest.read_bytes())
    data[200] ^= 1
    manifest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="one_embedding.checkpoint"):
        assert _run(path, 15, resume=True)["steps"] == 15
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert said and "step-10" in said[0] and "manifest" in said[0], caplog.text


def test_resume_names_the_missing_rank_folder(tmp_path):
    """A set of 2 rank folders without rank 1's: --resume said the path held "snapshots
    without training state" and steered to starting over (found by a fault campaign)."""
    from one_embedding.errors import ConfigError

    path = tmp_path / "run"
    _run(path, 5)
    os.rename(path / "0-1", path / "0-2")   # rank 0 of 2 ranks, rank 1's folder gone
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint: the set of 2 rank\(s\) "
                                          r"lacks the folder\(s\) 1-2: restore the missing"):
        _run(path, 10, resume=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"it holds no rank folder"):
        _run(empty, 10, resume=True)


def test_resume_from_a_set_another_process_holds_is_refused_naming_it(tmp_path):
    """A 1-rank resume over a live 2-rank run read its folders unlocked, raced its pruning and
    called a checkpoint damaged (and created its own rank folder): refused, naming the holder."""
    from one_embedding.errors import LockedError
    from one_embedding.store.lock import PathLock

    path = tmp_path / "run"
    _run(path, 5)
    shutil.copytree(path / "0-1", path / "1-2")
    os.rename(path / "0-1", path / "0-2")   # a complete set of 2 ranks, none of 1
    held = PathLock(str(path / "1-2"))        # the live run's rank 1
    try:
        with pytest.raises(LockedError, match=r"saved by 2 ranks, and persistent_path .*1-2' is "
                                              r"in use by this process"):
            _run(path, 10, resume=True)
    finally:
        held.release()
    assert not (path / "0-1").exists()
