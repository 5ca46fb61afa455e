"""Model-parallel training over ranks: samples/s and exchange bytes per step for P ranks and each
exchange dtype, and a cost model that projects the step time for P = 8..64.

    python -m benchmarks.bench_ranks [--ranks 1 2 4] [--dtypes fp32 fp16 int8] [--steps 40]
        [--batch-size 4096] [--embedding-dim 64] [--bandwidth-gbps 100] [--latency-us 5]
        [--warmup-steps 4]

Each run is ``mpiexec -n P one-embedding train`` on synthetic Criteo (Kaggle cardinalities x
``--scale``, Zipf ids) with the DLRM of the CPU benchmarks (bottom 512-256-E, top 512-256-1, SGD).
P = 1 under mpiexec is the baseline measured in the same run: it always runs, first (1 is added
to ``--ranks`` when missing). Before the timed runs an untimed P = 1 run of ``--warmup-steps``
steps warms the caches a process start reads (imports, shared libraries, MPI start-up): without it
the first run of an invocation measured a fraction of what the same run does after another (810
against 4,859 samples/s), so the order of the runs decided the baseline. On a machine with fewer cores than
ranks the ranks share cores (each gets cores/P BLAS threads), so samples/s at P > cores measures
oversubscription, not scaling: the cost model is the number to read for a cluster.

Cost model, per rank and step (B global batch, P ranks, E dim, s = bytes per exchanged row):

    compute(P)  = t_compute(1) / P              the dense and embedding work of B/P rows
    bytes(P)    = ids: 12 u_P (P-1)/P  +  rows and gradients: 2 s u_P (P-1)/P
                  + dense all-reduce (ring): 2 (P-1)/P * 4 * n_dense_params
    t(P)        = compute(P) + bytes(P) / bandwidth + 4 * latency * (P - 1)

u_P is the number of unique ids in one rank's block of B/P rows, counted on the same synthetic
data; t_compute(1) is the measured P = 1 step time. Exchanges are assumed not to overlap with
compute (the prefetch thread hides the id exchange in practice; the model ignores that).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from .common import markdown_table, print_header, save_result


def mpiexec() -> str:
    exe = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(exe):
        raise SystemExit("bench_ranks: mpiexec not found; pip install 'one_embedding[mpi]'")
    return exe


def plan(ranks: list[int], dtypes: list[str]) -> list[tuple[int, str]]:
    """The timed runs, in order: P = 1 (fp32: one rank exchanges nothing) first, whether or not
    ``ranks`` names it, then every other rank count of ``ranks`` (first mention kept) with each
    exchange dtype."""
    bad = [r for r in ranks if r < 1]
    if bad:
        raise SystemExit(f"bench_ranks: --ranks must be at least 1, got {bad}")
    worlds = [1] + [w for w in dict.fromkeys(ranks) if w != 1]
    return [(1, "fp32")] + [(w, d) for w in worlds[1:] for d in dict.fromkeys(dtypes)]


def run(world: int, dtype: str, args, scratch: str, steps: int | None = None,
        tag: str = "") -> dict:
    metrics = os.path.join(scratch, f"{tag}p{world}_{dtype}.jsonl")
    steps = args.steps if steps is None else steps
    cmd = [mpiexec(), "-n", str(world), sys.executable, "-m", "one_embedding", "train",
           "--model", "dlrm", "--embedding-dim", str(args.embedding_dim),
           "--bottom-mlp", f"512,256,{args.embedding_dim}", "--top-mlp", "512,256,1",
           "--optimizer", "sgd", "--lr", "0.1", "--batch-size", str(args.batch_size),
           "--steps", str(steps), "--synthetic-scale", str(args.scale),
           "--synthetic-rows", str(args.rows), "--eval-batches", "2", "--exchange-dtype", dtype,
           "--no-progress", "--metrics", metrics]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_ranks: P={world} {dtype} failed:\n{proc.stderr[-3000:]}")
    final = [json.loads(x) for x in open(metrics)][-1]
    steps = final["steps"]
    return {"ranks": world, "exchange": dtype, "samples_per_s": final["samples_per_s"],
            "step_ms": 1e3 * args.batch_size / final["samples_per_s"],
            "exchange_bytes_per_step": final["exchange_bytes"] / steps,
            "auc": final["auc"], "phase_ms": {k: 1e3 * v / steps
                                              for k, v in final["phase_seconds"].items()}}


def unique_per_block(args, worlds) -> dict:
    """Mean unique ids in one rank's block of B/P rows (the synthetic data the runs train on)."""
    from one_embedding.data import BatchLoader, SyntheticCriteo

    source = SyntheticCriteo("kaggle", scale=args.scale, seed=0, num_rows=args.rows)
    loader = BatchLoader(source, args.batch_size, split="train", drop_last=True, read_ahead=0,
                         eval_fraction=0.05)
    batches = [b.ids for _, b in zip(range(8), loader)]
    return {p: float(np.mean([np.unique(ids[: args.batch_size // p]).size for ids in batches]))
            for p in worlds}


def dense_params(embedding_dim: int) -> int:
    from one_embedding.models import DLRM

    model = DLRM(num_tables=26, embedding_dim=embedding_dim, dense_features=13,
                 bottom_mlp=(512, 256, embedding_dim), top_mlp=(512, 256, 1))
    return int(sum(p.data.size for p in model.parameters()))


def row_bytes(dtype: str, dim: int) -> int:
    from one_embedding.parallel.codec import row_bytes as rb

    return rb(dtype, dim)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "fp16", "int8"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="steps of the untimed P = 1 run before the timed ones (0: none)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--scale", type=float, default=0.05, help="Kaggle cardinalities x scale")
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--bandwidth-gbps", type=float, default=100.0,
                   help="network bandwidth per rank for the cost model (100 Gb/s: EDR InfiniBand)")
    p.add_argument("--latency-us", type=float, default=5.0)
    p.add_argument("--project", type=int, nargs="+", default=[8, 16, 32, 64])
    args = p.parse_args(argv)
    runs = plan(args.ranks, args.dtypes)
    args.ranks = list(dict.fromkeys(w for w, _ in runs))
    config = {k: getattr(args, k) for k in ("ranks", "dtypes", "steps", "warmup_steps",
                                             "batch_size", "embedding_dim", "scale", "rows",
                                             "bandwidth_gbps", "latency_us")}
    m = print_header("Ranks: samples/s and exchange bytes per step", config)
    scratch = tempfile.mkdtemp(prefix="bench_ranks_")
    rows = []
    try:
        if args.warmup_steps > 0:
            w = run(1, "fp32", args, scratch, steps=args.warmup_steps, tag="warmup_")
            print(f"  warm-up (untimed) P=1 fp32, {args.warmup_steps} steps: "
                  f"{w['samples_per_s']:,.0f} samples/s", flush=True)
        for world, dtype in runs:
            r = run(world, dtype, args, scratch)
            rows.append(r)
            print(f"  P={world} {dtype}: {r['samples_per_s']:,.0f} samples/s, "
                  f"{r['exchange_bytes_per_step'] / 2**20:.2f} MiB sent per step", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = rows[0]  # plan() puts P = 1 first
    for r in rows:
        r["vs_1_rank"] = r["samples_per_s"] / base["samples_per_s"]
        r["exchange_MiB_per_step"] = r["exchange_bytes_per_step"] / 2**20
    print()
    print(markdown_table(rows, ["ranks", "exchange", "samples_per_s", "vs_1_rank", "step_ms",
                                "exchange_MiB_per_step", "auc"]))

    # ---- cost model
    worlds = sorted(set(args.ranks) | set(args.project))
    unique = unique_per_block(args, worlds)
    n_dense = dense_params(args.embedding_dim)
    bandwidth = args.bandwidth_gbps * 1e9 / 8
    t1 = base["step_ms"] / 1e3
    model = []
    for world in worlds:
        if world == 1:
            continue
        share = (world - 1) / world
        for dtype in args.dtypes:
            rows_grads = 2 * row_bytes(dtype, args.embedding_dim) * unique[world] * share
            sent = 12 * unique[world] * share + rows_grads + 2 * share * 4 * n_dense
            t = t1 / world + sent / bandwidth + 4 * args.latency_us * 1e-6 * (world - 1)
            model.append({"ranks": world, "exchange": dtype, "unique_ids_per_rank": unique[world],
                          "rows_grads_MiB": rows_grads / 2**20,
                          "MiB_per_step": sent / 2**20, "step_ms": 1e3 * t,
                          "samples_per_s": args.batch_size / t,
                          "speedup": t1 / t})
    print(f"\ncost model: t_compute(1) = {1e3 * t1:.1f} ms (measured above), "
          f"{args.bandwidth_gbps:g} Gb/s, {args.latency_us:g} us per message, "
          f"{n_dense:,} dense parameters")
    print("(rows_grads_MiB is what a run's exchange_bytes counts, comparable with the measured "
          "column above; MiB_per_step adds the ids and the dense all-reduce)")
    print(markdown_table(model, ["ranks", "exchange", "unique_ids_per_rank", "rows_grads_MiB",
                                 "MiB_per_step", "step_ms", "samples_per_s", "speedup"]))
    path = save_result("bench_ranks", {"machine": m, "config": config, "runs": rows,
                                       "cost_model": model})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
