"""A benchmark's --dir that does not exist is made (bench_stores, bench_ssd and bench_disk died
with a bare FileNotFoundError from tempfile.mkdtemp), one that cannot be made ends the run with one
line, and the run folders' names are ignored by git (a killed bench_ssd left a 2 GiB raw.bin in
the checkout)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
common = pytest.importorskip("benchmarks.common")


def test_a_missing_dir_is_made(tmp_path):
    parent = tmp_path / "not" / "yet"
    root = common.run_folder("bench_ssd_", str(parent))
    assert parent.is_dir() and root.startswith(str(parent / "bench_ssd_"))


def test_a_dir_that_cannot_be_made_ends_the_run_with_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as e:
        common.run_folder("bench_disk_", str(tmp_path / "a-file" / "below"))
    msg = str(e.value.code)
    assert "bench_disk" in msg and "a-file" in msg and "--dir" in msg and "\n" not in msg


@pytest.mark.parametrize("module", ["bench_stores", "bench_ssd", "bench_disk"])
def test_each_benchmark_makes_its_folder_with_run_folder(module, monkeypatch, tmp_path):
    mod = pytest.importorskip(f"benchmarks.{module}")
    seen = []

    def fake(prefix, parent):
        seen.append((prefix, parent))
        raise SystemExit("stop here")

    monkeypatch.setattr(mod, "run_folder", fake)
    with pytest.raises(SystemExit, match="stop here"):
        mod.main(["--dir", str(tmp_path / "missing")])
    assert seen == [(f"{module}_", str(tmp_path / "missing"))]


@pytest.mark.parametrize("prefix", ["bench_ssd_", "bench_disk_", "bench_stores_", "bench_scale_",
                                    "bench_lifecycle_"])
def test_run_folders_in_the_checkout_are_ignored(prefix):
    r = subprocess.run(["git", "check-ignore", "-q", f"{prefix}x1y2/raw.bin"], cwd=helpers.ROOT)
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert r.returncode == 0, f"{prefix}*/ is not in .gitignore"
