"""Learning-rate schedules that drive any object with an ``lr`` attribute.

Updates count from 1, as the optimizers' ``step`` argument does; ``lr_at(t)`` is the learning
rate of update t. The formulas are OneFlow's ``flow.optim.lr_scheduler`` ones, evaluated at
OneFlow's step counter: the number of updates finished before this one, ``t - 1`` (OneFlow's
graph computes the rate from ``train_step``, 0 at the first update). So a linear warmup from 0
gives the first update the rate 0, as OneFlow's DLRM schedule does. A schedule sets
``target.lr`` to ``lr_at(last_step + 1)`` when built, and ``step()``, called after each update,
advances ``last_step`` and sets the rate of the next update::

    sched = WarmupPolynomialDecay(opt, 24.0, warmup_steps=2750, decay_start=49315,
                                  decay_steps=27772)
    for t in range(1, n + 1):
        opt.update(w, states, g, t)     # uses sched.lr_at(t)
        sched.step()

``target`` may also be a list of such objects (embedding and dense optimizers sharing one rate)
or None (the schedule only computes rates).

``step_origin=1`` evaluates the formulas at ``t`` instead of ``t - 1``: this library's schedules
before issue 23, one update ahead of OneFlow's. A schedule state saved then records no origin
and loads with 1, so a resumed run continues as it began.
"""
from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
import numbers

import warnings

from one_embedding.errors import ConfigError, ConventionWarning, InputError
from one_embedding.optim.base import check_real

__all__ = ["LRSchedule", "LinearWarmup", "PolynomialDecay", "WarmupPolynomialDecay",
           "MultiStepLR"]


