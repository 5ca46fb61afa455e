"""No error swallowed (issue 34, item 8): every broad ``except`` in the library re-raises, logs
a reason or hands the exception on (an AST check); RocksDB's integer properties raise instead of
reading 0; ``flush(wait_idle=True)`` waits a bounded time; the slot engine's segment opens close
their descriptor on every error path (counted in /proc/self/fd)."""
import ast
import errno
import logging
import os
import threading
import zlib
from pathlib import Path

import pytest

import helpers
from one_embedding.errors import SnapshotError, StoreError
from one_embedding.store import segments as seg_mod
from one_embedding.store.segments import SegmentInfo, SegmentPool

LIBRARY = helpers.PACKAGE
BROAD = {"Exception", "BaseException"}
REPORTS = {"debug", "info", "warning", "error", "exception", "critical", "warn", "print_exc",
           "print_exception"}


def _broad(node) -> bool:
    if node is None:                         # a bare except
        return True
    if isinstance(node, ast.Name):
        return node.id in BROAD
    if isinstance(node, ast.Tuple):
        return any(_broad(e) for e in node.elts)
    return False


def _body_nodes(nodes):
    """The nodes of a handler's body, not descending into functions or classes defined there."""
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        yield from _body_nodes(ast.iter_child_nodes(node))


def _accounted_for(handler: ast.ExceptHandler) -> bool:
    """It re-raises, logs or prints a reason, or hands the exception object on."""
    for node in _body_nodes(handler.body):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in REPORTS:
                return True
            if isinstance(f, ast.Name) and f.id == "print" and \
                    any(k.arg == "file" for k in node.keywords):
                return True
        if handler.name and isinstance(node, ast.Name) and node.id == handler.name and \
                isinstance(node.ctx, ast.Load):
            return True
    return False


def swallowed(source: str, filename: str = "<source>") -> list[str]:
    """``file:line`` of every broad handler that neither re-raises nor reports."""
    return [f"{filename}:{node.lineno}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ExceptHandler) and _broad(node.type)
            and not _accounted_for(node)]


def test_the_check_finds_what_it_should():
    assert swallowed("try:\n    f()\nexcept Exception:\n    pass\n")
    assert swallowed("try:\n    f()\nexcept:\n    x = 0\n")
    assert swallowed("try:\n    f()\nexcept (OSError, BaseException):\n    return_value = 0\n")
    assert swallowed("try:\n    f()\nexcept Exception as e:\n    def g():\n        raise e\n")
    assert not swallowed("try:\n    f()\nexcept Exception:\n    cleanup()\n    raise\n")
    assert not swallowed("try:\n    f()\nexcept Exception as e:\n    log.warning('x %r', e)\n")
    assert not swallowed("try:\n    f()\nexcept BaseException as e:\n    queue.put(e)\n")
    assert not swallowed("try:\n    f()\nexcept OSError:\n    pass\n")   # narrowed: allowed


def test_no_broad_except_in_the_library_swallows_its_error():
    found = []
    for path in sorted(Path(LIBRARY).rglob("*.py")):
        found += swallowed(path.read_text(), str(path.relative_to(helpers.ROOT)))
    assert not found, f"broad excepts that neither re-raise nor log a reason: {found}"


# ---------------------------------------------------------------- RocksDB properties and flush

@pytest.fixture
def rocks(tmp_path):
    pytest.importorskip("rocksdict")
    from one_embedding.store.rocksdb_store import RocksDBStore

    store = RocksDBStore(4, str(tmp_path))
    yield store
    store.close()


def test_an_unknown_or_unreadable_property_raises_instead_of_reading_0(rocks):
    assert rocks._int_property("rocksdb.num-running-compactions", both=True) == 0
    with pytest.raises(StoreError, match="no integer property 'rocksdb.no-such-property'"):
        rocks._int_property("rocksdb.no-such-property")
    with pytest.raises(StoreError, match="'rocksdb.stats'"):       # text, not an integer
        rocks._int_property("rocksdb.stats")


def test_a_property_after_close_raises(tmp_path):
    pytest.importorskip("rocksdict")
    from one_embedding.store.rocksdb_store import RocksDBStore

    store = RocksDBStore(4, str(tmp_path))
    store.close()
    with pytest.raises(StoreError, match="after close"):
        store._int_property("rocksdb.live-sst-files-size")


