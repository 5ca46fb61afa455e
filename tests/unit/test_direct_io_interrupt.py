"""A Ctrl-C while the I/O pool's shares run: the caller returned (and could free the buffer)
while other threads still wrote into it through its address; it now waits for every share that
started before the KeyboardInterrupt goes on (found by a review of the interrupt fixes)."""
import concurrent.futures
import mmap
import os
import threading
import time

import numpy as np
import pytest

from one_embedding.store import direct_io


def test_an_interrupted_transfer_returns_only_after_every_share_that_started(tmp_path,
                                                                              monkeypatch):
    block = 4096
    n = 64
    path = tmp_path / "blocks"
    path.write_bytes(os.urandom(n * block))
    fd = os.open(path, os.O_RDONLY)
    pool = direct_io.IOPool(io_threads=4)
    buffer = mmap.mmap(-1, n * block)
    running = set()
    lock = threading.Lock()
    real = direct_io._run_share

    def slow_share(*args):
        with lock:
            running.add(threading.get_ident())
        time.sleep(0.2)
        real(*args)
        with lock:
            running.discard(threading.get_ident())

    monkeypatch.setattr(direct_io, "_run_share", slow_share)
    monkeypatch.setattr(direct_io, "MAX_RUN_BYTES", block)   # one run per block: many shares
    calls = []

    def interrupted(self, timeout=None):
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return None

    monkeypatch.setattr(concurrent.futures.Future, "exception", interrupted)
    blocks = np.arange(0, n, 2, dtype=np.int64)
    with pytest.raises(KeyboardInterrupt):
        pool.read(np.full(blocks.shape[0], fd, np.int32), blocks, block, buffer)
    assert not running, "shares still used the buffer after the interrupt returned"
    pool.close()
    os.close(fd)
