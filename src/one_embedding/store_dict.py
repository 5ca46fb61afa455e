"""Store options as OneFlow's dicts: the layout ``flow.one_embedding.make_*_store_options`` return,
read the way OneFlow scripts read it (``store["kv_store"]["caches"][0]["policy"]``), and accepted
by ``MultiTableEmbedding`` as it is.

OneFlow's layout (python/oneflow/one_embedding.py, facts only)::

    {"kv_store": {"caches": [{"policy": "lru" | "full",
                              "cache_memory_budget_mb": MB,        # an evicting cache
                              "capacity": rows,                    # a "full" cache
                              "value_memory_kind": "device" | "host"}, ...],   # at most two
                  "persistent_table": {"path": str | [str per rank],
                                       "physical_block_size": 512 | 4096,
                                       "capacity_hint": rows}},
     "size_factor": int,
     "storage_dim": int}                                            # -1: the embedding's line

OneFlow tells the presets apart by their caches alone, and so does this module: a "full" device
cache is device_mem, an evicting device cache over a "full" host cache is cached_host_mem, evicting
caches only are cached_ssd. What OneFlow has no key for travels under ``"one_embedding"``
(OneFlow ignores the key): the SSD engine and the lifecycle options. ``storage_dim`` is read where
OneFlow puts it (the top level; under ``"one_embedding"`` as written before 2026-12-07, a
different value in both places is refused). Also accepted: policy "lfu" and physical block sizes
up to 65536 (this library's own).

``StoreOptions`` are frozen (hashable, shared by the embeddings built from them), so the dict form
never edits them: ``store[key]`` is a read-only view (an edit through it raises ``TypeError``
saying what to do), ``store.to_dict()`` a plain dict of one's own to edit as OneFlow scripts do,
and ``StoreOptions.from_dict(d)`` (or ``MultiTableEmbedding(..., d)``) new, checked options::

    d = store.to_dict()
    d["kv_store"]["caches"][0]["cache_memory_budget_mb"] = 4096
    store = StoreOptions.from_dict(d)

This module knows the layout only: it imports nothing from ``options`` (``options`` imports it),
so the classes come in as arguments.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import numbers

from .errors import ConfigError

_EXTENSION = "one_embedding"

#: the keys of each level of the layout: another key (a misspelt one) is refused, where it would
#: otherwise be ignored and its default used (a misspelt size_factor silently became 1)
_KEYS = {
    "the dict": ("kv_store", "size_factor", "storage_dim", _EXTENSION),
    "kv_store": ("caches", "persistent_table"),
    "kv_store['persistent_table']": ("path", "physical_block_size", "capacity_hint"),
    "cache": ("policy", "cache_memory_budget_mb", "capacity", "value_memory_kind"),
    _EXTENSION: ("engine", "lifecycle", "storage_dim"),
}


def to_oneflow_dict(options) -> dict:
    """A ``StoreOptions`` -> OneFlow's dict (a new, plain one the caller may edit)."""
    caches = []
    for cache in options.caches:
        entry = {"policy": cache.policy, "value_memory_kind": cache.location}
        if cache.policy == "full":
            entry["capacity"] = int(options.capacity or 0)
        else:
            entry["cache_memory_budget_mb"] = cache.budget_mb
        caches.append(entry)
    return {
        "kv_store": {
            "caches": caches,
            "persistent_table": {"path": options.persistent_path,
                                 "physical_block_size": options.physical_block_size,
                                 "capacity_hint": int(options.capacity or 0)},
        },
        "size_factor": options.size_factor,
        "storage_dim": options.storage_dim,
        # the lifecycle as its fields: the dict stays plain data (JSON, a copy to edit)
        _EXTENSION: {"engine": options.engine,
                     "lifecycle": dataclasses.asdict(options.lifecycle)
                     if options.lifecycle is not None else None},
    }


def _need(mapping, key: str, where: str):
    if not isinstance(mapping, dict):
        raise ConfigError(f"store options: {where} must be a dict, got {type(mapping).__name__}")
    if key not in mapping:
        raise ConfigError(f"store options: {where} has no {key!r} (OneFlow's layout: "
                          "{'kv_store': {'caches': [...], 'persistent_table': {'path': ...}}, "
                          "'size_factor': n}; make_*_store_options builds one)")
    return mapping[key]


def _known(mapping: dict, level: str, where: str) -> None:
    """ConfigError naming the keys of ``mapping`` that its ``level`` of the layout lacks."""
    extra = sorted(map(repr, set(mapping) - set(_KEYS[level])))
    if extra:
        raise ConfigError(f"store options: {where} has no key {', '.join(extra)}: its keys are "
                          f"{', '.join(map(repr, _KEYS[level]))} (a misspelt key would be "
                          "ignored and its default used)")


