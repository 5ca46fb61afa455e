"""Options: initializers, tables and columns, store presets.

Frozen dataclasses, each validated once in ``__post_init__``; the ``make_*`` builders on top carry
OneEmbedding's names and defaults.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Sequence, Union

from .errors import ConfigError
from .store_dict import oneflow_dict_fields, read_only, refuse_edit, to_oneflow_dict

# ---------------------------------------------------------------- initializers


def _finite(name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(v):
        raise ConfigError(f"{name}={value!r} must be finite")
    return v


#: the physical block sizes a store takes (bytes): the powers of two in 512..65536
PHYSICAL_BLOCK_SIZES = tuple(512 << i for i in range(8))


def whole_number(value) -> bool:
    """value is a whole number: an integer, or a finite float without a fraction (never raises
    on nan, inf, strings or None; a bool is not a number here)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and int(value) == value)


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike)) and isinstance(os.fspath(value), str)


@dataclass(frozen=True)
class UniformInitializer:
    """Values uniform in [low, high)."""

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self):
        low, high = _finite("low", self.low), _finite("high", self.high)
        if not low < high:
            raise ConfigError(f"uniform initializer needs low < high, got low={low}, high={high}")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)


@dataclass(frozen=True)
class NormalInitializer:
    """Values from N(mean, std**2)."""

    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self):
        mean, std = _finite("mean", self.mean), _finite("std", self.std)
        if std < 0:
            raise ConfigError(f"normal initializer needs std >= 0, got std={std}")
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)


@dataclass(frozen=True)
class ConstantInitializer:
    """Every value equal to ``value``."""

    value: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "value", _finite("value", self.value))


@dataclass(frozen=True)
class TruncNormalInitializer:
    """N(mean, std**2) restricted to [a, b] (absolute bounds, as in PyTorch's ``trunc_normal_``)."""

    mean: float = 0.0
    std: float = 1.0
    a: float = -2.0
    b: float = 2.0

    def __post_init__(self):
        vals = {k: _finite(k, getattr(self, k)) for k in ("mean", "std", "a", "b")}
        if vals["std"] <= 0:
            raise ConfigError(f"trunc_normal initializer needs std > 0, got std={vals['std']}")
        if not vals["a"] < vals["b"]:
            raise ConfigError(f"trunc_normal initializer needs a < b, got a={vals['a']}, b={vals['b']}")
        for k, v in vals.items():
            object.__setattr__(self, k, v)


Initializer = Union[UniformInitializer, NormalInitializer, ConstantInitializer, TruncNormalInitializer]
_INITIALIZER_TYPES = (UniformInitializer, NormalInitializer, ConstantInitializer, TruncNormalInitializer)

#: OneFlow's default when ``tables=None`` and no ``default_initializer`` is given.
DEFAULT_INITIALIZER = NormalInitializer(0.0, 0.05)


def make_uniform_initializer(low: float = 0.0, high: float = 1.0) -> UniformInitializer:
    """Initial values uniform between low and high (OneFlow's arguments and defaults)."""
    return UniformInitializer(low, high)


def make_normal_initializer(mean: float = 0.0, std: float = 1.0) -> NormalInitializer:
    """Initial values drawn from N(mean, std**2)."""
    return NormalInitializer(mean, std)


def make_constant_initializer(value: float) -> ConstantInitializer:
    """Every initial value is ``value``."""
    return ConstantInitializer(value)


def make_trunc_normal_initializer(
    mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0
) -> TruncNormalInitializer:
    """Initial values drawn from N(mean, std**2) restricted to [a, b] (absolute bounds, as in
    PyTorch's ``trunc_normal_``)."""
    return TruncNormalInitializer(mean, std, a, b)


def check_initializer(obj, where: str) -> Initializer:
    if not isinstance(obj, _INITIALIZER_TYPES):
        raise ConfigError(
            f"{where} is {obj!r}, not an initializer: build one with make_uniform_initializer, "
            "make_normal_initializer, make_constant_initializer or make_trunc_normal_initializer"
        )
    return obj


# ---------------------------------------------------------------- tables and columns


@dataclass(frozen=True)
class ColumnOptions:
    initializer: Initializer

    def __post_init__(self):
        check_initializer(self.initializer, "column initializer")


@dataclass(frozen=True)
class TableOptions:
    """A table carries only initializers, one per column; it has no size (one key space)."""

    columns: tuple[ColumnOptions, ...]

    def __post_init__(self):
        if not self.columns:
            raise ConfigError("a table needs at least one column")
        object.__setattr__(self, "columns", tuple(self.columns))


