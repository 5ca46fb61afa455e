"""The GPU benchmarks: embedding lookup bandwidth and DLRM training throughput, on one GPU.

    python -m benchmarks.bench_gpu [--steps 20] [--batch-size 65536] [--max-rows 2000000]
    python -m benchmarks.bench_gpu --dry-run      # the same logic on numpy / CPU, tiny sizes

1. Lookup: ``emb(ids)`` of a device_mem table on the GPU (validate, unique, hash-index find, rows
   out by inverse), keys already stored, ids Zipf(1.05) over ``--lookup-keys`` keys. Its
   bandwidth counts what a lookup must move at least: the ids read (8 B each) and each output row
   read and written (2 x 4E B): ``(8 + 8E) * n / t``. The baseline, measured in the same run, is
   the device's copy bandwidth: a device-to-device copy of a buffer as large as the output,
   counted read + write (``2 * bytes / t``). Goal: lookup >= 0.8x copy. The parts (unique alone,
   the chain's find, its line copies at 16 bytes per lane where the layout allows it beside the
   same find with one-element copies, the gather kernel as the step runs it: the found lines'
   first E columns read in place, at 16 bytes per thread where the layout allows it, beside the
   4-byte-per-thread scalar kernel as its baseline) are timed too, to show where the time goes;
   unique twice: the hash-table dedup the lookup runs and, as its baseline in the same run, the
   sort-based one it replaced (``device_unique.unique_ids_by_sorting``), whose results it must
   equal. The dedup and the store's find as two kernels against the find fused into the dedup's
   output pass (``bench_dedup_find``), results compared, and ``emb(ids)`` with the fusion off.
   Then the backward's other end: the per-key gradient sum and the row update (Adam, lines of 3E)
   of the same ids, as two kernels (``segment_sum`` then ``update_lines``: the (u, E) sums
   written and read back) and fused (``fused_update``: each key's rows summed inside the update),
   timed in the same run, their results compared bit for bit. Their bandwidth counts the gradient
   rows read (4E B each) and each line read and written (2 x 12E B per key). The write log's
   patch of a prefetched lookup (the next batch's rows take this batch's put, lines of 2E) by a
   hash index of the put's keys against the sort + binary search it replaced
   (``write_log.HASHED_PATCH`` off), compared bit for bit. Then the rows of a
   batch into the dot interaction's input: gather + concatenation (the path before) against the
   gather straight into it (``kernels.layout_ops``), in fp32 and bf16. The part's functions:
   ``bench_gpu_lookup``.
2. DLRM training on Criteo-1TB shapes: 26 tables of the Criteo 1TB sizes (each capped at
   ``--max-rows`` rows so a plain PyTorch model's dense tables fit the GPU), dim 128, bottom MLP
   512-256-128, top 1024-1024-512-256-1, dot interaction, BCE, SGD, batch 65536, Zipf ids per
   table. one_embedding: device_mem on the GPU, model on CuPy with the fused kernels, prefetch on
   a CUDA stream. Baseline in the same run: plain PyTorch DLRM (one ``nn.EmbeddingBag(sparse=True)``
   per table + MLPs, sparse SGD) on the same GPU and batches. Goal: faster than PyTorch. Anchor:
   HugeCTR's published 7.4 M samples/s per H100 (printed for scale; not run here).
3. The CLI's path on the same model shapes: ``one-embedding train --device cuda`` (the Trainer in
   this process: synthetic Criteo mlperf40m x ``--cli-scale`` from the data loader, the loss and
   metrics records, prefetch) against part 2's pre-built batches, measured in the same run. Goal
   (issue 30): within 10% of part 2's samples/s, the ``wait`` phase (the step waiting for its
   batch) under 5% of the step; the host reads per step (``host_sync``) are counted and printed.
   It runs twice: with the dense step replayed as a CUDA graph (the default) and, as its
   baseline in the same run, with ``--no-cuda-graph``.
4. Tensor cores (issue 32): the CLI's path again, a few steps (``--amp-steps``) for each of
   ``--amp off / tf32 / fp16 / bf16``, beside a one-table PyTorch DLRM under bf16 autocast on
   part 2's shapes and batches (the 26 tables concatenated into one, rows gathered with
   ``index_select`` and updated with ``index_add_``: PyTorch's fastest plain form) and, for scale,
   HugeCTR's published 7.4 M. Goal: the fastest mode >= 1.0x the PyTorch AMP baseline (2x the aim).

5. The loss fused with the last layer (issue 32 item 2): the dense step alone (DLRM's
   ``forward_from_embeddings`` and ``loss_and_backward_to_embeddings`` on inputs already on the
   device, part 2's shapes) with the fused loss (one ``dense_ops.bce_last_layer`` kernel for the
   loss, its gradient and the 256 -> 1 layer's backward) against the unfused passes (the loss,
   its gradient, the layer's own backward) as the baseline in the same run, under ``--amp off``
   and ``bf16``; and the two alone (the loss and the last layer's backward). The fused path
   needs the CuPy launcher: a ``--dry-run`` times the unfused one only (the dry run of the GPU
   tests, ``tests/gpu_dry_run.install``, runs both on the emulator).

6. Where the dense step's time goes (``bench_gpu_dense``): each stage (bottom MLP,
   interaction, top MLP) forward and backward, the MLPs' products alone with their FLOP rate,
   and the whole step, under ``--amp off / tf32 / bf16``.

7. The optimizer's update of the dense parameters (``bench_gpu_dense``): the group in one
   launch (``kernels.dense_update``) against one parameter at a time (the array expressions it
   replaced), SGD and Adam, with their bits compared; a ``--dry-run`` without the emulator times
   the per-parameter path only.

8. Where the CLI step's GPU time goes (``gpu_profile``): a short run of part 3 under ``--amp off``
   and ``bf16`` inside PyTorch's profiler (CUPTI: every kernel of the process, graph replays
   included): the device's busy share of the wall time, launches per step, time by launching
   library (cuBLAS, the project's kernels, CuPy, copies) and the costliest kernels. Needs
   PyTorch with CUDA; skipped elsewhere.

The header names the GPU, CUDA, CuPy and torch; results go to ``benchmarks/results/bench_gpu.json``
(or ``$ONE_EMBEDDING_BENCH_RESULTS``); the last line printed is a one-line summary. Without CuPy
or a CUDA device it exits at once (status 1) with the reason. A ``--dry-run`` writes no result
file: its CPU figures must never stand in for the GPU's; ``--dry-run --save`` writes them to
``bench_gpu_dry_run.json``, a name of their own.
"""
from __future__ import annotations

