"""The Trainer: its learning rates come from optim.lr_schedules, bit-identical to OneFlow's warmup
(LinearLR from 0); its steps, evaluation, snapshots and final record."""
import contextlib
import json
import os

import numpy as np
import pytest

from one_embedding.config import TrainConfig
from one_embedding.errors import ConfigError
from one_embedding.optim.lr_schedules import LinearWarmup, WarmupPolynomialDecay
from one_embedding.training import Trainer, train
from one_embedding.training_setup import make_lr_schedule

#: small and quick: a few thousand synthetic rows, tiny tables
TINY = dict(batch_size=128, synthetic_rows=4_000, synthetic_scale=0.001, eval_batches=2)


def oneflow_warmup_lr(lr, warmup_steps, t):
    """The rate of update t under OneFlow's LinearLR(start_factor=0, total_iters=warmup_steps),
    evaluated at its step counter t - 1 (python/oneflow/nn/optimizer/linear_lr.py)."""
    s = t - 1
    return lr * (0.0 + (1.0 - 0.0) * (s / warmup_steps)) if s < warmup_steps else lr


class Target:
    lr = None


@pytest.mark.parametrize("lr", [0.05, 0.5, 1e-3, 24.0, 0.1, 0.7, 1 / 3])
@pytest.mark.parametrize("warmup_steps", [0, 1, 3, 7, 10, 20, 49, 1000, 2750])
def test_linear_warmup_rates_are_bit_identical_to_oneflows(lr, warmup_steps):
    target = Target()
    sched = make_lr_schedule(TrainConfig(lr=lr, warmup_steps=warmup_steps), target)
    assert isinstance(sched, LinearWarmup)
    for t in range(1, 3 * warmup_steps + 5):
        assert target.lr == oneflow_warmup_lr(lr, warmup_steps, t)   # exact, not approximate
        sched.step()


def test_decay_uses_warmup_polynomial_decay():
    cfg = TrainConfig(lr=0.5, warmup_steps=4, decay_start=6, decay_steps=5)
    target = Target()
    sched = make_lr_schedule(cfg, target)
    ref = WarmupPolynomialDecay(None, 0.5, warmup_steps=4, decay_start=6, decay_steps=5)
    assert isinstance(sched, WarmupPolynomialDecay)
    for t in range(1, 15):
        assert target.lr == ref.lr_at(t)
        sched.step()
    assert target.lr == 0.0


def test_trainer_steps_with_the_scheduled_rates(tmp_path):
    cfg = TrainConfig(steps=7, lr=0.3, warmup_steps=4, eval_interval=5, snapshot_interval=3,
                      persistent_path=str(tmp_path / "table"), **TINY)
    trainer = Trainer(cfg, metrics_path=str(tmp_path / "m.jsonl"), progress=False)
    seen = []
    step = trainer.optimizer.step

    def recording_step():
        seen.append(trainer.optimizer.lr)
        step()

    trainer.optimizer.step = recording_step
    final = trainer.run()
    assert seen == [oneflow_warmup_lr(0.3, 4, t) for t in range(1, 8)]
    assert seen[:2] == [0.0, 0.075]
    assert trainer.lr_schedule.last_step == 7 and trainer.progress.step == 7
    assert trainer.progress.samples == 7 * 128 == final["samples"]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    # train records at step 1 and at the last step (7, not a multiple of --log-interval 10)
    assert [r["event"] for r in records] == ["config", "train", "eval", "train", "final"]
    assert records[0]["steps"] == 7 and records[2]["step"] == 5
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 7]
    snapshots = sorted(p.name for p in (tmp_path / "table").glob("*/snapshots/*"))
    assert snapshots == ["final", "step-3", "step-6"]
    assert final["steps"] == 7 and 0.0 <= final["auc"] <= 1.0


def test_an_epoch_run_writes_the_train_record_of_its_last_step(tmp_path):
    """Without --steps the run ends where the data does: its last step's train record (which
    --log-interval and --metrics promise "at the end") was missing whenever the step count was
    not a multiple of --log-interval; the final record's step agrees with it."""
    cfg = TrainConfig(**{**TINY, "epochs": 1, "log_interval": 7})
    final = train(cfg, metrics_path=str(tmp_path / "m.jsonl"), progress=False)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r["event"] == "train"]
    last = final["steps"]
    assert last % 7 != 0, "pick a --log-interval that does not divide the epoch's steps"
    assert train_steps == [1, *range(7, last, 7), last], train_steps


