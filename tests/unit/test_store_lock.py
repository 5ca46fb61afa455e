"""The path lock between real processes: deleting the LOCK file does not let a second one in."""
import os
import subprocess
import sys
import time

import pytest

import one_embedding as oe
from one_embedding.store.lock import PathLock

import helpers

ROOT = str(helpers.ROOT)

_OPEN = """
import sys, numpy as np
sys.path.insert(0, {root!r})
import one_embedding as oe

def build():
    tables = [oe.make_table_options(oe.make_uniform_initializer(-0.05, 0.05)) for _ in range(2)]
    store = oe.make_cached_ssd_store_options(0.05, {path!r}, size_factor=2, engine={engine!r})
    return oe.MultiTableEmbedding("locked", 8, np.float32, np.int64, tables, store)
"""

_TRAINER = """
emb = build()
opt = oe.Optimizer(oe.optim.Adagrad(lr=0.05), embeddings=[emb])
rng = np.random.default_rng(0)
def steps(n):
    for _ in range(n):
        out = emb(rng.integers(0, 5000, size=(256, 2)))
        emb.backward(np.ones_like(out))
        opt.step()
steps(3)
print("ready", flush=True)
sys.stdin.readline()
steps(3)
emb.save_snapshot("after")
keys, lines = emb.export()
emb.close()
print("done", len(keys), flush=True)
"""

_INTRUDER = """
try:
    build()
except oe.LockedError as e:
    print("LOCKED", e)
else:
    print("GOT IN")
"""


@pytest.mark.parametrize("engine", ["slots", "rocksdb"])
def test_deleting_lock_file_does_not_let_a_second_process_in(tmp_path, engine):
    head = _OPEN.format(root=ROOT, path=str(tmp_path), engine=engine)
    trainer = subprocess.Popen([sys.executable, "-c", head + _TRAINER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready", trainer.stderr.read()
        lock_file = tmp_path / "0-1" / "LOCK"
        assert lock_file.read_text() == str(trainer.pid)
        lock_file.unlink()
        intruder = subprocess.run([sys.executable, "-c", head + _INTRUDER], capture_output=True,
                                  text=True, timeout=120)
        assert intruder.stdout.startswith("LOCKED"), intruder.stdout + intruder.stderr
        assert "in use by another process" in intruder.stdout
        out, err = trainer.communicate("go\n", timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    # the first process went on undisturbed: no SIGBUS, no vanished working files
    assert trainer.returncode == 0, (trainer.returncode, err)
    assert out.startswith("done")
    # and once it has ended, the path is free again
    after = subprocess.run([sys.executable, "-c", head + _INTRUDER], capture_output=True,
                           text=True, timeout=120)
    assert after.stdout.startswith("GOT IN"), after.stdout + after.stderr


def test_lock_in_one_process_and_release(tmp_path):
    first = PathLock(str(tmp_path))
    os.unlink(first.path)
    with pytest.raises(oe.LockedError, match="in use by this process|pid unknown"):
        PathLock(str(tmp_path))
    first.release()
    first.release()  # twice is fine
    second = PathLock(str(tmp_path))
    assert open(second.path).read() == str(os.getpid())
    second.release()


def test_lock_on_a_path_that_is_a_file(tmp_path):
    target = tmp_path / "a_file"
    target.write_text("x")
    with pytest.raises(oe.StoreError, match="persistent path"):
        PathLock(str(target))


_FORK_AND_EXIT = """
import os, sys, time
sys.path.insert(0, {root!r})
from one_embedding.store.lock import PathLock
lock = PathLock({path!r})
child = os.fork()
if child == 0:   # shares the parent's flock, outlives it
    os.closerange(0, 3)
    time.sleep(60)
    os._exit(0)
print(os.getpid(), child, flush=True)
os._exit(0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_lock_left_to_a_forked_child_names_the_child_not_the_dead_writer(tmp_path):
    """The LOCK file holds the pid of the process that took the lock; a child forked from it
    shares the flock and may outlive it (a data-loader worker): the refusal says so instead of
    naming a pid that no longer runs."""
    out = subprocess.run([sys.executable, "-c", _FORK_AND_EXIT.format(root=ROOT + "/src",
                                                                     path=str(tmp_path))],
                         capture_output=True, text=True, check=True, timeout=60)
    parent, child = (int(x) for x in out.stdout.split())
    try:
        with pytest.raises(oe.LockedError, match=rf"forked from pid {parent}, which has exited"):
            PathLock(str(tmp_path))
    finally:
        os.kill(child, 9)
    for _ in range(200):   # the child is not ours to reap: wait for the kernel to drop its flock
        try:
            PathLock(str(tmp_path)).release()
            break
        except oe.LockedError:
            time.sleep(0.05)
    else:
        pytest.fail("the lock outlived the killed child")
