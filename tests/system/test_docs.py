"""The documentation site (docs/) builds from the docstrings with Sphinx, warnings as errors, as
.ci/run builds it; skipped where the ``docs`` extra is not installed (.ci/run installs it)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import helpers


def test_docs_build_without_warnings(tmp_path):
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: python -m pip install -e \".[docs]\"")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(tmp_path / "doctrees"), str(helpers.ROOT / "docs"),
                           str(tmp_path / "html")], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)  # conf.py finds the checkout's package from any folder
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    page = (tmp_path / "html" / "api" / "options.html").read_text()
    # the API reference holds the documented public names, with their docstrings
    assert 'id="one_embedding.options.make_cached_ssd_store_options"' in page
    assert 'id="one_embedding.options.make_uniform_initializer"' in page
    assert (tmp_path / "html" / "api" / "embedding.html").read_text().count(
        'id="one_embedding.embedding.MultiTableEmbedding"') == 1
    # the site names no file outside the repository (the design notes live beside it, not in it)
    outside = [str(p.relative_to(tmp_path)) for p in (tmp_path / "html").rglob("*.html")
               if "REFERENCE.md" in p.read_text() or "DESIGN.md" in p.read_text()]
    assert not outside, outside
