"""The row-optimizer base class (the argument checks every optimizer shares live in ``checks``).

Arguments follow OneFlow's and PyTorch's optimizers (``params`` first, then ``lr`` and the
algorithm's own), so ``SGD(model.parameters(), lr=0.1, momentum=0.9)`` reads as in either
framework. The first positional argument may also be the learning rate (``SGD(0.1)``), the form
this library used before it took ``params``.

Gradient factor: every update multiplies the gradient by ``grad_scale`` (1.0, exact, unless a
loss scaler sets ``1/scale`` for the duration of a step) and by -1 with ``maximize=True``, then
adds ``weight_decay * w`` in ``weight_decay_mode="l2"`` (the default) -- OneFlow's and PyTorch's
weight decay, an L2 term in the gradient. ``weight_decay_mode="decoupled"`` subtracts
``lr * weight_decay * w`` from the weight instead (AdamW's form), leaving the optimizer state
free of the decay; see the optimizers' docstrings for where each term enters. Until issue 23 the
default was "decoupled"; a checkpoint written then records no mode and resumes with it
(``Optimizer.load_state_dict``).
"""
from __future__ import annotations

import copy
import functools
import numbers
import warnings
from abc import ABC, abstractmethod

import numpy as np

from one_embedding.backend import array_namespace
from one_embedding.errors import ConfigError, ConventionWarning, InputError
from one_embedding.optim.checks import check_bool, check_real
from one_embedding.optim.groups import ParamGroup, build_groups, check_repeated, clip_coefficient
from .. import host_sync

__all__ = ["RowOptimizer", "check_real", "WEIGHT_DECAY_MODES", "DEFAULT_LR"]

#: OneFlow's default learning rate for SGD, Adagrad, Adam and Ftrl (flow.optim.*, one_embedding.Ftrl)
DEFAULT_LR = 0.001

#: "l2" (the default): g' = g + wd*w before the update, OneFlow's and PyTorch's ``weight_decay``;
#: "decoupled": w -= lr*wd*w beside the update (AdamW's form; this library's default until issue 23)
WEIGHT_DECAY_MODES = ("l2", "decoupled")
DEFAULT_WEIGHT_DECAY_MODE = "l2"
#: the modes of a checkpoint that records none (written before issue 23 changed the defaults)
LEGACY_MODES = {"weight_decay_mode": "decoupled", "convention": "tensorflow"}


def as_f64(xp, a):
    """A float64 copy of ``a`` (numpy or cupy)."""
    return a.astype(xp.float64)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise InputError(f"step={step!r} must be an integer >= 1: the global step counts updates "
                         "from 1 (Adam's bias correction and Adagrad's lr_decay use it)")
    return int(step)


def _as_2d(a):
    """A 2-D view of ``a`` (same memory), or None when no view exists without a copy."""
    if a.ndim == 2:
        return a
    shape = (1, 1) if a.ndim == 0 else (-1, a.shape[-1])
    if a.ndim >= 1 and a.shape[-1] == 0:
        shape = (0, 0)
    r = a.reshape(shape)
    # A reshape that had to copy never overlaps the original's memory.
    if r.size and not np.may_share_memory(r, a):
        return None
    return r


def _leading_arguments(owner: str, params, lr):
    """(params, lr) from the two leading arguments: a real number as ``params`` is the learning
    rate given positionally (``SGD(0.1)``, this library's form before it took ``params``)."""
    if isinstance(params, (numbers.Real, str, bytes)):
        # a learning rate given positionally (a string or bool gets lr's own error message)
        if lr != DEFAULT_LR:
            raise ConfigError(f"{owner}({params!r}, lr={lr!r}): the learning rate is given twice; "
                              f"pass the parameters first, e.g. {owner}(model.parameters(), "
                              f"lr={lr!r}), or only {owner}(lr={params!r})")
        return None, params
    return params, lr


