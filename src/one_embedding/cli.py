"""``one-embedding train | bench | convert | inspect | plan | serve | plot`` (also ``python -m
one_embedding``): train DLRM / DCN / DeepFM over tiered embedding stores, benchmark the stores,
convert Criteo TSV to Parquet, inspect a run's snapshots, plan a table's RAM and disk, serve a
run's checkpoints over HTTP, and plot training curves."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
import traceback

from .errors import ConfigError, OneEmbeddingError
from .interrupts import interrupt_of
from .store.file_limit import raise_open_file_limit


def _add_train_args(p: argparse.ArgumentParser, hidden=()) -> None:
    """Every TrainConfig field as a flag (``cache_mb`` -> ``--cache-mb``), its default, choices
    and help taken from the field: ``one_embedding.config`` is the one place to change them;
    ``hidden``: fields left out of the help (the command decides them)."""
    from .config import TrainConfig

    TrainConfig.add_arguments(p, hidden)


def _config(args):
    from .config import TrainConfig

    return TrainConfig.from_args(args)


def _check_metrics_path(path: str | None, data=()) -> None:
    """--metrics must name a file that can be created or appended to, checked before training
    (otherwise the run fails at its first log line, or worse, at its last); an existing one must
    hold metrics records (JSON lines) and be none of the ``data`` files: records appended to a
    TSV or Parquet file damaged the user's data."""
    if path is None:
        return
    if os.path.isfile(path):
        for source in data:
            if os.path.exists(source) and os.path.samefile(source, path):
                raise ConfigError(f"--metrics {path!r} is also a --data file: name a new file "
                                  "for the records, e.g. --metrics run.jsonl")
        with open(path, "rb") as f:
            first = f.readline(1 << 16).strip()
        try:
            record = json.loads(first) if first else {}
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ConfigError(f"--metrics {path!r} exists and does not hold metrics records (its "
                              "first line is not a JSON object): records are appended to the "
                              "file, so name a new file or an earlier run's --metrics file")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"--metrics {path!r} is a folder: give a file in it, e.g. --metrics "
                          f"{os.path.join(path, 'metrics.jsonl')}")
    if not os.path.isdir(folder):
        raise ConfigError(f"--metrics {path!r}: its folder {folder!r} does not exist: create it "
                          "(mkdir -p) or give a file in an existing folder")
    if not os.access(folder if not os.path.exists(path) else path, os.W_OK):
        raise ConfigError(f"--metrics {path!r} cannot be written by this user: give a file in a "
                          "folder you can write")


def cmd_train(args) -> int:
    from .parallel.comm import default_comm
    from .training import train

    cfg = _config(args)
    cfg.check_flags_act()
    _check_metrics_path(args.metrics, args.data)
    # a scheduler's SIGTERM (preemption, a job's time limit: what mpiexec passes on to every
    # rank) stops the run as Ctrl-C does (main's handler), with the checkpoint and the resume
    # command (exit 143)
    try:
        final = train(cfg, metrics_path=args.metrics, progress=not args.no_progress,
                      metrics_stdout=args.json)
    except (KeyboardInterrupt, SystemError) as e:  # Ctrl-C: say what is saved and how to go on
        e = interrupt_of(e)                         # (main exits 130)
        if e is None:
            raise
        rank = default_comm().rank
        if rank != 0:
            # rank 0 reports and ends the job (main: MPI_Abort) at once; rank 1 reports instead
            # when rank 0 is still there after a second (stuck in a collective this rank left)
            time.sleep(1.0)
        if rank <= 1:
            print(_interrupted(e, cfg, getattr(args, "argv", None)), file=sys.stderr, flush=True)
        raise e
    if default_comm().rank != 0:  # with several ranks, rank 0 alone reports (as it logs)
        return 0
    from .run_summary import train_summary

    where = (f"{cfg.snapshot_name!r} under {cfg.persistent_path}" if cfg.persistent_path
             else None)
    # stdout carries the JSON lines with --json: the summary goes beside the progress bar then
    print(train_summary(final, args.metrics, where), file=sys.stderr if args.json else sys.stdout,
          flush=True)
    return 0