def make_column_options(initializer: Initializer) -> ColumnOptions:
    """One column of a multi-column table (``MultiTableMultiColumnEmbedding``) and its initializer;
    a list of them goes to ``make_table_options``."""
    return ColumnOptions(check_initializer(initializer, "make_column_options(initializer)"))


def make_table_options(param: Union[Initializer, Sequence[ColumnOptions]]) -> TableOptions:
    """A table from one initializer (one column) or a list of ``make_column_options`` results."""
    if isinstance(param, _INITIALIZER_TYPES):
        return TableOptions((ColumnOptions(param),))
    if isinstance(param, (list, tuple)):
        cols = []
        for i, c in enumerate(param):
            if isinstance(c, _INITIALIZER_TYPES):
                c = ColumnOptions(c)
            if not isinstance(c, ColumnOptions):
                raise ConfigError(f"column {i} of the table is {c!r}: use make_column_options(initializer)")
            cols.append(c)
        return TableOptions(tuple(cols))
    raise ConfigError(
        f"make_table_options got {param!r}: pass an initializer or a list of make_column_options(...)"
    )


make_table = make_table_options

# ---------------------------------------------------------------- store options

# ---------------------------------------------------------------- feature lifecycle


def _count(name: str, value, low: int, flag: str, meaning: str) -> int:
    if not isinstance(value, (int, float)) or not whole_number(value) or value < low:
        raise ConfigError(f"{name}={value!r} ({flag}) must be an integer >= {low}{meaning}")
    return int(value)


