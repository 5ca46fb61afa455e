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


BLOCKED_ABORT = """
import threading, time
from one_embedding.parallel import comm as comm_mod

class AbortThatWaits:            # MPI_Abort stuck on a lock a spinning thread holds
    def Abort(self, code):
        time.sleep(60)

def spinning_collective():       # the other thread, as the prefetch thread in its shuffle
    time.sleep(60)

comm_mod.ABORT_GRACE_S = 1.0
comm = comm_mod.MpiComm.__new__(comm_mod.MpiComm)
comm._comm = AbortThatWaits()
threading.Thread(target=spinning_collective, name="one_embedding-prefetch", daemon=True).start()
comm.abort(3)
print("abort returned", flush=True)
"""


def test_an_mpi_abort_that_hangs_is_ended_by_its_watchdog_with_every_thread_named():
    import subprocess
    import time

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BLOCKED_ABORT], capture_output=True, text=True,
                          timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 1 and took < 20, (proc.returncode, took, proc.stderr[-2000:])
    assert "abort returned" not in proc.stdout
    # faulthandler's dump: both threads, the main one inside the stuck Abort
    assert "Timeout" in proc.stderr and "in Abort" in proc.stderr, proc.stderr[-2000:]
    assert "in spinning_collective" in proc.stderr
