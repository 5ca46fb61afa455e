"""Part (b) of ``bench_scale``: a DLRM training run whose table is several times the RAM it may
use (a cgroup-v1 memory limit), against the same model on device_mem in the same run, and the SSD
tier's block reads against this disk's raw random-read rate. See ``bench_scale``'s docstring."""
from __future__ import annotations

import os
import shutil
import time

import numpy as np

from .common import markdown_table
from .scale_workers import ROOT, disk_bytes, fmt, peak_rss, read_result, run_worker

#: the issue's DLRM
TRAIN_MODEL = dict(model="dlrm", embedding_dim=128, bottom_mlp=(512, 256, 128),
                   top_mlp=(1024, 1024, 512, 256, 1), synthetic_cardinalities="mlperf40m",
                   zipf_alpha=1.05)
CGROUP_ROOT = "/sys/fs/cgroup/memory"


def train_worker(job: dict) -> dict:
    """One ``train`` run of ``job["config"]`` (TrainConfig fields); the final record, its peak
    RSS and the bytes a stored row takes."""
    from one_embedding.config import TrainConfig, make_row_optimizer
    from one_embedding.training import train

    cfg = TrainConfig(**job["config"])
    t0 = time.perf_counter()
    record = train(cfg, metrics_path=job["metrics"], progress=False)
    wall = time.perf_counter() - t0
    size_factor = make_row_optimizer(cfg).required_size_factor()
    return {"final": record, "peak_rss": peak_rss(), "wall_seconds": wall,
            "line_bytes": 4 * cfg.embedding_dim * size_factor}


