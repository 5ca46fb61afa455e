"""The tier chain: cache levels over a bottom store, built from store options.

Get falls through on a miss and never fills; put writes into the top level and every line a level
evicts is written, whole, into the level below. Writes flow only downwards, so a copy at a higher
level is always newer than one below it and a lookup takes the first copy it finds
(REFERENCE.md "Cache behaviour").
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import ConfigError
from .base import Tier

#: store kind -> factory(options, line_size, embedding_dim, path, world) -> list of tiers, top first.
#: Each module that implements tiers registers its presets here.
TIER_FACTORIES: dict[str, Callable[..., list[Tier]]] = {}


def register_preset(kind: str):
    def deco(fn):
        TIER_FACTORIES[kind] = fn
        return fn

    return deco


class TierChain:
    def __init__(self, tiers: list[Tier]):
        if not tiers:
            raise ConfigError("a store needs at least one tier")
        if tiers[-1].evicts:
            raise ConfigError(f"the bottom tier {tiers[-1].name!r} evicts; it would lose rows")
        self.tiers = tiers
        self.line_size = tiers[0].line_size

    @property
    def bottom(self) -> Tier:
        return self.tiers[-1]

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """keys: (n,) uint64 unique -> (lines (n, line_size) float32, found (n,) bool).

        Lines of keys found nowhere are left uninitialised; the caller initialises them.
        """
        n = keys.shape[0]
        lines = np.empty((n, self.line_size), np.float32)
        found_any = np.zeros(n, np.bool_)
        pending = np.arange(n)
        for tier in self.tiers:
            if pending.size == 0:
                break
            found, got = tier.find(keys[pending])
            hit = pending[found]
            lines[hit] = got
            found_any[hit] = True
            pending = pending[~found]
        return lines, found_any

    def put(self, keys: np.ndarray, lines: np.ndarray) -> None:
        """keys: (n,) uint64 unique, lines: (n, line_size) float32 -> written to the top level."""
        self._write_from(0, keys, lines)

    def flush(self) -> None:
        """Write every cache level down, top first, so the bottom store holds the newest lines."""
        for level in range(len(self.tiers) - 1):
            for keys, lines in self.tiers[level].export_batches():
                self._write_from(level + 1, keys, lines)

    def _write_from(self, level: int, keys, lines) -> None:
        """Write into tier ``level``; whatever a tier evicts goes on to the next one."""
        for tier in self.tiers[level:]:
            keys, lines = tier.insert_or_assign(keys, lines)
            if keys.shape[0] == 0:
                return
        raise AssertionError("unreachable: the bottom tier never evicts")  # checked in __init__

    def clear_caches(self) -> None:
        for tier in self.tiers[:-1]:
            tier.clear()

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()

    def __len__(self) -> int:
        """Distinct keys stored (after a flush this is the bottom tier's row count)."""
        return len(self.bottom)

    def stats(self) -> list[dict]:
        return [t.stats() for t in self.tiers]

    def close(self) -> None:
        for t in self.tiers:
            t.close()


def build_chain(options, line_size: int, embedding_dim: int, path: str | None, world: int) -> TierChain:
    try:
        factory = TIER_FACTORIES[options.kind]
    except KeyError:
        raise ConfigError(
            f"store kind {options.kind!r} has no implementation; known: {sorted(TIER_FACTORIES)}"
        ) from None
    return TierChain(factory(options, line_size, embedding_dim, path, world))
