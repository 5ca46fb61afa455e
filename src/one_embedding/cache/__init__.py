"""Cache levels: evicting tiers in front of a store (the set-associative LRU / LFU on CPU)."""
from .set_associative import SetAssociativeCache

__all__ = ["SetAssociativeCache"]