class MemoryCgroup:
    """A cgroup-v1 memory cgroup with a limit; ``preexec`` puts a starting child in it.

    ``note`` says why there is none where it cannot be made (no v1 memory controller, not
    root): the caller then runs without a limit."""

    def __init__(self, limit_bytes: int):
        self.path, self.note = None, ""
        path = os.path.join(CGROUP_ROOT, f"bench_scale_{os.getpid()}")
        try:
            os.mkdir(path)
            with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit_bytes))
            self.path = path
        except OSError as e:
            self.note = f"no memory cgroup ({e.strerror or e}: {path}); ran without a limit"
            if os.path.isdir(path):
                os.rmdir(path)

    def preexec(self) -> None:
        """Runs in the child between fork and exec: it joins before it allocates anything."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def read(self, name: str) -> int | None:
        try:
            with open(os.path.join(self.path, name)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, TypeError):
            return None

    def remove(self) -> None:
        if self.path is None:
            return
        for _ in range(50):  # the exited child leaves the cgroup asynchronously
            try:
                os.rmdir(self.path)
                break
            except OSError as e:
                error = e
                time.sleep(0.1)
        else:
            print(f"  warning: could not remove {self.path} ({error.strerror}): rmdir it by hand",
                  flush=True)
        self.path = None


def part_b(args, root: str) -> dict:
    """Raw disk rate, the device_mem baseline, the cached_ssd run in a cgroup, raw rate again."""
    # random bytes written with O_DIRECT and fsync'd (every block real), and the GIL-free
    # 16-thread random-read loop of the library's own I/O kernel
    from .bench_ssd import raw_random_reads, write_raw_file

    raw_path = os.path.join(root, "raw.bin")
    write_raw_file(raw_path, args.raw_mb << 20)
    raw = [raw_random_reads(raw_path, args.io_threads, args.raw_seconds)]
    print(f"  raw 4 KiB O_DIRECT reads, {args.io_threads} threads: {raw[0]:,.0f}/s", flush=True)
    common_cfg = {**TRAIN_MODEL, "synthetic_scale": args.cardinality_scale,
                  "batch_size": args.batch, "steps": args.steps, "eval_batches": 1,
                  "synthetic_rows": args.synthetic_rows, "seed": 0}
    configs = {
        "device_mem": {**common_cfg, "store": "device_mem"},
        "cached_ssd": {**common_cfg, "store": "cached_ssd", "engine": "slots",
                       "cache_mb": args.train_cache_mb,
                       "persistent_path": os.path.join(root, "train-cached_ssd")},
    }
    runs = {}
    for name, cfg in configs.items():
        job = {"config": cfg, "metrics": os.path.join(root, f"train-{name}.jsonl"),
               "out": os.path.join(root, f"train-{name}.json")}
        cgroup, limit_note, cg = None, "no limit", {}
        if name == "cached_ssd":
            cgroup = MemoryCgroup(int(args.memory_limit_gb * 2**30))
            limit_note = (cgroup.note if cgroup.path is None
                          else f"cgroup-v1 memory limit {args.memory_limit_gb:g} GB")
            print(f"  {name}: {limit_note}", flush=True)
        try:
            proc = run_worker("train", job, ROOT, root,
                              cgroup.preexec if cgroup is not None and cgroup.path else None)
            if cgroup is not None and cgroup.path:  # its page cache counts here too
                cg = {"cgroup": cgroup.path,
                      "cgroup_max_usage_bytes": cgroup.read("memory.max_usage_in_bytes"),
                      "cgroup_failcnt": cgroup.read("memory.failcnt")}
        finally:
            if cgroup is not None:
                cgroup.remove()
        if proc.returncode in (-9, 137) and cgroup is not None:
            raise SystemExit(f"the {name} run was killed (signal 9), likely by the cgroup's "
                             f"OOM killer at {args.memory_limit_gb:g} GB: its RAM outgrew the "
                             "limit; raise --memory-limit-gb to see how much it needs")
        result = read_result(proc, job, f"the {name} training run")
        final = result["final"]
        run = {"store": name, "limit": limit_note, **cg,
               "samples_per_s": final["samples_per_s"], "train_seconds": final["train_seconds"],
               "peak_rss_bytes": result["peak_rss"], "rows_stored": final["rows_stored"],
               "line_bytes": result["line_bytes"],
               "table_bytes": final["rows_stored"] * result["line_bytes"],
               "phase_seconds": final["phase_seconds"],
               "loss_last_10pct": final.get("loss_last_10pct"), "auc": final.get("auc"),
               "top_tier_hit_rate": final.get("top_tier_hit_rate"),
               "store_stats": final["store_stats"]}
        if name == "cached_ssd":
            ssd = final["store_stats"][-1]
            run["disk_bytes"] = disk_bytes(cfg["persistent_path"])
            run["ssd_tier"] = ssd["tier"]
            for k in ("read_blocks", "written_blocks"):
                run[f"ssd_{k}"] = ssd.get(k)
            if ssd.get("read_blocks") is not None:
                run["ssd_read_blocks_per_s"] = ssd["read_blocks"] / final["train_seconds"]
            if ssd.get("read_seconds"):  # the rate while the tier reads (the workload needs
                # far fewer reads than the disk serves, so per training second says little)
                run["ssd_read_rate_while_reading"] = ssd["read_blocks"] / ssd["read_seconds"]
                run["ssd_read_seconds"] = ssd["read_seconds"]
            shutil.rmtree(cfg["persistent_path"], ignore_errors=True)
        runs[name] = run
        print(f"  {name}: {run['samples_per_s']:,.0f} samples/s, peak RSS "
              f"{run['peak_rss_bytes'] / 2**30:.2f} GB, {run['rows_stored']:,} rows", flush=True)
    raw.append(raw_random_reads(raw_path, args.io_threads, args.raw_seconds))
    os.remove(raw_path)
    raw_rate = float(np.mean(raw))
    ssd, dev = runs["cached_ssd"], runs["device_mem"]
    ratios = {
        "samples_per_s": ssd["samples_per_s"] / dev["samples_per_s"],
        "ssd_reads_vs_raw": (ssd["ssd_read_blocks_per_s"] / raw_rate
                             if "ssd_read_blocks_per_s" in ssd else None),
        "ssd_read_rate_vs_raw": (ssd["ssd_read_rate_while_reading"] / raw_rate
                                 if "ssd_read_rate_while_reading" in ssd else None),
        "table_vs_peak_rss": ssd["table_bytes"] / ssd["peak_rss_bytes"],
        "disk_vs_peak_rss": ssd["disk_bytes"] / ssd["peak_rss_bytes"],
        # the store must not change the numbers: a cache or SSD tier only moves rows
        "same_results": all(ssd[k] == dev[k] for k in ("loss_last_10pct", "auc")),
    }
    return {"config": configs, "raw_reads_per_s": raw, "raw_reads_per_s_mean": raw_rate,
            "io_threads": args.io_threads, "runs": runs, "ratios": ratios}


def b_tables(b: dict) -> str:
    rows = []
    for r in b["runs"].values():
        rows.append({"store": r["store"], "limit": r["limit"], "samples/s": r["samples_per_s"],
                     "peak RSS GB": r["peak_rss_bytes"] / 2**30, "rows": f"{r['rows_stored']:,}",
                     "table GB": r["table_bytes"] / 2**30,
                     "disk GB": r["disk_bytes"] / 2**30 if "disk_bytes" in r else "",
                     "SSD blocks read/s": r.get("ssd_read_blocks_per_s", ""),
                     "loss (last 10%)": r["loss_last_10pct"], "AUC": r["auc"],
                     "phases s": " / ".join(f"{k} {v:.1f}" for k, v in r["phase_seconds"].items())})
    ra = b["ratios"]
    ratio_rows = [
        {"ratio": "samples/s, cached_ssd / device_mem", "value": ra["samples_per_s"],
         "goal": ">= 0.9"},
        {"ratio": f"SSD tier block reads per second of its reads / raw {b['io_threads']}-thread "
                  f"4 KiB reads/s ({b['raw_reads_per_s_mean']:,.0f})",
         "value": fmt(ra.get("ssd_read_rate_vs_raw")), "goal": ">= 0.9"},
        {"ratio": "SSD tier block reads per training second / the same raw rate (what the "
                  "workload asked of the disk)",
         "value": fmt(ra["ssd_reads_vs_raw"]), "goal": ""},
        {"ratio": "table bytes (rows x line) / cached_ssd peak RSS",
         "value": ra["table_vs_peak_rss"], "goal": ">= 3"},
        {"ratio": "bytes on disk / cached_ssd peak RSS", "value": ra["disk_vs_peak_rss"],
         "goal": ""},
        {"ratio": "same loss and AUC on both stores",
         "value": "yes" if ra["same_results"] else "NO", "goal": "yes"},
    ]
    return (markdown_table(rows, list(rows[0])) + "\n\n"
            + markdown_table(ratio_rows, ["ratio", "value", "goal"]))