import argparse
import math
import os
import time
import traceback

import numpy as np

from .bench_gpu_dense import (bench_dense_parts, bench_dense_update, bench_fused_loss,
                              print_dense_parts, print_dense_update)
from .gpu_profile import print_profile
from .gpu_profile import profile as profile_kernels
from .bench_gpu_lookup import bench_interaction_input, bench_lookup, print_lookup
from .common import markdown_table, print_header, save_result, zipf_ids

#: HugeCTR's published DLRM training throughput on one H100, the anchor of issue 13
HUGECTR_H100_SAMPLES_PER_S = 7.4e6


NO_GPU_HINT = "--dry-run runs the same logic on numpy on the CPU"


def require_cupy():
    """CuPy with a CUDA device to run on; without either, a one-line SystemExit saying which is
    missing (status 1, no traceback)."""
    try:
        import cupy
    except ImportError as e:
        raise SystemExit(f"bench_gpu: needs CuPy and a CUDA device; CuPy does not import "
                         f"({e}). {NO_GPU_HINT}") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:                              # noqa: BLE001 - no driver, no device
        raise SystemExit(f"bench_gpu: needs a CUDA device; CuPy finds none "
                         f"({type(e).__name__}: {e}). {NO_GPU_HINT}") from None
    if count < 1:
        raise SystemExit(f"bench_gpu: needs a CUDA device; CuPy finds none. {NO_GPU_HINT}")
    return cupy