def test_train_function_and_trainer_agree_bit_for_bit(tmp_path):
    cfg = TrainConfig(steps=4, model="deepfm", optimizer="adam", lr=0.01, warmup_steps=2, **TINY)
    a = train(cfg, metrics_path=str(tmp_path / "a.jsonl"), progress=False)
    trainer = Trainer(cfg, metrics_path=str(tmp_path / "b.jsonl"), progress=False)
    losses = []
    with contextlib.closing(trainer.batches()) as batches:
        for batch in batches:
            losses.append(trainer.train_step(batch))
            if len(losses) == cfg.steps:
                break
    b = trainer.evaluate()
    trainer.close()
    assert (a["auc"], a["logloss"]) == (b["auc"], b["logloss"])
    assert all(isinstance(x, float) and np.isfinite(x) for x in losses)


def test_epochs_without_steps_run_the_whole_split(tmp_path):
    cfg = TrainConfig(epochs=2, **dict(TINY, synthetic_rows=1_000))
    final = train(cfg, metrics_path=str(tmp_path / "m.jsonl"), progress=False)
    per_epoch = final["steps"] // 2
    assert final["steps"] == 2 * per_epoch and per_epoch >= 5


def test_an_empty_training_split_is_a_config_error(tmp_path):
    cfg = TrainConfig(steps=3, **dict(TINY, synthetic_rows=100))
    with pytest.raises(ConfigError, match=r"no full batch of \d+ rows: its data holds fewer "
                                          r"rows than that: check --data \(an empty file\?\), or "
                                          "lower --batch-size"):
        train(cfg, metrics_path=str(tmp_path / "m.jsonl"), progress=False)


def test_data_whose_every_line_was_skipped_is_named_so_not_blamed_on_the_batch_size(tmp_path):
    junk = tmp_path / "junk.tsv"
    junk.write_text("not\ta\tcriteo\tline\n" * 50)
    cfg = TrainConfig(steps=3, batch_size=8, data=(str(junk),), on_bad_line="skip")
    with pytest.raises(ConfigError, match=r"no full batch of 8 rows.*\(\d+ malformed lines were "
                                          r"skipped\)"):
        train(cfg, metrics_path=str(tmp_path / "m.jsonl"), progress=False)


def test_the_summary_says_when_nothing_was_evaluated_and_what_was_skipped():
    from one_embedding.run_summary import train_summary

    final = {"steps": 10, "samples": 640, "store": "device_mem", "model": "dlrm",
             "optimizer": "adagrad", "lr": 0.05, "train_seconds": 1.0, "auc": float("nan"),
             "logloss": float("nan"), "eval_samples": 0, "loss_first_10pct": 0.7,
             "loss_last_10pct": 0.5, "samples_per_s": 100.0, "samples_per_s_all": 90.0,
             "rows_stored": 5, "top_tier_hit_rate": 1.0, "skipped_lines": 12}
    text = train_summary(final)
    assert "eval:       none: the held-out split gave no full batch (raise --eval-fraction" in text
    assert "input:      12 malformed lines skipped" in text
    final.update(eval_samples=100, auc=0.7, logloss=0.5, skipped_lines=0)
    text = train_summary(final)
    assert "AUC 0.7000" in text and "(100 held-out samples)" in text and "input:" not in text


def test_trainer_takes_a_train_config_only():
    with pytest.raises(ConfigError, match="cfg is a dict; pass a TrainConfig"):
        Trainer({"steps": 3})


def test_docstring_examples_run():
    import doctest

    from one_embedding import run_summary, training

    assert doctest.testmod(training).failed == 0
    assert doctest.testmod(run_summary).attempted and doctest.testmod(run_summary).failed == 0


