"""Lookup + backward + Adagrad step through MultiTableEmbedding, next to a plain-numpy dense table.

    python -m benchmarks.bench_embedding [--keys 10000000] [--dim 64] [--steps 20]

Both sides do the same work per step on the same Zipf(1.05) batches of 26 x 4096 ids: de-duplicate,
gather rows, sum duplicate gradients, Adagrad update, write rows back. The baseline is what a numpy
user writes for a preallocated dense (keys, dim) table: ``np.unique`` + ``take`` + ``np.add.at``.
one_embedding stores only keys it has seen (dynamic insertion) and keeps Adagrad's state in the row.
"""
from __future__ import annotations

import argparse
import tempfile

import numpy as np

import one_embedding as oe

from .common import markdown_table, print_header, save_result, timed, zipf_ids


def dense_numpy_baseline(n_keys, dim, lr, eps, iav):
    weights = np.random.default_rng(0).uniform(-0.05, 0.05, (n_keys, dim)).astype(np.float32)
    accum = np.full((n_keys, dim), iav, np.float32)

    def step(ids, grad_out):
        flat = ids.reshape(-1)
        uniq, inverse = np.unique(flat, return_inverse=True)
        out = weights.take(flat, axis=0)  # forward: (B*F, dim)
        grads = np.zeros((uniq.size, dim), np.float32)
        np.add.at(grads, inverse, grad_out.reshape(-1, dim))
        s = accum[uniq] + grads * grads
        accum[uniq] = s
        weights[uniq] -= lr * grads / (np.sqrt(s) + eps)
        return out

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    config = {k: getattr(args, k) for k in ("keys", "dim", "batch", "tables", "alpha", "steps", "warmup")}
    machine = print_header("Embedding lookup + backward + Adagrad step (rows/s)", config)

    rng = np.random.default_rng(0)
    n_batches = args.steps + args.warmup
    batches = [zipf_ids(rng, args.alpha, args.keys, (args.batch, args.tables)) for _ in range(n_batches)]
    grads = [rng.standard_normal((args.batch, args.tables, args.dim)).astype(np.float32) * 0.01
             for _ in range(4)]
    unique_per_batch = float(np.mean([np.unique(b).size for b in batches]))
    lr, eps, iav = 0.05, 1e-8, 0.1
    ids_per_step = args.batch * args.tables

    with tempfile.TemporaryDirectory() as path:
        store = oe.make_device_mem_store_options(path, capacity=args.keys, size_factor=2)
        emb = oe.MultiTableEmbedding("bench", args.dim, np.float32, np.int64, None, store,
                                     default_initializer=oe.make_uniform_initializer(-0.05, 0.05))
        opt = oe.Optimizer(oe.optim.Adagrad(lr=lr, eps=eps, initial_accumulator_value=iav),
                           embeddings=[emb])

        def ours(i):
            emb(batches[i])
            emb.backward(grads[i % 4])
            opt.step()

        t_ours = timed(ours, args.steps, args.warmup)
        emb.close()

    baseline = dense_numpy_baseline(args.keys, args.dim, lr, eps, iav)
    t_base = timed(lambda i: baseline(batches[i], grads[i % 4]), args.steps, args.warmup)

    rows = [
        {"implementation": "one_embedding (device_mem, numba index)", "ms/step": t_ours * 1e3,
         "ids/s": ids_per_step / t_ours, "unique rows/s": unique_per_batch / t_ours,
         "vs baseline": t_base / t_ours},
        {"implementation": "numpy dense table (unique+take+add.at)", "ms/step": t_base * 1e3,
         "ids/s": ids_per_step / t_base, "unique rows/s": unique_per_batch / t_base,
         "vs baseline": 1.0},
    ]
    print(f"unique ids per batch: {unique_per_batch:,.0f} of {ids_per_step:,}")
    print(markdown_table(rows, ["implementation", "ms/step", "ids/s", "unique rows/s", "vs baseline"]))
    path = save_result("bench_embedding", {"machine": machine, "config": config, "rows": rows,
                                            "unique_per_batch": unique_per_batch})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
