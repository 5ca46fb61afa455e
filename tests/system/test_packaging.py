"""What a built wheel carries besides the code: the ``py.typed`` marker (PEP 561: type checkers
read the package's annotations) and the LICENSE that pyproject's ``license`` names."""
from __future__ import annotations

import email
import importlib.util
import shutil
import subprocess
import sys
import zipfile

import pytest

import helpers


def test_the_wheel_ships_py_typed_and_the_license(tmp_path):
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: the wheel cannot be built without isolation")
    # build from a copy, so that setuptools' build/ folder is not left in the repository
    src = tmp_path / "src_copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(helpers.ROOT / name, src / name)
    for package_root in ("one_embedding", "src"):  # the flat layout or a src/ layout
        if (helpers.ROOT / package_root).is_dir():
            shutil.copytree(helpers.ROOT / package_root, src / package_root,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("one_embedding-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "one_embedding/py.typed" in names
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert licenses, names
        assert "Apache License" in z.read(licenses[0]).decode()
        meta = email.message_from_bytes(z.read(next(n for n in names
                                                    if n.endswith(".dist-info/METADATA"))))
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
