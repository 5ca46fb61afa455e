"""bench_gpu part 8: where a training step's GPU time goes, kernel by kernel.

The step's kernels (cuBLAS's products, the project's CUDA kernels, CuPy's elementwise and
reduction kernels) and copies are recorded by CUPTI through PyTorch's profiler, which traces
every kernel of the process whichever library launched it (kernels replayed from a CUDA graph
included), and read back from its Chrome trace (``cat`` "kernel", "gpu_memcpy", "gpu_memset";
``dur`` in microseconds): the device's busy time per step (the union of those intervals) beside
the step's wall time, launches per step, each category's share and the costliest kernels.

``kernel_table`` is the pure part (a trace dict in, the tables out); ``profile`` runs a
function under the profiler where PyTorch with CUDA is installed (None elsewhere: the dry run).
"""
from __future__ import annotations

import json
import os
import tempfile
import time

from .common import markdown_table

#: trace categories of device work
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str, cat: str) -> str:
    """What launched a device event, from its name: "copy / fill" (memcpy, memset), "cuBLAS"
    (GEMMs), "one_embedding" (the kernels of ``kernels/cuda``, named <family>_<kernel>), "CuPy"
    (its elementwise, reduction and copy kernels), else "other"."""
    from one_embedding.kernels import cuda_module as cm

    if cat != "kernel":
        return "copy / fill"
    low = name.lower()
    if any(f"{family}_" in name for family in cm.FAMILIES):
        return "one_embedding"
    if "cupy" in low:
        return "CuPy"
    if any(tag in low for tag in ("gemm", "cublas", "xmma", "cutlass", "sm90_", "sm80_")):
        return "cuBLAS"
    return "other"


def _busy_us(intervals) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def kernel_table(trace: dict, steps: int, wall_s: float, top: int = 15) -> dict:
    """A Chrome trace of ``steps`` training steps that took ``wall_s`` seconds -> {"per_step":
    {wall_ms, busy_ms, busy_share, launches, kernel_ms}, "categories": [{category, ms/step,
    launches/step, share}], "kernels": the ``top`` costliest [{kernel, category, launches/step,
    us/step, us/launch, share}]} (shares of the summed device time)."""
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    steps = max(int(steps), 1)
    by_name: dict = {}
    for e in events:
        row = by_name.setdefault((e.get("name", "?"), e["cat"]), [0, 0.0])
        row[0] += 1
        row[1] += float(e.get("dur", 0.0))
    device_us = sum(us for _, us in by_name.values()) or 1.0
    cats: dict = {}
    kernels = []
    for (name, cat), (count, us) in by_name.items():
        kind = category(name, cat)
        c = cats.setdefault(kind, [0, 0.0])
        c[0] += count
        c[1] += us
        kernels.append({"kernel": name if len(name) <= 90 else name[:87] + "...", "category": kind,
                        "launches/step": count / steps, "us/step": us / steps,
                        "us/launch": us / count, "share": us / device_us})
    kernels.sort(key=lambda r: -r["us/step"])
    busy = _busy_us((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events)
    wall_ms = wall_s * 1e3 / steps
    return {
        "per_step": {"wall_ms": wall_ms, "busy_ms": busy / 1e3 / steps,
                     "busy_share": busy / 1e3 / steps / wall_ms if wall_ms else float("nan"),
                     "launches": sum(c for c, _ in by_name.values()) / steps,
                     "kernel_ms": device_us / 1e3 / steps},
        "categories": sorted(({"category": k, "ms/step": us / 1e3 / steps,
                               "launches/step": n / steps, "share": us / device_us}
                              for k, (n, us) in cats.items()), key=lambda r: -r["ms/step"]),
        "kernels": kernels[:top],
    }


def profile(fn, steps: int) -> dict | None:
    """Run ``fn()`` (which runs ``steps`` training steps and waits for the device) under
    PyTorch's profiler with CUDA activity -> ``kernel_table`` of its trace; None where PyTorch
    or its CUDA is missing."""
    try:
        import torch
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return kernel_table(trace, steps, wall)


def print_profile(table: dict, mode: str, steps: int) -> str:
    """Prints one ``kernel_table`` of the CLI's path under ``--amp mode``; -> the summary's
    phrase."""
    step = table["per_step"]
    print(f"\n## where the CLI step's GPU time goes, --amp {mode} ({steps} steps, the warmup and "
          f"the graph's capture included): wall {step['wall_ms']:.1f} ms/step, device busy "
          f"{step['busy_ms']:.1f} ms ({step['busy_share']:.0%}), {step['launches']:.0f} "
          "launches/step")
    print(markdown_table(table["categories"], ["category", "ms/step", "launches/step", "share"]))
    print(markdown_table(table["kernels"], ["kernel", "category", "launches/step", "us/step",
                                            "us/launch", "share"]))
    return (f"profile --amp {mode}: device busy {step['busy_share']:.0%} of "
            f"{step['wall_ms']:.1f} ms/step, {step['launches']:.0f} launches/step")
