"""What ``bench_scale``'s parent and its workers share: starting a worker on a given checkout of
the library, reading what it wrote, and the /proc and disk readers the measurements use."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: starts a worker on the library at argv[1]: ``one_embedding`` is imported from there first
#: (its submodules follow its __path__), then this file's ``benchmarks`` from argv[2]; both
#: folders hold packages of both names, so one sys.path order cannot pick the two we want
_BOOT = ("import runpy, sys; lib, here = sys.argv[1:3]; del sys.argv[1:3]; "
         "sys.path.insert(0, lib); import one_embedding; sys.path[0] = here; "
         "runpy.run_module('benchmarks.bench_scale', run_name='__main__', alter_sys=True)")


def _proc_field(path: str, field: str) -> int:
    """The first number after ``field`` in a /proc file of this process (0 where missing)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def proc_tools():
    """(rss_anon, trim_heap, bytes_written, where from): ``one_embedding.procstats`` of this
    checkout, loaded from its file (it imports nothing of the package), so the baseline code,
    which has no such module, is measured with the very same readers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_scale_procstats", os.path.join(ROOT, "src", "one_embedding", "procstats.py"))
    procstats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(procstats)
    return procstats.rss_anon, procstats.trim_heap, procstats.bytes_written, "procstats"


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), bytes."""
    return 1024 * _proc_field("/proc/self/status", "VmHWM:")


def disk_bytes(path: str) -> int:
    """Bytes allocated under ``path`` (st_blocks x 512), each hard-linked inode counted once."""
    seen, total = set(), 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:  # deleted while we walk
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def package_parent(checkout: str) -> str:
    """The folder that holds a checkout's ``one_embedding`` package: ``src/`` (today's layout)
    or the checkout itself (the flat layout of older commits, a baseline's)."""
    src = os.path.join(checkout, "src")
    return src if os.path.isfile(os.path.join(src, "one_embedding", "__init__.py")) else checkout


def run_worker(kind: str, job: dict, lib: str, cwd: str,
               preexec_fn=None) -> subprocess.CompletedProcess:
    """This module's ``--worker kind`` in a fresh Python on the ``one_embedding`` under ``lib``;
    its result is read back from ``job["out"]``. glibc's mmap threshold is fixed and its arenas
    are two, for both codes alike, so freed buffers go back to the kernel and RssAnon shows the
    memory in use rather than what the allocator keeps around."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_ARENA_MAX="2")
    cmd = [sys.executable, "-c", _BOOT, package_parent(lib), ROOT, "--worker", kind, "--job",
           json.dumps(job)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          preexec_fn=preexec_fn)


def read_result(proc: subprocess.CompletedProcess, job: dict, what: str) -> dict:
    if proc.returncode != 0 or not os.path.exists(job["out"]):
        raise SystemExit(f"{what} failed (exit status {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(job["out"]) as f:
        return json.load(f)


def fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
