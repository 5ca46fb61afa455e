"""The three shuffles between the ids a rank reads and the rows the owner ranks hold.

    ID shuffle         ids (n,) ─unique─> (u,) ─partition by owner─> all-to-all ─unique─> owner keys (v,)
    embedding shuffle  owner rows (v, E) ─gather by owner inverse─> all-to-all ─> rows (u, E)
    gradient shuffle   grads (u, E) ─all-to-all─> (r, E) ─segment-sum by owner inverse─> (v, E)

The owner of a key is rank ``XXH64(8 little-endian bytes of the key, seed 1) % P`` (REFERENCE.md
"Distribution"). Over ``LocalComm`` (P = 1) every all-to-all is the identity and the owner-side
de-duplication finds nothing to merge, so the owner inverse is the identity and is skipped: one
rank computes exactly what it did before ranks existed, bit for bit.

Gradient summation order: a rank first sums the gradients of its own duplicate ids in
``segment_sum``'s tree order (batch order within chunks of 32 rows, the chunks' partials by the
same rule); the owner then adds the partial sums it receives in source-rank order (the same
rule, so past 32 ranks in the same tree order).

Rows and gradients cross the all-to-all in the exchange dtype (``codec``: fp32, fp16, int8 per
row); ``Traffic`` counts the bytes a rank sends to the other ranks.

On a GPU (``launch``: the embedding's device launcher) keys, rows and gradients stay device arrays
and the local steps run their device twins (``kernels.device_unique``: unique, segment sums;
``kernels.codec_ops``: codecs) with the same results; only the per-rank counts are host arrays
(a communicator takes them so: NCCL's sends and receives are sized on the host). With several
ranks that is the step's one read; both dedups keep their counts on the device (the local one's
placeholders are grouped after every owner's keys; the owner's keys, with ``fixed_capacity``,
stay a fixed-capacity array of the r received ids). A fixed-capacity all-to-all (blocks of a
bound's size, no read) would send the bound's rows, not the u unique ones: n/u times the
traffic (4.3x on Criteo-1TB's batch of 1.7 M ids, 393 k unique).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..hashing import xxh64_u64 as _xxh64_u64
from ..kernels import codec_ops, device_unique
from . import codec
from .comm import Communicator
from .unique import first_occurrence, segment_sum, unique_ids

#: XXH64 seed of the owner-rank hash (REFERENCE.md "Distribution").
OWNER_SEED = 1


def xxh64_u64(keys: np.ndarray, seed: int = OWNER_SEED) -> np.ndarray:
    """XXH64 of each key's 8 little-endian bytes (``hashing.xxh64_u64``), by default with the
    owner-rank seed. keys: (n,) uint64 -> (n,) uint64."""
    return _xxh64_u64(keys, seed)


def owner_rank(keys: np.ndarray, world: int, xp=np) -> np.ndarray:
    """Rank that owns each key: XXH64(key, seed=1) % world. keys: (n,) uint64 of ``xp`` -> (n,)
    int64."""
    if world == 1:
        return xp.zeros(keys.shape[0], xp.int64)
    return (_xxh64_u64(keys, OWNER_SEED, xp) % xp.uint64(world)).astype(xp.int64)


@dataclass
class LocalIds:
    """A rank's own ids, de-duplicated and grouped by owner rank (the sending half).

    unique_keys: (u,) uint64 in first-occurrence order within each owner's group
    unique_table_ids: (u,) int32 table of each unique key (its first occurrence's)
    inverse: (n,) int64 row of ``unique_keys`` for each input id
    counts_per_rank: (P,) int64 unique ids owned by each rank (P = 1: [u])
    unique_count: None, or for a fixed-capacity batch (one rank on the device,
    ``partition_ids(fixed_capacity=True)``) the (1,) int64 device count u: the arrays then hold
    n entries (the ids' count, an upper bound of u; ``counts_per_rank`` is [n]), those from u on
    placeholders that the kernels after it skip (``device_unique.unique_ids_fixed``)
    """

    unique_keys: np.ndarray
    unique_table_ids: np.ndarray
    inverse: np.ndarray
    counts_per_rank: np.ndarray
    unique_count: object = None


def partition_ids(keys: np.ndarray, table_ids: np.ndarray, world: int = 1,
                  launch=None, fixed_capacity: bool = False) -> LocalIds:
    """De-duplicate ``keys`` (n,) uint64 with their ``table_ids`` (n,) int32 and group them by
    owner rank (a stable grouping, so first-occurrence order holds within each owner).
    fixed_capacity (one rank on the device only): arrays of n entries and the unique count on
    the device (``LocalIds.unique_count``), so nothing is read back."""
    if fixed_capacity and (launch is None or world != 1):
        raise ValueError("fixed_capacity is for one rank on the device")
    if launch is not None:
        return _partition_on_device(keys, table_ids, world, launch, fixed_capacity)
    uniq, inverse = unique_ids(keys)
    uniq_tables = table_ids[first_occurrence(inverse, uniq.shape[0])].astype(np.int32)
    owners = owner_rank(uniq, world)
    counts = np.bincount(owners, minlength=world).astype(np.int64)
    if world > 1:
        order = np.argsort(owners, kind="stable")
        uniq, uniq_tables = uniq[order], uniq_tables[order]
        position = np.empty_like(order)
        position[order] = np.arange(order.shape[0])
        inverse = position[inverse]
    return LocalIds(uniq, uniq_tables, inverse, counts)


def _partition_on_device(keys, table_ids, world: int, launch,
                         fixed_capacity: bool = False) -> LocalIds:
    """``partition_ids`` on device arrays. One rank: the plain dedup (one read of the unique
    count), or with ``fixed_capacity`` nothing read. Several ranks: one counted read, the
    per-rank counts the exchange sizes its messages with (the dedup's count stays on the
    device: its placeholders are grouped after every owner's keys and never sent)."""
    xp = launch.xp
    if fixed_capacity:
        fixed = device_unique.unique_ids_fixed(keys, launch)
        return LocalIds(fixed.keys, table_ids[fixed.first].astype(xp.int32), fixed.inverse,
                        np.array([fixed.keys.shape[0]], np.int64), fixed.count)
    if world == 1:
        uniq, inverse, first = device_unique.unique_ids(keys, launch, return_first=True)
        return LocalIds(uniq, table_ids[first].astype(xp.int32), inverse,
                        np.array([uniq.shape[0]], np.int64))
    fixed = device_unique.unique_ids_fixed(keys, launch)
    n = fixed.keys.shape[0]
    position = xp.arange(n, dtype=xp.int64)
    # placeholders (positions count..n-1) get owner ``world``: grouped after every real owner
    owners = xp.where(position < fixed.count, owner_rank(fixed.keys, world, xp), world)
    # (owner, position) packed into one distinct int64: any sort is the stable grouping
    order = xp.argsort(owners * max(n, 1) + position).astype(xp.int64)
    # the exchange sizes its messages with them: the step's one counted read (no bincount,
    # which reads too; the unique count is their sum)
    offsets = device_unique.segment_offsets(xp, owners[order], world)
    counts = np.diff(launch.to_host(offsets, reason="partition: per-rank counts for the exchange"))
    u = int(counts.sum())
    order = order[:u]
    where = xp.empty_like(position)
    where[order] = position[:u]   # each unique key's place in the grouped order
    return LocalIds(fixed.keys[order], table_ids[fixed.first[order]].astype(xp.int32),
                    where[fixed.inverse], counts)


@dataclass
class IdExchange:
    """The plan of one step's exchanges, from both sides.

    - local: this rank's ids (``LocalIds``); ``local.counts_per_rank`` is what it sends each owner
    - recv_counts: (P,) int64 ids received from each rank, in source-rank order (r in total)
    - owner_keys: (v,) uint64 the keys this rank owns among those received, de-duplicated
    - owner_table_ids: (v,) int32
    - owner_inverse: (r,) int64 row of ``owner_keys`` per received id, or None when the received
      ids were already unique (then it is the identity: always so with one rank)
    - owner_count: None, or the (1,) int64 device count v of ``owner_keys`` when they are a
      fixed-capacity array (``shuffle_ids(fixed_capacity=True)`` on the device): ``owner_keys``
      and ``owner_table_ids`` then hold more entries (one rank: n, several: r), those from v on
      placeholders that the store and the update skip
    """

    local: LocalIds
    recv_counts: np.ndarray
    owner_keys: np.ndarray
    owner_table_ids: np.ndarray
    owner_inverse: np.ndarray | None
    owner_count: object = None

    @property
    def send_counts(self) -> np.ndarray:
        return self.local.counts_per_rank


@dataclass
class Traffic:
    """Bytes this rank sent to other ranks (its own block is not counted: it never leaves)."""

    id_bytes: int = 0
    row_bytes: int = 0
    grad_bytes: int = 0

    @property
    def exchange_bytes(self) -> int:
        """Row and gradient bytes: what the exchange dtype changes."""
        return self.row_bytes + self.grad_bytes


def _remote(comm: Communicator, counts: np.ndarray) -> int:
    return int(counts.sum() - counts[comm.rank])


def _exchange_rows(comm: Communicator, rows: np.ndarray, send_counts, recv_counts,
                   exchange_dtype: str, launch=None) -> tuple[np.ndarray, int]:
    """rows: (n, E) float32 -> (received (r, E) float32, bytes sent to other ranks)."""
    dim = rows.shape[1]
    sent = _remote(comm, send_counts) * codec.row_bytes(exchange_dtype, dim)
    if exchange_dtype == "fp32":
        return comm.alltoallv(rows, send_counts, recv_counts), sent
    if launch is not None:
        payload = comm.alltoallv(codec_ops.encode(rows, exchange_dtype, launch), send_counts,
                                 recv_counts)
        return codec_ops.decode(payload, exchange_dtype, dim, launch), sent
    payload = comm.alltoallv(codec.encode(rows, exchange_dtype), send_counts, recv_counts)
    return codec.decode(payload, exchange_dtype, dim), sent


def shuffle_ids(comm: Communicator, keys: np.ndarray, table_ids: np.ndarray,
                traffic: Traffic | None = None, launch=None,
                fixed_capacity: bool = False) -> IdExchange:
    """The ID shuffle. keys: (n,) uint64, table_ids: (n,) int32 -> the step's ``IdExchange``.

    Unique, partition by owner, exchange counts, all-to-all of ids and table ids, unique again on
    the owner (the same key arrives from several ranks). launch: device arrays (see the module
    docstring). fixed_capacity (on the device, for an owner store that takes device counts):
    the owner's keys come in a fixed-capacity array with their count on the device
    (``IdExchange.owner_count``), so the step reads nothing back but, with several ranks, the
    per-rank counts the exchange's messages are sized with (one read).
    """
    if fixed_capacity and launch is None:
        raise ValueError("fixed_capacity is for device arrays")
    one_rank_fixed = fixed_capacity and comm.world == 1
    local = partition_ids(keys, table_ids, comm.world, launch, one_rank_fixed)
    if traffic is not None:
        traffic.id_bytes += 12 * _remote(comm, local.counts_per_rank)  # uint64 key + int32 table
    recv_counts = comm.alltoall_counts(local.counts_per_rank)
    recv_keys = comm.alltoallv(local.unique_keys, local.counts_per_rank, recv_counts)
    recv_tables = comm.alltoallv(local.unique_table_ids, local.counts_per_rank, recv_counts)
    if launch is not None and comm.world == 1:
        # one rank received its own unique keys: nothing to merge (no second sort on the device)
        return IdExchange(local, recv_counts, recv_keys, recv_tables, None, local.unique_count)
    if fixed_capacity:
        # the same key from several ranks merged into a fixed-capacity array: no count read
        owner = device_unique.unique_ids_fixed(recv_keys, launch)
        return IdExchange(local, recv_counts, owner.keys, recv_tables[owner.first],
                          owner.inverse, owner.count)
    owner_keys, owner_inverse = unique_ids(recv_keys, launch)
    if owner_keys.shape[0] == recv_keys.shape[0]:
        # nothing to merge: owner_keys == recv_keys in the same order
        return IdExchange(local, recv_counts, recv_keys, recv_tables, None)
    first = first_occurrence(owner_inverse, owner_keys.shape[0], launch)
    return IdExchange(local, recv_counts, owner_keys, recv_tables[first], owner_inverse)


def shuffle_rows(comm: Communicator, plan: IdExchange, owner_rows: np.ndarray,
                 exchange_dtype: str = "fp32", traffic: Traffic | None = None,
                 launch=None) -> np.ndarray:
    """The embedding shuffle. owner_rows: (v, E) float32, the rows of ``plan.owner_keys`` ->
    (u, E) float32, the rows of this rank's ``plan.local.unique_keys``."""
    send = owner_rows if plan.owner_inverse is None else owner_rows[plan.owner_inverse]
    rows, sent = _exchange_rows(comm, send, plan.recv_counts, plan.send_counts, exchange_dtype,
                                launch)
    if traffic is not None:
        traffic.row_bytes += sent
    return rows


def shuffle_grads(comm: Communicator, plan: IdExchange, grads: np.ndarray,
                  exchange_dtype: str = "fp32", traffic: Traffic | None = None,
                  launch=None) -> np.ndarray:
    """The gradient shuffle, the embedding shuffle's exact reverse. grads: (u, E) float32 per
    unique local id (duplicates already summed) -> (v, E) float32 per owned key."""
    received, sent = _exchange_rows(comm, grads, plan.send_counts, plan.recv_counts,
                                    exchange_dtype, launch)
    if traffic is not None:
        traffic.grad_bytes += sent
    if plan.owner_inverse is None:
        return received
    return segment_sum(received, plan.owner_inverse, plan.owner_keys.shape[0], launch)
