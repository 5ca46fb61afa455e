"""The base layer under caches and stores: tier verbs and counters, the key -> slot hash index,
huge-page host arrays. It imports nothing above it (only ``hashing`` and ``errors``)."""
from .hash_index import HashIndex
from .tier import ClosedTier, StoreTier, Tier, TierCounters, all_missing, empty_lines

__all__ = ["ClosedTier", "HashIndex", "StoreTier", "Tier", "TierCounters", "all_missing",
           "empty_lines"]
