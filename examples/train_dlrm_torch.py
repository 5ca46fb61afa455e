"""Train DLRM written in PyTorch over a one_embedding table on SSD (cached_ssd).

The model is plain PyTorch: bottom MLP, dot interaction, top MLP, BCEWithLogitsLoss, autograd,
torch.optim.SGD for the dense weights. The 26 embedding tables are one MultiTableEmbedding in a
tiered store (a small LRU cache in RAM over an SSD table, `--engine slots|rocksdb`), used as a
torch module through `one_embedding.torch.TorchEmbedding`; `loss.backward()` hands the rows'
gradient to the embedding, and `one_embedding.Optimizer` (SGD) updates the rows in the store.
A `Prefetcher` looks the next batches' rows up on a background thread while this one computes.

    z = relu(bottom_mlp(dense))                     (B, E)
    X = [z, emb_1(ids_1), ..., emb_26(ids_26)]      (B, 27, E)
    logit = top_mlp([z | <X_i, X_j> for i > j])     (B,)

    pip install 'one_embedding[torch]'
    python examples/train_dlrm_torch.py                              # synthetic data
    python examples/train_dlrm_torch.py --engine rocksdb --persistent-path /tmp/dlrm_torch
"""
import argparse
import itertools
import tempfile
import time

import numpy as np

try:
    import torch
except ImportError:  # an optional extra: say which
    raise SystemExit("train_dlrm_torch.py needs PyTorch: pip install 'one_embedding[torch]' "
                     "(or a torch build for your platform)") from None

import one_embedding as oe
from one_embedding.data import BatchLoader, SyntheticCriteo, resolve_cardinalities
from one_embedding.metrics import log_loss, roc_auc
from one_embedding.pipeline import Prefetcher
from one_embedding.torch import TorchEmbedding

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--data", nargs="+", help="Criteo TSV or Parquet files (default: synthetic)")
p.add_argument("--synthetic-scale", type=float, default=0.001, help="x Criteo 1TB cardinalities")
p.add_argument("--engine", default="slots", choices=["slots", "rocksdb"], help="the SSD table")
p.add_argument("--cache-mb", type=float, default=1.0, help="LRU cache in RAM above the SSD table")
p.add_argument("--persistent-path",
               help="SSD table and snapshot folder (default: a temporary folder, removed at the end)")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, default=512)
p.add_argument("--embedding-dim", type=int, default=16)
p.add_argument("--lr", type=float, default=0.5, help="SGD, for the rows and the dense weights")
p.add_argument("--prefetch-depth", type=int, default=1, help="batches looked up ahead (0: off)")
p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations of 10 batches")
args = p.parse_args()
E = args.embedding_dim
# without --persistent-path the table lives in a temporary folder, removed at the end
scratch = None if args.persistent_path else tempfile.TemporaryDirectory(prefix="dlrm_torch_")
path = args.persistent_path or scratch.name
torch.manual_seed(0)

# Data: dense (B, 13) log(x + 1), ids (B, 26) int64 unique across columns, labels (B,).
if args.data:
    sizes, source = resolve_cardinalities("mlperf_v1"), args.data  # sizes only scale the init
else:
    source = SyntheticCriteo("mlperf_v1", scale=args.synthetic_scale, seed=0,
                             num_rows=int(args.steps * args.batch_size * 1.2) + 50_000)
    sizes = source.cardinalities
train_data = BatchLoader(source, args.batch_size, split="train", eval_fraction=0.05, drop_last=True)
eval_data = BatchLoader(source, args.batch_size, split="eval", eval_fraction=0.05)

# The embedding: table j (column j of ids) starts uniform(+-sqrt(1 / size_j)); SGD keeps no
# state, so a stored line is just the row (size_factor=1).
tables = [oe.make_table_options(oe.make_uniform_initializer(-(1 / n) ** 0.5, (1 / n) ** 0.5))
          for n in sizes]
store = oe.make_cached_ssd_store_options(args.cache_mb, path, size_factor=1, engine=args.engine)
embedding = oe.MultiTableEmbedding("dlrm_embedding", E, np.float32, np.int64, tables, store)


