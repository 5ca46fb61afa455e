"""Sphinx configuration of the documentation site: the Markdown pages of docs/ (MyST) and the API
reference autodoc builds from the package's docstrings (napoleon reads their Google-style
sections). Build it with warnings as errors, as .ci/run does:

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# document this checkout's package (flat or src/ layout), whatever else is installed or on the path
ROOT = Path(__file__).resolve().parents[1]
for _parent in (ROOT / "src", ROOT):
    if (_parent / "one_embedding" / "__init__.py").is_file():
        sys.path.insert(0, str(_parent))
        break

import one_embedding  # noqa: E402

project = "one_embedding"
author = "the one_embedding authors"
copyright = "2026, the one_embedding authors"
release = version = one_embedding.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# the API reference: members in source order, signatures with their annotations
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
# TorchEmbedding's module imports torch; where torch is not installed the page is still built
# from the docstrings against a stand-in (torch is an optional extra)
autodoc_mock_imports = [] if importlib.util.find_spec("torch") else ["torch"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections as fields of their class: a property of the same name (RowOptimizer.params)
# is then not described twice
napoleon_use_ivar = True

# Markdown pages: ``#`` headings get anchors for links such as ``serving.md#models``
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = f"one_embedding {release}"


def _drop_builtin_type_docstring(app, what, name, obj, options, lines):
    """A constant autodoc documents (``.. autodata::`` of an int, a str, a tuple, a dict) without a
    ``#:`` comment of its own falls back to its type's docstring (``int([x]) -> integer ...``):
    drop that, keeping the sentence written under the directive."""
    if what not in ("data", "attribute") or isinstance(obj, type) or callable(obj):
        return
    type_doc = type(obj).__doc__ or ""
    words = lambda text: [line.strip() for line in text if line.strip()]  # noqa: E731
    if lines and words(lines) == words(type_doc.splitlines()):
        lines.clear()


def setup(app):
    # before napoleon (priority 500) rewrites the lines
    app.connect("autodoc-process-docstring", _drop_builtin_type_docstring, priority=400)
