"""Train DLRM (Naumov et al. 2019) on Criteo-like data with one_embedding.

13 dense features -> bottom MLP; 26 categorical features -> one MultiTableEmbedding (a table per
column, each initialised uniform(+-sqrt(1 / table_size)) as the reference does); dot interaction;
top MLP -> one logit. SGD on the embedding rows and the MLPs, with DLRM's linear warmup and
polynomial decay of the learning rate.

    python examples/train_dlrm.py                                 # synthetic data, scaled-down sizes
    python examples/train_dlrm.py --store cached_ssd --persistent-path /tmp/dlrm
    python examples/train_dlrm.py --data day_0.parquet --reference-sizes
"""
import argparse
import itertools
import tempfile
import time

import numpy as np

import one_embedding as oe
from one_embedding.data import BatchLoader, SyntheticCriteo, resolve_cardinalities
from one_embedding.metrics import log_loss, roc_auc
from one_embedding.models import DLRM
from one_embedding.nn import BCEWithLogits
from one_embedding.optim import SGD, WarmupPolynomialDecay

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--data", nargs="+", help="Criteo TSV or Parquet files (default: synthetic)")
p.add_argument("--synthetic-scale", type=float, default=0.001, help="x Criteo 1TB cardinalities")
p.add_argument("--store", default="device_mem",
               choices=["device_mem", "cached_host_mem", "cached_ssd"])
p.add_argument("--cache-mb", type=float, default=4.0, help="device cache of the cached stores")
p.add_argument("--persistent-path",
               help="store and snapshot folder (default: a temporary folder, removed at the end)")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, help="default 512 (reference 55296)")
p.add_argument("--lr", type=float, help="default 0.5 (reference 24)")
p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations of 10 batches")
p.add_argument("--reference-sizes", action="store_true", help="OneFlow's DLRM sizes (see above)")
args = p.parse_args()
# OneFlow's Criteo 1TB configuration, and the scaled-down default.
REFERENCE = dict(E=128, bottom=(512, 256, 128), top=(1024, 1024, 512, 256, 1), batch=55_296,
                 lr=24.0, warmup=2750, decay_start=49_315, decay_steps=27_772)
SMALL = dict(E=16, bottom=(64, 32, 16), top=(64, 32, 1), batch=512, lr=0.5, warmup=args.steps // 10,
             decay_start=args.steps // 2, decay_steps=max(1, args.steps - args.steps // 2))
cfg = REFERENCE if args.reference_sizes else SMALL
E, batch_size, lr = cfg["E"], args.batch_size or cfg["batch"], args.lr or cfg["lr"]
# without --persistent-path the store lives in a temporary folder, removed at the end
scratch = None if args.persistent_path else tempfile.TemporaryDirectory(prefix="dlrm_")
path = args.persistent_path or scratch.name

# Data: every source yields dense (B, 13) log(x + 1), ids (B, 26) int64 unique across columns.
if args.data:
    sizes, source = resolve_cardinalities("mlperf_v1"), args.data  # sizes only scale the init
else:
    synthetic = SyntheticCriteo("mlperf_v1", scale=args.synthetic_scale, seed=0,
                                num_rows=int(args.steps * batch_size * 1.2) + 50_000)
    sizes, source = synthetic.cardinalities, synthetic
train_data = BatchLoader(source, batch_size, split="train", eval_fraction=0.05, drop_last=True)
eval_data = BatchLoader(source, batch_size, split="eval", eval_fraction=0.05)

# Embedding: one table per categorical column; SGD keeps no state, so a line is just the row.
tables = [oe.make_table_options(oe.make_uniform_initializer(-(1 / n) ** 0.5, (1 / n) ** 0.5))
          for n in sizes]
capacity = None if args.data else sum(sizes)
if args.store == "device_mem":
    store = oe.make_device_mem_store_options(path, capacity=capacity, size_factor=1)
elif args.store == "cached_host_mem":
    store = oe.make_cached_host_mem_store_options(args.cache_mb, path, capacity, size_factor=1)
else:
    store = oe.make_cached_ssd_store_options(args.cache_mb, path, capacity=capacity, size_factor=1)
embedding = oe.MultiTableEmbedding("dlrm_embedding", E, np.float32, np.int64, tables, store)
model = DLRM(num_tables=len(sizes), embedding_dim=E, dense_features=13, bottom_mlp=cfg["bottom"],
             top_mlp=cfg["top"], embedding=embedding)

opt = oe.Optimizer(SGD(lr=lr), embeddings=[embedding], parameters=model.parameters())
schedule = WarmupPolynomialDecay(opt, lr, cfg["warmup"], cfg["decay_start"], cfg["decay_steps"])
loss_fn = BCEWithLogits()


def evaluate():
    model.eval()
    labels, logits = [], []
    for _, batch in zip(range(10), eval_data):
        logits.append(np.asarray(model(batch.dense, batch.ids), np.float64))
        labels.append(batch.labels)
    model.train()
    y, z = np.concatenate(labels), np.concatenate(logits)
    return roc_auc(y, z), log_loss(y, z)


def batches():
    """Training batches, epoch after epoch."""
    for epoch in itertools.count():
        train_data.set_epoch(epoch)
        yield from train_data
        if epoch == 0 and samples == 0:
            raise SystemExit("the training split has no full batch: lower --batch-size")


# samples/s times the training step (model, optimizer, store), not data loading or evaluation
samples, seconds = 0, 0.0
for step, batch in enumerate(itertools.islice(batches(), args.steps), 1):
    t0 = time.perf_counter()
    logits = model(batch.dense, batch.ids)              # (B,)
    loss = float(loss_fn(logits, batch.labels))
    model.backward(loss_fn.backward())                  # dense grads + embedding row grads
    opt.step()                                          # SGD on MLPs and touched rows
    opt.zero_grad()
    schedule.step()                                     # the next step's learning rate
    seconds += time.perf_counter() - t0
    samples += len(batch.labels)
    if step % args.eval_every == 0 or step == args.steps:
        auc, ll = evaluate()
        print(f"step {step:6d}  loss {loss:.4f}  lr {opt.lr:.4g}  eval AUC {auc:.4f}  "
              f"logloss {ll:.4f}  {samples / seconds:,.0f} samples/s", flush=True)

embedding.save_snapshot("final")
print(f"trained {args.steps} steps, {samples:,} samples: {samples / seconds:,.0f} samples/s; "
      f"{len(embedding):,} rows stored; snapshot 'final' in {path}")
embedding.close()
if scratch is not None:
    scratch.cleanup()
    print(f"{path} was a temporary folder and is removed: --persistent-path keeps the snapshot")
