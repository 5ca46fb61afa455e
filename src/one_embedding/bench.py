"""``one-embedding bench``: the same training under each store preset and engine, with prefetch
off (``--prefetch-depth 0``) and on (the config's depth).

Writes ``bench.json``, ``bench.md`` (a markdown table) and ``bench.png`` (samples/s with prefetch
off and on, and where a step's time goes, per store) into the output folder. The time split is
the trainer's: ``wait`` (the main thread waiting for the next batch's rows: data, ID shuffle and
lookup when they are not prefetched), ``embedding`` (rows out, gradients in), ``dense`` (model and
loss forward + backward), ``update`` (optimizer step: dense weights and rows). An untimed warm-up
training runs first: measured here, whichever store ran first in a process was up to 2x slower
(compiled kernels loading, first touches of memory), which would otherwise bias the comparison.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import tempfile

from .config import TrainConfig
from .errors import ConfigError

DEFAULT_STORES = ("device_mem", "cached_host_mem", "cached_ssd:slots", "cached_ssd:rocksdb")


def _machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def parse_store_specs(stores) -> list[tuple[str, str, str]]:
    """["cached_ssd:rocksdb", ...] -> [(spec, store, engine)]; the engine defaults to slots."""
    from .config import ENGINES, STORES

    specs = []
    for spec in stores or DEFAULT_STORES:
        store, _, engine = spec.partition(":")
        if store not in STORES or (engine and (store != "cached_ssd" or engine not in ENGINES)):
            raise ConfigError(f"--stores {spec!r}: use a store of {STORES}, or cached_ssd:ENGINE "
                              f"with ENGINE one of {ENGINES}")
        specs.append((spec, store, engine or "slots"))
    return specs


def run_bench(cfg: TrainConfig, out_dir: str, stores=None) -> list[dict]:
    """Train ``cfg`` once per store spec (``DEFAULT_STORES`` when None); every other setting,
    the steps included, is the config's. Returns one result row per store."""
    from .training import train

    specs = parse_store_specs(stores)
    cfg = cfg.with_model_defaults()  # the header names the optimizer and lr the runs use
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"--out {out_dir!r} is a file: name a folder for the results (it is "
                          "created if missing)")
    os.makedirs(out_dir, exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    # this run's records only: appended to an earlier run's, they sat beside new summaries
    open(metrics_path, "w").close()
    with tempfile.TemporaryDirectory(prefix="one_embedding_warmup_") as scratch:
        train(dataclasses.replace(cfg, store="cached_ssd", engine="slots", eval_interval=0,
                                  steps=min(cfg.steps or 20, 20), persistent_path=scratch),
              metrics_path=os.devnull, progress=False)
    depths = sorted({0, cfg.prefetch_depth})
    runs = []
    for spec, store, engine in specs:
        for depth in depths:
            scratch = tempfile.mkdtemp(prefix="one_embedding_bench_")
            try:
                run_cfg = dataclasses.replace(cfg, store=store, engine=engine,
                                              host_cache_mb=cfg.host_cache_mb
                                              if store == "cached_ssd" else 0.0,
                                              persistent_path=os.path.join(scratch, "table"),
                                              eval_interval=0, prefetch_depth=depth)
                rec = train(run_cfg, metrics_path=metrics_path, progress=False)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            run = {"store": spec, "prefetch_depth": depth, "samples_per_s": rec["samples_per_s"],
                   "auc": rec["auc"], "logloss": rec["logloss"],
                   "top_tier_hit_rate": rec["top_tier_hit_rate"],
                   "rows_stored": rec["rows_stored"], "steps": rec["steps"],
                   "ms_per_step": {k: 1e3 * v / rec["steps"]
                                   for k, v in rec["phase_seconds"].items()}}
            runs.append(run)
            print(json.dumps(run), flush=True)
    # one result per store: the config's prefetch depth, with the prefetch-off run beside it
    results = []
    for spec, _, _ in specs:
        on = next(r for r in runs if r["store"] == spec and r["prefetch_depth"] == cfg.prefetch_depth)
        off = next(r for r in runs if r["store"] == spec and r["prefetch_depth"] == 0)
        results.append({**on, "samples_per_s_prefetch_off": off["samples_per_s"],
                        "ms_per_step_prefetch_off": off["ms_per_step"]})
    header = (f"machine: {_machine()}\n\nconfig: model={cfg.model}, batch={cfg.batch_size}, "
              f"steps={cfg.steps}, dim={cfg.embedding_dim}, cache_mb={cfg.cache_mb}, "
              f"optimizer={cfg.optimizer}, data={cfg.data}, scale={cfg.synthetic_scale}, "
              f"prefetch depth {cfg.prefetch_depth} (baseline in the same run: depth 0)\n")
    lines = [header, "| store | samples/s | prefetch off | vs off | top-tier hit rate | AUC |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['store']} | {r['samples_per_s']:,.0f} | "
                     f"{r['samples_per_s_prefetch_off']:,.0f} | "
                     f"{r['samples_per_s'] / r['samples_per_s_prefetch_off']:.2f} | "
                     f"{r['top_tier_hit_rate']:.3f} | {r['auc']:.4f} |")
    lines += ["", "ms per step: wait (for the next batch's rows: data, and ID shuffle + lookup "
              "when not prefetched), embedding (rows out, gradients in), dense (forward + "
              "backward), update (optimizer)", "",
              "| store | prefetch | wait | embedding | dense | update |", "|---|---|---|---|---|---|"]
    for r in runs:
        ms = r["ms_per_step"]
        lines.append(f"| {r['store']} | {r['prefetch_depth']} | {ms['wait']:.1f} | "
                     f"{ms['embedding']:.1f} | {ms['dense']:.1f} | {ms['update']:.1f} |")
    same = len({(r["auc"], r["logloss"]) for r in runs}) == 1
    lines.append(f"\nAUC and log loss {'identical' if same else 'DIFFER'} across stores and "
                 "prefetch depths (training is bit-identical by design)")
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"machine": _machine(), "config": dataclasses.asdict(cfg), "results": results,
                   "runs": runs}, f, indent=1)
    _plot(runs, os.path.join(out_dir, "bench.png"))
    print("\n".join(lines))
    return results


def _plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import numpy as np

    stores = list(dict.fromkeys(r["store"] for r in results))
    depths = sorted({r["prefetch_depth"] for r in results})
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(depths)
    x = np.arange(len(stores))
    for i, depth in enumerate(depths):
        by_store = {r["store"]: r["samples_per_s"] for r in results if r["prefetch_depth"] == depth}
        a.bar(x + i * width, [by_store[s] for s in stores], width,
              label="prefetch off" if depth == 0 else f"prefetch depth {depth}")
    a.set_xticks(x + width * (len(depths) - 1) / 2, stores)
    a.set_ylabel("samples/s")
    a.set_title("training throughput")
    a.legend()
    labels = [f"{r['store']}\nd={r['prefetch_depth']}" for r in results]
    bottom = np.zeros(len(results))
    for phase, color in zip(("wait", "embedding", "dense", "update"),
                            ("tab:gray", "tab:orange", "tab:blue", "tab:green")):
        ms = np.array([r["ms_per_step"][phase] for r in results])
        b.bar(labels, ms, bottom=bottom, label=phase, color=color)
        bottom += ms
    b.set_ylabel("ms per step")
    b.set_title("where a step's time goes")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
