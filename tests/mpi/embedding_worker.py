"""Run under ``mpiexec -n P``: a small DLRM trained through the Python API on a fixed sequence of
global batches; each rank takes its block of every global batch. Rank 0 writes a JSON report.

    mpiexec -n 2 python tests/mpi/embedding_worker.py OUT.json [--exchange-dtype int8]
        [--path DIR] [--save NAME] [--load NAME] [--steps N] [--clip MAX_NORM]

--clip: one parameter group holding the model and the embedding, clipped to that global 2-norm
(the rows' gradients summed over the ranks).
"""
import argparse
import json

import numpy as np

import one_embedding as oe
from one_embedding.models import DLRM
from one_embedding.nn.loss import BCEWithLogits
from one_embedding.parallel.comm import default_comm
from one_embedding.parallel.shuffle import owner_rank

TABLES, GLOBAL_BATCH = 4, 96


def global_batches(steps, seed=7):
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = (rng.zipf(1.2, size=(GLOBAL_BATCH, TABLES)) % (500 + 100 * step)).astype(np.int64)
        ids += np.arange(TABLES) * 1_000_000
        dense = rng.standard_normal((GLOBAL_BATCH, 5)).astype(np.float32)
        labels = (rng.random(GLOBAL_BATCH) < 0.3).astype(np.float32)
        yield dense, ids, labels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--exchange-dtype", default="fp32")
    ap.add_argument("--path", default=None)
    ap.add_argument("--store", default="device_mem")
    ap.add_argument("--save", default=None)
    ap.add_argument("--load", default=None)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--clip", type=float, default=None)
    args = ap.parse_args()
    comm = default_comm()
    E = args.dim
    if args.store == "cached_ssd":
        store = oe.make_cached_ssd_store_options(0.01, args.path, size_factor=2)
    else:
        store = oe.make_device_mem_store_options(args.path, 100_000, size_factor=2)
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64,
                                 [oe.make_table_options(oe.make_uniform_initializer(-0.1, 0.1))] * TABLES,
                                 store, seed=3, exchange_dtype=args.exchange_dtype)
    model = DLRM(num_tables=TABLES, embedding_dim=E, dense_features=5, bottom_mlp=(16, E),
                 top_mlp=(16, 1), embedding=emb, seed=2)
    if args.clip is None:
        opt = oe.Optimizer(oe.optim.Adagrad(lr=0.05), embeddings=[emb],
                           parameters=list(model.parameters()))
    else:
        group = {"params": list(model.parameters()) + [emb], "clip_grad_max_norm": args.clip}
        opt = oe.Optimizer(oe.optim.Adagrad([group], lr=0.05))
    if args.load:
        emb.load_snapshot(args.load)
    loss_fn = BCEWithLogits()
    local = GLOBAL_BATCH // comm.world
    block = slice(comm.rank * local, (comm.rank + 1) * local)
    losses = []
    for dense, ids, labels in global_batches(args.steps):
        logits = model(dense[block], ids[block])
        loss_fn(logits, labels[block])
        dlogits = loss_fn.backward() * np.float32(local / GLOBAL_BATCH)  # share of the global mean
        model.backward(dlogits)
        opt.step()
        opt.zero_grad()
        # the logged loss is the global batch's mean: the mean of the ranks' means
        all_logits = comm.allgather(np.asarray(logits, np.float32))
        losses.append(float(BCEWithLogits()(all_logits, labels)))
    if args.save:
        emb.save_snapshot(args.save)
    keys, lines = emb.export()
    owned = bool((owner_rank(keys, comm.world) == comm.rank).all())
    all_keys = comm.allgather(keys)
    all_lines = comm.allgather(lines)
    dense_params = np.concatenate([p.data.reshape(-1) for p in model.parameters()])
    same_dense = comm.allgather(dense_params[None, :])
    report = {
        "world": comm.world, "rank": comm.rank, "losses": losses,
        "owned_only": bool(np.all(comm.allgather(np.array([owned])))),
        "dense_identical_across_ranks": bool((same_dense == same_dense[0]).all()),
        "exchange_bytes": int(comm.allreduce_sum(np.array([emb.traffic.exchange_bytes]))[0]),
        "id_bytes": int(comm.allreduce_sum(np.array([emb.traffic.id_bytes]))[0]),
    }
    if comm.rank == 0:
        order = np.argsort(all_keys)
        np.savez(args.out + ".npz", keys=all_keys[order], lines=all_lines[order])
        with open(args.out, "w") as f:
            json.dump(report, f)
    emb.close()


if __name__ == "__main__":
    main()
