"""The library's two 64-bit hashes, each written once: the splitmix64 mix and XXH64 of 8-byte keys.

* ``mix64(xp, z)``: the splitmix64 finalizer (Stafford's "variant 13"), a bijection on uint64.
  Initial values (``initializers.counter_hash``), dropout masks, the hash index's buckets, the ID
  shuffle's de-duplication table and the LRU's set choice all hash with it.
  ``splitmix64(xp, z) = mix64(xp, z + GOLDEN)`` is one full splitmix64 output for state ``z``
  (the data layer's row hash: train/eval split, synthetic data).
* ``xxh64_u64(values, seed)``: XXH64 of each value's 8 little-endian bytes, equal to
  ``xxhash.xxh64_intdigest(int(v).to_bytes(8, "little"), seed)``. Owner rank of a key
  (seed 1, REFERENCE.md "Distribution") and the Criteo "hash" key scheme (seed = column).

Everything is wrapping uint64 arithmetic, which numpy and CuPy evaluate bit-identically; ``xp`` is
the array namespace of the inputs. ``jit_mix64`` is ``mix64`` on one scalar for numba kernels, to
be inlined into them (``@njit(nogil=True, inline="always")``).

    >>> import numpy as np
    >>> int(mix64(np, np.array([1], np.uint64))[0]) == 0x5692161D100B05E5
    True
    >>> int(xxh64_u64(np.array([0], np.uint64), 0)[0]) == 0x34C96ACDCADB1BBB
    True
"""
from __future__ import annotations

import numpy as np
from numba import njit

MASK64 = (1 << 64) - 1

#: splitmix64's increment, 2**64 / golden ratio; also the column stride of ``counter_hash``.
GOLDEN = 0x9E3779B97F4A7C15
#: splitmix64 finalizer multipliers.
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

#: XXH64 primes.
XXH_P1 = 0x9E3779B185EBCA87
XXH_P2 = 0xC2B2AE3D27D4EB4F
XXH_P3 = 0x165667B19E3779F9
XXH_P4 = 0x85EBCA77C2B2AE63
XXH_P5 = 0x27D4EB2F165667C5


def mix64(xp, z):
    """The splitmix64 finalizer, element-wise. z: (...) uint64 -> (...) uint64."""
    z = xp.asarray(z, dtype=xp.uint64)
    with np.errstate(over="ignore"):  # 0-d numpy values warn on wrap-around; arrays do not
        z = (z ^ (z >> xp.uint64(30))) * xp.uint64(MIX1)
        z = (z ^ (z >> xp.uint64(27))) * xp.uint64(MIX2)
        return z ^ (z >> xp.uint64(31))


def splitmix64(xp, z):
    """splitmix64's output for state ``z``: ``mix64(z + GOLDEN)``. z: (...) uint64 -> (...) uint64."""
    z = xp.asarray(z, dtype=xp.uint64)
    with np.errstate(over="ignore"):
        return mix64(xp, z + xp.uint64(GOLDEN))


# numba's cache of a kernel that inlines this keys only on the kernel's own file: after changing
# this function, delete the callers' __pycache__/*.nbi/*.nbc (initializers, tiers/hash_index,
# cache/set_associative, parallel/unique) or they keep the old mix.
@njit(cache=True, nogil=True, inline="always")
def jit_mix64(z):
    """``mix64`` of one uint64, for numba kernels (inlined where called)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


def _rotl(xp, x, r: int):
    return (x << xp.uint64(r)) | (x >> xp.uint64(64 - r))


def _xxh64_avalanche(xp, h):
    h = (h ^ (h >> xp.uint64(33))) * xp.uint64(XXH_P2)
    h = (h ^ (h >> xp.uint64(29))) * xp.uint64(XXH_P3)
    return h ^ (h >> xp.uint64(32))


def _seed_array(xp, seed):
    # a Python int seed is taken modulo 2**64, as xxhash does; arrays must already be unsigned
    if isinstance(seed, (int, np.integer)):
        seed = int(seed) & MASK64
    return xp.asarray(seed, dtype=xp.uint64)


def xxh64_u64(values, seed, xp=np):
    """XXH64 of each value's 8 little-endian bytes.

    values: (...) uint64; seed: an int or a uint64 array broadcastable to ``values`` (one seed per
    element, e.g. the column of each key). Returns (...) uint64, equal to
    ``xxhash.xxh64_intdigest(int(v).to_bytes(8, "little"), seed=s)``.
    """
    v = xp.asarray(values, dtype=xp.uint64)
    with np.errstate(over="ignore"):
        h = _seed_array(xp, seed) + xp.uint64(XXH_P5) + xp.uint64(8)
        k = _rotl(xp, v * xp.uint64(XXH_P2), 31) * xp.uint64(XXH_P1)
        h = _rotl(xp, h ^ k, 27) * xp.uint64(XXH_P1) + xp.uint64(XXH_P4)
        return _xxh64_avalanche(xp, h)


def xxh64_empty(seed: int) -> int:
    """XXH64 of the empty input with ``seed``, as a Python int (the Criteo "missing" key hash)."""
    with np.errstate(over="ignore"):
        h = _seed_array(np, seed) + np.uint64(XXH_P5)
        return int(_xxh64_avalanche(np, h))
