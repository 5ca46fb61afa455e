"""Ctrl-C that always stops a run (one_embedding.interrupts): a SIGINT noted as well as raised,
so a KeyboardInterrupt that a compiled extension lost is raised again at the next step, and one
it turned into a SystemError is still a Ctrl-C (the CLI's exit 130 and resume command)."""
import os
import signal
import threading

import pytest

from one_embedding import cli
from one_embedding.config import TrainConfig
from one_embedding.interrupts import CtrlC, interrupt_of
from one_embedding.training import Trainer, TrainingInterrupted

TINY = dict(batch_size=128, synthetic_rows=4_000, synthetic_scale=0.001, eval_batches=2)


def press_ctrl_c():
    """SIGINT to this process, as a terminal's Ctrl-C sends it; Python raises it here."""
    os.kill(os.getpid(), signal.SIGINT)


def lost_by_an_extension():
    """A Ctrl-C raised inside a callback that drops the error, as C code that clears errors it
    did not expect does."""
    try:
        press_ctrl_c()
    except KeyboardInterrupt:
        pass


def made_a_system_error_by_an_extension():
    """A Ctrl-C turned into CPython's SystemError of a C function that returned a result with
    an exception set (numba's dispatcher does: the interrupt is the SystemError's cause)."""
    try:
        press_ctrl_c()
    except KeyboardInterrupt as e:
        raise SystemError("CPUDispatcher(<function f>) returned a result with an exception "
                          "set") from e


def test_a_ctrl_c_is_noted_as_well_as_raised_and_the_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    assert before is signal.default_int_handler
    with CtrlC() as ctrl_c:
        ctrl_c.check()                          # nothing pressed: passes
        with pytest.raises(KeyboardInterrupt):
            press_ctrl_c()
        assert ctrl_c.pressed
        with pytest.raises(KeyboardInterrupt):  # raised again, however often asked
            ctrl_c.check()
    assert signal.getsignal(signal.SIGINT) is before
    with CtrlC() as ctrl_c:
        lost_by_an_extension()
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()


def test_a_handler_of_the_callers_own_and_other_threads_are_left_alone():
    mine = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: mine.append(signum))
    try:
        with CtrlC() as ctrl_c:
            press_ctrl_c()
            ctrl_c.check()                      # the caller's handler decided: no interrupt
        assert mine == [signal.SIGINT] and not ctrl_c.pressed
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    entered = []

    def off_the_main_thread():                  # signal.signal would raise ValueError there
        with CtrlC() as other:
            entered.append(other._previous)

    thread = threading.Thread(target=off_the_main_thread)
    thread.start()
    thread.join()
    assert entered == [None]


def test_the_interrupt_behind_a_system_error_is_found_and_nothing_else_is_one():
    with pytest.raises(SystemError) as info:
        made_a_system_error_by_an_extension()
    assert isinstance(interrupt_of(info.value), KeyboardInterrupt)
    plain = KeyboardInterrupt()
    assert interrupt_of(plain) is plain
    assert interrupt_of(SystemError("a real one")) is None
    assert interrupt_of(ValueError("x")) is None and interrupt_of(None) is None
    try:                                        # a ValueError caused by Ctrl-C is no Ctrl-C
        raise ValueError("bad") from KeyboardInterrupt()
    except ValueError as e:
        assert interrupt_of(e) is None
    looped = SystemError("loop")
    looped.__cause__ = looped
    assert interrupt_of(looped) is None


@pytest.mark.parametrize("extension", [lost_by_an_extension, made_a_system_error_by_an_extension])
def test_a_ctrl_c_an_extension_lost_or_changed_still_stops_the_run(tmp_path, extension):
    """Before: a lost one let the run go on to its end (exit 0); a SystemError ended it with a
    traceback and no resume command (exit 1)."""
    path = str(tmp_path / "table")
    trainer = Trainer(TrainConfig(steps=20, persistent_path=path, snapshot_interval=3, **TINY),
                      metrics_path=os.devnull, progress=False)
    train_step = trainer.train_step

    def step(*args):
        if trainer.progress.step == 7:
            extension()
        return train_step(*args)

    trainer.train_step = step
    with pytest.raises(TrainingInterrupted) as info:
        trainer.run()
    trainer.embedding.close()
    # a lost one at the next step's start, the changed one at once
    assert info.value.step == (8 if extension is lost_by_an_extension else 7)
    assert info.value.checkpoint == (6, "step-6")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_cli_takes_a_ctrl_c_made_a_system_error_as_ctrl_c(monkeypatch, tmp_path, capsys):
    def train(cfg, **kwargs):
        made_a_system_error_by_an_extension()

    monkeypatch.setattr("one_embedding.training.train", train)
    code = cli.main(["train", "--steps", "5", "--persistent-path", str(tmp_path / "t"),
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130, err
    assert "Traceback" not in err and "SystemError" not in err
    assert "one-embedding train: interrupted before training began; no checkpoint was saved" \
        in err

    def fails(cfg, **kwargs):
        raise SystemError("a real one")

    monkeypatch.setattr("one_embedding.training.train", fails)
    with pytest.raises(SystemError, match="a real one"):
        cli.main(["train", "--steps", "5", "--no-progress"])


def test_an_interrupted_run_releases_its_store_and_threads_for_a_resume_in_this_process(tmp_path):
    """A notebook keeps the last error, and through its traceback the Trainer: its store (the
    path's lock) and read-ahead thread stayed, so resuming in the same process was refused with
    'in use by this process' (found by a fault campaign)."""
    path = str(tmp_path / "table")
    cfg = TrainConfig(steps=12, persistent_path=path, snapshot_interval=4, **TINY)
    before = set(threading.enumerate())
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    train_step = trainer.train_step

    def step(*args):
        if trainer.progress.step == 6:
            press_ctrl_c()
        return train_step(*args)

    trainer.train_step = step
    with pytest.raises(TrainingInterrupted) as kept:   # the error (and the Trainer) stay alive
        trainer.run()
    assert kept.value.checkpoint == (4, "step-4")
    assert set(threading.enumerate()) <= before, "threads outlived the interrupted run"
    resumed = Trainer(TrainConfig(**{**cfg.__dict__, "resume": True}), metrics_path=os.devnull,
                      progress=False)
    assert resumed.run()["steps"] == 12


def test_a_run_that_fails_releases_its_store(tmp_path):
    path = str(tmp_path / "table")
    trainer = Trainer(TrainConfig(steps=6, persistent_path=path, **TINY),
                      metrics_path=os.devnull, progress=False)

    def fails(*args):
        raise RuntimeError("a bug in a custom step")

    trainer.train_step = fails
    with pytest.raises(RuntimeError, match="a bug in a custom step"):
        trainer.run()
    Trainer(TrainConfig(steps=6, persistent_path=path, overwrite=True, **TINY),
            metrics_path=os.devnull, progress=False).run()
