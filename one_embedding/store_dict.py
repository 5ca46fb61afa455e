"""Store options as OneFlow's dicts: what ``flow.one_embedding.make_*_store_options`` return, read
and edited the way OneFlow scripts do (``store["kv_store"]["caches"][0]["cache_memory_budget_mb"]
= 4096``), and accepted by ``MultiTableEmbedding`` as they are.

OneFlow's layout (python/oneflow/one_embedding.py, facts only)::

    {"kv_store": {"caches": [{"policy": "lru" | "full",
                              "cache_memory_budget_mb": MB,        # an evicting cache
                              "capacity": rows,                    # a "full" cache
                              "value_memory_kind": "device" | "host"}, ...],   # at most two
                  "persistent_table": {"path": str | [str per rank],
                                       "physical_block_size": 512 | 4096,
                                       "capacity_hint": rows}},
     "size_factor": int}

OneFlow tells the presets apart by their caches alone, and so does this module: a "full" device
cache is device_mem, an evicting device cache over a "full" host cache is cached_host_mem, evicting
caches only are cached_ssd. What OneFlow has no key for travels under ``"one_embedding"``
(OneFlow ignores the key): the SSD engine, ``storage_dim``, the lifecycle options. Also accepted:
policy "lfu" and physical block sizes up to 65536 (this library's own).

An edit through ``StoreOptions[...]`` is checked and applied at once (a bad value raises
``ConfigError`` naming it, and the options stay as they were); the view is rebuilt from the
options at every ``[...]``.
"""
from __future__ import annotations

import copy

from .errors import ConfigError

_EXTENSION = "one_embedding"


def to_oneflow_dict(options) -> dict:
    """A ``StoreOptions`` -> OneFlow's dict (a new, plain one)."""
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
        _EXTENSION: {"engine": options.engine, "storage_dim": options.storage_dim,
                     "lifecycle": options.lifecycle},
    }


def _need(mapping, key: str, where: str):
    if not isinstance(mapping, dict):
        raise ConfigError(f"store options: {where} must be a dict, got {type(mapping).__name__}")
    if key not in mapping:
        raise ConfigError(f"store options: {where} has no {key!r} (OneFlow's layout: "
                          "{'kv_store': {'caches': [...], 'persistent_table': {'path': ...}}, "
                          "'size_factor': n}; make_*_store_options builds one)")
    return mapping[key]


def from_oneflow_dict(store: dict):
    """OneFlow's dict -> ``StoreOptions`` (checked; errors name the key and the fix)."""
    from .options import CacheOptions, StoreOptions

    kv = _need(store, "kv_store", "the dict")
    table = _need(kv, "persistent_table", "kv_store")
    path = _need(table, "path", "kv_store['persistent_table']")
    if isinstance(path, (list, tuple)):
        raise ConfigError("store options: a list of paths (one per rank) is not supported; give one "
                          "directory: each rank uses <path>/<rank>-<ranks> under it")
    caches = kv.get("caches", [])
    if isinstance(caches, dict):
        caches = [caches]
    if not isinstance(caches, (list, tuple)) or not 1 <= len(caches) <= 2:
        raise ConfigError(f"store options: kv_store['caches'] must be one or two cache dicts, got "
                          f"{caches!r}")
    levels, capacity = [], table.get("capacity_hint") or None
    for i, cache in enumerate(caches):
        where = f"kv_store['caches'][{i}]"
        policy = _need(cache, "policy", where)
        location = _need(cache, "value_memory_kind", where)
        if policy == "full":
            capacity = cache.get("capacity") or capacity
            levels.append(CacheOptions("full", location))
        else:
            levels.append(CacheOptions(policy, location, cache.get("cache_memory_budget_mb")))
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
    engine = extension.get("engine") or ("slots" if kind == "cached_ssd" else None)
    return StoreOptions(kind, path, int(capacity) if capacity else None,
                        store.get("size_factor", 1), extension.get("storage_dim", -1),
                        table.get("physical_block_size", 4096), caches=tuple(levels),
                        engine=engine if kind == "cached_ssd" else None,
                        lifecycle=extension.get("lifecycle"))


class _Node:
    """Shared by the view's dicts and lists: any change re-parses the whole view into the
    options (``_root.commit``)."""

    _root: "_View"

    def _changed(self):
        self._root.commit()


class _Dict(_Node, dict):
    def __setitem__(self, key, value):
        dict.__setitem__(self, key, _wrap(value, self._root))
        self._changed()

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        self._changed()

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            dict.__setitem__(self, key, _wrap(value, self._root))
        self._changed()

    def pop(self, *args):
        value = dict.pop(self, *args)
        self._changed()
        return value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


class _List(_Node, list):
    def __setitem__(self, index, value):
        list.__setitem__(self, index, _wrap(value, self._root))
        self._changed()

    def __delitem__(self, index):
        list.__delitem__(self, index)
        self._changed()

    def append(self, value):
        list.append(self, _wrap(value, self._root))
        self._changed()

    def insert(self, index, value):
        list.insert(self, index, _wrap(value, self._root))
        self._changed()

    def pop(self, index=-1):
        value = list.pop(self, index)
        self._changed()
        return value


def _wrap(value, root):
    if isinstance(value, dict) and not isinstance(value, _Dict):
        node = _Dict()
        node._root = root
        for k, v in value.items():
            dict.__setitem__(node, k, _wrap(v, root))
        return node
    if isinstance(value, (list, tuple)) and not isinstance(value, _List):
        node = _List()
        node._root = root
        for v in value:
            list.append(node, _wrap(v, root))
        return node
    return value


class _View:
    """The live OneFlow dict of one ``StoreOptions``."""

    def __init__(self, options):
        self.options = options
        self.tree = _wrap(to_oneflow_dict(options), self)

    def commit(self) -> None:
        plain = _plain(self.tree)
        try:
            parsed = from_oneflow_dict(plain)
        except ConfigError:
            self.tree = _wrap(to_oneflow_dict(self.options), self)     # as it was
            raise
        self.options._replace_from(parsed)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return copy.copy(value)


def live_item(options, key: str):
    """``options[key]`` of OneFlow's dict, edits applied to ``options``."""
    view = _View(options)
    if key not in view.tree:
        raise KeyError(f"{key!r}: OneFlow's store options hold 'kv_store', 'size_factor' (and "
                       f"{_EXTENSION!r} here)")
    return view.tree[key]


def set_item(options, key: str, value) -> None:
    """``options[key] = value`` of OneFlow's dict, applied to ``options``."""
    view = _View(options)
    view.tree[key] = value
