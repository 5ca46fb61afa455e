"""Tier chains for OneEmbedding's store presets (REFERENCE.md "Store presets").

Each preset turns ``StoreOptions`` into a list of tiers, top first. ``capacity`` is the total over
all ranks, so each rank sizes its tables for about ``capacity / world`` keys.
"""
from __future__ import annotations

from ..cache.full import FullCache
from .chain import register_preset


def _per_rank(capacity: int | None, world: int) -> int | None:
    return None if capacity is None else -(-int(capacity) // world)


@register_preset("device_mem")
def device_mem(options, line_size: int, embedding_dim: int, path: str | None, world: int):
    """One "full" cache in device memory (RAM on CPU) that holds every key."""
    return [FullCache(line_size, _per_rank(options.capacity, world), name="device.full")]
