"""No process-global state behind an object's back (issue 34, item 6): the default embedding
device is per thread (a serving follower thread never picks up a trainer's "cuda"), and a store
leaves the process's open-file limit alone: the CLI raises it explicitly (logging why when it
cannot), and a store out of descriptors says which limit and how to raise it."""
import errno
import logging
import os
import resource
import threading

import numpy as np
import pytest

import one_embedding as oe
from one_embedding.backend import default_embedding_device, embedding_device
from one_embedding.errors import StoreError
from one_embedding.store import file_limit
from one_embedding.store.segments import SegmentPool


def _on_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(value=fn()))
    t.start()
    t.join(30)
    return out["value"]


def test_the_default_device_is_per_thread():
    with embedding_device("cuda:3"):
        assert default_embedding_device() == "cuda:3"
        assert _on_thread(default_embedding_device) == "cpu"
        with embedding_device("cpu"):
            assert default_embedding_device() == "cpu"
        assert default_embedding_device() == "cuda:3"
    assert default_embedding_device() == "cpu"


def test_an_embedding_built_on_another_thread_ignores_a_trainers_cuda_setting():
    # a trainer builds its model on "cuda" (here a machine without one) while a serving thread
    # builds its own embedding: before, the thread picked up "cuda" and failed (or took the GPU)
    def build():
        emb = oe.MultiTableEmbedding("serve", 4, np.float32, np.int64, None,
                                     oe.make_device_mem_store_options(None, 100))
        on_cpu = emb.launch is None and emb.xp is np
        emb.close()
        return on_cpu

    with embedding_device("cuda"):
        assert _on_thread(build) is True


@pytest.fixture
def low_soft_limit():
    """The soft open-file limit lowered below the hard one for the test, restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip(f"the hard open-file limit {hard} leaves no room to test below it")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    yield 512
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_slot_store_leaves_the_process_file_limit_alone(tmp_path, low_soft_limit):
    emb = oe.MultiTableEmbedding("t", 4, np.float32, np.int64, None,
                                 oe.make_cached_ssd_store_options(1, str(tmp_path)))
    emb(np.arange(10))
    emb.close()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low_soft_limit


def test_the_owner_raises_the_limit_explicitly(low_soft_limit):
    assert file_limit.raise_open_file_limit("a test") > low_soft_limit


def test_a_refused_raise_is_logged_with_its_reason(low_soft_limit, monkeypatch, caplog):
    # (low_soft_limit first: it restores the limit after monkeypatch has restored setrlimit)
    def refuse(*args):
        raise ValueError("not allowed")

    monkeypatch.setattr(file_limit.resource, "setrlimit", refuse)
    with caplog.at_level(logging.WARNING, logger=file_limit.__name__):
        assert file_limit.raise_open_file_limit("segments of a big table") == low_soft_limit
    assert "could not raise the open-file limit" in caplog.text
    assert "not allowed" in caplog.text and "segments of a big table" in caplog.text


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("slack", [4, 5])   # the limit falls on the rows file / the keys file
def test_out_of_descriptors_is_a_clear_error_and_leaks_nothing(tmp_path, slack):
    pool = SegmentPool(str(tmp_path / "seg"), 8, 4096, 256, direct=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    segments, error = [], None
    fds_at_start = _open_fds()
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds_at_start + slack, hard))
    try:
        for i in range(10):        # each segment holds two descriptors while it is active
            try:
                segments.append(pool.create(i + 1, i, 256))
            except StoreError as e:
                error = e
                break
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # (counted with the limit back: listing /proc/self/fd takes a descriptor itself)
    fds_held = _open_fds() - fds_at_start
    for seg in segments:
        seg.close()
    assert error is not None, "the lowered limit was never reached"
    assert "open-file limit is reached" in str(error) and "ulimit -n" in str(error)
    assert fds_held == 2 * len(segments)        # the failed create closed what it opened
    assert not os.path.exists(pool.path(len(segments) + 1, "rows"))


def test_the_limit_error_names_emfile_only():
    assert file_limit.too_many_open_files("/x", OSError(errno.ENOSPC, "full")) is None
    assert isinstance(file_limit.too_many_open_files("/x", OSError(errno.EMFILE, "many")),
                      StoreError)