#: set when SIGTERM stopped ``train``: main then exits 143 (128 + SIGTERM), not Ctrl-C's 130
_terminated = threading.Event()


def _sigterm_as_interrupt(signum, frame) -> None:
    _terminated.set()
    raise KeyboardInterrupt("SIGTERM")


def _interrupted(error: KeyboardInterrupt, cfg, argv: list[str] | None) -> str:
    """What an interrupted ``train`` prints: the step, the last checkpoint saved, and the
    command that resumes from it (this one, with --resume instead of --overwrite)."""
    import shlex

    from .checkpoint import TrainingInterrupted, resumable_checkpoint
    from .parallel.comm import launched_world_size

    world = launched_world_size() or 1
    if not isinstance(error, TrainingInterrupted):  # before the training loop began
        saved = resumable_checkpoint(cfg.persistent_path, world) if cfg.persistent_path else None
        error = TrainingInterrupted(None, cfg.persistent_path, saved)
    if error.checkpoint is None or argv is None:
        return f"one-embedding train: {error.describe()}"
    text = f"one-embedding train: {error.describe(how_to_resume=False)}"
    # argparse takes an unambiguous prefix of a flag too (--over): drop those as well
    kept = [a for a in argv if not (a.startswith("--ov") and "--overwrite".startswith(a))]
    if not any(a.startswith("--res") and "--resume".startswith(a) for a in kept):
        kept.append("--resume")
    if os.path.basename(sys.argv[0]) == "__main__.py":  # python -m one_embedding
        program = [sys.executable, "-m", "one_embedding"]
    else:
        program = ["one-embedding"]
    launcher = ["mpiexec", "-n", str(world)] if world > 1 else []
    command = shlex.join(launcher + program + kept)
    where = "" if os.path.isabs(cfg.persistent_path) else f" (in {os.getcwd()})"
    return f"{text}. Continue from it with{where}:\n  {command}"


#: train flags that bench decides itself, per run: --stores names the stores, each on a scratch
#: path, timed without evaluation or checkpoints in between (left out of bench --help)
_BENCH_SETS = ("store", "engine", "persistent_path")
_BENCH_RUN_SETS = ("resume", "overwrite", "eval_interval", "snapshot_interval", "keep_snapshots",
                   "snapshot_name")


