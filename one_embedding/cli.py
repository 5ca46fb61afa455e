"""``one-embedding train | bench | convert | inspect`` (also ``python -m one_embedding``)."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import OneEmbeddingError


def _ints(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from .training import MODELS, OPTIMIZERS, STORES

    g = p.add_argument_group("model")
    g.add_argument("--model", choices=MODELS, default="dlrm")
    g.add_argument("--embedding-dim", type=int, default=16)
    g.add_argument("--bottom-mlp", type=_ints, default=None,
                   help="DLRM bottom MLP sizes, ending in the embedding dim (default 64,32,E)")
    g.add_argument("--top-mlp", type=_ints, default=(64, 32, 1), help="DLRM top MLP, ending in 1")
    g.add_argument("--dnn", type=_ints, default=(256, 128), help="DCN / DeepFM DNN sizes")
    g.add_argument("--cross-layers", type=int, default=3)
    g.add_argument("--cross", choices=("vector", "matrix"), default="vector")
    g.add_argument("--dropout", type=float, default=0.0)
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", default=["synthetic"],
                   help="'synthetic', or Criteo TSV / Parquet files or folders")
    g.add_argument("--synthetic-cardinalities", default="kaggle",
                   help="kaggle | mlperf40m | mlperf_v1 (REFERENCE.md lists)")
    g.add_argument("--synthetic-scale", type=float, default=0.01,
                   help="multiplies every cardinality (1.0 = the real sizes)")
    g.add_argument("--synthetic-rows", type=int, default=2_000_000)
    g.add_argument("--zipf-alpha", type=float, default=1.05)
    g.add_argument("--on-bad-line", choices=("error", "skip"), default="error")
    g.add_argument("--eval-fraction", type=float, default=0.05)
    g = p.add_argument_group("store")
    g.add_argument("--store", choices=STORES, default="device_mem")
    g.add_argument("--engine", choices=("slots", "rocksdb"), default="slots")
    g.add_argument("--cache-mb", type=float, default=64.0, help="device cache budget per rank")
    g.add_argument("--host-cache-mb", type=float, default=0.0, help="host LRU under cached_ssd")
    g.add_argument("--capacity", type=int, default=None)
    g.add_argument("--persistent-path", default=None,
                   help="table directory (snapshots go to <path>/<rank>-<world>/snapshots)")
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=int, default=1024)
    g.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    g.add_argument("--epochs", type=int, default=1, help="passes over the data when --steps is not given")
    g.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    g.add_argument("--lr", type=float, default=0.05)
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--eval-interval", type=int, default=0)
    g.add_argument("--eval-batches", type=int, default=20)
    g.add_argument("--snapshot-interval", type=int, default=0)
    g.add_argument("--snapshot-name", default="final")
    g.add_argument("--seed", type=int, default=0)


def _config(args):
    from .training import TrainConfig

    bottom = args.bottom_mlp or (64, 32, args.embedding_dim)
    return TrainConfig(
        model=args.model, data=args.data, synthetic_cardinalities=args.synthetic_cardinalities,
        synthetic_scale=args.synthetic_scale, synthetic_rows=args.synthetic_rows,
        zipf_alpha=args.zipf_alpha, store=args.store, engine=args.engine, cache_mb=args.cache_mb,
        host_cache_mb=args.host_cache_mb, capacity=args.capacity, persistent_path=args.persistent_path,
        embedding_dim=args.embedding_dim, bottom_mlp=tuple(bottom), top_mlp=tuple(args.top_mlp),
        dnn=tuple(args.dnn), cross_layers=args.cross_layers, cross=args.cross, dropout=args.dropout,
        batch_size=args.batch_size, steps=args.steps, epochs=args.epochs, optimizer=args.optimizer,
        lr=args.lr, warmup_steps=args.warmup_steps, eval_interval=args.eval_interval,
        eval_batches=args.eval_batches, eval_fraction=args.eval_fraction,
        snapshot_interval=args.snapshot_interval, snapshot_name=args.snapshot_name, seed=args.seed,
        on_bad_line=args.on_bad_line,
    )


def cmd_train(args) -> int:
    from .training import train

    final = train(_config(args), metrics_path=args.metrics, progress=not args.no_progress)
    print(f"final: AUC {final['auc']:.4f}, logloss {final['logloss']:.4f}, "
          f"{final['samples_per_s']:,.0f} samples/s over {final['steps']} steps "
          f"(loss {final['loss_first_10pct']:.4f} -> {final['loss_last_10pct']:.4f})",
          file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench

    run_bench(_config(args), args.out, stores=args.stores)
    return 0


def cmd_convert(args) -> int:
    from .data import convert_tsv_to_parquet

    info = convert_tsv_to_parquet(args.src, args.dst, has_label=not args.no_label,
                                  on_bad_line=args.on_bad_line)
    print(json.dumps(info, default=str))
    return 0


def cmd_inspect(args) -> int:
    from .inspect_snapshot import inspect_path

    print(json.dumps(inspect_path(args.path, args.name, args.rows), indent=1, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="one-embedding", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train DLRM / DCN / DeepFM on Criteo or synthetic Criteo")
    _add_train_args(p)
    p.add_argument("--metrics", default=None, help="append JSON lines here (default: stdout)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("bench", help="samples/s for each store preset x engine")
    _add_train_args(p)
    p.add_argument("--out", default="bench_out", help="folder for JSON, markdown and PNG")
    p.add_argument("--stores", nargs="+", default=None,
                   help="subset, e.g. device_mem cached_host_mem cached_ssd:slots cached_ssd:rocksdb")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("convert", help="Criteo TSV -> Parquet (streaming, with a progress bar)")
    p.add_argument("src", nargs="+", help="raw Criteo TSV file(s)")
    p.add_argument("dst", help="output .parquet file or folder")
    p.add_argument("--no-label", action="store_true", help="Kaggle test.txt: no label column")
    p.add_argument("--on-bad-line", choices=("error", "skip"), default="error")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="a table path's snapshots: rows, dims, counters")
    p.add_argument("path", help="the persistent_path (or its <rank>-<world> folder)")
    p.add_argument("--name", default=None, help="one snapshot (default: all)")
    p.add_argument("--rows", type=int, default=3, help="rows to print per snapshot")
    p.set_defaults(func=cmd_inspect)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OneEmbeddingError as e:
        print(f"one-embedding {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
