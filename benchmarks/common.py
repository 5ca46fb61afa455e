"""Helpers every benchmark shares: the machine header, Zipf ids, timing, result files."""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from datetime import datetime, timezone

import numpy as np

#: where result JSON goes; ONE_EMBEDDING_BENCH_RESULTS redirects it (the smoke tests use a temp dir
#: so they never overwrite the committed measurements)
RESULTS = os.environ.get("ONE_EMBEDDING_BENCH_RESULTS",
                         os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def print_header(title: str, config: dict) -> dict:
    m = machine()
    print(f"# {title}")
    print(f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, Python {m['python']}, "
          f"numpy {m['numpy']}, {m['date_utc']} UTC")
    print("config: " + ", ".join(f"{k}={v}" for k, v in config.items()))
    return m


def run_folder(prefix: str, parent: str | None) -> str:
    """A fresh folder for one run's files (``tempfile.mkdtemp``: ``prefix`` and a random tail)
    under ``parent`` (``--dir``; None: the system temp folder). A missing ``parent`` is made; one
    that cannot be made or written ends the run with one line saying so (a bare
    FileNotFoundError from mkdtemp before). The prefixes are in .gitignore: a killed run under
    the checkout leaves its folder there."""
    try:
        if parent is not None:
            os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=prefix, dir=parent)
    except OSError as e:
        where = parent if parent is not None else tempfile.gettempdir()
        raise SystemExit(f"{prefix.rstrip('_')}: cannot make a run folder in {where!r}: "
                         f"{e.strerror or e}; pass --dir a writable folder") from None


def zipf_ids(rng: np.random.Generator, alpha: float, n_keys: int, size) -> np.ndarray:
    """Zipf(alpha)-ranked ids in [0, n_keys): rank r has probability ~ r**-alpha (ranks past
    n_keys are redrawn), then ranks are scattered over the key range by a fixed odd multiplier
    so that hot keys are not neighbours."""
    out = rng.zipf(alpha, size=size).astype(np.int64)
    bad = out > n_keys
    while bad.any():
        out[bad] = rng.zipf(alpha, size=int(bad.sum()))
        bad = out > n_keys
    return ((out - 1) * 0x9E3779B1) % n_keys


def timed(fn, steps: int, warmup: int) -> float:
    """Seconds per call of ``fn(i)`` after ``warmup`` calls."""
    for i in range(warmup):
        fn(i)
    t = time.perf_counter()
    for i in range(warmup, warmup + steps):
        fn(i)
    return (time.perf_counter() - t) / steps


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"{v:,.0f}" if isinstance(v, float) and abs(v) >= 100 else
                         f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_result(name: str, payload: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


def previous_result(name: str) -> dict:
    """``RESULTS/name.json`` as an earlier run left it: {} when there is none, or (with a
    warning) when it does not parse. A run of some of a benchmark's parts keeps the others' from
    it (``measured_by`` records which run measured each)."""
    path = os.path.join(RESULTS, f"{name}.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"warning: {path} unreadable ({type(e).__name__}: {e}); this run's parts replace it")
        return {}
    return data if isinstance(data, dict) else {}


def measured_by(previous: dict, parts: list[str], kept: list[str], machine: dict,
                config: dict) -> dict:
    """{part: {"machine", "config"}}: the run that measured each part a merged result file holds.
    ``parts`` were measured now; ``kept`` come from ``previous``, whose own ``measured_by`` names
    their run (a file written before that record: its top-level machine and config)."""
    before = previous.get("measured_by", {})
    out = {}
    for part in kept:
        out[part] = before.get(part) or {"machine": previous.get("machine"),
                                         "config": previous.get("config")}
    for part in parts:
        out[part] = {"machine": machine, "config": config}
    return out