class Device:
    """The array module and a clock that waits for queued device work (numpy: the wall clock)."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        if dry_run:
            self.xp, self.name = np, "none (dry run: numpy on the CPU)"
            return
        self.xp = cupy = require_cupy()
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.name = (f"{props['name'].decode()} ({props['multiProcessorCount']} SMs, "
                     f"{props['totalGlobalMem'] / 2**30:.0f} GiB), CUDA runtime "
                     f"{cupy.cuda.runtime.runtimeGetVersion()}, CuPy {cupy.__version__}")

    def sync(self) -> None:
        if not self.dry_run:
            self.xp.cuda.Device().synchronize()

    def seconds(self, fn, repeats: int, warmup: int = 2) -> float:
        """Seconds per call of ``fn()``, device work included."""
        for _ in range(warmup):
            fn()
        self.sync()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        self.sync()
        return (time.perf_counter() - t) / repeats


# ---------------------------------------------------------------- 2. DLRM training


def criteo_shapes(max_rows: int) -> list[int]:
    from one_embedding.models.dlrm import CRITEO_1TB_TABLE_SIZES

    return [min(int(s), max_rows) for s in CRITEO_1TB_TABLE_SIZES]


def dlrm_batches(dev: Device, table_rows, args, count: int) -> list[dict]:
    """Zipf(1.05) ids per table (hot rows scattered by a fixed multiplier), exponential dense
    counts, 25 % positives; ids (B, 26) local to each table. Device arrays."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(count):
        ids = np.stack([zipf_ids(rng, 1.05, rows, args.batch_size) for rows in table_rows], axis=1)
        dense = np.floor(rng.exponential(20.0, (args.batch_size, 13))).astype(np.float32)
        labels = (rng.random(args.batch_size) < 0.25).astype(np.float32)
        out.append({k: dev.xp.asarray(v) for k, v in
                    (("ids", ids.astype(np.int64)), ("dense", dense), ("labels", labels))})
    return out


def run_one_embedding(dev: Device, table_rows, batches, args) -> dict:
    import one_embedding as oe
    from one_embedding.models import DLRM
    from one_embedding.pipeline import Prefetcher

    xp = dev.xp
    tables = [oe.make_table_options(oe.make_uniform_initializer(-1 / math.sqrt(r), 1 / math.sqrt(r)))
              for r in table_rows]
    store = oe.make_device_mem_store_options(None, capacity=min(sum(table_rows), 1 << 24))
    emb = oe.MultiTableEmbedding("dlrm", args.dim, np.float32, np.int64, tables, store,
                                 device="cpu" if dev.dry_run else "cuda")
    model = DLRM(num_tables=26, embedding_dim=args.dim, dense_features=13,
                 bottom_mlp=args.bottom_mlp, top_mlp=args.top_mlp, embedding=emb).to(xp)
    opt = oe.Optimizer(oe.optim.SGD(lr=args.lr), embeddings=[emb], parameters=list(model.parameters()))
    offsets = xp.asarray(np.cumsum([0] + list(table_rows[:-1])).astype(np.int64))[None, :]
    keyed = [{**b, "ids": b["ids"] + offsets} for b in batches]     # one key space
    total = args.warmup + args.steps
    stream = (keyed[i % len(keyed)] for i in range(total))
    loss, start = float("nan"), None
    with Prefetcher(stream, emb, depth=args.prefetch_depth, ids=lambda b: b["ids"]) as batches_ahead:
        for i, (batch, state) in enumerate(batches_ahead):
            if i == args.warmup:
                dev.sync()
                start = time.perf_counter()
            logits = model.forward_from_embeddings(xp.log1p(batch["dense"]), emb.embed(state))
            # the Trainer's step: on CuPy the loss fused with the last layer (part 5)
            loss, _, dembedded = model.loss_and_backward_to_embeddings(logits, batch["labels"])
            emb.backward(dembedded)
            opt.step()
            opt.zero_grad()
    dev.sync()
    seconds = time.perf_counter() - start
    stats = emb.store_stats()[0]
    emb.close()
    return {"samples_per_s": args.steps * args.batch_size / seconds, "seconds": seconds,
            "final_loss": float(loss), "rows_stored": stats["rows"]}


