"""Counts the device operations of the dense parameters' update, per step, for a DLRM: the
per-parameter path the device path ran before ``kernels.dense_update`` (``optimizer.masked_update``
over the rule's ``_vectorized`` array expressions, each operation one CuPy kernel on a GPU)
against the flat path's launches (the fill and two kernels, whatever the number of parameters).

The per-parameter path runs here on numpy arrays of a subclass that counts each ufunc call and
reduction, each array function (``copyto``, ...) and each ``astype``, ``copy`` and item
assignment: the operations CuPy launches a kernel for. A lower bound: the negation of the 0-d
"any" result is a numpy scalar here, not counted (one kernel on CuPy).

    python -m benchmarks.dense_update_ops [--num-tables 26] [--embedding-dim 128]
        [--dense-features 13] [--bottom-mlp 512 256 128] [--top-mlp 1024 1024 512 256 1]
        [--optimizers sgd adagrad adam]

The sizes are the model's (``models.DLRM``'s defaults; tables of 100 rows: only the dense
parameters' shapes count); ``--help`` lists them.
No GPU needed; the launches' time is measured on one by ``bench_gpu.py`` part 7.
"""
from __future__ import annotations

import argparse
import collections

import numpy as np

from .common import markdown_table, print_header

#: the flat path's launches per parameter group and step: nonzero.fill(0), optim_dense_nonzero,
#: optim_dense_<rule> (tests/unit/test_dense_update.py asserts the two kernels)
FLAT_LAUNCHES = 3


class CountingArray(np.ndarray):
    """A numpy array that counts the operations made on it into ``CountingArray.ops``."""

    ops: collections.Counter = collections.Counter()

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        CountingArray.ops[f"{ufunc.__name__}.{method}"] += 1
        inputs = [x.view(np.ndarray) if isinstance(x, CountingArray) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, CountingArray) else x
                                  for x in kwargs["out"])
        result = getattr(ufunc, method)(*inputs, **kwargs)
        return result.view(CountingArray) if isinstance(result, np.ndarray) else result

    def __array_function__(self, func, types, args, kwargs):
        CountingArray.ops[func.__name__] += 1
        return super().__array_function__(func, types, args, kwargs)

    def astype(self, *args, **kwargs):
        CountingArray.ops["astype"] += 1
        return super().astype(*args, **kwargs)

    def copy(self, *args, **kwargs):
        CountingArray.ops["copy"] += 1
        return super().copy(*args, **kwargs)

    def __setitem__(self, key, value):
        CountingArray.ops["setitem"] += 1
        return super().__setitem__(key, value)


def per_parameter_ops(optimizer, shapes) -> int:
    """Operations of one step of the per-parameter device path over parameters of ``shapes``."""
    from one_embedding.optimizer import masked_update

    rng = np.random.default_rng(0)

    class Vectorized:
        """``optimizer`` whose update is its array expressions, as on CuPy."""

        def update(self, w, states, g, t):
            optimizer._vectorized(np, w, states, g, optimizer._current_lr(), t,
                                  optimizer._grad_factor())

    CountingArray.ops.clear()
    for shape in shapes:
        w = rng.standard_normal(shape).astype(np.float32).view(CountingArray)
        g = rng.standard_normal(shape).astype(np.float32).view(CountingArray)
        states = [np.full(shape, v, np.float32).view(CountingArray)
                  for v in optimizer.initial_state()]
        masked_update(Vectorized(), w, states, g, 1)
    return sum(CountingArray.ops.values())


OPTIMIZERS = {"sgd": lambda oe: oe.optim.SGD(lr=0.1),
              "adagrad": lambda oe: oe.optim.Adagrad(lr=0.05),
              "adam": lambda oe: oe.optim.Adam(lr=0.01)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-tables", type=int, default=26,
                   help="embedding tables: the interaction's width (default: %(default)s)")
    p.add_argument("--embedding-dim", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--dense-features", type=int, default=13, help="(default: %(default)s)")
    p.add_argument("--bottom-mlp", type=int, nargs="+", default=None,
                   help="layer sizes, the last one --embedding-dim (default: 512 256 E)")
    p.add_argument("--top-mlp", type=int, nargs="+", default=[1024, 1024, 512, 256, 1],
                   help="layer sizes, the last one 1 (default: 1024 1024 512 256 1)")
    p.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS),
                   help="(default: all)")
    args = p.parse_args(argv)
    if args.bottom_mlp is None:
        args.bottom_mlp = [512, 256, args.embedding_dim]
    for name in ("num_tables", "embedding_dim", "dense_features"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.bottom_mlp[-1] != args.embedding_dim:
        p.error(f"--bottom-mlp must end in --embedding-dim {args.embedding_dim}, got "
                f"{args.bottom_mlp}")
    if args.top_mlp[-1] != 1:
        p.error(f"--top-mlp must end in 1 (one logit per sample), got {args.top_mlp}")
    if min(args.bottom_mlp + args.top_mlp) <= 0:
        p.error("layer sizes must be positive")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import one_embedding as oe
    from one_embedding.models import DLRM

    model = DLRM(num_tables=args.num_tables, embedding_dim=args.embedding_dim,
                 dense_features=args.dense_features, bottom_mlp=tuple(args.bottom_mlp),
                 top_mlp=tuple(args.top_mlp), table_sizes=[100] * args.num_tables)
    shapes = [p.data.shape for p in model.parameters()]
    model.embedding.close()
    print_header("Device operations of the dense update per step (DLRM, one parameter group)",
                 {"tables": args.num_tables, "embedding_dim": args.embedding_dim,
                  "bottom_mlp": args.bottom_mlp, "top_mlp": args.top_mlp,
                  "parameters": len(shapes), "floats": int(sum(np.prod(s) for s in shapes))})
    rows = []
    for name in args.optimizers:
        ops = per_parameter_ops(OPTIMIZERS[name](oe), shapes)
        rows.append({"optimizer": name, "per parameter (before)": ops,
                     "per parameter, each": ops / len(shapes), "flat (now)": FLAT_LAUNCHES,
                     "x fewer": ops / FLAT_LAUNCHES})
    print(markdown_table(rows, ["optimizer", "per parameter (before)", "per parameter, each",
                                "flat (now)", "x fewer"]))
    return rows


if __name__ == "__main__":
    main()
