"""The hook that ends a multi-rank job on an uncaught exception, and its opt-out."""
import sys
import threading

import pytest

from one_embedding.parallel import comm as comm_mod


class FakeComm:
    rank, world = 1, 2

    def __init__(self):
        self.aborted = []

    def abort(self, code=1):
        self.aborted.append(code)


@pytest.fixture
def hooks():
    saved = (sys.excepthook, threading.excepthook)
    yield
    comm_mod._HOOKED.clear()
    sys.excepthook, threading.excepthook = saved


def test_uncaught_exception_aborts_and_the_opt_out_restores_python(hooks, capsys):
    fake = FakeComm()
    before = (sys.excepthook, threading.excepthook)
    comm_mod.abort_on_uncaught_exception(fake)
    try:
        raise ValueError("bad batch")
    except ValueError:
        sys.excepthook(*sys.exc_info())
    assert fake.aborted == [1]
    err = capsys.readouterr().err
    assert "ValueError: bad batch" in err and "rank 1 of 2" in err and "ABORT_ON_ERROR=0" in err
    comm_mod.abort_on_uncaught_exception(fake, enable=False)
    assert (sys.excepthook, threading.excepthook) == before


def test_the_environment_variable_opts_out(hooks, monkeypatch):
    monkeypatch.setenv(comm_mod.ABORT_ENV, "0")
    before = sys.excepthook
    comm_mod.abort_on_uncaught_exception(FakeComm())
    assert sys.excepthook is before
