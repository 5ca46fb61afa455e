"""Scale of the SSD tier: RAM per stored key, snapshot and reopen costs, a table larger than RAM.

    python -m benchmarks.bench_scale [--part a|b|both] [--keys 2000000] [--steps 600] [--dir /work]

(a) Table figures, per SSD engine (slots, rocksdb), for the code of this checkout ("new") and for
    ``--baseline-ref`` ("baseline", default 2bf9b1a, the commit before the segment-log
    redesign), checked out with ``git worktree`` and measured by the same worker in the same run.
    One table, dim 32, Adam (a line is 96 floats = 384 B), cached_ssd with a ``--cache-mb`` cache;
    keys are created by training steps over ``--fill-batch`` new ids at a time. Each (engine,
    code) pair runs in a fresh process, so its RSS is its own.
    1. RAM per stored key: at ``--mid-keys`` and at ``--keys`` keys, after two warm-up steps of
       existing ids (fixed caches and allocator arenas at steady state), ``trim_heap()`` and, for
       RocksDB, idle background work: the SSD tier's ``memory_bytes`` and the process's
       RssAnon. Reported: their growth / the growth of the SSD tier's rows, in bytes per key.
    2. Snapshots: ``s0``, then 5 times a step over 1% of the stored rows (distinct, at random)
       and ``save_snapshot(f"s{i}")``; the bytes the process wrote (/proc/self/io write_bytes)
       over the save and the background work it left, / the table's bytes (rows x 384 B). Disk
       of the whole persistent path (allocated blocks, each inode once) with all 6 snapshots, and
       after deleting the oldest to keep ``--keep`` (where the code has ``delete_snapshot``).
    3. Reopen: ``close()``, then a new embedding on the same path + ``load_snapshot`` of the
       newest snapshot: bytes written / table bytes, and wall seconds; the row count is checked.
(b) A training run whose table is several times the process's peak RSS: DLRM dim 128, bottom
    MLP 512-256-128, top 1024-1024-512-256-1, synthetic Criteo with mlperf40m cardinalities x
    ``--cardinality-scale``, Zipf 1.05, batch ``--batch``, ``--steps`` steps, through
    ``one_embedding.training.train``: cached_ssd (slots, ``--train-cache-mb`` cache) in a
    cgroup-v1 memory cgroup of ``--memory-limit-gb``, and the same model on device_mem (no
    limit) as the baseline. Reported: samples/s (the final record's steady state) and their
    ratio, peak RSS (VmHWM) of each run, the table's bytes on disk, and the SSD tier's block
    reads per second of training wall time (the prefetch thread reads while the dense model
    computes, so the embedding phase's seconds would undercount the time reads take) against the
    disk's raw rate: random 4 KiB O_DIRECT reads with ``--io-threads`` threads from a
    ``--raw-mb`` file on the same disk, the mean of a measurement before and after the runs.

Results: markdown tables on stdout, ``RESULTS/bench_scale.json`` and ``RESULTS/bench_scale.png``
(RESULTS is ``benchmarks/results`` unless ONE_EMBEDDING_BENCH_RESULTS says otherwise). A run of
one part replaces that part's figures only: the other part's stay as the file held them, and
``measured_by`` names the machine and configuration of the run behind each part (the plot is
redrawn when (a) ran).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np

from . import common
from .common import markdown_table, measured_by, previous_result, print_header, save_result
from .scale_training import b_tables, part_b, train_worker
from .scale_workers import (ROOT, disk_bytes, fmt, peak_rss, proc_tools, read_result,
                            package_parent, run_worker)


# ---- (a): the table of the issue
DIM = 32
SIZE_FACTOR = 3                        # Adam: the row and two states
LINE_BYTES = 4 * DIM * SIZE_FACTOR     # 384 B per stored row
KEY_STRIDE = 2654435761                # ids are index * stride: spread keys, still distinct
WARMUP_STEPS = 2
CHANGED_SHARE = 0.01                   # rows changed between two snapshots
SNAPSHOTS_AFTER_FIRST = 5
#: DESIGN.md's budgets: RAM per stored key (bytes), disk with the kept snapshots (x table),
#: bytes a reopen may write (x table)
GOALS = {"ram_per_key": {"slots": 8, "rocksdb": 4}, "disk_kept": 2.0, "reopen_write": 0.1}



def filesystem_type(path: str) -> str:
    """The type of the filesystem ``path`` lives on, from /proc/mounts ("" where unknown)."""
    path, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mount, fstype = line.split()[1:3]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):  # the deepest mount holding the path
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


def working_folder(arg: str | None) -> str:
    """``--dir`` (made if missing), else /work or the temp folder; never a RAM filesystem."""
    parent = arg or ("/work" if os.access("/work", os.W_OK) else tempfile.gettempdir())
    kind = filesystem_type(parent)
    if kind in ("tmpfs", "ramfs"):
        raise SystemExit(f"--dir {parent!r} is on {kind}, in RAM: the benchmark measures a disk; "
                         "pass --dir on one (e.g. --dir /work)")
    os.makedirs(parent, exist_ok=True)
    return parent


# ---------------------------------------------------------------- (a) the table worker
def _build_table(engine: str, path: str, cache_mb: float):
    """The issue's table: one table, dim 32, cached_ssd over ``engine``; and its Adam."""
    import one_embedding as oe

    opts = oe.make_cached_ssd_store_options(cache_mb, path, engine=engine, size_factor=SIZE_FACTOR)
    emb = oe.MultiTableEmbedding("t", DIM, np.float32, np.int64, None, opts, seed=0)
    return emb, oe.Optimizer(oe.optim.Adam(lr=1e-3), embeddings=[emb])


