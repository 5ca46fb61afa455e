"""Storage tiers: the chain, the stores under the caches, snapshots."""
from . import presets  # noqa: F401  (registers the store presets with the chain)
from .chain import TierChain, build_chain

__all__ = ["TierChain", "build_chain"]