class RowOptimizer(ABC):
    """Base class: hyper-parameters, the state layout of a line, and an in-place ``update``.

    Attributes:
        param_groups: OneFlow's / PyTorch's groups (``optim.groups``): the first argument
            ``params`` as one group, or one per dict of a list of dicts; each has its own ``lr``,
            ``weight_decay`` and gradient clipping.
        params: the dense parameters of every group; ``one_embedding.Optimizer`` updates them
            when it is given none itself.
        n_states: state arrays per weight element (the line holds ``1 + n_states`` blocks of E).
        state_names: names of those states, in line order.
        lr: the first group's learning rate. LR schedules assign it between steps; the other
            groups follow in proportion to the rates they were built with.
        weight_decay: the first group's.
        grad_scale: every gradient is multiplied by it before the update (1.0; a loss scaler sets
            ``1/scale`` while a step runs, fusing the unscaling into the update).
        use_compiled: numpy arrays go through the numba kernel when True (the default); False
            forces the vectorized path, the one CuPy arrays always take.
    """

    n_states: int = 0
    state_names: tuple[str, ...] = ()
    #: per-row int64 columns after the state blocks (SmartDecayAdam's last step)
    row_columns: tuple[str, ...] = ()
    use_compiled: bool = True

    def __init_subclass__(cls, **kwargs):
        # Once the outermost __init__ has set every optimizer-wide argument, check what the
        # parameter groups repeat of them.
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def checked_init(self, *args, **kw):
            depth = self.__dict__.get("_init_depth", 0)
            self._init_depth = depth + 1
            try:
                init(self, *args, **kw)
            finally:
                self._init_depth = depth
            if depth == 0:
                check_repeated(self, self.param_groups)

        cls.__init__ = checked_init

    def __init__(self, params=None, lr: float = DEFAULT_LR, *, weight_decay: float = 0.0,
                 weight_decay_mode: str | None = None, maximize: bool = False):
        owner = type(self).__name__
        params, lr = _leading_arguments(owner, params, lr)
        self.param_groups = build_groups(self, params, lr, weight_decay)
        for group in self.param_groups:
            group["lr"] = self._check_group_lr(group["lr"])
        #: the modes this optimizer was given explicitly (not left at their defaults)
        self._given_modes = {"weight_decay_mode"} if weight_decay_mode is not None else set()
        if weight_decay_mode is None:
            weight_decay_mode = DEFAULT_WEIGHT_DECAY_MODE
        if weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ConfigError(f"{owner}: weight_decay_mode={weight_decay_mode!r}: use 'l2' "
                              "(g += wd*w, OneFlow's and PyTorch's, the default) or 'decoupled' "
                              "(w -= lr*wd*w, AdamW's)")
        self.weight_decay_mode = weight_decay_mode
        self.maximize = check_bool(owner, "maximize", maximize)
        self.grad_scale = 1.0
        self._standalone = None  # (step count, state arrays per param) of step() without a wrapper
        self._wrapped = False    # set by one_embedding.Optimizer, which then owns the updates

    # --- modes (what a checkpoint records, so that a run resumes with the rule it began with) -
    def mode_state(self) -> dict:
        """The rules that changed defaults in issue 23: ``{"weight_decay_mode": ...}``."""
        return {"weight_decay_mode": self.weight_decay_mode}

    def _mode_matters(self, key: str) -> bool:
        """Whether ``key``'s value changes this optimizer's results."""
        if key == "weight_decay_mode":
            stateless_sgd = type(self).__name__ == "SGD" and self.n_states == 0
            return not stateless_sgd and any(g["weight_decay"] for g in self.param_groups)
        return True

    def adopt_modes(self, saved: dict | None, where: str = "the checkpoint") -> None:
        """Continue with the modes ``saved`` records (``LEGACY_MODES`` for those it lacks: it
        was written before they existed). A mode this optimizer was given explicitly must agree
        (ConfigError otherwise); one left at its default takes the saved value, with a
        ConventionWarning where that changes results."""
        owner = type(self).__name__
        saved = saved or {}
        for key, mine in self.mode_state().items():
            theirs = saved.get(key, LEGACY_MODES[key])
            if theirs == mine:
                continue
            if key in self._given_modes:
                raise ConfigError(f"{owner}: {where} was written with {key}={theirs!r}, this "
                                  f"optimizer has {key}={mine!r}: build it with {key}={theirs!r} "
                                  "to continue that run, or start a new one")
            self._set_mode(key, theirs)
            if self._mode_matters(key):
                old = " (the default before issue 23)" if key not in saved else ""
                warnings.warn(f"{owner}: continuing with {where}'s {key}={theirs!r}{old} instead "
                              f"of the default {mine!r}, so the run resumes as it began; pass "
                              f"{key}= explicitly to choose", ConventionWarning, stacklevel=3)

    def _set_mode(self, key: str, value) -> None:
        if key != "weight_decay_mode" or value not in WEIGHT_DECAY_MODES:
            raise ConfigError(f"{type(self).__name__}: {key}={value!r} is not a mode it has")
        self.weight_decay_mode = value

    # --- groups -------------------------------------------------------------------------------
    def _check_group_lr(self, lr) -> float:
        return check_real(type(self).__name__, "lr", lr, low=0.0)

    @property
    def params(self) -> list:
        """The dense parameters of every group, in group order."""
        return [p for group in self.param_groups for p in group.parameters]

    @property
    def lr(self):
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value) -> None:
        # Checked where it is used (a schedule's value); the other groups keep their ratio to the
        # first, as OneFlow's schedulers rate each group from its own initial lr.
        first, *others = self.param_groups
        first["lr"] = value
        if not others:
            return
        value = check_real(type(self).__name__, "lr", value, low=0.0)
        for group in others:
            if group.built_lr == first.built_lr:
                group["lr"] = value
            elif first.built_lr == 0:
                raise ConfigError(f"{type(self).__name__}: lr={value!r} cannot move the groups in "
                                  "proportion: the first group was built with lr 0; set each "
                                  "group's param_groups[i]['lr'] instead")
            else:
                group["lr"] = value * (group.built_lr / first.built_lr)

    @property
    def weight_decay(self) -> float:
        return self.param_groups[0]["weight_decay"]

    @weight_decay.setter
    def weight_decay(self, value) -> None:
        self.param_groups[0]["weight_decay"] = value

    def for_group(self, group: ParamGroup, grad_scale: float | None = None) -> "RowOptimizer":
        """This optimizer with ``group``'s lr and weight_decay as its only group (a shallow copy
        for one step: the kernels read one set of hyper-parameters), and ``grad_scale``."""
        bound = copy.copy(self)
        bound.param_groups = [ParamGroup(bound, lr=group["lr"],
                                         weight_decay=group["weight_decay"])]
        bound.grad_scale = self.grad_scale if grad_scale is None else grad_scale
        return bound

    # --- layout -------------------------------------------------------------------------------
    def initial_state(self) -> tuple[float, ...]:
        """The value each state element of a new key (or parameter) starts at, in line order."""
        return ()

    def new_states(self, w) -> list:
        """Fresh state arrays for a parameter ``w`` (any shape; numpy or cupy), in line order."""
        xp = array_namespace(w)
        return [xp.full(w.shape, value, dtype=w.dtype) for value in self.initial_state()]

    def required_size_factor(self) -> int:
        """Blocks of E floats per line: the weight plus one per state."""
        return 1 + self.n_states

    def required_storage_dim(self, embedding_dim: int) -> int:
        """Floats per line for an embedding of ``embedding_dim`` columns."""
        return self.required_size_factor() * int(embedding_dim)

    def check_size_factor(self, size_factor: int) -> None:
        """Raise ConfigError unless a store with ``size_factor`` can hold this optimizer's lines."""
        need = self.required_size_factor()
        if size_factor != need:
            states = f"{self.n_states} state{'s' if self.n_states != 1 else ''} per row"
            raise ConfigError(f"size_factor={size_factor!r} but {type(self).__name__} stores "
                              f"{states}: use size_factor={need}")

    def _current_lr(self) -> float:
        # lr is mutable (schedules set it), so it is checked again at each update.
        return check_real(type(self).__name__, "lr", self.lr, low=0.0,
                          hint="; check the LR schedule that set it")

    # --- gradient terms -----------------------------------------------------------------------
    def _grad_factor(self) -> float:
        """What the raw gradient is multiplied by: grad_scale, negated with maximize. (0 is
        clipping to a max norm of 0, which OneFlow's clip_grad_norm_ allows.)"""
        scale = check_real(type(self).__name__, "grad_scale", self.grad_scale, low=0.0,
                           hint="; a loss scaler sets 1/scale, clipping multiplies it by <= 1")
        return -scale if self.maximize else scale

    def _l2(self) -> float:
        """The coefficient of w added to the gradient (0 in decoupled mode)."""
        return self.weight_decay if self.weight_decay_mode == "l2" else 0.0

    def _decoupled(self) -> float:
        """The coefficient of lr*w subtracted from the weight (0 in l2 mode)."""
        return self.weight_decay if self.weight_decay_mode == "decoupled" else 0.0

    @staticmethod
    def _scaled_grad(xp, g, w64, factor: float, l2: float):
        """float64 ``g*factor + l2*w``: the kernels' first expression, as arrays."""
        g64 = g.astype(xp.float64)
        g64 *= factor
        if l2:
            g64 += l2 * w64
        return g64

    # --- standalone use (OneFlow's / PyTorch's optimizer.step() on dense params) ---------------
    def step(self, closure=None):
        """Update ``params`` from their ``.grad`` (OneFlow's ``Ftrl(params).step()``, for a model
        without embeddings; with embeddings, ``one_embedding.Optimizer`` drives the updates),
        each group with its lr, weight_decay and clipping. closure: called first, its value
        returned (PyTorch's convention). A step in which no parameter has a non-zero gradient
        changes nothing and is not counted."""
        if self._wrapped:
            raise ConfigError(f"this {type(self).__name__} is driven by a one_embedding.Optimizer: "
                              "call that Optimizer's step()")
        for group in self.param_groups:
            if group.embeddings:
                raise ConfigError(f"{type(self).__name__}: parameter group {group.index} holds "
                                  f"embeddings; wrap the optimizer: one_embedding.Optimizer(opt) "
                                  "updates their rows")
        loss = closure() if closure is not None else None
        if self._standalone is None:
            self._standalone = (0, [[self.new_states(p.data) for p in group.parameters]
                                    for group in self.param_groups])
        count, all_states = self._standalone
        live = [[(p, s) for p, s in zip(group.parameters, states)
                 if p.grad is not None and host_sync.flag(p.grad.any(),
                                                               "optimizer: dense grad nonzero")]
                for group, states in zip(self.param_groups, all_states)]
        if any(live):
            count += 1
            for group, pairs in zip(self.param_groups, live):
                coef = 1.0
                if group.clips:
                    coef = clip_coefficient(group["clip_grad_max_norm"],
                                            group["clip_grad_norm_type"],
                                            [p.grad for p, _ in pairs], [], self.grad_scale)
                bound = self.for_group(group, self.grad_scale * coef)
                for p, states in pairs:
                    bound.update(p.data, states, p.grad, count)
            self._standalone = (count, all_states)
        return loss

    def zero_grad(self) -> None:
        """Zero every ``params`` gradient."""
        for p in self.params:
            if p.grad is not None:
                p.grad[...] = 0

    # --- update -------------------------------------------------------------------------------
    def update(self, w, states, g, step: int, *, last_step=None) -> None:
        """Apply one step in place.

        Args:
            w: (n, E) float32 weights, or any shape; may be a non-contiguous view into lines.
            states: ``n_states`` arrays shaped like ``w`` (views allowed), in ``state_names`` order.
            g: gradient shaped like ``w`` (float32 usually), as the loss produced it (scaled by
                the loss scale when one is used: ``grad_scale`` undoes it).
            step: global step t >= 1 of this update.
            last_step: for an optimizer with ``row_columns`` (SmartDecayAdam) updating embedding
                lines: (n, 2) float32, the line's slots of each row's last-update step; the rows
                then take the row update (without it, w is a dense parameter).
        """
        t = _check_step(step)
        lr = self._current_lr()
        factor = self._grad_factor()
        states = list(states)
        if len(states) != self.n_states:
            raise InputError(f"{type(self).__name__} keeps {self.n_states} state arrays "
                             f"{self.state_names}, got {len(states)}")
        named = [("w", w), ("g", g)] + [(f"states[{i}]", s) for i, s in enumerate(states)]
        for name, a in named:
            if tuple(a.shape) != tuple(w.shape):
                raise InputError(f"{name} has shape {tuple(a.shape)} but w has shape "
                                 f"{tuple(w.shape)}: pass arrays shaped like w")
            if a.dtype.kind != "f":
                raise InputError(f"{name} has dtype {a.dtype}: optimizers update floating-point "
                                 "arrays (float32 lines)")
        xp = array_namespace(w, g, *states)
        if xp is np:
            for name, a in named:
                if name != "g" and not a.flags.writeable:
                    raise InputError(f"{name} is read-only: pass a writable array (or view)")
        if last_step is not None:
            self._update_rows(xp, w, states, g, last_step, lr, t, factor)
            return
        if xp is np:
            if self.use_compiled:
                views = [_as_2d(a) for a in [w, *states, g]]
                if all(v is not None for v in views):
                    self._kernel(views[0], views[1:-1], views[-1], lr, t, factor)
                    return
        self._vectorized(xp, w, states, g, lr, t, factor)

    def _update_rows(self, xp, w, states, g, last_step, lr: float, t: int,
                     factor: float) -> None:
        """The row update of an optimizer with ``row_columns``."""
        raise InputError(f"{type(self).__name__} keeps no per-row step: pass last_step=None")

    @abstractmethod
    def _kernel(self, w, states, g, lr: float, t: int, factor: float) -> None:
        """The compiled CPU update on 2-D views."""

    @abstractmethod
    def _vectorized(self, xp, w, states, g, lr: float, t: int, factor: float) -> None:
        """The same update as array expressions in ``xp`` (numpy or cupy)."""

    def __repr__(self) -> str:
        hidden = ("use_compiled", "n_states", "state_names", "params", "grad_scale",
                  "param_groups")
        fields = [f"lr={self.lr!r}", f"weight_decay={self.weight_decay!r}"]
        fields += [f"{k}={v!r}" for k, v in vars(self).items()
                   if k not in hidden and not k.startswith("_")]
        if len(self.param_groups) > 1:
            fields.append(f"groups={len(self.param_groups)}")
        return f"{type(self).__name__}({', '.join(fields)})"