def _train_over(emb, opt, ids: np.ndarray, batch: int) -> None:
    """Adam steps over ``ids`` (n,) int64, ``batch`` at a time: every row named is created or
    changed (the gradient is a constant: its values do not matter here)."""
    for s in range(0, ids.shape[0], batch):
        part = ids[s:s + batch]
        emb(part)                                                   # (b, DIM)
        emb.backward(np.full((part.shape[0], DIM), 1e-3, np.float32))
        opt.step()
        opt.zero_grad()


def _rocksdb_idle(emb, flush: bool = False, timeout_s: float = 120.0) -> float:
    """Wait until RocksDB runs no flush or compaction and has none pending (``flush``: write its
    memtables out first); seconds waited. The new store says so itself (``flush(wait_idle=)``,
    both column families); for older code this reaches into the store. Any failure means "not
    RocksDB here" and returns 0."""
    props = ("rocksdb.num-running-compactions", "rocksdb.num-running-flushes",
             "rocksdb.compaction-pending", "rocksdb.mem-table-flush-pending")
    t0 = time.perf_counter()
    try:
        bottom = emb._owner()._chain.bottom
        db = bottom._db
        if hasattr(bottom, "flush"):
            if flush:
                bottom.flush(wait_idle=True)
            else:
                while (any(bottom._int_property(p, both=True) for p in props)
                       and time.perf_counter() - t0 < timeout_s):
                    time.sleep(0.05)
            return time.perf_counter() - t0
        if flush:
            db.flush()
        while (any(int(db.property_int_value(p) or 0) for p in props)
               and time.perf_counter() - t0 < timeout_s):
            time.sleep(0.05)
        return time.perf_counter() - t0
    except Exception:
        return 0.0


