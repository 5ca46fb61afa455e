"""bench_serve (and bench_serve_fronts, serve_floors) change the system only when asked: a missing
wrk or h2load ends the run naming the packages and --install-tools (it ran apt-get install as root
on its own before); with --install-tools, apt-get installs them."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import helpers

sys.path.insert(0, str(helpers.ROOT))
bench_serve = pytest.importorskip("benchmarks.bench_serve")


@pytest.fixture
def no_h2load(monkeypatch):
    installed = {"wrk": "/usr/bin/wrk", "apt-get": "/usr/bin/apt-get"}
    monkeypatch.setattr(shutil, "which", lambda name: installed.get(name))
    monkeypatch.setattr(bench_serve.os, "geteuid", lambda: 0, raising=False)
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        installed["h2load"] = "/usr/bin/h2load"
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_serve.subprocess, "run", fake_run)
    return calls


def test_a_missing_tool_ends_the_run_saying_what_to_install(no_h2load):
    with pytest.raises(SystemExit) as e:
        bench_serve.find_tools()
    msg = str(e.value.code)
    assert "h2load" in msg and "nghttp2-client" in msg and "--install-tools" in msg
    assert "wrk," not in msg
    assert no_h2load == []  # nothing installed unasked, even as root


def test_install_tools_installs_the_missing_ones_only(no_h2load):
    assert bench_serve.find_tools(install=True) == {"wrk": "/usr/bin/wrk",
                                                    "h2load": "/usr/bin/h2load"}
    assert no_h2load == [["apt-get", "install", "-y", "nghttp2-client"]]


def test_install_tools_without_root_says_so(no_h2load, monkeypatch):
    monkeypatch.setattr(bench_serve.os, "geteuid", lambda: 1000, raising=False)
    with pytest.raises(SystemExit, match="needs root"):
        bench_serve.find_tools(install=True)
    assert no_h2load == []


@pytest.mark.parametrize("module", ["bench_serve", "bench_serve_fronts", "serve_floors"])
def test_each_serving_benchmark_asks_before_it_installs(module, no_h2load):
    mod = pytest.importorskip(f"benchmarks.{module}")
    with pytest.raises(SystemExit, match="--install-tools"):
        mod.main([])
    assert no_h2load == []