def _rows(value, where: str):
    """A row count of the layout (0 or None: none given) -> int or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value != int(value) or value < 0:
        raise ConfigError(f"store options: {where} is {value!r}: give a whole number of rows "
                          "(0: none)")
    return int(value) or None


def oneflow_dict_fields(store: dict, cache_type, lifecycle_type=None) -> dict:
    """OneFlow's dict -> the keyword arguments of ``StoreOptions`` (checked; errors name the key
    and the fix). ``cache_type``: ``CacheOptions``, built (and so checked) for each cache;
    ``lifecycle_type``: ``LifecycleOptions``, built from the extension's lifecycle fields."""
    kv = _need(store, "kv_store", "the dict")
    _known(store, "the dict", "the dict")
    table = _need(kv, "persistent_table", "kv_store")
    _known(kv, "kv_store", "kv_store")
    _need(table, "path", "kv_store['persistent_table']")
    _known(table, "kv_store['persistent_table']", "kv_store['persistent_table']")
    path = table["path"]
    if isinstance(path, tuple):
        path = list(path)  # one per rank, as OneFlow takes them (StoreOptions checks them)
    caches = kv.get("caches", [])
    if isinstance(caches, dict):
        caches = [caches]
    if not isinstance(caches, (list, tuple)) or not 1 <= len(caches) <= 2:
        raise ConfigError(f"store options: kv_store['caches'] must be one or two cache dicts, got "
                          f"{caches!r}")
    levels = []
    capacity = _rows(table.get("capacity_hint"), "kv_store['persistent_table']['capacity_hint']")
    for i, cache in enumerate(caches):
        where = f"kv_store['caches'][{i}]"
        policy = _need(cache, "policy", where)
        location = _need(cache, "value_memory_kind", where)
        _known(cache, "cache", where)
        if policy == "full":
            capacity = _rows(cache.get("capacity"), f"{where}['capacity']") or capacity
            levels.append(cache_type("full", location))
            continue
        try:
            levels.append(cache_type(policy, location, cache.get("cache_memory_budget_mb")))
        except ConfigError as e:   # named by the dict's key, not the builder's argument
            raise ConfigError(f"store options: {where}['cache_memory_budget_mb'] is "
                              f"{cache.get('cache_memory_budget_mb')!r}: {e}") from None
    kinds = [(c.policy == "full", c.location) for c in levels]
    if kinds == [(True, "device")]:
        kind = "device_mem"
    elif kinds == [(False, "device"), (True, "host")]:
        kind = "cached_host_mem"
    elif all(not full for full, _ in kinds):
        kind = "cached_ssd"
    else:
        raise ConfigError(f"store options: caches {[(c.policy, c.location) for c in levels]} are no "
                          "preset: a full device cache (device_mem), an evicting device cache over "
                          "a full host cache (cached_host_mem), or evicting caches over the SSD "
                          "table (cached_ssd)")
    extension = store.get(_EXTENSION) or {}
    if not isinstance(extension, dict):
        raise ConfigError(f"store options: {_EXTENSION!r} must be a dict (keys "
                          f"{', '.join(map(repr, _KEYS[_EXTENSION]))}), got "
                          f"{type(extension).__name__}")
    _known(extension, _EXTENSION, repr(_EXTENSION))
    engine = extension.get("engine") or ("slots" if kind == "cached_ssd" else None)
    lifecycle = extension.get("lifecycle")
    if isinstance(lifecycle, dict) and lifecycle_type is not None:
        try:
            lifecycle = lifecycle_type(**lifecycle)
        except TypeError as e:
            raise ConfigError(f"store options: {_EXTENSION}['lifecycle'] {e}: its keys are "
                              f"{', '.join(f.name for f in dataclasses.fields(lifecycle_type))}"
                              ) from None
    storage_dim = store.get("storage_dim", extension.get("storage_dim", -1))
    if "storage_dim" in store and "storage_dim" in extension \
            and store["storage_dim"] != extension["storage_dim"]:
        raise ConfigError(f"store options: storage_dim is {store['storage_dim']!r} but "
                          f"{_EXTENSION}['storage_dim'] is {extension['storage_dim']!r}: keep "
                          "one (OneFlow's place is the top level)")
    return dict(kind=kind, persistent_path=path, capacity=capacity,
                size_factor=store.get("size_factor", 1),
                storage_dim=storage_dim,
                physical_block_size=table.get("physical_block_size", 4096), caches=tuple(levels),
                # another store's engine: the default one (what an edit of a cached_ssd dict
                # into another preset leaves) is dropped, any other passed on to be refused
                engine=engine if kind == "cached_ssd" else
                (None if extension.get("engine") in (None, "slots") else extension["engine"]),
                lifecycle=lifecycle)


# ---------------------------------------------------------------- the read-only view

_FROZEN = ("store options are frozen (hashable, and shared by the embeddings built from them): "
           "edit a copy of OneFlow's dict instead, d = store.to_dict(); d{where} = ...; then pass d "
           "to MultiTableEmbedding, or build new options with StoreOptions.from_dict(d)")


def refuse_edit(where: str = "[...]"):
    """The ``TypeError`` an edit of frozen store options raises (``where``: the key path)."""
    return TypeError(_FROZEN.format(where=where))


class _ReadOnly:
    """What the view's dicts and lists share: every edit raises ``refuse_edit``."""

    _where = ""

    def _refuse(self, *args, **kwargs):
        raise refuse_edit(self._where + "[...]")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = __ior__ = _refuse

    def __reduce__(self):   # pickles (and unpickles) as the same read-only view
        return read_only, (plain(self), self._where)

    def __copy__(self):
        return plain(self)

    def __deepcopy__(self, memo):
        return plain(self)


class _ReadOnlyDict(_ReadOnly, dict):
    update = pop = popitem = clear = setdefault = _ReadOnly._refuse


class _ReadOnlyList(_ReadOnly, list):
    append = extend = insert = pop = remove = clear = sort = reverse = _ReadOnly._refuse


def read_only(value, where: str = ""):
    """A read-only copy of a tree of dicts and lists (equal to the plain one)."""
    if isinstance(value, dict):
        node = _ReadOnlyDict((k, read_only(v, f"{where}[{k!r}]")) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        node = _ReadOnlyList(read_only(v, f"{where}[{i}]") for i, v in enumerate(value))
    else:
        return value
    node._where = where
    return node


def plain(value):
    """A plain, editable deep copy of a (read-only or plain) tree of dicts and lists."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return copy.copy(value)
