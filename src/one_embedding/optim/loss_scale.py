"""Loss scaling for mixed precision: scale the loss up so small fp16 gradients survive, undo it in
the update, and skip a step whose gradients overflowed.

    scaler = LossScaler()                                # dynamic, from 2**16
    opt = one_embedding.Optimizer(Adam(lr=1e-3), embeddings=[emb], parameters=params,
                                  loss_scale=scaler)
    out = emb(ids)
    d_out = model.backward(scaler.scale * d_loss)        # dense grads and d_out carry the scale
    scaler.backward(emb, d_out)                          # emb.backward, unless d_out overflowed
    opt.step()                                           # unscaled inside the update, or skipped
    opt.zero_grad()

The unscaling is fused into the row update (the gradient is multiplied by ``1/scale`` where the
update reads it, as OneFlow's embedding update kernels take a ``scale`` and a ``skip_if``), so the
gradients are never rewritten. With ``dynamic=True`` (PyTorch's ``GradScaler`` rule) the scale
halves after a step with an inf/nan gradient and doubles after ``growth_interval`` clean steps in
a row; ``dynamic=False`` keeps it fixed (OneFlow's ``StaticGradScaler``), though a non-finite step
is still skipped.
"""
from __future__ import annotations

import numbers

import numpy as np

from one_embedding import host_sync
from one_embedding.backend import array_namespace
from one_embedding.errors import ConfigError
from one_embedding.optim.base import check_bool, check_real

__all__ = ["LossScaler", "all_finite"]


def all_finite(*arrays) -> bool:
    """True when every element of every array (numpy or cupy; None skipped) is finite."""
    for a in arrays:
        if a is None:
            continue
        xp = array_namespace(a)
        if not host_sync.flag(xp.isfinite(a).all(), "loss scale: overflow check"):
            return False
    return True


class LossScaler:
    """The loss scale and its update rule (PyTorch's ``GradScaler`` defaults).

    Attributes:
        scale: the current factor (a float; multiply the loss, or its gradient, by it).
        found_inf: True once ``backward`` (or ``record_overflow``) saw a non-finite gradient in
            the current step; the Optimizer skips that step and clears it.
        skipped_steps: steps skipped so far because of overflow.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, dynamic: bool = True):
        self.scale = check_real("LossScaler", "init_scale", init_scale, low=0.0, low_open=True,
                                high=float(np.finfo(np.float32).max),
                                hint="the model multiplies by it in float32")
        self.growth_factor = check_real("LossScaler", "growth_factor", growth_factor, low=1.0)
        self.backoff_factor = check_real("LossScaler", "backoff_factor", backoff_factor, 0.0, 1.0,
                                         low_open=True)
        if (isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral)
                or growth_interval < 1):
            raise ConfigError(f"LossScaler: growth_interval={growth_interval!r} must be an integer "
                              ">= 1 (clean steps before the scale grows), e.g. 2000")
        self.growth_interval = int(growth_interval)
        self.dynamic = check_bool("LossScaler", "dynamic", dynamic)
        self.found_inf = False
        self.skipped_steps = 0
        self._clean_steps = 0

    @classmethod
    def of(cls, loss_scale) -> "LossScaler | None":
        """None, a LossScaler, or a number (a static scale) -> LossScaler or None."""
        if loss_scale is None or isinstance(loss_scale, cls):
            return loss_scale
        if isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool):
            return cls(init_scale=loss_scale, dynamic=False)
        raise ConfigError(f"loss_scale={loss_scale!r}: pass a number (a static scale, e.g. 1024), "
                          "a one_embedding.optim.LossScaler, or None")

    def scale_loss(self, loss):
        """``loss * scale`` (a number or an array)."""
        return loss * self.scale

    def backward(self, embedding, grad_out, state=None) -> bool:
        """``embedding.backward(grad_out, state)`` when ``grad_out`` is finite; otherwise records
        the overflow (the step will be skipped) and drops this gradient. Returns True when passed
        on. (The embedding refuses a non-finite gradient outright; this is the scaled path.)

        grad_out: (..., embedding_dim) float, the scaled gradient of a lookup's output;
        state: that lookup's StepState (default: the last forward)."""
        if all_finite(grad_out):
            if state is None:
                embedding.backward(grad_out)
            else:
                embedding.backward(grad_out, state=state)
            return True
        self.found_inf = True
        return False

    def record_overflow(self) -> None:
        """Mark the current step as overflowed (e.g. a check the caller made itself)."""
        self.found_inf = True

    def update(self, found_inf: bool) -> None:
        """Advance the rule after a step: back off on overflow, grow after a clean streak."""
        self.found_inf = False
        if found_inf:
            self.skipped_steps += 1
            self._clean_steps = 0
            if self.dynamic:
                # never reach 0: a scale below the smallest normal float would zero every gradient
                self.scale = max(self.scale * self.backoff_factor, np.finfo(np.float32).tiny)
            return
        self._clean_steps += 1
        if self.dynamic and self._clean_steps >= self.growth_interval:
            grown = self.scale * self.growth_factor
            # the model multiplies by float32(scale): a scale past float32's range is inf there
            # (and every step would overflow); PyTorch's GradScaler keeps it finite too
            if grown <= float(np.finfo(np.float32).max):
                self.scale = grown
            self._clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = check_real("LossScaler", "scale", state["scale"], low=0.0, low_open=True)
        self._clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, skipped_steps={self.skipped_steps})"
