"""scripts/gpu_check.sh cannot go green by skipping: here (no GPU) every GPU test skips, pytest
exits 0, and the check must still fail and say why. Its verdict helper is pinned on JUnit and
sanitizer outputs written here, passing ones included, so that neither can pass vacuously."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from one_embedding.backend import cupy_available

import helpers

SCRIPT = helpers.ROOT / "scripts" / "gpu_check.sh"
REPORT = helpers.ROOT / "scripts" / "gpu_check_report.py"


def _report(*args) -> tuple[int, str]:
    run = subprocess.run([sys.executable, str(REPORT), *map(str, args)], capture_output=True,
                         text=True, timeout=60)
    return run.returncode, run.stdout.strip()


@pytest.mark.skipif(cupy_available(), reason="checks the verdict where the GPU tests skip")
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_fails_when_the_gpu_tests_skip(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_NO_INSTALL": "1",
           "GPU_CHECK_TESTS": "tests/gpu/test_amp_gpu.py", "GPU_CHECK_BENCH": "0",
           "GPU_CHECK_WORKERS": "1", "PATH": os.environ.get("PATH", "")}
    run = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env,
                         cwd=helpers.ROOT, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    # pytest itself was content: the skips are what the check refuses
    assert "rc 0" in (out / "gpu_check.log").read_text()
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("gpu_check FAILED (tests"), summary
    assert "no GPU test ran" in summary and "needs CuPy and a CUDA device" in summary, summary


def _junit(path, cases: str) -> None:
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}'
                    "</testsuite></testsuites>")


def test_tests_verdict_passes_only_when_tests_ran_and_none_failed_or_skipped(tmp_path):
    xml = tmp_path / "r.xml"
    ok = '<testcase classname="tests.gpu.t" name="test_a"/>'
    _junit(xml, ok * 3)
    assert _report("tests", xml) == (0, "passed (3 passed, 0 failed, 0 errors, 0 skipped)")
    _junit(xml, ok + '<testcase classname="tests.gpu.t" name="test_b"><failure message="x"/></testcase>')
    rc, line = _report("tests", xml)
    assert rc == 1 and "failing: tests.gpu.t::test_b" in line
    _junit(xml, ok + '<testcase classname="tests.gpu.t" name="test_c"><skipped message="no torch"/>'
           "</testcase>")
    rc, line = _report("tests", xml)
    assert rc == 1 and "1 x 'no torch'" in line
    assert _report("tests", xml, "--allow-skip", "torch")[0] == 0
    _junit(xml, "")
    assert _report("tests", xml) == (1, "FAILED (0 passed, 0 failed, 0 errors, 0 skipped): no GPU test ran")
    rc, line = _report("tests", tmp_path / "absent.xml")
    assert rc == 1 and "pytest crashed or timed out" in line


def test_sanitizer_verdict_fails_on_reports_missing_summaries_and_failing_tests(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("....\n12 passed in 3.1s\n========= ERROR SUMMARY: 0 errors\n")
    assert _report("sanitizer", "memcheck", log, 0) == (0, "memcheck 0 errors (12 passed in 3.1s)")
    assert _report("sanitizer", "memcheck", log, 1)[0] == 1          # the tests under it failed
    log.write_text("========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 2 errors\n")
    rc, line = _report("sanitizer", "memcheck", log, 86)
    assert rc == 1 and "2 reports" in line and "Invalid __global__ read" in line
    log.write_text("========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n")
    assert _report("sanitizer", "racecheck", log, 0)[0] == 1
    log.write_text("========= Target application doesn't exist or is not a valid executable\n")
    rc, line = _report("sanitizer", "initcheck", log, 1)
    assert rc == 1 and "no sanitizer summary" in line
