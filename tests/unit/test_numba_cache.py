"""A read-only install run by a user without a writable home: numba raised 'cannot cache
function ... no locator available' at ``import one_embedding`` (even ``--help``), found by a
fault campaign; the cache now goes to the temporary folder."""
import os
import subprocess
import sys

from one_embedding import _numba_cache


def test_the_cache_goes_to_the_temporary_folder_where_nothing_else_is_writable(monkeypatch,
                                                                                tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(_numba_cache.sys, "modules", {})    # numba not imported yet
    read_only = {str(tmp_path / "site"), str(tmp_path / "home")}
    monkeypatch.setattr(_numba_cache.os, "access",
                        lambda path, mode: not any(str(path).startswith(r) for r in read_only))
    (tmp_path / "site" / "one_embedding").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    folder = _numba_cache.ensure_writable_numba_cache(str(tmp_path / "site" / "one_embedding"))
    assert folder is not None and folder.startswith(os.path.realpath("/tmp")[:4])
    assert os.environ["NUMBA_CACHE_DIR"] == folder
    # a writable home, or a cache folder the user set, is left alone
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    read_only.discard(str(tmp_path / "home"))
    assert _numba_cache.ensure_writable_numba_cache(str(tmp_path / "site" / "one_embedding")) \
        is None
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere")
    assert _numba_cache.ensure_writable_numba_cache() is None


def test_import_works_with_an_unwritable_source_cache_and_no_home(tmp_path):
    """End to end: the package's __pycache__ and the user's cache folder made unusable (a file
    in their place, which root cannot write into either)."""
    site = tmp_path / "site"
    src = os.path.dirname(os.path.dirname(os.path.abspath(_numba_cache.__file__)))
    (site / "one_embedding").mkdir(parents=True)
    for root, dirs, files in os.walk(os.path.join(src, "one_embedding")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(root, src)
        (site / rel).mkdir(parents=True, exist_ok=True)
        (site / rel / "__pycache__").write_text("not a folder")
        for f in files:
            if not f.endswith((".pyc", ".nbi", ".nbc")):
                os.symlink(os.path.join(root, f), site / rel / f)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    (tmp_path / "no_cache").write_text("a file where the user's cache folder would be")
    env.update(HOME="/nonexistent", XDG_CACHE_HOME=str(tmp_path / "no_cache"),
               PYTHONPATH=str(site), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = subprocess.run([sys.executable, "-c", "import os, one_embedding; "
                          "print(os.environ['NUMBA_CACHE_DIR'])"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str(tmp_path / "tmp" / f"one_embedding-numba-{os.getuid()}")