def cmd_bench(args) -> int:
    from .bench import run_bench
    from .config import TrainConfig

    defaults = TrainConfig()
    given = [name for name in _BENCH_SETS if getattr(args, name) != getattr(defaults, name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(f"bench runs each store of --stores on its own scratch path, so {flags} "
                          "would be ignored: drop it and list the stores, e.g. --stores "
                          "device_mem cached_ssd:rocksdb")
    given = [name for name in _BENCH_RUN_SETS if getattr(args, name) != getattr(defaults, name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(f"bench times fresh runs on scratch paths, evaluated once at the end "
                          f"and never checkpointed, so {flags} would be ignored: drop it")
    run_bench(_config(args), args.out, stores=args.stores)
    return 0


def cmd_convert(args) -> int:
    from .data import convert_tsv_to_parquet

    info = convert_tsv_to_parquet(args.src, args.dst, has_label=not args.no_label,
                                  on_bad_line=args.on_bad_line, layout=args.layout,
                                  overwrite=args.overwrite)
    print(json.dumps(info, default=str))
    return 0


def cmd_inspect(args) -> int:
    """Prints every snapshot (one line each, or ``--json``); a damaged one is listed as such
    (and named on stderr) and the exit status is 1, so a script notices, while the intact ones
    are still shown."""
    from .inspect_snapshot import format_inspection, inspect_path

    if args.rows is not None and not args.json:
        raise ConfigError(f"--rows {args.rows} sets the sample rows of the --json output, and "
                          "the summary shows none: add --json")
    found = inspect_path(args.path, args.name, 3 if args.rows is None else args.rows,
                         quick=args.quick)
    print(json.dumps(found, indent=1, default=str) if args.json else format_inspection(found))
    # a snapshot this version cannot read (damaged, or written by a newer one_embedding) is
    # named on stderr, and the exit status says so
    unreadable = [s for s in found if s["status"] in ("damaged", "newer")]
    for s in unreadable:
        what = "damaged" if s["status"] == "damaged" else "written by a newer version"
        print(f"one-embedding inspect: {what}: {s['error']}", file=sys.stderr)
    return 1 if unreadable else 0


def _sample_rows(text: str) -> int:
    """inspect --rows: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number of rows >= 0")
    return value


def _count(text: str) -> int:
    """A row count as typed: 2000000, 2_000_000, 2e6, 1.5e9."""
    try:
        value = float(str(text).replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of rows (e.g. 2e6)") from None
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number of rows")
    return int(value)


def cmd_plan(args) -> int:
    """RAM per tier and disk of a table, from the constants the stores use."""
    from .plan import format_plan, plan_capacity, plan_json

    # settings of a tier the store does not have are refused, as train refuses them
    if args.store == "device_mem" and args.cache_mb is not None:
        raise ConfigError(f"--cache-mb {args.cache_mb:g} sizes the device cache of the cached "
                          "stores; --store device_mem keeps the whole table in device memory: "
                          "drop --cache-mb or pick another --store")
    if args.store != "cached_ssd" and (args.host_cache_mb or args.engine != "slots"):
        flag = f"--host-cache-mb {args.host_cache_mb:g}" if args.host_cache_mb else \
            f"--engine {args.engine}"
        raise ConfigError(f"{flag} is a setting of --store cached_ssd's SSD tier; --store "
                          f"{args.store} has none: drop it or use --store cached_ssd")
    if args.cache_mb is None:
        if args.store != "device_mem":
            raise ConfigError(f"--store {args.store} has a device cache: give its size per rank "
                              "with --cache-mb MB (train's default is 64), e.g. --cache-mb 64")
        args.cache_mb = 0.0  # device_mem: the whole table is the device tier
    if args.keep_snapshots < 1:
        raise ConfigError(f"--keep-snapshots {args.keep_snapshots}: as train's, 0 keeps every "
                          "checkpoint, so the disk grows with the run and has no peak to plan; "
                          "give the number train will keep (its default is 3)")

    # train keeps K interval checkpoints and the final one; while the next is written, the
    # oldest of the K is still there: K + 1 snapshots at the peak
    p = plan_capacity(args.rows, args.embedding_dim, args.optimizer, args.store, args.cache_mb,
                      args.host_cache_mb, args.engine, args.keep_snapshots + 1,
                      args.changed_per_snapshot, args.world, args.physical_block_size,
                      args.eviction, args.admit_sketch_mb, args.device)
    print(plan_json(p) if args.json else format_plan(p))
    return 0


def cmd_serve(args) -> int:
    """The Open Inference Protocol over HTTP, answering from a training run's checkpoints."""
    try:
        from .serving.server import serve
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"serve needs the serve extra ({e.name} is missing): pip install "
                          "'one_embedding[serve]'") from None
    for name in ("cache_mb", "poll_seconds", "max_request_mb", "max_queue_delay_us",
                 "shutdown_grace_seconds"):
        if not 0 <= getattr(args, name) < math.inf:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be a "
                              "finite number >= 0")
    if args.scratch is not None and os.path.exists(args.scratch) \
            and not os.path.isdir(args.scratch):
        raise ConfigError(f"--scratch {args.scratch!r} is a file: pass a folder (it is created "
                          "if missing)")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} must be in 1..65535")
    if args.grpc_port is not None:
        if not 0 < args.grpc_port < 65536 or args.grpc_port == args.port:
            raise ConfigError(f"--grpc-port {args.grpc_port} must be in 1..65535 and differ from "
                              f"--port {args.port}")
        try:
            import grpc  # noqa: F401
            import tritonclient.grpc.service_pb2  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"--grpc-port needs the serve extra ({e.name} is missing): pip "
                              "install 'one_embedding[serve]'") from None
        except RuntimeError as e:   # tritonclient's generated code checks grpcio's version
            raise ConfigError(f"--grpc-port: {e}; upgrade them together: pip install -U "
                              "'one_embedding[serve]'") from None
    if args.wait_for_checkpoint and args.poll_seconds == 0:
        raise ConfigError("--wait-for-checkpoint with --poll-seconds 0 would wait for ever: the "
                          "first checkpoint is found by polling (give --poll-seconds > 0)")
    if args.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size {args.max_batch_size} must be >= 1 (1: no dynamic "
                          "batching)")
    if args.blas_threads < 1:
        raise ConfigError(f"--blas-threads {args.blas_threads} must be >= 1")
    serve(args.persistent_path, args.snapshot, args.host, args.port, args.cache_mb,
          args.poll_seconds, args.max_request_mb, args.scratch, args.grpc_port,
          args.max_batch_size, args.max_queue_delay_us, args.blas_threads,
          args.shutdown_grace_seconds, args.wait_for_checkpoint)
    return 0


