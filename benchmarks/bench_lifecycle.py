"""Feature lifecycle: rows stored, disk and AUC under admission and eviction rules.

    python -m benchmarks.bench_lifecycle [--part real|zipf|both] [--rows 1000000]

Each rule set trains DLRM (Adagrad) through `one-embedding train` on a cached_ssd table (slot
engine, a 64 MB cache) and reports, from the final record: rows stored, the SSD table's bytes on
disk after the final snapshot and its garbage collection, rows admitted / lookups not admitted
/ rows evicted, and the AUC and log loss on the held-out split. The baseline, measured in the
same run, is the first rule set: ``--admit-min-count 1`` with no eviction (every id stored at
first sight, kept for ever); every row reports its rows and disk as a fraction of it and its
AUC as a difference.

Parts:
- ``real``: every real Criteo row under ../shared/data/criteo (1,300 rows of Criteo 1TB day 0 and
  Kaggle; ids are the raw hashes), 20 % held out, batches of 32, one epoch. The rows are few: the
  row counts show the real long tail, the AUC (about 260 held-out rows) is only indicative.
- ``zipf``: synthetic Criteo with the Kaggle cardinalities at full scale (33.8 M ids) and Zipf
  ids (alpha 1.05), ``--rows`` rows in batches of 4,096, one epoch, 5 % held out.

Writes results/lifecycle.json, a plot (results/lifecycle.png: rows stored and AUC per rule set)
and prints the markdown table docs/lifecycle.md shows. A run of one part replaces that part's
records only: the other part's stay as the file held them (and in the plot), and
``measured_by`` names the machine and configuration of the run behind each part.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from . import common
from .common import markdown_table, measured_by, previous_result, print_header, save_result

HERE = os.path.dirname(os.path.abspath(__file__))
CRITEO = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "data", "criteo"))

PARTS = ("real", "zipf")

#: (label, flags): the first is the baseline
RULES = [
    ("min-count 1 (baseline)", []),
    ("min-count 2", ["--admit-min-count", "2"]),
    ("min-count 4", ["--admit-min-count", "4"]),
    ("min-count 8", ["--admit-min-count", "8"]),
    # the same rule with a sketch 8x larger: the rows the default 32 MiB sketch admits early
    # (counters that all collide) or forgets (halvings) are the difference
    ("min-count 2, 256 MiB sketch", ["--admit-min-count", "2", "--admit-sketch-mb", "256"]),
]


def ttl_rules(steps: int) -> list[tuple[str, list[str]]]:
    """Time-to-live rule sets scaled to the run: a quarter, an eighth and a sixteenth of it."""
    return [(f"TTL {t} steps", ["--steps-to-live", str(t)])
            for t in (max(1, steps // 4), max(1, steps // 8), max(1, steps // 16))]


def part_config(part: str, args) -> tuple[list[str], int]:
    """(data and schedule flags, steps of one run)."""
    if part == "real":
        files = sorted(os.path.join(CRITEO, f) for f in os.listdir(CRITEO) if f.endswith(".tsv"))
        rows = sum(sum(1 for _ in open(f)) for f in files)
        batch, epochs = 32, 1
        steps = int(rows * 0.8) // batch * epochs
        return (["--data", *files, "--on-bad-line", "skip", "--batch-size", str(batch),
                 "--epochs", str(epochs), "--eval-fraction", "0.2"], steps)
    batch = 4096
    steps = int(args.rows * 0.95) // batch
    return (["--data", "synthetic", "--synthetic-scale", "1.0", "--synthetic-rows",
             str(args.rows), "--zipf-alpha", "1.05", "--batch-size", str(batch),
             "--eval-fraction", "0.05", "--capacity", str(args.rows * 4)], steps)


def run(flags: list[str], rule: list[str], root: str, name: str) -> dict:
    path, metrics = os.path.join(root, name), os.path.join(root, name + ".jsonl")
    cmd = [sys.executable, "-m", "one_embedding", "train", "--model", "dlrm", "--optimizer",
           "adagrad", "--store", "cached_ssd", "--engine", "slots", "--cache-mb", "64",
           "--eval-batches", "0", "--keep-snapshots", "1", "--no-progress",
           "--persistent-path", path, "--metrics", metrics, *flags, *rule]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train failed ({name}):\n{proc.stderr[-2000:]}")
    record = next(r for r in map(json.loads, open(metrics)) if r["event"] == "final")
    return {"rows_stored": record["rows_stored"],
            "disk_bytes": record["store_stats"][-1]["disk_bytes"],
            "admitted_rows": record["admitted_rows"],
            "not_admitted_lookups": record["not_admitted_lookups"],
            "evicted_rows": record["evicted_rows"], "auc": record["auc"],
            "logloss": record["logloss"], "steps": record["steps"],
            "samples_per_s": record["samples_per_s"], "wall_s": time.monotonic() - t0}


def run_part(part: str, args) -> list[dict]:
    flags, steps = part_config(part, args)
    rules = RULES + ttl_rules(steps) + [("min-count 2 + TTL " + str(max(1, steps // 4)),
                                         ["--admit-min-count", "2", "--steps-to-live",
                                          str(max(1, steps // 4))])]
    out = []
    with tempfile.TemporaryDirectory(prefix="bench_lifecycle_", dir=args.scratch) as root:
        for i, (label, rule) in enumerate(rules):
            r = {"part": part, "rules": label, "flags": " ".join(rule), **run(flags, rule, root,
                                                                              f"{part}-{i}")}
            base = out[0] if out else r
            r["rows_vs_baseline"] = r["rows_stored"] / base["rows_stored"]
            r["disk_vs_baseline"] = r["disk_bytes"] / base["disk_bytes"]
            r["auc_change"] = r["auc"] - base["auc"]
            out.append(r)
            print(f"{part:5s} {label:28s} rows {r['rows_stored']:>10,} "
                  f"({r['rows_vs_baseline']:.3f}x)  disk {r['disk_bytes'] / 2**20:8.1f} MB "
                  f"({r['disk_vs_baseline']:.3f}x)  AUC {r['auc']:.4f} ({r['auc_change']:+.4f})"
                  f"  {r['wall_s']:.0f} s", flush=True)
    return out


def plot(results: list[dict], out: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    parts = sorted({r["part"] for r in results}, key=PARTS.index)
    fig = Figure(figsize=(6.5 * len(parts), 4.8))
    FigureCanvasAgg(fig)
    for ax, part in zip(fig.subplots(1, len(parts), squeeze=False)[0], parts):
        rows = [r for r in results if r["part"] == part]
        for i, r in enumerate(rows):
            ax.scatter(r["rows_vs_baseline"], r["auc_change"], color=f"C{i % 10}", s=40,
                       label=r["rules"])
        ax.axhline(-0.002, color="gray", ls="--", lw=0.8)
        ax.axvline(0.5, color="gray", ls=":", lw=0.8)
        ax.set_xlabel("rows stored / baseline")
        ax.set_ylabel("AUC - baseline AUC")
        ax.set_title({"real": "real Criteo rows (1,300: AUC indicative)",
                      "zipf": "synthetic Zipf, Kaggle cardinalities"}[part])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=[*PARTS, "both"], default="both")
    p.add_argument("--rows", type=int, default=1_000_000, help="synthetic rows of the zipf part")
    p.add_argument("--scratch", default=None, help="folder for the tables (default: $TMPDIR)")
    args = p.parse_args(argv)
    parts = list(PARTS) if args.part == "both" else [args.part]
    if "real" in parts and not os.path.isdir(CRITEO):
        raise SystemExit(f"no real Criteo rows at {CRITEO}: run --part zipf")
    config = {"parts": parts, "zipf rows": args.rows, "model": "dlrm", "optimizer": "adagrad",
              "store": "cached_ssd slots, 64 MB cache"}
    machine = print_header("feature lifecycle: rows, disk and AUC per rule set", config)
    results = []
    for part in parts:
        results += run_part(part, args)
    columns = ["part", "rules", "rows_stored", "rows_vs_baseline", "disk_vs_baseline",
               "not_admitted_lookups", "evicted_rows", "auc", "auc_change"]
    print(markdown_table(results, columns))
    payload = merge_parts(previous_result("lifecycle") if len(parts) < len(PARTS) else {},
                          parts, results, machine, config, args.rows)
    kept = [part for part in PARTS if part not in parts and part in payload["measured_by"]]
    if kept:
        print(f"(part {', '.join(kept)}: kept from the file's earlier run)")
    os.makedirs(common.RESULTS, exist_ok=True)
    plot(payload["results"], os.path.join(common.RESULTS, "lifecycle.png"))
    print("wrote", save_result("lifecycle", payload))


def merge_parts(previous: dict, parts: list[str], results: list[dict], machine: dict,
                config: dict, rows: int) -> dict:
    """The result file's payload: this run's ``results`` for ``parts``, and the records of the
    other parts as ``previous`` (the file before; {}: none) held them, in PARTS order. ``rows``
    (the zipf part's) is this run's when it ran zipf, else the earlier file's."""
    old = [r for r in previous.get("results", []) if r.get("part") not in parts]
    kept = list(dict.fromkeys(r["part"] for r in old))
    merged = sorted(old + results, key=lambda r: PARTS.index(r["part"]))  # stable: rule order kept
    if "zipf" not in parts and "rows" in previous:
        rows = previous["rows"]
    return {"machine": machine, "config": config, "rows": rows, "results": merged,
            "measured_by": measured_by(previous, parts, kept, machine, config)}


if __name__ == "__main__":
    main()
