"""The tier interface every cache level and store implements, and its counters.

A tier holds whole lines (embedding + optimizer state, ``line_size`` float32) keyed by uint64.
Verbs say what happens on hit and miss:

- ``find(keys)``: look up; never fills. Returns the hits compactly so the misses go on to the
  next tier.
- ``insert_or_assign(keys, lines)``: write; an evicting tier returns the whole lines it pushed out,
  which the chain writes to the next tier down.
- ``export_batches()``: every (key, line) it holds, for flushing down and for snapshots.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # lines pushed out to the next tier (counted by the evicting tier)
    writes: int = 0  # lines written by insert_or_assign

    def as_dict(self) -> dict:
        return asdict(self)


def empty_lines(line_size: int) -> tuple[np.ndarray, np.ndarray]:
    return np.empty(0, np.uint64), np.empty((0, line_size), np.float32)


class Tier(ABC):
    """One level of the chain. Subclasses set ``line_size`` and ``name`` and keep ``counters``."""

    line_size: int
    name: str
    #: True for caches that push lines out when full; the bottom tier of a chain must not evict.
    evicts: bool = False

    def __init__(self) -> None:
        self.counters = TierCounters()

    @abstractmethod
    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) uint64 -> (found (n,) bool, lines (n_found, line_size) float32 in key order)."""

    @abstractmethod
    def insert_or_assign(self, keys: np.ndarray, lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) uint64 unique, lines: (n, line_size) float32.

        Returns the evicted (keys (m,) uint64, lines (m, line_size) float32); empty unless ``evicts``.
        """

    @abstractmethod
    def export_batches(self, batch_rows: int = 1 << 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every held (keys (k,) uint64, lines (k, line_size) float32), in batches."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every line."""

    @abstractmethod
    def __len__(self) -> int:
        """Lines held now."""

    @property
    def memory_bytes(self) -> int:
        return 0

    @property
    def disk_bytes(self) -> int:
        return 0

    def stats(self) -> dict:
        return {
            "tier": self.name,
            "rows": len(self),
            "memory_bytes": self.memory_bytes,
            "disk_bytes": self.disk_bytes,
            **self.counters.as_dict(),
        }

    # -- bottom tiers (stores) only ------------------------------------------------------
    def save_snapshot(self, directory: str) -> None:
        """Write this tier's whole state into ``directory`` (a fresh, private folder), durably."""
        raise TypeError(f"{type(self).__name__} is a cache level and cannot be a snapshot's source")

    def load_snapshot(self, directory: str) -> None:
        """Replace this tier's state with the one saved in ``directory``."""
        raise TypeError(f"{type(self).__name__} is a cache level and cannot load a snapshot")

    def close(self) -> None:
        """Release files and handles; the default holds none."""