@dataclass(frozen=True)
class LifecycleOptions:
    """Which ids get a stored row and how long it stays (``lifecycle.py`` runs the rules).

    admit_min_count: an id gets a row once it has appeared in that many training steps (1:
    at first sight); until then a lookup returns the initializer's value and its gradient is
    dropped. Counted per owner rank in a count-min sketch of ``sketch_mb`` MiB (``sketch_depth``
    rows of 16-bit counters), whose counters halve each time it has counted half a row's width
    of ids: the N steps must fall within that window of not-yet-admitted ids; an id is admitted
    early only when all its counters collide.
    steps_to_live: a stored row not looked up in training for that many steps is evicted (0:
    never); ``evict_interval`` steps between sweeps (0: ``max(1, steps_to_live // 4)``).
    max_rows: the table's limit over all ranks (0: none); past it, the least frequently used rows
    (frequency halved every ``frequency_half_life`` steps; 0: no decay) are evicted down to
    ``low_water`` of it.
    """

    admit_min_count: int = 1
    steps_to_live: int = 0
    max_rows: int = 0
    sketch_mb: float = 32.0
    sketch_depth: int = 4
    evict_interval: int = 0
    frequency_half_life: int = 1000
    low_water: float = 0.9

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen)
        set_("admit_min_count", _count("admit_min_count", self.admit_min_count, 1,
                                       "--admit-min-count", " (1: every id is stored at first sight)"))
        set_("steps_to_live", _count("steps_to_live", self.steps_to_live, 0, "--steps-to-live",
                                     " (0: rows never expire)"))
        set_("max_rows", _count("max_rows", self.max_rows, 0, "--max-rows", " (0: no limit)"))
        set_("evict_interval", _count("evict_interval", self.evict_interval, 0,
                                      "--evict-interval", " (0: steps_to_live // 4)"))
        set_("frequency_half_life", _count("frequency_half_life", self.frequency_half_life, 0,
                                           "--frequency-half-life", " (0: no decay)"))
        set_("sketch_depth", _count("sketch_depth", self.sketch_depth, 1, "sketch_depth", ""))
        if self.admit_min_count > 0xFFFF:
            raise ConfigError(f"admit_min_count={self.admit_min_count} (--admit-min-count) is "
                              "beyond the sketch's 16-bit counters: use at most 65535")
        mb = _finite("sketch_mb", self.sketch_mb)
        if not mb > 0:
            raise ConfigError(f"sketch_mb={self.sketch_mb!r} (--admit-sketch-mb) must be > 0")
        set_("sketch_mb", mb)
        low = _finite("low_water", self.low_water)
        if not 0 < low <= 1:
            raise ConfigError(f"low_water={self.low_water!r} must be in (0, 1]: the share of "
                              "max_rows left after an eviction sweep")
        set_("low_water", low)

    @property
    def admits_all(self) -> bool:
        return self.admit_min_count <= 1

    @property
    def evicts(self) -> bool:
        """Rows carry a last-seen step and a frequency (two more floats per line)."""
        return self.steps_to_live > 0 or self.max_rows > 0

    @property
    def active(self) -> bool:
        return not self.admits_all or self.evicts

    @property
    def sweep_interval(self) -> int:
        """Steps between time-to-live sweeps (0: none)."""
        if not self.steps_to_live:
            return 0
        return self.evict_interval or max(1, self.steps_to_live // 4)


def make_lifecycle_options(admit_min_count: int = 1, steps_to_live: int = 0, max_rows: int = 0,
                           **more) -> LifecycleOptions:
    """Admission and eviction rules for ``make_*_store_options(..., lifecycle=...)``; ``more``:
    the other ``LifecycleOptions`` fields (sketch_mb, evict_interval, frequency_half_life, ...)."""
    return LifecycleOptions(admit_min_count, steps_to_live, max_rows, **more)


STORE_KINDS = ("device_mem", "cached_host_mem", "cached_ssd")
CACHE_POLICIES = ("full", "lru", "lfu")
SSD_ENGINES = ("slots", "rocksdb")


@dataclass(frozen=True)
class CacheOptions:
    """One cache level. ``budget_mb`` sizes an evicting cache; a "full" cache holds every key."""

    policy: str
    location: str  # "device" (GPU memory, RAM on CPU) or "host"
    budget_mb: float | None = None
    ways: int = 32

    def __post_init__(self):
        if self.policy not in CACHE_POLICIES:
            raise ConfigError(f"cache policy {self.policy!r} is not one of {CACHE_POLICIES}")
        if self.location not in ("device", "host"):
            raise ConfigError(f"cache location {self.location!r} must be 'device' or 'host'")
        if self.policy != "full":
            budget = self.budget_mb
            if isinstance(budget, bool) or not isinstance(budget, numbers.Real) \
                    or not math.isfinite(budget) or not budget > 0:
                arg, unset = (("cache_budget_mb", "") if self.location == "device" else
                              ("host_cache_budget_mb", " (0: no host cache)"))
                raise ConfigError(
                    f"an {self.policy!r} cache needs {arg} > 0, got {arg}={budget!r}: pass the "
                    f"cache's size in MiB as a finite number{unset}"
                )
        if self.ways < 1:
            raise ConfigError(f"ways={self.ways} must be >= 1")

    def rows(self, line_size: int) -> int:
        """Rows that fit the budget: budget_mb * 2**20 / (4 * line_size), as OneFlow sizes a cache."""
        if self.budget_mb is None:
            raise ConfigError("a 'full' cache has no row budget")
        return int(self.budget_mb * 2**20 // (4 * line_size))


@dataclass(frozen=True)
class StoreOptions:
    """What ``make_*_store_options`` return; ``MultiTableEmbedding`` builds its tier chain from it."""

    kind: str
    persistent_path: str | None
    capacity: int | None
    size_factor: int = 1
    storage_dim: int = -1
    physical_block_size: int = 4096
    caches: tuple[CacheOptions, ...] = field(default_factory=tuple)
    engine: str | None = None  # bottom SSD engine for cached_ssd: "slots" or "rocksdb"
    #: admission and eviction (None: every id stored at first sight, kept for ever)
    lifecycle: LifecycleOptions | None = None

    def __post_init__(self):
        if self.lifecycle is not None and not isinstance(self.lifecycle, LifecycleOptions):
            raise ConfigError(f"lifecycle={self.lifecycle!r}: build it with make_lifecycle_options(...)")
        if self.kind not in STORE_KINDS:
            raise ConfigError(f"store kind {self.kind!r} is not one of {STORE_KINDS}")
        path = self.persistent_path
        if not (path is None or _is_path(path)
                or isinstance(path, (list, tuple)) and path and all(map(_is_path, path))):
            raise ConfigError(
                f"persistent_path={path!r} must be a folder: a str or os.PathLike (or a list of "
                "one per rank, or None for none), e.g. persistent_path='/data/table'"
            )
        if self.capacity is not None and (not whole_number(self.capacity) or self.capacity <= 0):
            raise ConfigError(f"capacity={self.capacity!r} must be a positive integer (or None)")
        if not whole_number(self.size_factor) or not 1 <= self.size_factor <= 8:
            raise ConfigError(f"size_factor={self.size_factor!r} must be an integer in 1..8")
        if self.storage_dim != -1 and (not whole_number(self.storage_dim) or self.storage_dim <= 0):
            raise ConfigError(f"storage_dim={self.storage_dim!r} must be a positive integer or -1")
        pbs = self.physical_block_size
        if isinstance(pbs, bool) or pbs not in PHYSICAL_BLOCK_SIZES:
            raise ConfigError(f"physical_block_size={pbs!r} must be a power of two in 512..65536")
        # whole numbers given as floats or numpy integers are stored as ints: they reach JSON
        # manifests and byte arithmetic (np.int64(512) failed the save, 4096.0 the segments)
        for name in ("capacity", "size_factor", "storage_dim", "physical_block_size"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, int(value))
        if self.kind == "cached_ssd":
            if self.engine not in SSD_ENGINES:
                raise ConfigError(f"engine={self.engine!r} must be one of {SSD_ENGINES}")
            if not self.persistent_path:
                raise ConfigError("cached_ssd needs a persistent_path: the directory of the SSD table")
        elif self.engine is not None:
            raise ConfigError(f"engine={self.engine!r} applies to cached_ssd stores only")
        if len(self.caches) > 2:
            raise ConfigError(f"at most two cache levels, got {len(self.caches)}")
        object.__setattr__(self, "caches", tuple(self.caches))

    # OneFlow's dict form (store_dict.py): reads through store["kv_store"]..., edits on a copy
    def __getitem__(self, key: str):
        """``options[key]`` of OneFlow's dict: a read-only view (edit ``to_dict()`` instead)."""
        tree = to_oneflow_dict(self)
        if key not in tree:
            raise KeyError(f"{key!r}: OneFlow's store options hold {sorted(tree)}")
        return read_only(tree[key], f"[{key!r}]")

    def __setitem__(self, key: str, value) -> None:
        raise refuse_edit(f"[{key!r}]")

    def __delitem__(self, key: str) -> None:
        raise refuse_edit(f"[{key!r}]")

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def keys(self):
        return to_oneflow_dict(self).keys()

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def to_dict(self) -> dict:
        """OneFlow's dict of these options: a new, plain dict the caller may edit (the options
        stay as they are); ``from_dict`` or ``MultiTableEmbedding`` take it back."""
        return to_oneflow_dict(self)

    @classmethod
    def from_dict(cls, store: dict) -> "StoreOptions":
        """New options from OneFlow's dict (``to_dict()``'s, edited or not, or OneFlow's own),
        checked: a bad value raises ``ConfigError`` naming its key."""
        if isinstance(store, StoreOptions):
            return store
        return cls(**oneflow_dict_fields(store, CacheOptions, LifecycleOptions))


def make_device_mem_store_options(
    persistent_path: str | None,
    capacity: int | None,
    size_factor: int = 1,
    storage_dim: int = -1,
    physical_block_size: int = 4096,
    lifecycle: LifecycleOptions | None = None,
) -> StoreOptions:
    """One "full" (never evicting) cache in device memory (RAM on CPU) holding every key."""
    return StoreOptions(
        "device_mem", persistent_path, capacity, size_factor, storage_dim, physical_block_size,
        caches=(CacheOptions("full", "device"),), lifecycle=lifecycle,
    )


def make_cached_host_mem_store_options(
    cache_budget_mb: float,
    persistent_path: str | None,
    capacity: int | None,
    size_factor: int = 1,
    storage_dim: int = -1,
    physical_block_size: int = 4096,
    cache_policy: str = "lru",
    lifecycle: LifecycleOptions | None = None,
) -> StoreOptions:
    """An LRU cache in device memory over a full store in host memory."""
    return StoreOptions(
        "cached_host_mem", persistent_path, capacity, size_factor, storage_dim, physical_block_size,
        caches=(CacheOptions(cache_policy, "device", cache_budget_mb), CacheOptions("full", "host")),
        lifecycle=lifecycle,
    )


def make_cached_ssd_store_options(
    cache_budget_mb: float,
    persistent_path: str,
    capacity: int | None = None,
    size_factor: int = 1,
    storage_dim: int = -1,
    physical_block_size: int = 4096,
    host_cache_budget_mb: float = 0,
    engine: str = "slots",
    cache_policy: str = "lru",
    lifecycle: LifecycleOptions | None = None,
) -> StoreOptions:
    """An LRU cache in device memory [over an LRU host cache] over an SSD table.

    ``engine`` picks the SSD table: "slots" (fixed-size rows in a file, our fast engine) or
    "rocksdb" (RocksDB through rocksdict).
    """
    caches = [CacheOptions(cache_policy, "device", cache_budget_mb)]
    # 0 (or None): no host cache; anything else is checked by CacheOptions (-5, nan: refused)
    if host_cache_budget_mb not in (None, 0):
        caches.append(CacheOptions(cache_policy, "host", host_cache_budget_mb))
    return StoreOptions(
        "cached_ssd", persistent_path, capacity, size_factor, storage_dim, physical_block_size,
        caches=tuple(caches), engine=engine, lifecycle=lifecycle,
    )