def test_waiting_for_rocksdb_to_settle_is_bounded(rocks, monkeypatch, caplog):
    monkeypatch.setattr(rocks, "_int_property", lambda name, both=False: 1)  # never settles
    out = {}
    t = threading.Thread(target=lambda: out.update(
        idle=rocks.flush(wait_idle=True, idle_timeout=0.3)), daemon=True)
    with caplog.at_level(logging.WARNING):
        t.start()
        t.join(20)
    assert not t.is_alive(), "flush(wait_idle=True) waited for ever"
    assert out["idle"] is False
    assert "still busy after" in caplog.text
    assert "rocksdb.num-running-compactions=1" in caplog.text
    monkeypatch.undo()
    assert rocks.flush(wait_idle=True) is True          # a real, idle DB settles at once


# ---------------------------------------------------------------- descriptors on error paths

def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_segment_whose_keys_file_cannot_be_created_closes_its_rows_file(tmp_path):
    pool = SegmentPool(str(tmp_path / "seg"), 8, 4096, 256, direct=False)
    os.mkdir(pool.path(1, "keys"))              # EISDIR when the keys file is opened
    before = _open_fds()
    with pytest.raises(StoreError, match="allocating the segment .* failed"):
        pool.create(1, 0, 256)
    assert _open_fds() == before
    assert not os.path.exists(pool.path(1, "rows"))


def _sealed_on_disk(pool: SegmentPool, slots: int = 4) -> SegmentInfo:
    """The files of one sealed segment of ``slots`` rows in ``pool``'s folder."""
    rows = bytes(pool.block_bytes)
    keys = bytes(8 * slots)
    sums = bytes(8)
    for kind, data in (("rows", rows), ("keys", keys), ("sums", sums)):
        Path(pool.path(7, kind)).write_bytes(data)
    return SegmentInfo(7, slots, len(rows), zlib.crc32(rows), zlib.crc32(keys), zlib.crc32(sums))


def test_a_sealed_segment_whose_keys_cannot_be_mapped_leaks_nothing(tmp_path):
    """Keys are mapped on first use (issue 34 item 7): a keys file gone by then is an error
    naming it, and the failed mapping holds no descriptor."""
    pool = SegmentPool(str(tmp_path / "seg"), 8, 4096, 256, direct=False)
    info = _sealed_on_disk(pool)
    seg = pool.open_sealed(info, 0, pool.folder, owned=True)     # the files as they are: opens
    seg.close()
    os.unlink(pool.path(7, "keys"))             # removed between the check and the open
    before = _open_fds()
    seg = pool.open_sealed(info, 0, pool.folder, owned=True)
    with pytest.raises((SnapshotError, StoreError), match="0000000000000007.keys"):
        seg.keys
    seg.close()
    assert _open_fds() == before


def test_a_sealed_segment_whose_alignment_check_fails_closes_its_rows_file(tmp_path, monkeypatch):
    pool = SegmentPool(str(tmp_path / "seg"), 8, 4096, 256, direct=False)
    info = _sealed_on_disk(pool)

    def opened_direct(path, flags, direct, warn_as=None):   # as on a disk that takes O_DIRECT
        return os.open(path, flags), True

    def io_error(fd, block_bytes):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(seg_mod, "open_block_file", opened_direct)
    monkeypatch.setattr(seg_mod, "check_alignment", io_error)
    before = _open_fds()
    with pytest.raises(SnapshotError, match="Input/output error"):
        pool.open_sealed(info, 0, pool.folder, owned=True)
    assert _open_fds() == before


def test_a_failed_reopen_without_o_direct_closes_nothing_twice(tmp_path, monkeypatch):
    pool = SegmentPool(str(tmp_path / "seg"), 8, 4096, 256, direct=False)
    real_open = os.open

    def opened_direct(path, flags, direct, warn_as=None):
        return real_open(path, flags, 0o644), True

    def refuse_reopen(path, flags, *mode):
        if path.endswith(".rows") and not flags & os.O_CREAT:
            raise OSError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *mode)

    monkeypatch.setattr(seg_mod, "open_block_file", opened_direct)
    monkeypatch.setattr(seg_mod, "check_alignment", lambda fd, block_bytes: False)
    monkeypatch.setattr(seg_mod.os, "open", refuse_reopen)
    before = _open_fds()
    with pytest.raises(StoreError, match="Permission denied"):   # before: EBADF, a double close
        pool.create(1, 0, 256)
    monkeypatch.undo()
    assert _open_fds() == before
