"""The device path's stream order, checked in the default suite: ``tests/gpu/test_stream_order_gpu.py``
on the dry run of the device path (a process of its own: the dry run puts a stand-in ``cupy``
into ``sys.modules``). There ``tests/stream_order.py`` gives each stream a vector clock and
checks every device array access of training runs (prefetch depths 1 and 2, device_mem and
cached_host_mem, synthetic rows made on the device and Parquet batches staged through
page-locked buffers, AMP, CUDA graphs, snapshots) for a buffer freed while another stream may
still use it and for accesses of two streams with no event between; and it finds the two races
that an H200 found on 2026-11-27, put back by hand, and a third (a staging buffer overwritten
under its upload)."""
import os
import subprocess
import sys

import helpers


def test_the_device_path_keeps_cuda_stream_order_on_the_dry_run():
    root = helpers.ROOT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root / "tests"), str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("ONE_EMBEDDING_CUDA_EMULATION_SEED", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gpu_dry_run", "-m", "gpu",
                        "-p", "no:cacheprovider", "tests/gpu/test_stream_order_gpu.py"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