def test_ftrl_convention_oneflow_for_a_new_run_and_the_checkpoints_on_resume(tmp_path, monkeypatch):
    import warnings

    import one_embedding.training as training

    path = str(tmp_path / "table")
    cfg = TrainConfig(steps=2, optimizer="ftrl", lr=0.05, persistent_path=path, **TINY)
    assert cfg.ftrl_convention is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # the convention is chosen: no ConventionWarning
        trainer = Trainer(cfg, metrics_path=str(tmp_path / "a.jsonl"), progress=False)
    assert trainer.cfg.ftrl_convention == "oneflow" == trainer.optimizer.optimizer.convention
    trainer.run()
    resumed = dict(steps=4, optimizer="ftrl", lr=0.05, persistent_path=path, resume=True, **TINY)
    again = Trainer(TrainConfig(**resumed), metrics_path=os.devnull, progress=False)
    assert again.optimizer.optimizer.convention == "oneflow"
    again.close()
    with pytest.raises(ConfigError, match=r"ftrl_convention: 'oneflow' -> 'tensorflow'"):
        Trainer(TrainConfig(**resumed, ftrl_convention="tensorflow"), metrics_path=os.devnull,
                progress=False)
    # a checkpoint written before the option existed: its run computed TensorFlow's convention
    saved = training.saved_config

    def without_convention(*args):
        config = saved(*args)
        del config["ftrl_convention"]
        return config

    monkeypatch.setattr(training, "saved_config", without_convention)
    load = training.Optimizer.load_state_dict

    def without_modes(self, state):              # nor did the optimizer state record modes
        load(self, {k: v for k, v in state.items() if k != "modes"})

    monkeypatch.setattr(training.Optimizer, "load_state_dict", without_modes)
    old = Trainer(TrainConfig(**resumed), metrics_path=os.devnull, progress=False)
    assert old.cfg.ftrl_convention == "tensorflow" == old.optimizer.optimizer.convention
    old.close()
    with pytest.raises(ConfigError, match=r"ftrl_convention: 'tensorflow' -> 'oneflow'"):
        Trainer(TrainConfig(**resumed, ftrl_convention="oneflow"), metrics_path=os.devnull,
                progress=False)


@pytest.mark.parametrize("admission", [{}, {"admit_min_count": 2}])
def test_checkpoints_from_before_the_unset_sketch_size_resume(tmp_path, monkeypatch, admission):
    """issue 29 made --admit-sketch-mb "unset" (None) unless given; a checkpoint written before
    holds admit_sketch_mb 32.0 even without admission. It resumes without the flag: with
    admission the run carries on with the checkpoint's size, without it the size means nothing."""
    import one_embedding.training as training

    path = str(tmp_path / "table")
    Trainer(TrainConfig(steps=2, persistent_path=path, **admission, **TINY),
            metrics_path=os.devnull, progress=False).run()
    saved = training.saved_config

    def as_before(*args):
        return {**saved(*args), "admit_sketch_mb": 32.0}

    monkeypatch.setattr(training, "saved_config", as_before)
    resumed = Trainer(TrainConfig(steps=4, persistent_path=path, resume=True, **admission, **TINY),
                      metrics_path=os.devnull, progress=False)
    assert resumed.cfg.admit_sketch_mb == (32.0 if admission else None)
    assert resumed.run()["steps"] == 4
    if admission:  # a size given that differs from the checkpoint's still changes results
        with pytest.raises(ConfigError, match=r"admit_sketch_mb: 32.0 -> 8.0"):
            Trainer(TrainConfig(steps=6, persistent_path=path, resume=True, admit_sketch_mb=8,
                                **admission, **TINY), metrics_path=os.devnull, progress=False)