def table_worker(job: dict) -> dict:
    """Part (a) for one engine on the ``one_embedding`` this process imported. job: engine,
    path, keys, mid_keys, cache_mb, fill_batch, keep. Returns the raw figures (bytes, rows,
    seconds); ratios are the parent's."""
    import one_embedding

    rss_anon, trim_heap, bytes_written, tools = proc_tools()
    engine, path, batch = job["engine"], job["path"], job["fill_batch"]
    rng = np.random.default_rng(7)
    emb, opt = _build_table(engine, path, job["cache_mb"])
    if 4 * emb.line_size != LINE_BYTES:
        raise SystemExit(f"a line of this table is {4 * emb.line_size} B, not the issue's "
                         f"{LINE_BYTES} B (dim {DIM} x Adam's size factor {SIZE_FACTOR})")
    has_delete = hasattr(emb, "delete_snapshot")
    ssd = len(emb.store_stats()) - 1   # the SSD tier is the bottom one
    filled, points = 0, []
    t_fill = time.perf_counter()
    for target in (job["mid_keys"], job["keys"]):
        _train_over(emb, opt, np.arange(filled, target, dtype=np.int64) * KEY_STRIDE, batch)
        filled = target
        for _ in range(WARMUP_STEPS):  # existing ids: caches and arenas settle at this size
            some = rng.choice(filled, min(batch, filled), replace=False)
            _train_over(emb, opt, some * KEY_STRIDE, batch)
        # RocksDB's memtable is a bounded write buffer, full to an arbitrary level at any given
        # moment: flushed, both points see it empty and the growth is the per-key cost
        idle = _rocksdb_idle(emb, flush=True)
        trim_heap()
        tier = emb.store_stats()[ssd]
        points.append({"keys": filled, "ssd_rows": tier["rows"],
                       "memory_bytes": tier["memory_bytes"], "rss_anon": rss_anon(),
                       "idle_wait_s": idle})
    fill_s = time.perf_counter() - t_fill

    emb.save_snapshot("s0")
    table_rows = len(emb)
    snapshots = []
    for i in range(1, SNAPSHOTS_AFTER_FIRST + 1):
        changed = rng.choice(filled, max(1, int(table_rows * CHANGED_SHARE)), replace=False)
        _train_over(emb, opt, changed * KEY_STRIDE, batch)
        _rocksdb_idle(emb)  # the training's own background writes are not the snapshot's
        w0, t0 = bytes_written(), time.perf_counter()
        emb.save_snapshot(f"s{i}")
        seconds = time.perf_counter() - t0
        _rocksdb_idle(emb)  # ... but the compactions its flush started are
        snapshots.append({"name": f"s{i}", "rows_changed": int(changed.shape[0]),
                          "bytes_written": bytes_written() - w0, "seconds": seconds})
    names = [f"s{i}" for i in range(SNAPSHOTS_AFTER_FIRST + 1)]
    disk_all = disk_bytes(path)
    disk_kept = None
    if has_delete:
        for name in names[:-job["keep"]]:
            emb.delete_snapshot(name)
        disk_kept = disk_bytes(path)
    tier = emb.store_stats()[ssd]
    emb.close()
    del emb, opt
    trim_heap()

    # reopen in place: a new embedding on the path, then the newest snapshot
    w0, t0 = bytes_written(), time.perf_counter()
    emb, opt = _build_table(engine, path, job["cache_mb"])
    emb.load_snapshot(names[-1])
    reopen_s = time.perf_counter() - t0
    _rocksdb_idle(emb)
    reopen_written = bytes_written() - w0
    reopened_rows = len(emb)
    emb.close()
    return {
        "engine": engine, "library": os.path.dirname(os.path.dirname(one_embedding.__file__)),
        "proc_tools": tools, "line_bytes": LINE_BYTES, "points": points, "fill_seconds": fill_s,
        "table_rows": table_rows, "table_bytes": table_rows * LINE_BYTES,
        "snapshots": snapshots, "snapshots_kept_all": len(names), "disk_all_bytes": disk_all,
        "has_delete_snapshot": has_delete, "kept": job["keep"] if has_delete else None,
        "disk_kept_bytes": disk_kept, "ssd_tier_after_snapshots": tier,
        "reopen_bytes_written": reopen_written, "reopen_seconds": reopen_s,
        "reopened_rows": reopened_rows, "peak_rss": peak_rss(),
    }


def table_figures(raw: dict) -> dict:
    """The reported figures of one ``table_worker`` result: bytes per key and x table bytes."""
    mid, end = raw["points"]
    grown = end["ssd_rows"] - mid["ssd_rows"]
    table = raw["table_bytes"]
    written = [s["bytes_written"] / table for s in raw["snapshots"]]

    def per_key(what):  # None where the SSD tier did not grow (a cache as big as the table)
        return (end[what] - mid[what]) / grown if grown > 0 else None

    return {
        "ram_per_key_memory_bytes": per_key("memory_bytes"),
        "ram_per_key_rss_anon": per_key("rss_anon"),
        "snapshot_write_x": float(np.mean(written)), "snapshot_write_max_x": max(written),
        "disk_all_x": raw["disk_all_bytes"] / table,
        "disk_kept_x": None if raw["disk_kept_bytes"] is None else raw["disk_kept_bytes"] / table,
        "reopen_write_x": raw["reopen_bytes_written"] / table,
        "reopen_seconds": raw["reopen_seconds"],
        "fill_seconds": raw["fill_seconds"],
    }