def mlp(sizes, last_relu):
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if last_relu or i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class DLRM(torch.nn.Module):
    def __init__(self, lookup, num_tables, dim, bottom=(64, 32), top=(64, 32)):
        super().__init__()
        self.lookup = lookup                                   # TorchEmbedding: ids -> rows
        self.bottom = mlp((13, *bottom, dim), last_relu=True)
        # the (i, j), i > j, entries of the flattened (F+1, F+1) dot products, built once; one
        # index_select (its backward an index_add) is ~3x faster on CPU than dots[:, i, j]
        n = num_tables + 1
        i, j = torch.tril_indices(n, n, offset=-1)
        self.register_buffer("pairs", i * n + j, persistent=False)
        self.top = mlp((dim + self.pairs.shape[0], *top, 1), last_relu=False)

    def forward(self, dense, ids):
        """dense (B, 13) float32; ids (B, 26) LongTensor, or the StepState a Prefetcher
        prepared -> logits (B,)."""
        z = self.bottom(dense)                                 # (B, E)
        x = torch.cat([z[:, None], self.lookup(ids)], dim=1)   # (B, 27, E)
        dots = torch.bmm(x, x.transpose(1, 2))                 # (B, 27, 27)
        inter = dots.flatten(1).index_select(1, self.pairs)    # (B, 351)
        return self.top(torch.cat([z, inter], dim=1)).squeeze(1)


model = DLRM(TorchEmbedding(embedding), len(sizes), E)
row_optimizer = oe.Optimizer(oe.optim.SGD(lr=args.lr), embeddings=[embedding])
dense_optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # the rows are not in here
loss_fn = torch.nn.BCEWithLogitsLoss()


def evaluate():
    model.eval()
    labels, logits = [], []
    with torch.no_grad():  # lookups without a backward
        for _, batch in zip(range(10), eval_data):
            logits.append(model(torch.from_numpy(batch.dense), torch.from_numpy(batch.ids)))
            labels.append(batch.labels)
    model.train()
    y, z = np.concatenate(labels), torch.cat(logits).double().numpy()
    return roc_auc(y, z), log_loss(y, z)


def batches():
    """Training batches, epoch after epoch."""
    for epoch in itertools.count():
        train_data.set_epoch(epoch)
        yield from train_data
        if epoch == 0 and samples == 0:
            raise SystemExit("the training split has no full batch: lower --batch-size")


# samples/s times the training step (model, optimizers, store), not data loading or evaluation
samples, seconds = 0, 0.0
steps = Prefetcher(itertools.islice(batches(), args.steps), embedding, depth=args.prefetch_depth)
for step, (batch, state) in enumerate(steps, 1):
    t0 = time.perf_counter()
    logits = model(torch.from_numpy(batch.dense), state)   # state: this batch's rows, looked up
    loss = loss_fn(logits, torch.from_numpy(batch.labels))
    loss.backward()                                        # dense .grad + the rows' gradient
    row_optimizer.step()                                   # SGD on the touched rows, in the store
    dense_optimizer.step()
    row_optimizer.zero_grad()
    dense_optimizer.zero_grad()
    seconds += time.perf_counter() - t0
    samples += len(batch.labels)
    if step % args.eval_every == 0 or step == args.steps:
        auc, ll = evaluate()
        print(f"step {step:6d}  loss {loss.item():.4f}  lr {args.lr:.4g}  eval AUC {auc:.4f}  "
              f"logloss {ll:.4f}  {samples / seconds:,.0f} samples/s", flush=True)

embedding.save_snapshot("final")
print(f"trained {args.steps} steps, {samples:,} samples: {samples / seconds:,.0f} samples/s; "
      f"{len(embedding):,} rows stored ({args.engine} engine); snapshot 'final' in {path}")
embedding.close()
if scratch is not None:
    scratch.cleanup()
    print(f"{path} was a temporary folder and is removed: --persistent-path keeps the snapshot")
