"""Parameter groups: OneFlow's (and PyTorch's) ``params`` as a list of dicts, and gradient clipping.

    SGD([{"params": dense, "lr": 0.1, "clip_grad_max_norm": 1.0, "clip_grad_norm_type": 2.0},
         {"params": [emb], "weight_decay": 1e-5}], lr=0.05, momentum=0.9)

What may differ per group is what OneFlow scripts set per group: ``lr``, ``weight_decay``,
``clip_grad_max_norm`` and ``clip_grad_norm_type`` (``GROUP_KEYS``). The other hyper-parameters
(momentum, betas, ...) shape the state a line holds and the kernel that updates it, so they are
one per optimizer: a group may repeat them (OneFlow's tests do) only with the optimizer's value.
Any other key is refused, when the group is built and when it is set later. An LR scheduler's
``initial_lr`` is kept.

A group's ``params`` may hold embeddings as well as dense parameters: an embedding follows the
group that names it (OneFlow names the embedding's shadow parameter instead), or the only group.

Clipping, OneFlow's ``clip_grad_norm_`` on a group's gradients with the embedding rows' gradients
of the step included (what its graph pass does): ``total`` is the ``clip_grad_norm_type``-norm of
every gradient of the group together (``inf``: max |g|, ``-inf``: min |g|), and every gradient is
multiplied by ``min(1, clip_grad_max_norm / (total + 1e-6))`` before the L2 term is added. Here
the factor joins the update's gradient factor, so no gradient array is rewritten.
``clip_grad_max_norm`` alone clips with the 2-norm (``clip_grad_norm_``'s default; OneFlow would
ignore it without ``clip_grad_norm_type``).
"""
from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import MutableMapping

import numpy as np

from one_embedding.backend import array_namespace
from one_embedding.errors import ConfigError
from one_embedding.optim.checks import check_real

__all__ = ["ParamGroup", "GROUP_KEYS", "build_groups", "clip_coefficient"]

#: what may differ between the groups of one optimizer
GROUP_KEYS = ("lr", "weight_decay", "clip_grad_max_norm", "clip_grad_norm_type")
#: keys LR schedulers (OneFlow's, PyTorch's) add to a group, kept as given
SCHEDULER_KEYS = ("initial_lr",)
#: optimizer-wide hyper-parameters a group shows (read only), where the optimizer has them
OPTIMIZER_KEYS = ("momentum", "dampening", "nesterov", "maximize", "weight_decay_mode", "betas",
                  "eps", "amsgrad", "do_bias_correction", "lr_decay", "initial_accumulator_value",
                  "lr_power", "lambda1", "lambda2", "beta", "convention")
#: clipping adds it to the norm before dividing (OneFlow's clip_grad_norm_)
CLIP_EPS = 1e-6


def is_embedding(obj) -> bool:
    return hasattr(obj, "stage_gradients") and hasattr(obj, "bind_optimizer")


def _check_clip_norm(owner: str, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{owner}: clip_grad_max_norm={value!r} is not a real number; pass a "
                          "float >= 0 (or None: no clipping)")
    v = float(value)
    if not (math.isfinite(v) and v >= 0):
        raise ConfigError(f"{owner}: clip_grad_max_norm={value!r}: use a finite number >= 0 "
                          "(or None: no clipping)")
    return v


def _check_norm_type(owner: str, value) -> float:
    if isinstance(value, str):  # OneFlow's tests pass "inf" / "-inf"
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            value > 0 or value == -math.inf):
        raise ConfigError(f"{owner}: clip_grad_norm_type={value!r}: use p > 0 (2.0: the "
                          "Euclidean norm), inf (max |g|) or -inf (min |g|)")
    return float(value)