def time_torch_steps(torch, device, step, warmup: int, steps: int, batch_size: int) -> dict:
    """``step(i)`` (a PyTorch training step returning its loss) ``warmup`` times, then ``steps``
    timed times between device synchronizations -> samples/s, seconds, the last loss."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(warmup):
        step(i)
    sync()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = step(i)
    sync()
    seconds = time.perf_counter() - start
    return {"samples_per_s": steps * batch_size / seconds, "seconds": seconds,
            "final_loss": float(loss), "torch": torch.__version__}


def run_torch(dev: Device, table_rows, batches, args) -> dict:
    import torch
    from torch import nn

    from .peers.torch_dlrm import _mlp

    device = torch.device("cpu" if dev.dry_run else "cuda")

    class TorchDLRM(nn.Module):
        """benchmarks/peers/torch_dlrm.PlainDLRM with one table size per table."""

        def __init__(self):
            super().__init__()
            self.embeddings = nn.ModuleList(nn.EmbeddingBag(r, args.dim, mode="sum", sparse=True)
                                            for r in table_rows)
            for rows, table in zip(table_rows, self.embeddings):
                nn.init.uniform_(table.weight, -1 / math.sqrt(rows), 1 / math.sqrt(rows))
            self.bottom = _mlp(13, args.bottom_mlp, relu_last=True)
            width = args.dim + 27 * 26 // 2
            self.top = _mlp(width, args.top_mlp, relu_last=False)
            lower = torch.tril_indices(27, 27, offset=-1)
            self.register_buffer("rows", lower[0], persistent=False)
            self.register_buffer("cols", lower[1], persistent=False)

        def forward(self, dense, ids_by_table):
            bottom = self.bottom(torch.log1p(dense))                              # (B, D)
            pooled = [t(i.unsqueeze(1)) for t, i in zip(self.embeddings, ids_by_table)]
            x = torch.stack([bottom, *pooled], dim=1)                            # (B, 27, D)
            pairs = torch.bmm(x, x.transpose(1, 2))[:, self.rows, self.cols]     # (B, 351)
            return self.top(torch.cat([bottom, pairs], dim=1)).squeeze(1)

    torch.manual_seed(0)
    model = TorchDLRM().to(device)
    sparse_opt = torch.optim.SGD(list(model.embeddings.parameters()), lr=args.lr)
    dense_opt = torch.optim.SGD(list(model.bottom.parameters()) + list(model.top.parameters()),
                                lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    # the same batches, handed over without a copy (CUDA array interface / numpy buffer)
    inputs = [(torch.as_tensor(b["dense"], device=device),
               torch.as_tensor(dev.xp.ascontiguousarray(b["ids"].T), device=device),
               torch.as_tensor(b["labels"], device=device)) for b in batches]

    def step(i):
        dense, ids, labels = inputs[i % len(inputs)]
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(dense, ids), labels)
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        return loss.detach()

    return time_torch_steps(torch, device, step, args.warmup, args.steps, args.batch_size)


def bench_cli(dev: Device, args, amp: str = "off", steps: int | None = None,
              cuda_graph: bool = True) -> dict:
    """Part 3: the Trainer, as ``one-embedding train`` runs it, on part 2's model shapes
    (``--amp amp``; ``steps`` timed steps after the warmup, default ``--steps``; the dense step
    replayed as a CUDA graph unless ``cuda_graph`` is False, ``--no-cuda-graph``)."""
    from one_embedding import host_sync
    from one_embedding.config import TrainConfig
    from one_embedding.training import Trainer

    steps = args.warmup + (args.steps if steps is None else steps)
    cfg = TrainConfig(
        model="dlrm", data=("synthetic",), synthetic_cardinalities="mlperf40m",
        synthetic_scale=args.cli_scale, synthetic_rows=max(steps + 2, 4) * args.batch_size * 2,
        embedding_dim=args.dim, bottom_mlp=tuple(args.bottom_mlp), top_mlp=tuple(args.top_mlp),
        batch_size=args.batch_size, steps=steps, optimizer="sgd", lr=args.lr, eval_batches=1,
        prefetch_depth=args.prefetch_depth, device="cpu" if dev.dry_run else "cuda", amp=amp,
        cuda_graph=cuda_graph)
    trainer = Trainer(cfg, metrics_path=os.devnull, progress=False)
    with host_sync.counting() as reads:
        record = trainer.run()
    phases = record["phase_seconds"]
    step_seconds = sum(phases.values())
    return {"samples_per_s": record["samples_per_s"], "steps": steps,
            "skipped_steps": record.get("skipped_steps", 0), "final_loss": record.get("loss_last_10pct"),
            "wait_share": phases["wait"] / step_seconds if step_seconds else float("nan"),
            "phase_seconds": phases, "host_reads": reads.total,
            "host_reads_per_step": reads.total / steps, "host_reads_by_reason": dict(reads.by_reason),
            # None on the CPU (the dry run): graphs exist on the device path only
            "cuda_graph": record.get("cuda_graph"),
            "cuda_graph_replays": record.get("cuda_graph_replays", 0)}


def run_torch_one_table(dev: Device, table_rows, batches, args, autocast: bool) -> dict:
    """A plain PyTorch DLRM with the 26 tables as one (sum of rows, dim) tensor: the rows of a
    batch gathered with ``index_select`` into a leaf, SGD applied with ``index_add_`` of the
    leaf's gradient; MLPs and interaction as ``run_torch``; under ``torch.autocast`` (bf16) when
    ``autocast``."""
    import torch
    from torch import nn

    from .peers.torch_dlrm import _mlp

    device = torch.device("cpu" if dev.dry_run else "cuda")
    torch.manual_seed(0)
    bounds = torch.cat([torch.full((r,), 1 / math.sqrt(r)) for r in table_rows]).to(device)
    table = (torch.rand(sum(table_rows), args.dim, device=device) * 2 - 1) * bounds[:, None]
    offsets = torch.as_tensor(np.cumsum([0] + list(table_rows[:-1])), device=device)[None, :]
    bottom = _mlp(13, args.bottom_mlp, relu_last=True).to(device)
    top = _mlp(args.dim + 27 * 26 // 2, args.top_mlp, relu_last=False).to(device)
    lower = torch.tril_indices(27, 27, offset=-1, device=device)
    dense_opt = torch.optim.SGD(list(bottom.parameters()) + list(top.parameters()), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    inputs = [(torch.as_tensor(b["dense"], device=device),
               (torch.as_tensor(b["ids"], device=device) + offsets).reshape(-1),
               torch.as_tensor(b["labels"], device=device)) for b in batches]

    def step(i):
        dense, ids, labels = inputs[i % len(inputs)]
        dense_opt.zero_grad(set_to_none=True)
        rows = table.index_select(0, ids).requires_grad_(True)              # (B * 26, D) leaf
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            z = bottom(torch.log1p(dense))
            x = torch.cat([z[:, None, :], rows.view(-1, 26, args.dim)], dim=1)   # (B, 27, D)
            pairs = torch.bmm(x, x.transpose(1, 2))[:, lower[0], lower[1]]
            logits = top(torch.cat([z, pairs], dim=1)).squeeze(1)
            loss = loss_fn(logits.float(), labels)
        loss.backward()
        dense_opt.step()
        with torch.no_grad():
            table.index_add_(0, ids, rows.grad, alpha=-args.lr)
        return loss.detach()

    return time_torch_steps(torch, device, step, args.warmup, args.amp_steps, args.batch_size)


def bench_amp(dev: Device, args, batches=None) -> dict:
    """Part 4: the CLI's path under each --amp mode, and the PyTorch bf16 autocast baseline."""
    from one_embedding.nn.amp import PRECISIONS

    table_rows = criteo_shapes(args.max_rows)
    rows = []
    for mode in PRECISIONS:
        run = bench_cli(dev, args, amp=mode, steps=args.amp_steps)
        rows.append({"what": f"one-embedding train --amp {mode}", "amp": mode, **run})
    try:
        if batches is None:
            batches = dlrm_batches(dev, table_rows, args, args.batches)
        peer = run_torch_one_table(dev, table_rows, batches, args, autocast=True)
        rows.append({"what": "PyTorch DLRM, one table, bf16 autocast (same GPU, shapes)", **peer})
        baseline = peer["samples_per_s"]
    except ImportError as e:
        peer, baseline = {"error": str(e)}, float("nan")
    rows.append({"what": "HugeCTR, published (fp16, anchor, not run)",
                 "samples_per_s": HUGECTR_H100_SAMPLES_PER_S})
    for r in rows:
        r["x PyTorch bf16"] = r["samples_per_s"] / baseline
        r["x HugeCTR"] = r["samples_per_s"] / HUGECTR_H100_SAMPLES_PER_S
    modes = [r for r in rows if "amp" in r]
    fastest = max(modes, key=lambda r: r["samples_per_s"])
    return {"rows": rows, "torch_bf16": peer, "fastest": fastest["amp"],
            "fastest_samples_per_s": fastest["samples_per_s"],
            "speedup_vs_torch_bf16": fastest["samples_per_s"] / baseline}


