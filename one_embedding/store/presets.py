"""Tier chains for OneEmbedding's store presets (REFERENCE.md "Store presets").

Each preset turns ``StoreOptions`` into a list of tiers, top first. ``capacity`` is the total over
all ranks, so each rank sizes its tables for about ``capacity / world`` keys.
"""
from __future__ import annotations

from ..cache.full import FullCache
from ..cache.set_associative import SetAssociativeCache
from ..errors import ConfigError
from .chain import register_preset
from .rocksdb_store import RocksDBStore
from .slot_file import SlotFileStore


def _per_rank(capacity: int | None, world: int) -> int | None:
    return None if capacity is None else -(-int(capacity) // world)


@register_preset("device_mem")
def device_mem(options, line_size: int, embedding_dim: int, path: str | None, world: int):
    """One "full" cache in device memory (RAM on CPU) that holds every key."""
    return [FullCache(line_size, _per_rank(options.capacity, world), name="device.full")]


def _cache_level(cache_options, line_size: int, capacity: int | None):
    """One cache level from its ``CacheOptions``; named ``<location>.<policy>``."""
    name = f"{cache_options.location}.{cache_options.policy}"
    if cache_options.policy == "full":
        return FullCache(line_size, capacity, name=name)
    return SetAssociativeCache.from_options(cache_options, line_size, name)


@register_preset("cached_host_mem")
def cached_host_mem(options, line_size: int, embedding_dim: int, path: str | None, world: int):
    """An LRU (or LFU) cache in device memory over a "full" store in host memory."""
    capacity = _per_rank(options.capacity, world)
    device = _cache_level(options.caches[0], line_size, capacity)
    return [device, FullCache(line_size, capacity, name="host.full")]


@register_preset("cached_ssd")
def cached_ssd(options, line_size: int, embedding_dim: int, path: str | None, world: int):
    """A device cache [over a host cache] over the SSD table of ``options.engine``.

    ``path`` is this rank's folder; the SSD table lives in ``<path>/slots`` or ``<path>/rocksdb``.
    """
    if not path:
        raise ConfigError("cached_ssd needs a persistent_path: the directory of the SSD table")
    capacity = _per_rank(options.capacity, world)
    levels = [_cache_level(c, line_size, capacity) for c in options.caches]
    if options.engine == "slots":
        bottom = SlotFileStore(line_size, path, options.physical_block_size, expected_keys=capacity or 0)
    elif options.engine == "rocksdb":
        bottom = RocksDBStore(line_size, path)
    else:
        raise ConfigError(f"engine={options.engine!r} must be 'slots' or 'rocksdb'")
    return levels + [bottom]