class ParamGroup(MutableMapping):
    """One group: ``params`` as given, split into ``parameters`` (dense) and ``embeddings``, and
    the ``GROUP_KEYS`` values. Reads show the optimizer-wide hyper-parameters too; writes take
    ``GROUP_KEYS`` (checked) and ``initial_lr``. ``lr`` is checked where it is used (an LR
    schedule's value, like ``optimizer.lr``)."""

    def __init__(self, optimizer, params=(), *, lr, weight_decay=0.0, clip_grad_max_norm=None,
                 clip_grad_norm_type=2.0, index: int = 0):
        # weakly: the optimizer holds its groups, and a cycle through them kept the embeddings
        # (and their paths' locks) alive after `del` until the cyclic collector ran
        self._optimizer_ref = weakref.ref(optimizer)
        self.index = index
        self._owner = f"{type(optimizer).__name__} parameter group {index}"
        self.params = list(params)
        self.parameters = [p for p in self.params if not is_embedding(p)]
        self.embeddings = [p for p in self.params if is_embedding(p)]
        #: the lr the group was built with: ``optimizer.lr = x`` keeps the groups' ratios
        self.built_lr = lr
        self._values = {"lr": lr}
        self._extra: dict = {}
        #: optimizer-wide keys the group dict repeated, checked once the optimizer is built
        self.repeated: dict = {}
        self["weight_decay"] = weight_decay
        self["clip_grad_max_norm"] = clip_grad_max_norm
        self["clip_grad_norm_type"] = clip_grad_norm_type

    @property
    def _optimizer(self):
        return self._optimizer_ref()

    @property
    def clips(self) -> bool:
        return self._values["clip_grad_max_norm"] is not None

    def _live(self) -> dict:
        opt = self._optimizer
        live = {"params": self.params, **self._values}
        live.update({k: getattr(opt, k) for k in OPTIMIZER_KEYS if hasattr(opt, k)})
        return live

    def __getitem__(self, key):
        live = self._live()
        return live[key] if key in live else self._extra[key]

    def __setitem__(self, key, value) -> None:
        if key == "lr":
            self._values["lr"] = value
        elif key == "weight_decay":
            self._values[key] = check_real(self._owner, key, value, low=0.0)
        elif key == "clip_grad_max_norm":
            self._values[key] = _check_clip_norm(self._owner, value)
        elif key == "clip_grad_norm_type":
            self._values[key] = _check_norm_type(self._owner, value)
        elif key in SCHEDULER_KEYS:
            self._extra[key] = value
        elif key == "params" or key in self._live():
            raise ConfigError(f"{self._owner}: {key!r} is fixed when the optimizer is built (one "
                              f"value for every group: the state layout and the kernel take "
                              f"it); per group: {', '.join(GROUP_KEYS)}")
        else:
            raise ConfigError(f"{self._owner}: no setting {key!r}: a group takes "
                              f"{', '.join(GROUP_KEYS)} (and an LR scheduler's initial_lr)")

    def __delitem__(self, key) -> None:
        if key not in self._extra:
            raise ConfigError(f"{self._owner}: {key!r} cannot be removed")
        del self._extra[key]

    def __iter__(self):
        return iter({**self._live(), **self._extra})

    def __len__(self) -> int:
        return len({**self._live(), **self._extra})

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.items() if k != "params"}
        return f"ParamGroup({len(self.params)} params, {shown})"


def build_groups(optimizer, params, lr, weight_decay) -> list[ParamGroup]:
    """The groups of ``params`` (None, an iterable of parameters / embeddings, or of group dicts)
    with the optimizer's ``lr`` and ``weight_decay`` as defaults. Raises ConfigError."""
    owner = type(optimizer).__name__
    if params is None:
        return [ParamGroup(optimizer, lr=lr, weight_decay=weight_decay)]
    if not hasattr(params, "__iter__") or isinstance(params, (str, bytes, dict)):
        raise ConfigError(f"{owner}: params={params!r} is not an iterable of parameters; pass "
                          "model.parameters(), a list of one_embedding.nn.Parameter, a list of "
                          "parameter groups (dicts with 'params'), or nothing")
    found = list(params)
    dicts = [isinstance(p, dict) for p in found]
    if not any(dicts):
        _check_items(owner, found, "params")
        return [ParamGroup(optimizer, found, lr=lr, weight_decay=weight_decay)]
    if not all(dicts):
        raise ConfigError(f"{owner}: params mixes parameter groups (dicts) and parameters: put "
                          "every parameter into a group dict {'params': [...], ...}")
    groups, seen = [], set()
    for index, spec in enumerate(found):
        where = f"{owner}: parameter group {index}"
        if "params" not in spec:
            raise ConfigError(f"{where} has no 'params': pass {{'params': [...], 'lr': ...}}")
        items = spec["params"]
        items = [items] if hasattr(items, "grad") or is_embedding(items) else list(items)
        _check_items(where, items, "['params']")
        for p in items:
            if id(p) in seen:
                raise ConfigError(f"{where}: {_name(p)} is in more than one parameter group")
            seen.add(id(p))
        values = {"lr": lr, "weight_decay": weight_decay}
        repeated, extra = {}, {}
        for key, value in spec.items():
            if key in GROUP_KEYS:
                values[key] = value
            elif key in SCHEDULER_KEYS:
                extra[key] = value
            elif key in OPTIMIZER_KEYS:
                repeated[key] = value
            elif key != "params":
                raise ConfigError(f"{where} has key {key!r}, which no group takes: per group "
                                  f"{', '.join(GROUP_KEYS)} (the optimizer's other arguments "
                                  "only with its own value)")
        if "clip_grad_norm_type" in values and values.get("clip_grad_max_norm") is None:
            raise ConfigError(f"{where}: clip_grad_norm_type={values['clip_grad_norm_type']!r} "
                              "without clip_grad_max_norm clips nothing: add clip_grad_max_norm")
        group = ParamGroup(optimizer, items, index=index, **values)
        group.repeated = repeated
        group._extra.update(extra)
        groups.append(group)
    return groups