def cmd_plot(args) -> int:
    """Loss, AUC and samples/s against step for each metrics file; one JSON line on stdout."""
    from .plot import plot_runs

    runs = plot_runs(args.metrics, args.out, labels=args.labels)
    print(json.dumps({"out": args.out, "runs": [
        {"file": r.path, "label": r.label, "train_records": len(r.train),
         "eval_records": len(r.eval)} for r in runs]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .config import DEVICES, OPTIMIZERS

    ap = argparse.ArgumentParser(prog="one-embedding", description=__doc__.replace("``", ""))
    ap.add_argument("--version", action="version", version=f"one-embedding {__version__}",
                    help="print the version of one_embedding and exit")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train DLRM / DCN / DeepFM on Criteo or synthetic Criteo")
    _add_train_args(p)
    p.add_argument("--metrics", default=None,
                   help="append the run's JSON lines to this file: the config, a train record "
                        "every --log-interval steps (that step's loss, samples/s over all steps "
                        "so far), eval records and the final record (default: none written)")
    p.add_argument("--json", action="store_true",
                   help="also write the JSON lines to stdout (the summary then goes to stderr)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("bench", help="samples/s for each store preset x engine")
    _add_train_args(p, hidden=_BENCH_SETS + _BENCH_RUN_SETS)
    p.add_argument("--out", default="bench_out", help="folder for JSON, markdown and PNG")
    p.add_argument("--stores", nargs="+", default=None,
                   help="subset, e.g. device_mem cached_host_mem cached_ssd:slots cached_ssd:rocksdb")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("convert", help="Criteo TSV -> Parquet (streaming, with a progress bar)")
    p.add_argument("src", nargs="+", help="raw Criteo TSV file(s)")
    p.add_argument("dst", help="output .parquet file (a new one; --overwrite replaces one)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output file (never one of the sources)")
    p.add_argument("--no-label", action="store_true", help="Kaggle test.txt: no label column")
    p.add_argument("--on-bad-line", choices=("error", "skip"), default="error",
                   help="a malformed line: stop with its file and line number (error), or skip "
                        "it and count it (default: error)")
    p.add_argument("--layout", choices=("one_embedding", "oneflow"), default="one_embedding",
                   help="one_embedding: dense stored as log(x+1); oneflow: OneFlow's raw + 1 "
                        "(the log taken when read); both read back as the same batches")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="a table path's snapshots: rows, dims, counters (exit "
                                       "status 1 when one is damaged)")
    p.add_argument("path", help="the persistent_path (or its <rank>-<world> folder)")
    p.add_argument("--name", default=None, help="one snapshot (default: all)")
    p.add_argument("--rows", type=_sample_rows, default=None,
                   help="sample rows per snapshot in the --json output (default: 3)")
    p.add_argument("--quick", action="store_true",
                   help="check the data a snapshot shares (SSTs, slot segments) by size and key "
                        "checksums, as a load does, instead of reading every byte")
    p.add_argument("--json", action="store_true",
                   help="every field of every snapshot as JSON (manifest, store counters, "
                        "sample rows) instead of one line per snapshot")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("plan", help="RAM per tier and disk (live, steady, peak with K retained "
                                    "snapshots) of a table before it exists")
    p.add_argument("--rows", type=_count, required=True, help="keys over all ranks, e.g. 2e9")
    p.add_argument("--embedding-dim", type=int, required=True,
                   help="floats per embedding (train's --embedding-dim)")
    p.add_argument("--optimizer", default="sgd", choices=tuple(sorted(OPTIMIZERS)),
                   help="the row optimizer, as train's --optimizer: its states make up the line "
                        "(adagrad: 2x the dim, adam and ftrl: 3x) (default: sgd)")
    p.add_argument("--store", default="cached_ssd",
                   choices=("device_mem", "cached_host_mem", "cached_ssd"),
                   help="the store preset, as train's --store (default: cached_ssd)")
    p.add_argument("--engine", default="slots", choices=("slots", "rocksdb"),
                   help="the SSD engine of cached_ssd (default: slots)")
    p.add_argument("--cache-mb", type=float, default=None,
                   help="device cache per rank, MB: required by cached_host_mem and cached_ssd "
                        "(train's default is 64)")
    p.add_argument("--host-cache-mb", type=float, default=0.0,
                   help="host cache per rank under cached_ssd, MB (default: 0, none)")
    p.add_argument("--keep-snapshots", type=int, default=3,
                   help="as train's: the interval checkpoints kept; planned with the final one "
                        "(or the one being written) beside them, K + 1 snapshots (default: 3, "
                        "train's)")
    p.add_argument("--changed-per-snapshot", type=float, default=0.01,
                   help="share of the rows changed between snapshots (default: 0.01)")
    p.add_argument("--world", type=int, default=1,
                   help="ranks the table is spread over (default: 1)")
    p.add_argument("--physical-block-size", type=int, default=4096,
                   help="bytes of the slot engine's disk blocks (default: 4096)")
    p.add_argument("--eviction", action="store_true",
                   help="rows carry the lifecycle's last-seen step and frequency (training with "
                        "--steps-to-live or --max-rows: 8 bytes more a line); give --rows the "
                        "--max-rows limit")
    p.add_argument("--admit-sketch-mb", type=float, default=0.0,
                   help="RAM of the admission sketch per rank (training with --admit-min-count "
                        "> 1: its --admit-sketch-mb, 32 unless given) (default: 0, none)")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="as train's --device: on cuda the device tiers (the device cache, "
                        "device_mem's table) are in GPU memory, planned apart from RAM "
                        "(default: cpu)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("serve", help="answer lookups and click predictions from a training run's "
                                     "newest checkpoint over the Open Inference Protocol (REST, and gRPC "
                                     "with --grpc-port), "
                                     "following the run as it publishes new ones")
    p.add_argument("--persistent-path", required=True, help="the training run's --persistent-path")
    p.add_argument("--snapshot", default=None, help="serve this checkpoint (default: the newest)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface (default: 127.0.0.1, "
                        "this machine only)")
    p.add_argument("--port", type=int, default=8000, help="the REST port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve the protocol's gRPC service (inference.GRPCInferenceService, "
                        "what tritonclient.grpc and KServe's gRPC clients call) on this port")
    p.add_argument("--max-batch-size", type=int, default=1,
                   help="dynamic batching: concurrent requests to the trained model are merged "
                        "into one call of up to this many rows, each answered with its own rows "
                        "(default 1: no batching)")
    p.add_argument("--max-queue-delay-us", type=float, default=0.0,
                   help="dynamic batching: how long a request may wait for others to merge with, "
                        "in microseconds (default 0: merge what is queued when the model is free)")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="BLAS threads per model call (default 1: concurrent requests already use "
                        "the cores; on a 2-core machine under load, 2 BLAS threads per call ran "
                        "6x slower)")
    p.add_argument("--cache-mb", type=float, default=64.0,
                   help="RAM cache over the snapshot's rows (default 64)")
    p.add_argument("--wait-for-checkpoint", action="store_true",
                   help="start even if the run has published no checkpoint yet (or has not "
                        "started): live, not ready (requests answered 503) until the first one "
                        "is found, then served (for a server started beside its training)")
    p.add_argument("--poll-seconds", type=float, default=1.0,
                   help="how often to look for a newer checkpoint (0: never; default 1)")
    p.add_argument("--max-request-mb", type=float, default=64.0,
                   help="largest request body accepted (default 64)")
    p.add_argument("--shutdown-grace-seconds", type=float, default=10.0,
                   help="after SIGTERM / Ctrl-C, how long requests in flight may finish before "
                        "they are answered 503 and the server exits (default 10)")
    p.add_argument("--scratch", default=None,
                   help="folder for the private stores that read SSD snapshots (default: the "
                        "system's temporary folder; on the run's file system, RocksDB links "
                        "its files instead of copying them)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plot", help="loss, AUC and samples/s against step from train --metrics "
                                    "files (several runs overlaid) into a PNG")
    p.add_argument("metrics", nargs="+", help="metrics JSON-lines file(s) of one-embedding train")
    p.add_argument("--out", default="curves.png", help="the PNG to write (default: curves.png)")
    p.add_argument("--labels", nargs="+", default=None,
                   help="one legend label per file (default: the file names)")
    p.set_defaults(func=cmd_plot)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = build_parser().parse_args(argv)
    # the process is the CLI's own: the library never changes its limits by itself
    raise_open_file_limit("a slot-engine table keeps one file open per live segment")
    args.argv = argv  # train's Ctrl-C message repeats the command, with --resume
    _terminated.clear()   # (main may run several times in one process: tests, notebooks)
    # SIGTERM (a scheduler's, a `timeout`'s) stops a command as Ctrl-C does, through its
    # cleanup (bench's scratch tables, train's checkpoint message), with exit status 143; serve
    # installs handlers of its own for uvicorn's graceful shutdown
    previous = None
    if args.command != "serve" and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        return args.func(args)
    except OneEmbeddingError as e:
        print(f"one-embedding {args.command}: error: {e}", file=sys.stderr, flush=True)
        return _end_job(2)
    except KeyboardInterrupt:
        return _end_job(_interrupt_code())
    except MemoryError as e:  # numpy's names the array it could not allocate
        print(f"one-embedding {args.command}: error: out of memory ({e or 'MemoryError'}): the "
              "settings need more RAM than this machine has; lower the sizes (`one-embedding "
              "plan` gives a table's RAM before it exists)", file=sys.stderr, flush=True)
        return _end_job(1)
    except BrokenPipeError:  # the reader of our output went away (e.g. `| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except BaseException as e:
        if interrupt_of(e) is not None:  # a Ctrl-C that a compiled extension made a SystemError
            return _end_job(_interrupt_code())
        if _other_ranks():
            traceback.print_exc()
            _end_job(1)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt_code() -> int:
    """The exit status of a run stopped by a signal: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + (signal.SIGTERM if _terminated.is_set() else signal.SIGINT)


def _other_ranks() -> bool:
    from .parallel.comm import launched_world_size

    return (launched_world_size() or 1) > 1


def _end_job(code: int) -> int:
    """With several ranks, an error on one ends them all now (MPI_Abort), instead of leaving the
    others waiting in a collective for ever."""
    if _other_ranks():
        from .parallel.comm import default_comm

        sys.stderr.flush()
        try:
            comm = default_comm()
        except OneEmbeddingError:   # no MPI to end the job with (its absence was the error)
            return code
        comm.abort(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
