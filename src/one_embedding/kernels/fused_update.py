"""The backward's per-key gradient sum fused with the row optimizer's update (the device path).

Unfused, a step's embedding gradient takes two kernels: ``embedding_segment_sum`` writes the
per-key sum (u, E) float32 of the backward's rows, and ``optim_<rule>`` reads it back to update
the lines. Where nothing needs that sum in between, the backward keeps its rows instead, as a
``SummedGradients`` (rows, inverse, key count: the sum not computed yet), and the update runs
``optim_summed_<rule>`` (``cuda/optim.cu``): each thread sums its (key, column)'s rows in the tree
order of ``device_unique.segment_sum``, in float32, and applies the same rule to that float. A key
of at most ``SUM_CHUNK`` (32) rows is summed by the thread itself, in row order from +0 as
``embedding_segment_sum`` does; a longer key's total is summed beforehand by the tree's level
kernels (``device_unique.long_segment_totals``, a thread per (chunk, column)) into a (u, E) array
written at those keys only, which the thread reads. Results are bit-identical to ``segment_sum``
then ``update_lines``; the short keys' sums are never written.

Valid where the sum goes straight to the update: one rank (the gradient shuffle is the identity)
exchanging fp32 (fp16 and int8 round the sum even on one rank), one backward per lookup (a second
adds sums: ``materialize``), no clipping (the norm needs the sums first), no admission filter
(rows left out index the sums). ``MultiTableMultiColumnEmbedding.backward`` decides the first
two, the optimizer and the shard the others, and they ``materialize`` where it does not hold.
``ENABLED = False`` runs the two kernels everywhere (the tests and benchmarks compare both).
"""
from __future__ import annotations

import numpy as np

from . import device_ops, device_unique
from .device_ops import Launcher

#: False: the backward sums at once (segment_sum) and the update reads the sums (update_lines)
ENABLED = True


class SummedGradients:
    """The per-key gradient sum of one backward, not computed yet.

    values: (n, E) float32 device array, the backward's gradient rows (padding dropped);
    inverse: (n,) int64 in [0, n_keys), the key of each row (``unique_ids``' inverse);
    n_keys: u, the number of keys. Stands for the (u, E) float32 array
    ``segment_sum(values, inverse, n_keys)``, which ``materialize`` computes. live: None, or
    the (1,) int64 device count of a fixed-capacity batch (n_keys is then its capacity and the
    keys from ``live`` on are placeholders no row sums into: the update leaves their lines).
    """

    def __init__(self, values, inverse, n_keys: int, launch: Launcher, live=None):
        self.values = device_ops.device_array(launch, "values", values, np.float32, ndim=2)
        self.inverse = device_ops.device_array(launch, "inverse", inverse, np.int64, ndim=1)
        self.n_keys = int(n_keys)
        self.launch = launch
        self.live = live
        self._order = None
        self._long_totals = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_keys, self.values.shape[1]

    def order(self):
        """(rows_by_segment (n,) int64, offsets (u + 1,) int64): the rows grouped by key
        (``device_unique.segment_order``), computed once."""
        if self._order is None:
            self._order = device_unique.segment_order(self.launch.xp, self.inverse, self.n_keys)
        return self._order

    def long_totals(self):
        """(u, E) float32: the sums of the keys of more than ``SUM_CHUNK`` rows (below ``live``),
        by the tree's level kernels, computed once; its other rows are never written
        (``xp.empty``) nor read (the fused kernels sum those keys themselves)."""
        if self._long_totals is None:
            rows_by_segment, offsets = self.order()
            xp = self.launch.xp
            # one row stands in when no key can be long (nothing reads it)
            shape = self.shape if device_unique.tree_levels(self.values.shape[0]) else (1, 1)
            self._long_totals = xp.empty(shape, dtype=xp.float32)
            device_unique.long_segment_totals(self.launch, self.values, rows_by_segment, offsets,
                                              self.n_keys, self._long_totals, self.live)
        return self._long_totals

    def materialize(self):
        """The sums: (u, E) float32, ``device_unique.segment_sum`` of the rows."""
        return device_unique.segment_sum(self.values, self.inverse, self.n_keys, self.launch,
                                      check_inverse=False)

    def row(self, at):
        """(E,) float32: the sum of key ``at`` (a 0-d device int), as the fused update sums it;
        no host read (a failed check's details)."""
        xp, launch = self.launch.xp, self.launch
        rows_by_segment, offsets = self.order()
        dim = self.values.shape[1]
        out = xp.empty(dim, dtype=xp.float32)
        segment = xp.asarray(at, dtype=xp.int64).reshape(1)
        device_ops.launch_threads(launch, "optim", "summed_row", np.float32, dim,
                                  (self.values, np.int32(dim), rows_by_segment, offsets,
                                   self.long_totals(), segment, out))
        return out


def materialized(grads):
    """``grads`` as an array: the sums of a ``SummedGradients``, anything else as given."""
    return grads.materialize() if isinstance(grads, SummedGradients) else grads


def update_lines_summed(optimizer, lines, grads: SummedGradients, step: int,
                        live=None):
    """``device_ops.update_lines(optimizer, lines, grads.materialize(), step)``, bit for bit, in
    one kernel that sums each key's rows itself. lines: (u, L) float32, C-contiguous, the lines
    of the u keys in key order. live: the (1,) int64 device count of a fixed-capacity batch
    (default ``grads.live``): the lines from it on are left untouched (the kernel's threads
    there return at once). -> (u,) bool device array: the rows the update made hold an inf or
    NaN (``device_ops.run_update``; never those from ``live`` on)."""
    launch = grads.launch
    live = grads.live if live is None else live
    count = launch.xp.full(1, grads.n_keys, dtype=launch.xp.int64) if live is None else live
    rows_by_segment, offsets = grads.order()
    long_totals = grads.long_totals()
    return device_ops.run_update(optimizer, lines, grads.shape, step, launch, "summed_",
                                 (grads.values, rows_by_segment, offsets, long_totals, count),
                                 live, group_reads=(grads.values, long_totals))
