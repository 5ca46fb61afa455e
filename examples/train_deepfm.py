"""Train DeepFM (Guo et al. 2017) on Criteo-like data with one_embedding.

All 39 Criteo fields enter as categorical features, as in the reference: the 26 C columns keep
their keys and the 13 dense columns are bucketized into 13 more tables. Each key owns one line
with two columns, [v (E) | w (1)], in a MultiTableMultiColumnEmbedding: v feeds the factorization
machine and the DNN, w is the key's first-order weight (starting at 0).
logit = bias + sum_f w_f + FM(v) + DNN(v). Adam updates the DNN and the embedding rows, so a
stored line is [v | w | Adam's two states]: size_factor 3.

    python examples/train_deepfm.py                               # synthetic data, scaled-down sizes
    python examples/train_deepfm.py --store cached_ssd --persistent-path /tmp/deepfm
    python examples/train_deepfm.py --data train.parquet --reference-sizes
"""
import argparse
import itertools
import tempfile
import time

import numpy as np

import one_embedding as oe
from one_embedding.data import BatchLoader, SyntheticCriteo, resolve_cardinalities
from one_embedding.metrics import log_loss, roc_auc
from one_embedding.models import DeepFM
from one_embedding.nn import BCEWithLogits
from one_embedding.optim import Adam

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--data", nargs="+", help="Criteo TSV or Parquet files (default: synthetic)")
p.add_argument("--synthetic-scale", type=float, default=0.002, help="x Criteo Kaggle cardinalities")
p.add_argument("--store", default="device_mem",
               choices=["device_mem", "cached_host_mem", "cached_ssd"])
p.add_argument("--cache-mb", type=float, default=4.0, help="device cache of the cached stores")
p.add_argument("--persistent-path",
               help="store and snapshot folder (default: a temporary folder, removed at the end)")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, help="default 512 (reference 10000)")
p.add_argument("--lr", type=float, help="default 0.005 (reference 0.001)")
p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations of 10 batches")
p.add_argument("--reference-sizes", action="store_true", help="OneFlow's DeepFM sizes (see above)")
args = p.parse_args()
# OneFlow's Criteo configuration and the scaled-down default; both: E = 16, dropout 0.2.
REFERENCE = dict(dnn=(1000,) * 5, batch=10_000, lr=1e-3)
SMALL = dict(dnn=(128, 64), batch=512, lr=5e-3)
cfg = REFERENCE if args.reference_sizes else SMALL
batch_size, lr = args.batch_size or cfg["batch"], args.lr or cfg["lr"]
# without --persistent-path the store lives in a temporary folder, removed at the end
scratch = None if args.persistent_path else tempfile.TemporaryDirectory(prefix="deepfm_")
path = args.persistent_path or scratch.name

if args.data:
    sizes, source = resolve_cardinalities("kaggle"), args.data  # sizes only scale the init
else:
    synthetic = SyntheticCriteo("kaggle", scale=args.synthetic_scale, seed=0,
                                num_rows=int(args.steps * batch_size * 1.2) + 50_000)
    sizes, source = synthetic.cardinalities, synthetic
train_data = BatchLoader(source, batch_size, split="train", eval_fraction=0.05, drop_last=True)
eval_data = BatchLoader(source, batch_size, split="eval", eval_fraction=0.05)

# Dense column j becomes a categorical: a bucket of log(x + 1) in quarter steps, capped at 63,
# keyed far above every Criteo key (data keys stay below 2**62) so no key collides.
BUCKETS, DENSE_KEY_BASE = 64, np.int64(1 << 62)


def all_categorical(batch):
    """dense (B, 13) float32, ids (B, 26) int64 -> ids (B, 39) int64."""
    buckets = np.minimum(batch.dense * 4, BUCKETS - 1).astype(np.int64)
    dense_keys = DENSE_KEY_BASE + BUCKETS * np.arange(13) + buckets
    return np.concatenate([batch.ids, dense_keys], axis=1)


sizes = list(sizes) + [BUCKETS] * 13
tables = [oe.make_table_options([
    oe.make_column_options(oe.make_uniform_initializer(-(1 / n) ** 0.5, (1 / n) ** 0.5)),  # v
    oe.make_column_options(oe.make_constant_initializer(0.0)),                             # w
]) for n in sizes]
capacity = None if args.data else sum(sizes)
if args.store == "device_mem":
    store = oe.make_device_mem_store_options(path, capacity=capacity, size_factor=3)
elif args.store == "cached_host_mem":
    store = oe.make_cached_host_mem_store_options(args.cache_mb, path, capacity, size_factor=3)
else:
    store = oe.make_cached_ssd_store_options(args.cache_mb, path, capacity=capacity, size_factor=3)
embedding = oe.MultiTableMultiColumnEmbedding("deepfm_embedding", [16, 1], np.float32, np.int64,
                                              tables, store)             # rows 16 + 1 wide
model = DeepFM(num_tables=len(sizes), embedding_dim=16, dense_features=0, dnn=cfg["dnn"],
               dropout=0.2, embedding=embedding)
opt = oe.Optimizer(Adam(lr=lr), embeddings=[embedding], parameters=model.parameters())
loss_fn = BCEWithLogits()


def evaluate():
    model.eval()                                        # dropout off
    labels, logits = [], []
    for _, batch in zip(range(10), eval_data):
        logits.append(np.asarray(model(None, all_categorical(batch)), np.float64))
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
    logits = model(None, all_categorical(batch))        # (B,)
    loss = float(loss_fn(logits, batch.labels))
    model.backward(loss_fn.backward())
    opt.step()                                          # Adam on DNN, bias and touched rows
    opt.zero_grad()
    seconds += time.perf_counter() - t0
    samples += len(batch.labels)
    if step % args.eval_every == 0 or step == args.steps:
        auc, ll = evaluate()
        print(f"step {step:6d}  loss {loss:.4f}  eval AUC {auc:.4f}  logloss {ll:.4f}  "
              f"{samples / seconds:,.0f} samples/s", flush=True)

embedding.save_snapshot("final")
print(f"trained {args.steps} steps, {samples:,} samples: {samples / seconds:,.0f} samples/s; "
      f"{len(embedding):,} rows stored; snapshot 'final' in {path}")
embedding.close()
if scratch is not None:
    scratch.cleanup()
    print(f"{path} was a temporary folder and is removed: --persistent-path keeps the snapshot")