#: (figure key, label, unit) in the order of the table and the plot
TABLE_ROWS = [
    ("ram_per_key_memory_bytes", "RAM per stored key: SSD tier memory_bytes", "B/key"),
    ("ram_per_key_rss_anon", "RAM per stored key: process RssAnon", "B/key"),
    ("snapshot_write_x", "save_snapshot after 1% changed: written (mean of 5)", "x table"),
    ("snapshot_write_max_x", "save_snapshot after 1% changed: written (max of 5)", "x table"),
    ("disk_all_x", "disk with all 6 snapshots", "x table"),
    ("disk_kept_x", "disk after delete_snapshot of all but the newest --keep", "x table"),
    ("reopen_write_x", "reopen + load_snapshot: written", "x table"),
    ("reopen_seconds", "reopen + load_snapshot: wall time", "s"),
    ("fill_seconds", "filling the table (training steps)", "s"),
]


def _goal(key: str, engine: str) -> str:
    if key.startswith("ram_per_key"):
        return f"<= {GOALS['ram_per_key'][engine]}"
    return {"disk_kept_x": f"<= {GOALS['disk_kept']}",
            "reopen_write_x": f"<= {GOALS['reopen_write']}"}.get(key, "")


# ---------------------------------------------------------------- (a) the parent
def baseline_worktree(ref: str, parent: str) -> tuple[str | None, bool, str]:
    """A checkout of ``ref`` for the baseline worker: (folder or None, made here, note).

    Reused where ``parent`` already holds one at the same commit, else made there with ``git
    worktree add``."""
    def git(*args, cwd=ROOT):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)

    r = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    if r.returncode != 0:
        return None, False, f"git cannot resolve --baseline-ref {ref!r}: {r.stderr.strip()}"
    sha = r.stdout.strip()
    folder = os.path.join(parent, f"bench_scale_baseline_{sha[:12]}")
    if os.path.isdir(folder):
        head = git("rev-parse", "HEAD", cwd=folder)
        if head.returncode == 0 and head.stdout.strip() == sha:
            return folder, False, f"reused {folder}"
        return None, False, (f"{folder} exists but is not a checkout of {sha[:12]}: remove it "
                             "(git worktree remove --force) or pass another --dir")
    r = git("worktree", "add", "--detach", folder, sha)
    if r.returncode != 0:
        return None, False, f"git worktree add failed: {r.stderr.strip()}"
    return folder, True, f"made {folder}"


def remove_worktree(folder: str) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", folder], cwd=ROOT,
                   capture_output=True, text=True)
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True, text=True)