def _check_int(owner: str, name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ConfigError(f"{owner}: {name}={value!r} must be an integer >= {low}")
    return int(value)


class LRSchedule(ABC):
    """Base class: owns ``base_lr``, the step counter and the targets; subclasses give
    ``rate(position)``, the formula at OneFlow's step counter."""

    #: the origin a saved state without one had (LinearWarmup and the decays ran one update
    #: ahead of OneFlow's before issue 23; MultiStepLR already matched it)
    LEGACY_STEP_ORIGIN = 1

    def __init__(self, target, base_lr: float, *, last_step: int = 0, step_origin: int = 0):
        owner = type(self).__name__
        if target is None:
            targets = []
        elif isinstance(target, (list, tuple)):
            targets = list(target)
        else:
            targets = [target]
        for obj in targets:
            if not hasattr(obj, "lr"):
                raise ConfigError(f"{owner}: target {obj!r} has no 'lr' attribute; pass an "
                                  "optimizer (or a list of them, or None)")
        self.targets = targets
        self.base_lr = check_real(owner, "base_lr", base_lr, low=0.0)
        self.last_step = _check_int(owner, "last_step", last_step, 0)
        self.step_origin = _check_origin(owner, step_origin)

    def _finish_init(self) -> None:
        # Subclasses validate their own fields first, then publish the first rate.
        self._assign(self.lr_at(self.last_step + 1))

    def lr_at(self, step: int) -> float:
        """The learning rate of update ``step`` (1-based; 0, before any update, gives the first
        update's). Pure."""
        t = self._check_step(step)
        return self.rate(max(t - 1 + self.step_origin, 0))

    @abstractmethod
    def rate(self, position: int) -> float:
        """The formula at OneFlow's step counter ``position`` (updates finished before)."""

    @property
    def current_lr(self) -> float:
        """The rate the next update uses: ``lr_at(last_step + 1)``."""
        return self.lr_at(self.last_step + 1)

    def step(self) -> float:
        """Count one finished update, set every target's ``lr`` for the next one, and return it."""
        self.last_step += 1
        lr = self.lr_at(self.last_step + 1)
        self._assign(lr)
        return lr

    def state_dict(self) -> dict:
        """Where the schedule stands: ``{"last_step": int, "step_origin": int}`` (the rates
        follow from them)."""
        return {"last_step": self.last_step, "step_origin": self.step_origin}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``: set ``last_step``, the step origin it was saved with
        (``LEGACY_STEP_ORIGIN`` when it records none), and every target's ``lr``."""
        owner = type(self).__name__
        origin = _check_origin(owner, state.get("step_origin", self.LEGACY_STEP_ORIGIN))
        if origin != self.step_origin:
            warnings.warn(
                f"{owner}: the saved schedule evaluates its formula at update t - 1 + "
                f"{origin} (step_origin={origin}{', saved before issue 23' if origin else ''}), "
                f"this one at t - 1 + {self.step_origin}; continuing with the saved origin so "
                "the run resumes as it began", ConventionWarning, stacklevel=2)
        self.step_origin = origin
        self.last_step = _check_int(owner, "last_step", state["last_step"], 0)
        self._assign(self.lr_at(self.last_step + 1))

    def _assign(self, lr: float) -> None:
        for obj in self.targets:
            obj.lr = lr

    @staticmethod
    def _check_step(step) -> int:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise InputError(f"step={step!r} must be an integer >= 0 (updates count from 1)")
        return int(step)


def _check_origin(owner: str, origin) -> int:
    if isinstance(origin, bool) or origin not in (0, 1):
        raise ConfigError(f"{owner}: step_origin={origin!r}: use 0 (OneFlow's: update t is "
                          "rated at t - 1) or 1 (this library's schedules before issue 23)")
    return int(origin)


class LinearWarmup(LRSchedule):
    """Linear ramp from ``start_factor*base_lr`` to ``base_lr``, OneFlow's ``LinearLR`` (with
    ``end_factor=1``, ``total_iters=warmup_steps``).

    ``rate(s) = base_lr * (f0 + (1 - f0) * (s / W))`` for s < W, else ``base_lr``; update t is
    rated at s = t - 1, so with f0 = 0 the first update has the rate 0 and update W + 1 the full
    rate, as OneFlow's DLRM warmup. ``W = 0`` means no warmup.
    """

    def __init__(self, target, base_lr: float, warmup_steps: int, start_factor: float = 0.0, *,
                 last_step: int = 0, step_origin: int = 0):
        super().__init__(target, base_lr, last_step=last_step, step_origin=step_origin)
        self.warmup_steps = _check_int("LinearWarmup", "warmup_steps", warmup_steps, 0)
        self.start_factor = check_real("LinearWarmup", "start_factor", start_factor, 0.0, 1.0)
        self._finish_init()

    def rate(self, position: int) -> float:
        return self.base_lr * _warmup_factor(position, self.warmup_steps, self.start_factor)


def _warmup_factor(s: int, warmup_steps: int, start_factor: float) -> float:
    if s >= warmup_steps:
        return 1.0
    return start_factor + (1.0 - start_factor) * (s / warmup_steps)


def _decay_lr(s: int, base_lr: float, decay_start: int, decay_steps: int, end_lr: float,
              power: float) -> float:
    k = min(max(s - decay_start, 0), decay_steps)
    return (base_lr - end_lr) * (1.0 - k / decay_steps) ** power + end_lr


class PolynomialDecay(LRSchedule):
    """``base_lr`` until ``decay_start`` updates are done, then a polynomial fall to ``end_lr``:
    OneFlow's ``PolynomialLR`` (``cycle=False``) started by a ``SequentialLR`` milestone at
    ``decay_start`` with ``interval_rescaling=True``.

    With ``k = clamp(s - decay_start, 0, D)``: ``rate(s) = (base - end) * (1 - k/D)^power + end``;
    update t is rated at s = t - 1, so update ``decay_start + 1`` still has ``base_lr`` and
    ``end_lr`` holds from update ``decay_start + D + 1`` on.
    """

    def __init__(self, target, base_lr: float, decay_start: int, decay_steps: int,
                 end_lr: float = 0.0, power: float = 2.0, *, last_step: int = 0,
                 step_origin: int = 0):
        super().__init__(target, base_lr, last_step=last_step, step_origin=step_origin)
        _init_decay(self, decay_start, decay_steps, end_lr, power)
        self._finish_init()

    def rate(self, position: int) -> float:
        return _decay_lr(position, self.base_lr, self.decay_start, self.decay_steps,
                         self.end_lr, self.power)


def _init_decay(sched: LRSchedule, decay_start, decay_steps, end_lr, power) -> None:
    owner = type(sched).__name__
    sched.decay_start = _check_int(owner, "decay_start", decay_start, 0)
    sched.decay_steps = _check_int(owner, "decay_steps", decay_steps, 1)
    sched.end_lr = check_real(owner, "end_lr", end_lr, 0.0, sched.base_lr,
                              hint=": end_lr lies between 0 and base_lr")
    sched.power = check_real(owner, "power", power, low=0.0, low_open=True)


class WarmupPolynomialDecay(LRSchedule):
    """OneFlow's DLRM schedule (OneFlow-Inc/models RecommenderSystems/dlrm ``make_lr_scheduler``):
    ``SequentialLR([LinearLR(start_factor=0, total_iters=W), PolynomialLR(decay_batch=D,
    end_learning_rate=0, power=2)], milestones=[decay_start], interval_rescaling=True)``.

    ``rate(s)`` is the warmup ``base_lr * (f0 + (1 - f0) * s / W)`` for s < W, ``base_lr`` for
    W <= s < decay_start, then ``(base - end) * (1 - (s - decay_start)/D)^power + end`` until
    ``end_lr``; update t is rated at s = t - 1.
    """

    def __init__(self, target, base_lr: float, warmup_steps: int, decay_start: int,
                 decay_steps: int, end_lr: float = 0.0, power: float = 2.0,
                 start_factor: float = 0.0, *, last_step: int = 0, step_origin: int = 0):
        super().__init__(target, base_lr, last_step=last_step, step_origin=step_origin)
        owner = "WarmupPolynomialDecay"
        self.warmup_steps = _check_int(owner, "warmup_steps", warmup_steps, 0)
        self.start_factor = check_real(owner, "start_factor", start_factor, 0.0, 1.0)
        _init_decay(self, decay_start, decay_steps, end_lr, power)
        if self.decay_start < self.warmup_steps:
            raise ConfigError(f"{owner}: decay_start={decay_start!r} is before the end of the "
                              f"warmup (warmup_steps={warmup_steps!r}): use "
                              f"decay_start >= {self.warmup_steps}")
        self._finish_init()

    def rate(self, position: int) -> float:
        if position < self.warmup_steps:
            return self.base_lr * _warmup_factor(position, self.warmup_steps, self.start_factor)
        return _decay_lr(position, self.base_lr, self.decay_start, self.decay_steps, self.end_lr,
                         self.power)


class MultiStepLR(LRSchedule):
    """``base_lr * gamma^m``, m = milestones already passed: OneFlow's and PyTorch's
    ``MultiStepLR`` (``bisect_right(milestones, s)`` at step counter s = t - 1).

    A milestone M means "after M updates": updates 1..M use the old rate, M+1 on the new one.
    This schedule always matched OneFlow's, so a saved state without an origin loads with 0.
    """

    LEGACY_STEP_ORIGIN = 0

    def __init__(self, target, base_lr: float, milestones, gamma: float = 0.1, *,
                 last_step: int = 0, step_origin: int = 0):
        super().__init__(target, base_lr, last_step=last_step, step_origin=step_origin)
        try:
            ms = list(milestones)
        except TypeError:
            raise ConfigError(f"MultiStepLR: milestones={milestones!r} must be a list of "
                              "increasing positive integers") from None
        for i, m in enumerate(ms):
            _check_int("MultiStepLR", f"milestones[{i}]", m, 1)
        if any(b <= a for a, b in zip(ms, ms[1:])):
            raise ConfigError(f"MultiStepLR: milestones={milestones!r} must be strictly "
                              "increasing: sort them and drop duplicates")
        self.milestones = [int(m) for m in ms]
        self.gamma = check_real("MultiStepLR", "gamma", gamma, low=0.0, low_open=True)
        self._finish_init()

    def rate(self, position: int) -> float:
        return self.base_lr * self.gamma ** bisect.bisect_right(self.milestones, position)