# ---------------------------------------------------------------- 2. DLRM training: the pre-built-batch run beside PyTorch


def bench_dlrm(dev: Device, args) -> dict:
    table_rows = criteo_shapes(args.max_rows)
    batches = dlrm_batches(dev, table_rows, args, args.batches)
    ours = run_one_embedding(dev, table_rows, batches, args)
    rows = [{"implementation": "one_embedding (device_mem on the GPU, CuPy)", **ours}]
    try:
        peer = run_torch(dev, table_rows, batches, args)
        rows.append({"implementation": "PyTorch EmbeddingBag(sparse) + MLP, same GPU", **peer})
        speedup = ours["samples_per_s"] / peer["samples_per_s"]
    except ImportError as e:                 # no torch: the comparison is reported missing
        peer, speedup = {"error": str(e)}, float("nan")
    rows.append({"implementation": "HugeCTR, published (anchor, not run)",
                 "samples_per_s": HUGECTR_H100_SAMPLES_PER_S})
    for r in rows:
        r["x HugeCTR"] = r["samples_per_s"] / HUGECTR_H100_SAMPLES_PER_S
    return {"table_rows": table_rows, "ours": ours, "torch": peer, "speedup_vs_torch": speedup,
            "rows": rows, "batches": batches}


def result_name(args) -> str | None:
    """The result file's name: ``bench_gpu`` for a GPU run; a dry run's CPU figures go nowhere
    unless ``--save`` asks, and then under a name of their own."""
    if not args.dry_run:
        return "bench_gpu"
    return "bench_gpu_dry_run" if args.save else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="numpy on the CPU, tiny sizes: checks the benchmark's logic, no GPU needed")
    ap.add_argument("--save", action="store_true",
                    help="with --dry-run: write its results to bench_gpu_dry_run.json (a dry run "
                         "writes none by default; a GPU run always writes bench_gpu.json)")
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=20, help="timed DLRM steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed DLRM steps first")
    ap.add_argument("--batches", type=int, default=4, help="distinct DLRM batches, cycled")
    ap.add_argument("--max-rows", type=int, default=2_000_000,
                    help="cap on a Criteo table's rows (PyTorch's dense tables must fit the GPU)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--bottom-mlp", type=int, nargs="+", default=[512, 256, 128])
    ap.add_argument("--top-mlp", type=int, nargs="+", default=[1024, 1024, 512, 256, 1])
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--prefetch-depth", type=int, default=1)
    ap.add_argument("--lookup-keys", type=int, default=10_000_000)
    ap.add_argument("--lookup-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per lookup measurement")
    ap.add_argument("--cli-scale", type=float, default=0.05,
                    help="part 3: mlperf40m cardinalities times this (the issue's x0.05)")
    ap.add_argument("--amp-steps", type=int, default=5,
                    help="part 4: timed steps per --amp mode (after --warmup)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["lookup", "dlrm", "cli", "amp",
                                                              "fused", "dense", "update",
                                                              "profile"])
    args = ap.parse_args(argv)
    if args.dry_run:
        args.batch_size, args.steps, args.warmup, args.batches = 256, 2, 1, 2
        args.amp_steps = 2
        args.max_rows, args.dim, args.lookup_keys, args.lookup_dim, args.repeats = 5000, 16, 20_000, 16, 2
        args.bottom_mlp, args.top_mlp, args.cli_scale = [32, 16], [32, 1], 0.001
    dev = Device(args.dry_run)
    machine = print_header("GPU benchmarks: embedding lookup bandwidth, DLRM training (one GPU)",
                           {k: v for k, v in vars(args).items() if k != "skip"})
    print(f"device: {dev.name}")
    payload = {"machine": machine, "device": dev.name, "config": vars(args)}
    summary = []
    failed = {}

    def part(name, fn):
        """Runs one part; a part that raises is reported (summary, payload) and the next runs."""
        if name in args.skip:
            return
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:                          # noqa: BLE001 - reported; the next part runs
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {e}"
            summary.append(f"{name} FAILED ({failed[name][:200]})")
        print(f"[part {name}: {time.perf_counter() - start:.1f} s]", flush=True)

    def lookup_part():
        lookup = bench_lookup(dev, args)
        payload["lookup"] = lookup
        print_lookup(lookup, summary)
        layout = bench_interaction_input(dev, args)
        payload["interaction_input"] = layout
        print(f"\n## rows into the dot interaction's input, batch {args.batch_size}, dim "
              f"{args.lookup_dim}: the path before and the fused gather")
        print(markdown_table(layout["rows"], ["what", "ms", "MB written", "x before"]))

    def dlrm_part():
        dlrm = bench_dlrm(dev, args)
        payload["dlrm"] = dlrm
        print(f"\n## DLRM training, Criteo-1TB shapes (tables capped at {args.max_rows:,} rows, "
              f"{sum(dlrm['table_rows']):,} rows in all), batch {args.batch_size}")
        print(markdown_table(dlrm["rows"], ["implementation", "samples_per_s", "x HugeCTR",
                                            "final_loss"]))
        ours = dlrm["ours"]["samples_per_s"]
        verdict = ("met" if dlrm["speedup_vs_torch"] > 1 else "not met") \
            if math.isfinite(dlrm["speedup_vs_torch"]) else "no torch"
        summary.append(f"DLRM {ours / 1e6:.2f} M samples/s = {dlrm['speedup_vs_torch']:.2f}x "
                       f"PyTorch (goal >1x: {verdict}), {ours / HUGECTR_H100_SAMPLES_PER_S:.2f}x "
                       f"HugeCTR's 7.4 M/s per H100")

    def cli_part():
        cli = bench_cli(dev, args)
        # the same run with every kernel launched each step: the CUDA graph's baseline
        plain = bench_cli(dev, args, cuda_graph=False)
        payload["cli"], payload["cli_no_cuda_graph"] = cli, plain
        print(f"\n## the CLI's path (Trainer, synthetic mlperf40m x{args.cli_scale}), same shapes")
        prebuilt = payload.get("dlrm", {}).get("ours", {}).get("samples_per_s", float("nan"))
        ratio = cli["samples_per_s"] / prebuilt
        print(markdown_table([
            {"what": "one-embedding train (Trainer)", "samples_per_s": cli["samples_per_s"],
             "x pre-built": ratio, "wait share": cli["wait_share"],
             "host reads/step": cli["host_reads_per_step"], "cuda graph": cli["cuda_graph"]},
            {"what": "one-embedding train --no-cuda-graph", "samples_per_s": plain["samples_per_s"],
             "x pre-built": plain["samples_per_s"] / prebuilt, "wait share": plain["wait_share"],
             "host reads/step": plain["host_reads_per_step"], "cuda graph": plain["cuda_graph"]},
            {"what": "part 2, batches pre-built on the device", "samples_per_s": prebuilt,
             "x pre-built": 1.0}], ["what", "samples_per_s", "x pre-built", "wait share",
                                    "host reads/step", "cuda graph"]))
        print(f"CUDA graph: {cli['samples_per_s'] / plain['samples_per_s']:.2f}x the uncaptured "
              f"steps ({cli['cuda_graph_replays']} of {cli['steps']} steps replayed; dense phase "
              f"{cli['phase_seconds']['dense']:.3f} s vs {plain['phase_seconds']['dense']:.3f} s)")
        print(f"host reads by reason over {cli['steps']} steps (and the final evaluation): "
              f"{cli['host_reads_by_reason']}")
        verdict = "met" if ratio >= 0.9 and cli["wait_share"] < 0.05 else "not met"
        summary.append(f"CLI {cli['samples_per_s'] / 1e6:.2f} M samples/s = {ratio:.2f}x pre-built, "
                       f"wait {cli['wait_share']:.0%}, {cli['host_reads_per_step']:.1f} host "
                       f"reads/step (goal >=0.9x, wait <5%: {verdict}); CUDA graph "
                       f"{cli['cuda_graph']}: {cli['samples_per_s'] / plain['samples_per_s']:.2f}x "
                       "--no-cuda-graph")

    def amp_part():
        amp = bench_amp(dev, args, payload.get("dlrm", {}).get("batches"))
        payload["amp"] = amp
        print(f"\n## tensor cores: the CLI's path under --amp, {args.amp_steps} timed steps each, "
              f"beside PyTorch with bf16 autocast")
        print(markdown_table(amp["rows"], ["what", "samples_per_s", "x PyTorch bf16", "x HugeCTR",
                                           "skipped_steps", "final_loss"]))
        ratio = amp["speedup_vs_torch_bf16"]
        verdict = ("met" if ratio >= 1 else "not met") if math.isfinite(ratio) else "no torch"
        summary.append(f"AMP fastest --amp {amp['fastest']} {amp['fastest_samples_per_s'] / 1e6:.2f} M "
                       f"samples/s = {ratio:.2f}x PyTorch bf16 autocast (goal >=1x: {verdict}), "
                       f"{amp['fastest_samples_per_s'] / HUGECTR_H100_SAMPLES_PER_S:.2f}x HugeCTR")

    def fused_part():
        fused = bench_fused_loss(dev, args)
        payload["fused_loss"] = fused
        print(f"\n## the loss fused with the last layer: the dense step alone (DLRM, batch "
              f"{args.batch_size}, inputs on the device), {args.repeats} timed calls each")
        print(markdown_table(fused["rows"], ["what", "step ms", "x unfused step",
                                             "loss + last layer ms", "x unfused part"]))
        if fused["fused_step_speedup"]:
            summary.append("fused loss: dense step " + ", ".join(
                f"{x:.2f}x unfused (--amp {m})" for m, x in fused["fused_step_speedup"].items()))

    def dense_part():
        dense = bench_dense_parts(dev, args)
        payload["dense_parts"] = dense
        summary.extend(print_dense_parts(dense, args))

    def update_part():
        update = bench_dense_update(dev, args)
        payload["dense_update"] = update
        summary.extend(print_dense_update(update))

    def profile_part():
        payload["profile"] = {}
        for mode in ("off", "bf16"):
            steps = args.warmup + args.amp_steps
            table = profile_kernels(lambda: bench_cli(dev, args, amp=mode, steps=args.amp_steps),
                                    steps)
            if table is None:
                print("\n## profile: needs PyTorch with CUDA (its profiler reads CUPTI); skipped")
                return
            payload["profile"][mode] = table
            summary.append(print_profile(table, mode, steps))

    for name, fn in (("lookup", lookup_part), ("dlrm", dlrm_part), ("cli", cli_part),
                     ("amp", amp_part), ("fused", fused_part), ("dense", dense_part),
                     ("update", update_part), ("profile", profile_part)):
        part(name, fn)
    payload["failed"] = failed
    payload.get("dlrm", {}).pop("batches", None)
    payload["summary"] = "; ".join(summary)
    name = result_name(args)
    if name is None:
        print("\ndry run: no result file written (--save writes bench_gpu_dry_run.json)")
    else:
        print(f"\nwrote {save_result(name, payload)}")
    print(f"summary ({'dry run, ' if args.dry_run else ''}{dev.name.split(' (')[0]}): "
          f"{payload['summary']}")
    return payload


if __name__ == "__main__":
    raise SystemExit(1 if main()["failed"] else 0)
