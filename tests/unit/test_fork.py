"""A process forked from an embedding's (a data-loader worker started with fork) never touches the
parent's store: using the embedding there is a ClosedError naming the parent, and the child's
exit (or its close()) neither unlocks the parent's path nor deletes its live files, nor hangs on
RocksDB's threads, which a fork does not copy (found by a fault campaign: the child's normal exit
let another process open the path and deleted live segment files under the parent). Each case
runs in a fresh interpreter: a fork of pytest itself would run pytest on in the child."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

SCRIPT = r'''
import os, signal, sys, time
import numpy as np
import one_embedding as oe
from one_embedding.errors import ClosedError, LockedError
from one_embedding.store.lock import PathLock

kind, fork_with, root = sys.argv[1], sys.argv[2], sys.argv[3]


def store(path):
    if kind == "host":
        return oe.make_cached_host_mem_store_options(0.02, path, 100_000, size_factor=2)
    return oe.make_cached_ssd_store_options(0.02, path, size_factor=2, engine=kind)


def train(emb, opt, seeds):
    for seed in seeds:
        ids = np.random.default_rng(seed).integers(0, 50_000, (256, 4))
        out = emb(ids)
        emb.backward(out * 0.1 + 0.01)
        opt.step()
        opt.zero_grad()


def run(path, fork):
    emb = oe.MultiTableEmbedding("e", 8, np.float32, np.int64, None, store(path))
    opt = oe.Optimizer(oe.optim.Adagrad(lr=0.05), embeddings=[emb])
    train(emb, opt, range(4))
    emb.save_snapshot("s")
    train(emb, opt, range(4, 6))
    if fork:
        pid = os.fork()
        if pid == 0:  # the child: what it met in its exit status, then a normal exit
            code = 0
            try:
                train(emb, opt, [99])
                code = 3                                  # it used the parent's store
            except ClosedError as e:
                code = 0 if "forked from it" in str(e) else 4
            except BaseException:
                code = 5
            if fork_with == "close":
                emb.close()
            sys.exit(code)                                # finalizers run
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                print("CHILD HUNG")
                sys.exit(1)
            time.sleep(0.05)
        print("child exit", os.waitstatus_to_exitcode(status))
        try:
            PathLock(os.path.join(path, "0-1")).release()
            print("PATH UNLOCKED")
        except LockedError:
            print("path still locked")
    train(emb, opt, range(6, 10))
    emb.save_snapshot("t")
    rows = emb.export()
    emb.close()
    return rows


want = run(os.path.join(root, "plain"), False)
got = run(os.path.join(root, "forked"), True)
print("same rows", all(np.array_equal(a, b) for a, b in zip(want, got)))
'''


@pytest.mark.parametrize("kind", ["slots", "rocksdb", "host"])
@pytest.mark.parametrize("fork_with", ["exit", "close"])
def test_a_forked_child_leaves_the_parents_store_alone(tmp_path, kind, fork_with):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, kind, fork_with, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.split("\n")[:3] == ["child exit 0", "path still locked", "same rows True"], \
        (proc.stdout, proc.stderr[-3000:])