def check_repeated(optimizer, groups) -> None:
    """Refuse a group that repeats an optimizer-wide hyper-parameter with another value (or one
    this optimizer does not have); run once the optimizer is built."""
    owner = type(optimizer).__name__
    for group in groups:
        for key, value in group.repeated.items():
            if not hasattr(optimizer, key):
                raise ConfigError(f"{owner} parameter group {group.index}: {owner} has no {key!r}; "
                                  f"per group: {', '.join(GROUP_KEYS)}")
            mine = getattr(optimizer, key)
            same = tuple(value) == tuple(mine) if isinstance(mine, tuple) else value == mine
            if not same:
                raise ConfigError(
                    f"{owner} parameter group {group.index}: {key}={value!r} differs from the "
                    f"optimizer's {key}={mine!r}: {key} is one per optimizer (it shapes the "
                    "state and the kernel); build one optimizer per value, or leave it out of "
                    "the group")


def _check_items(where: str, items, what: str) -> None:
    for p in items:
        if isinstance(p, dict):
            raise ConfigError(f"{where}: {what} holds a dict; parameter groups do not nest")
        if not (is_embedding(p) or (hasattr(p, "data") and hasattr(p, "grad"))):
            raise ConfigError(f"{where}: {what} holds {p!r}, which has no .data and .grad; pass "
                              "one_embedding.nn.Parameter objects (model.parameters()) or "
                              "embeddings")


def _name(p) -> str:
    name = getattr(p, "name", None)
    return f"{type(p).__name__} {name!r}" if name else repr(p)


# ---------------------------------------------------------------- clipping


def norm_partial(grads, norm_type: float) -> float:
    """This set of gradient arrays' share of the norm: sum |g|^p, or max / min |g| (inf / -inf);
    float64, on the arrays' device, one number back."""
    if norm_type == math.inf:
        out = 0.0
        for g in grads:
            if g.size:
                out = max(out, float(array_namespace(g).abs(g).max()))
        return out
    if norm_type == -math.inf:
        out = math.inf
        for g in grads:
            if g.size:
                out = min(out, float(array_namespace(g).abs(g).min()))
        return out
    out = 0.0
    for g in grads:
        xp = array_namespace(g)
        a = xp.abs(g.astype(xp.float64))
        out += float((a * a).sum()) if norm_type == 2.0 else float((a ** norm_type).sum())
    return out


def clip_coefficient(max_norm: float, norm_type: float, dense_grads, row_grads, factor: float,
                     comm=None) -> float:
    """``min(1, max_norm / (total + 1e-6))`` of one group.

    dense_grads: the group's dense gradient arrays (the same on every rank); row_grads: this
    rank's embedding rows' gradients (each key on one rank); factor: what the update multiplies
    the gradients by (the loss scale's 1/scale), so ``total`` is the norm of what it applies;
    comm: combines the row partials of every rank when there are several.
    """
    rows = norm_partial(row_grads, norm_type)
    if comm is not None and comm.world > 1:
        if norm_type in (math.inf, -math.inf):
            every = np.asarray(comm.allgather(np.array([rows], np.float64))).reshape(-1)
            rows = float(every.max() if norm_type > 0 else every.min())
        else:
            rows = float(np.asarray(comm.allreduce_sum(np.array([rows], np.float64)))[0])
    dense = norm_partial(dense_grads, norm_type)
    if norm_type == math.inf:
        total = max(rows, dense)
    elif norm_type == -math.inf:
        total = min(rows, dense)
        total = 0.0 if total == math.inf else total  # no gradient at all
    else:
        total = (rows + dense) ** (1.0 / norm_type)
    total *= abs(factor)
    return min(1.0, max_norm / (total + CLIP_EPS))