def test_ctrl_c_in_a_run_raises_training_interrupted_naming_the_checkpoint(tmp_path):
    """issue 29: a KeyboardInterrupt in the loop becomes TrainingInterrupted (still a
    KeyboardInterrupt): the step reached and the newest checkpoint on disk, which resumes."""
    from one_embedding.training import TrainingInterrupted

    def interrupted_at(step, **settings):
        trainer = Trainer(TrainConfig(steps=20, **settings, **TINY), metrics_path=os.devnull,
                          progress=False)
        train_step = trainer.train_step

        def stopping_step(*args):
            if trainer.progress.step == step:
                raise KeyboardInterrupt
            return train_step(*args)

        trainer.train_step = stopping_step
        with pytest.raises(TrainingInterrupted) as info:
            trainer.run()
        trainer.embedding.close()
        return info.value

    path = str(tmp_path / "table")
    e = interrupted_at(7, persistent_path=path, snapshot_interval=3, keep_snapshots=1)
    assert isinstance(e, KeyboardInterrupt)
    assert (e.step, e.checkpoint, e.persistent_path) == (7, (6, "step-6"), path)
    assert str(e) == (f"interrupted at step 7; the last checkpoint saved is 'step-6' (step 6) "
                      f"under {path!r}: resume=True (--resume) continues from it")
    resumed = Trainer(TrainConfig(steps=9, persistent_path=path, resume=True, snapshot_interval=3,
                                  keep_snapshots=1, **TINY), metrics_path=os.devnull,
                      progress=False)
    assert resumed.resumed_from == {"checkpoint": "step-6", "step": 6}
    assert resumed.run()["steps"] == 9
    e = interrupted_at(2, persistent_path=str(tmp_path / "other"), snapshot_interval=3)
    assert e.checkpoint is None and "no checkpoint was saved under" in str(e)
    e = interrupted_at(2)
    assert "nothing was saved (no persistent_path)" in str(e)


def _losses(cfg: TrainConfig) -> np.ndarray:
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    trainer.run()
    return np.array(trainer.progress.losses)


def test_dcn_first_steps_do_not_blow_up_with_the_defaults():
    """issue 31: with Adagrad at lr 0.05 (the defaults then) DCN's step losses were 19 and 16 at
    steps 2-3 (Adagrad's first update is lr * sign(g) for every weight); the model's reference
    optimizer (Adam, 1e-3) is its default now. The CLI's defaults, synthetic data, 50 steps."""
    losses = _losses(TrainConfig(model="dcn", steps=50, eval_batches=1))
    assert losses.size == 50 and losses.max() < 1.0, np.round(losses[:5], 3)
    # DeepFM shares the cause; its loss at initialisation is 1.09 (its DNN takes the raw
    # log(x + 1) dense features), and every update after it brings the loss down from there
    losses = _losses(TrainConfig(model="deepfm", steps=50, eval_batches=1))
    assert losses[1:].max() < 1.0, np.round(losses[:5], 3)


def test_optimizer_and_lr_default_to_the_models_and_resume_as_the_checkpoints(tmp_path):
    for model, optimizer, lr in [("dlrm", "adagrad", 0.05), ("dcn", "adam", 0.001),
                                 ("deepfm", "adam", 0.001)]:
        cfg = TrainConfig(model=model)
        assert (cfg.optimizer, cfg.lr) == (None, None)  # unset, resolved per run
        assert cfg.with_model_defaults().optimizer == optimizer
        assert cfg.with_model_defaults().lr == lr
    assert TrainConfig(model="dcn", optimizer="adagrad").with_model_defaults().lr == 0.05
    assert TrainConfig(model="dlrm", lr=0.2).with_model_defaults().optimizer == "adagrad"
    # a DCN run begun with the old defaults (Adagrad, 0.05) resumes with them when unset
    path = str(tmp_path / "table")
    first = Trainer(TrainConfig(model="dcn", steps=2, optimizer="adagrad", lr=0.05,
                                persistent_path=path, **TINY), metrics_path=os.devnull,
                    progress=False)
    assert first.cfg.lr == 0.05
    first.run()
    again = Trainer(TrainConfig(model="dcn", steps=4, persistent_path=path, resume=True, **TINY),
                    metrics_path=os.devnull, progress=False)
    assert (again.cfg.optimizer, again.cfg.lr) == ("adagrad", 0.05)
    assert type(again.optimizer.optimizer).__name__ == "Adagrad"
    again.close()
    # given ones are compared, as before
    with pytest.raises(ConfigError, match=r"optimizer: 'adagrad' -> 'adam'"):
        Trainer(TrainConfig(model="dcn", steps=4, persistent_path=path, resume=True,
                            optimizer="adam", **TINY), metrics_path=os.devnull, progress=False)
