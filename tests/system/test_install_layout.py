"""The installed package wins over a folder named ``one_embedding`` beside a script (issue 31
item 1): with the flat layout, a script run from the folder that holds a clone named
``one_embedding`` (or ``python ../x.py`` from inside it) imported the clone's root as an empty
namespace package and failed with ``AttributeError: ... make_table_options``. The src/ layout
keeps the package out of the clone's root."""
from __future__ import annotations

import os
import subprocess
import sys

import helpers

SCRIPT = ("import one_embedding as oe\n"
          "print(oe.__file__)\n"
          "print(oe.make_table_options(oe.make_uniform_initializer(-0.1, 0.1)).__class__.__name__)\n")


def _run(script, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_script_beside_a_clone_named_like_the_package_imports_the_package(tmp_path):
    parent = tmp_path / "work"
    parent.mkdir()
    clone = parent / "one_embedding"   # a clone's root folder, named as git names it
    clone.mkdir()
    (clone / "README.md").write_text("a checkout's root: no __init__.py here\n")
    script = parent / "x.py"
    script.write_text(SCRIPT)
    package = str(helpers.PACKAGE / "__init__.py")
    for cwd, path in ((parent, script.name), (clone, os.path.join("..", script.name))):
        r = _run(path, cwd)              # from the parent folder, and from inside the clone
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.splitlines()
        assert os.path.realpath(lines[0]) == os.path.realpath(package), lines
        assert lines[1] == "TableOptions", lines