def part_a(args, root: str) -> dict:
    """Both engines, new and (where its checkout works) baseline code, one process each."""
    mid = args.mid_keys if args.mid_keys is not None else min(500_000, args.keys // 4)
    if not 0 < mid < args.keys:
        raise SystemExit(f"--mid-keys {mid} must be between 0 and --keys {args.keys} (both "
                         "excluded): RAM per key is the growth between the two sizes")
    codes = {"new": ROOT}
    note, made = "not measured (--baseline-ref none)", None
    if args.baseline_ref.lower() != "none":
        # under --dir it may be reused (and kept, with --keep-worktree); else it is this run's
        folder, fresh, note = baseline_worktree(args.baseline_ref, args.dir or root)
        if folder is None:
            print(f"  baseline skipped: {note}", flush=True)
        else:
            codes = {"baseline": folder, **codes}
            made = folder if fresh and not (args.dir and args.keep_worktree) else None
    results = {}
    try:
        for engine in args.engines:
            for code, lib in codes.items():
                path = os.path.join(root, f"{code}-{engine}")
                job = {"engine": engine, "path": path, "keys": args.keys, "mid_keys": mid,
                       "cache_mb": args.cache_mb, "fill_batch": args.fill_batch,
                       "keep": args.keep, "out": os.path.join(root, f"{code}-{engine}.json")}
                t0 = time.perf_counter()
                raw = read_result(run_worker("table", job, lib, root), job, f"{code} {engine}")
                shutil.rmtree(path, ignore_errors=True)
                if os.path.realpath(raw["library"]) != os.path.realpath(package_parent(lib)):
                    raise SystemExit(f"the {code} worker imported one_embedding from "
                                     f"{raw['library']}, not {lib}")
                if raw["reopened_rows"] != raw["table_rows"]:
                    raise SystemExit(f"{code} {engine}: the reopened table holds "
                                     f"{raw['reopened_rows']:,} rows, the saved one "
                                     f"{raw['table_rows']:,}")
                raw["figures"] = table_figures(raw)
                results[f"{code}/{engine}"] = raw
                f = raw["figures"]
                print(f"  {code} {engine}: {raw['table_rows']:,} rows; RAM/key "
                      f"{fmt(f['ram_per_key_memory_bytes'])} B (memory_bytes), "
                      f"{fmt(f['ram_per_key_rss_anon'])} B (RssAnon); snapshot writes "
                      f"{f['snapshot_write_x']:.3f}x; reopen writes {f['reopen_write_x']:.3f}x in "
                      f"{f['reopen_seconds']:.2f} s ({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        if made:
            remove_worktree(made)
    rows = []
    for engine in args.engines:
        for key, label, unit in TABLE_ROWS:
            row = {"engine": engine, "figure": label, "unit": unit, "goal": _goal(key, engine)}
            for code in codes:
                row[code] = fmt(results[f"{code}/{engine}"]["figures"][key])
            rows.append(row)
    return {"mid_keys": mid, "baseline_ref": args.baseline_ref, "baseline_note": note,
            "codes": codes, "runs": results, "rows": rows}


# ---------------------------------------------------------------- plot, main
def plot(a: dict, path: str) -> None:
    """One panel per (a) figure: bars per engine, baseline and new side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codes = list(a["codes"])
    engines = list(dict.fromkeys(r["engine"] for r in a["runs"].values()))
    keys = [k for k in TABLE_ROWS if k[0] != "snapshot_write_max_x"]
    cols = 4
    n_rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4 * cols, 3.2 * n_rows), squeeze=False)
    width = 0.8 / len(codes)
    for ax, (key, label, unit) in zip(axes.flat, keys):
        for j, code in enumerate(codes):
            values = [a["runs"][f"{code}/{e}"]["figures"][key] for e in engines]
            ax.bar(np.arange(len(engines)) + (j - (len(codes) - 1) / 2) * width,
                   [np.nan if v is None else v for v in values], width, label=code)
        goals = [_goal(key, e) for e in engines]
        for i, g in enumerate(goals):
            if g:  # the budget, a dashed line over its engine's bars
                ax.hlines(float(g.split()[-1]), i - 0.45, i + 0.45, colors="k", linestyles="--",
                          label="goal" if i == 0 else None)
        ax.set_xticks(np.arange(len(engines)), engines)
        ax.set_title(label, fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"SSD tier at scale: {a['baseline_ref']} (baseline) vs this checkout (new)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("a", "b", "both"), default="both")
    p.add_argument("--dir", help="working folder on the disk to measure (default /work or the "
                                 "temp folder); a run folder is made in it and removed after")
    a = p.add_argument_group("(a) table figures")
    a.add_argument("--keys", type=int, default=2_000_000, help="keys stored at the end")
    a.add_argument("--mid-keys", type=int, default=None,
                   help="the first RAM measurement (default min(500000, keys / 4))")
    a.add_argument("--cache-mb", type=float, default=16.0, help="cache above the SSD tier")
    a.add_argument("--fill-batch", type=int, default=65536, help="ids per training step")
    a.add_argument("--keep", type=int, default=3, help="snapshots kept by delete_snapshot")
    a.add_argument("--engines", nargs="+", choices=("slots", "rocksdb"),
                   default=["slots", "rocksdb"])
    a.add_argument("--baseline-ref", default="2bf9b1a",
                   help="git ref of the baseline code ('none': no baseline)")
    a.add_argument("--keep-worktree", action="store_true",
                   help="keep the baseline's worktree under --dir for the next run")
    b = p.add_argument_group("(b) training beyond RAM")
    b.add_argument("--steps", type=int, default=600)
    b.add_argument("--batch", type=int, default=4096)
    b.add_argument("--cardinality-scale", type=float, default=1.0,
                   help="multiplies the mlperf40m cardinalities")
    b.add_argument("--synthetic-rows", type=int, default=4_000_000,
                   help="rows of the synthetic source; the default holds 600 x 4096 training "
                        "rows, so no row comes twice and new keys keep arriving")
    b.add_argument("--train-cache-mb", type=float, default=256.0)
    b.add_argument("--memory-limit-gb", type=float, default=1.5, help="cgroup limit of cached_ssd")
    b.add_argument("--raw-mb", type=int, default=2048, help="size of the raw-read file")
    b.add_argument("--raw-seconds", type=float, default=4.0, help="per raw-read measurement")
    b.add_argument("--io-threads", type=int, default=16, help="threads of the raw reads")
    p.add_argument("--worker", choices=("table", "train"), help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("keys", "cache_mb", "fill_batch", "keep", "steps", "batch", "synthetic_rows",
                 "train_cache_mb", "memory_limit_gb", "raw_mb", "raw_seconds", "io_threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.keep > SNAPSHOTS_AFTER_FIRST:
        p.error(f"--keep {args.keep}: the run makes {SNAPSHOTS_AFTER_FIRST + 1} snapshots; keep "
                f"at most {SNAPSHOTS_AFTER_FIRST}, so some are deleted")
    return args


def keep_other_parts(payload: dict) -> tuple[dict, list[str]]:
    """A run of one part leaves the other part's figures in ``bench_scale.json``: the parts the
    file holds and ``payload`` lacks are copied into it. Returns the earlier file ({} when
    there is none, or when every part was measured now) and the parts copied from it."""
    if all(part in payload for part in ("a", "b")):
        return {}, []
    previous = previous_result("bench_scale")
    kept = [part for part in ("a", "b") if part not in payload and part in previous]
    for part in kept:
        payload[part] = previous[part]
    for part in ("a", "b"):  # the file's order whichever part ran
        if part in payload:
            payload[part] = payload.pop(part)
    return previous, kept


def main(argv=None):
    args = parse_args(argv)
    if args.worker:  # a child started by run_worker: measure, write the result, nothing else
        job = json.loads(args.job)
        result = (table_worker if args.worker == "table" else train_worker)(job)
        with open(job["out"], "w") as f:
            json.dump(result, f)
        return
    args.dir_parent = working_folder(args.dir)
    config = {k: v for k, v in vars(args).items() if k not in ("worker", "job", "dir_parent")}
    machine = print_header("Scale of the SSD tier: RAM per key, snapshots, reopen, a table "
                           "beyond RAM", config)
    root = tempfile.mkdtemp(prefix="bench_scale_", dir=args.dir_parent)
    print(f"working folder: {root} ({filesystem_type(root) or 'unknown filesystem'})", flush=True)
    payload = {"machine": machine, "config": {**config, "fs_dir": root}}
    try:
        if args.part in ("a", "both"):
            print(f"\n## (a) one table, dim {DIM}, Adam ({LINE_BYTES} B lines), cached_ssd "
                  f"{args.cache_mb:g} MB, {args.keys:,} keys", flush=True)
            a = part_a(args, root)
            payload["a"] = a
            codes = [c for c in ("baseline", "new") if c in a["codes"]]
            print()
            print(markdown_table(a["rows"], ["engine", "figure", "unit", *codes, "goal"]))
            print(f"baseline {a['baseline_ref']}: {a['baseline_note']}. RAM per key: growth "
                  f"{a['mid_keys']:,} -> {args.keys:,} keys over the growth of the SSD tier's "
                  "rows; 'x table' = bytes / (rows x 384 B)")
        if args.part in ("b", "both"):
            print(f"\n## (b) DLRM on synthetic mlperf40m x{args.cardinality_scale:g}, batch "
                  f"{args.batch}, {args.steps} steps", flush=True)
            b = part_b(args, root)
            payload["b"] = b
            print()
            print(b_tables(b))
            print("SSD blocks read/s = the SSD tier's read_blocks in the final record (training, "
                  "one eval batch, final snapshot) / the training steps' wall seconds")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    measured = [part for part in ("a", "b") if part in payload]
    previous, kept = keep_other_parts(payload)
    payload["measured_by"] = measured_by(previous, measured, kept, machine, payload["config"])
    path = save_result("bench_scale", payload)
    print(f"\nwrote {path}" + (f" (part {', '.join(kept)} kept from its earlier run)"
                               if kept else ""))
    if "a" in measured:
        png = os.path.join(common.RESULTS, "bench_scale.png")
        plot(payload["a"], png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
