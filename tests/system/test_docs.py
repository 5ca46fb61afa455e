"""The documentation site (docs/) builds from the docstrings with Sphinx, warnings as errors, as
.ci/run builds it; skipped where the ``docs`` extra is not installed (.ci/run installs it)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import helpers

#: runs Sphinx with torch invisible to the import system, as on a Python without the torch extra
HIDE_TORCH = """
import sys
from importlib.machinery import PathFinder

class WithoutTorch(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return super().find_spec(name, path, target)

sys.meta_path = [WithoutTorch if f is PathFinder else f for f in sys.meta_path]
from sphinx.cmd.build import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules or not getattr(sys.modules["torch"], "__file__", None)
sys.exit(code)
"""


def build(tmp_path, hide_torch: bool = False):
    """The site built into ``tmp_path / "html"`` as .ci/run builds it (warnings are errors)."""
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: python -m pip install -e \".[docs]\"")
    runner = ["-c", HIDE_TORCH] if hide_torch else ["-m", "sphinx"]
    proc = subprocess.run([sys.executable, *runner, "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(tmp_path / "doctrees"), str(helpers.ROOT / "docs"),
                           str(tmp_path / "html")], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)  # conf.py finds the checkout's package from any folder
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp_path / "html"


def test_docs_build_without_warnings(tmp_path):
    html = build(tmp_path)
    page = (html / "api" / "options.html").read_text()
    # the API reference holds the documented public names, with their docstrings
    assert 'id="one_embedding.options.make_cached_ssd_store_options"' in page
    assert 'id="one_embedding.options.make_uniform_initializer"' in page
    assert (html / "api" / "embedding.html").read_text().count(
        'id="one_embedding.embedding.MultiTableEmbedding"') == 1
    # the site names no file outside the repository (the design notes live beside it, not in it)
    outside = [str(p.relative_to(html)) for p in html.rglob("*.html")
               if "REFERENCE.md" in p.read_text() or "DESIGN.md" in p.read_text()]
    assert not outside, outside


@pytest.mark.slow
def test_docs_build_without_torch(tmp_path):
    """CI on a Python without the pinned torch build: the PyTorch page is built from its
    docstrings against conf.py's stand-in for torch, still without a warning."""
    html = build(tmp_path, hide_torch=True)
    assert 'id="one_embedding.torch.TorchEmbedding"' in (html / "api" / "torch.html").read_text()
