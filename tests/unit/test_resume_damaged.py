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
