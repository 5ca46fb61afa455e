"""A resume compares what the runs used, not how it was spelled, and carries every total (found
by a fault campaign, 2026-12-07): a default written out (--admit-sketch-mb 32, --exchange-dtype
fp32) was refused as a change, while OneFlow's environment switch turned a resumed multi-rank run
to int8 unseen; FTRL with a decay died where the decay reached lr 0; the lifecycle's counters
started again from 0 when a checkpoint was resharded; the last step wrote no train record."""
import json
import os

import pytest

import one_embedding as oe
from one_embedding.config import TrainConfig
from one_embedding.errors import ConfigError
from one_embedding.lifecycle import Lifecycle
from one_embedding.parallel.codec import QUANTIZED_COMM_ENV
from one_embedding.training import train

TINY = dict(batch_size=64, synthetic_rows=2000, eval_batches=1, snapshot_interval=4)


def _run(path, steps, **kw):
    return train(TrainConfig(steps=steps, persistent_path=str(path), **TINY, **kw),
                 metrics_path=os.devnull, progress=False)


def test_defaults_written_out_resume_and_the_environments_dtype_is_compared(tmp_path,
                                                                           monkeypatch):
    monkeypatch.delenv(QUANTIZED_COMM_ENV, raising=False)
    path = tmp_path / "run"
    _run(path, 4, admit_min_count=2)
    state = json.loads((path / "0-1" / "snapshots" / "final" / "trainer" / "state.json")
                       .read_text())
    assert state["config"]["exchange_dtype"] == "fp32"      # recorded as used
    assert state["config"]["admit_sketch_mb"] == 32.0
    assert _run(path, 6, admit_min_count=2, admit_sketch_mb=32, exchange_dtype="fp32",
                resume=True)["steps"] == 6
    monkeypatch.setenv(QUANTIZED_COMM_ENV, "1")             # would exchange int8 from here on
    with pytest.raises(ConfigError, match=r"exchange_dtype: 'fp32' -> 'int8'"):
        _run(path, 8, admit_min_count=2, resume=True)


def test_ftrl_with_a_decay_to_lr_0_is_refused_before_it_starts():
    with pytest.raises(ConfigError, match=r"decay_steps=3 with optimizer='ftrl': the decay ends "
                                          r"at lr 0"):
        TrainConfig(optimizer="ftrl", decay_start=2, decay_steps=3)
    TrainConfig(optimizer="adagrad", decay_start=2, decay_steps=3)


def _source(counters: dict):
    return ("unused", {"lifecycle": {"counters": counters}})


def test_resharded_counters_go_on_from_the_old_ranks_totals_on_rank_0():
    options = oe.make_lifecycle_options(steps_to_live=10)
    old = [_source({"admitted_rows": 5, "evicted_rows": 2, "sweeps": 1}),
           _source({"admitted_rows": 7, "evicted_rows": 1, "sweeps": 1})]
    first = Lifecycle(options, 8)
    first.load(old, resharded=True, takes_counters=True)
    assert (first.counters.admitted_rows, first.counters.evicted_rows,
            first.counters.sweeps) == (12, 3, 2)
    other = Lifecycle(options, 8)
    other.load(old, resharded=True, takes_counters=False)
    assert other.counters.admitted_rows == 0                 # the totals are counted once
    same_world = Lifecycle(options, 8)
    same_world.load(old[1:], resharded=False, takes_counters=False)
    assert same_world.counters.admitted_rows == 7            # a rank's own, as before
