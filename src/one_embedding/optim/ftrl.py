"""FTRL with OneFlow's formula (the default) or TensorFlow's FTRL-Proximal convention.

Both keep ``[n, z]`` per weight (n starts at ``initial_accumulator_value``, z at 0) and recompute
the weight from them each step. With g' the gradient after the loss-scale factor (and ``+ wd*w``
in the default ``weight_decay_mode="l2"``), ``P(n) = n ** power``:

    n' = n + g'^2;  sigma = (P(n') - P(n)) / lr;  z += g' - sigma * w;  n = n'
    w = (sign(z) * lambda1 - z) / ((beta + P(n')) / lr + q) - lr * dwd * w   where z is outside
        the dead zone, else 0

    convention   power        q             dead zone (w = 0)
    "oneflow"    lr_power     lambda2       |z| <  lambda1
    "tensorflow" -lr_power    2 * lambda2   |z| <= lambda1

``dwd`` is ``weight_decay`` in ``weight_decay_mode="decoupled"`` (the term OneFlow's kernel calls
``weight_decay`` and its eager embedding path applies) and 0 in ``"l2"``.

OneFlow's ``flow.one_embedding.Ftrl`` applies ``accumulator ** lr_power`` as written (its
``FtrlUpdateFunctor``), so with its default ``lr_power=-0.5`` the per-coordinate rate
``lr / n ** lr_power = lr * sqrt(n)`` grows with the accumulated gradient, where FTRL-Proximal
(McMahan et al. 2013; TensorFlow's ``Ftrl``, ``n ** -lr_power``) shrinks it as ``lr / sqrt(n)``.
OneFlow's ``lr_power=0.5`` and ``lambda2/2`` give TensorFlow's result with ``lr_power=-0.5``
(except on the dead zone's boundary, ``|z| == lambda1``). Until issue 23 this library computed
only TensorFlow's convention; a checkpoint written then records no convention and resumes with
it (``Optimizer.load_state_dict``).
"""
from __future__ import annotations

import warnings

from one_embedding.errors import ConfigError, ConventionWarning
from one_embedding.optim import kernels
from one_embedding.optim.base import DEFAULT_LR, RowOptimizer, as_f64, check_real

__all__ = ["Ftrl", "FTRL_CONVENTIONS"]

#: "oneflow" (the default): OneFlow's formula; "tensorflow": FTRL-Proximal as TensorFlow has it
FTRL_CONVENTIONS = ("oneflow", "tensorflow")


class Ftrl(RowOptimizer):
    """FTRL, by OneFlow's formula unless ``convention="tensorflow"`` (see the module docstring).

    Arguments and defaults as OneFlow's ``flow.one_embedding.Ftrl(params, lr=0.001,
    weight_decay=0.0, lr_power=-0.5, initial_accumulator_value=0.1, lambda1=0.0, lambda2=0.0,
    beta=0.0)``. ``convention`` left out means OneFlow's, with a ``ConventionWarning`` where that
    departs from FTRL-Proximal (``lr_power < 0`` or ``lambda2 > 0``); pass it to choose and
    silence the warning. State: ``[n, z]`` (``initial_accumulator_value`` > 0, and 0).
    """

    n_states = 2
    state_names = ("accumulator", "linear")

    def __init__(self, params=None, lr: float = DEFAULT_LR, weight_decay: float = 0.0,
                 lr_power: float = -0.5, initial_accumulator_value: float = 0.1,
                 lambda1: float = 0.0, lambda2: float = 0.0, beta: float = 0.0, *,
                 maximize: bool = False, weight_decay_mode: str | None = None,
                 convention: str | None = None):
        super().__init__(params, lr, weight_decay=weight_decay,
                         weight_decay_mode=weight_decay_mode, maximize=maximize)
        if convention is not None:
            self._given_modes.add("convention")
        self.convention = "oneflow" if convention is None else convention
        if self.convention not in FTRL_CONVENTIONS:
            raise ConfigError(f"Ftrl: convention={convention!r}: use 'oneflow' (OneFlow's formula, "
                              "accumulator ** lr_power) or 'tensorflow' (FTRL-Proximal, "
                              "accumulator ** -lr_power)")
        if self.convention == "tensorflow":
            self.lr_power = check_real("Ftrl", "lr_power", lr_power, high=0.0,
                                       hint=": TensorFlow's convention takes lr_power <= 0 "
                                            "(accumulator ** -lr_power)")
        else:
            self.lr_power = check_real("Ftrl", "lr_power", lr_power)
        self.initial_accumulator_value = check_real(
            "Ftrl", "initial_accumulator_value", initial_accumulator_value, low=0.0,
            low_open=True, hint=": a power of a zero accumulator leaves 0/0 on a zero gradient")
        self.lambda1 = check_real("Ftrl", "lambda1", lambda1, low=0.0)
        self.lambda2 = check_real("Ftrl", "lambda2", lambda2, low=0.0)
        self.beta = check_real("Ftrl", "beta", beta, low=0.0)
        if convention is None and (self.lr_power < 0 or self.lambda2 > 0):
            differences = []
            if self.lr_power < 0:
                differences.append(f"accumulator ** {self.lr_power:g}, so the step grows as "
                                   "gradients accumulate, where FTRL-Proximal (McMahan et al., "
                                   f"TensorFlow) takes accumulator ** {-self.lr_power:g}")
            if self.lambda2 > 0:
                differences.append(f"lambda2={self.lambda2:g} added as given, where FTRL-Proximal "
                                   "adds 2 * lambda2")
            warnings.warn(
                f"Ftrl(lr_power={self.lr_power:g}, lambda2={self.lambda2:g}) follows OneFlow's "
                f"formula: {'; '.join(differences)}. The weights differ from the first step. "
                "Pass convention='oneflow' to keep OneFlow's formula (and silence this warning) "
                "or convention='tensorflow' for FTRL-Proximal", ConventionWarning, stacklevel=3)

    def mode_state(self) -> dict:
        return {**super().mode_state(), "convention": self.convention}

    def _set_mode(self, key: str, value) -> None:
        if key != "convention":
            return super()._set_mode(key, value)
        if value not in FTRL_CONVENTIONS:
            raise ConfigError(f"Ftrl: convention={value!r} is not a convention it has")
        if value == "tensorflow" and self.lr_power > 0:
            raise ConfigError(f"Ftrl: the saved convention is 'tensorflow', which takes "
                              f"lr_power <= 0, but lr_power={self.lr_power:g}: use the run's "
                              "lr_power, or start a new run")
        self.convention = value

    @staticmethod
    def _check_lr(lr) -> float:
        return check_real("Ftrl", "lr", lr, low=0.0, low_open=True,
                          hint=": FTRL divides by lr; start a warmup with start_factor > 0")

    def _check_group_lr(self, lr) -> float:
        # sigma divides by lr, so Ftrl needs lr > 0 (checked again at each update)
        return self._check_lr(lr)

    def _current_lr(self) -> float:
        return self._check_lr(self.lr)

    def initial_state(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value, 0.0)

    def kernel_constants(self) -> tuple[float, float, bool]:
        """(power applied to the accumulator, lambda2's coefficient q in the denominator, whether
        ``|z| == lambda1`` is in the dead zone) of this convention."""
        if self.convention == "tensorflow":
            return -self.lr_power, 2.0 * self.lambda2, True
        return self.lr_power, self.lambda2, False

    def _kernel(self, w, states, g, lr, t, factor):
        power, quad_l2, closed = self.kernel_constants()
        kernels.ftrl_kernel(w, states[0], states[1], g, factor, self._l2(), 1.0 / lr, power,
                            self.lambda1, quad_l2, self.beta, closed, lr * self._decoupled())

    def _vectorized(self, xp, w, states, g, lr, t, factor):
        acc, z = states
        power, quad_l2, closed = self.kernel_constants()
        w64 = as_f64(xp, w)
        g64 = self._scaled_grad(xp, g, w64, factor, self._l2())
        n_old = as_f64(xp, acc)
        n_new = n_old + g64 * g64
        acc[...] = n_new
        p_old, p_new = _powered(xp, n_old, power), _powered(xp, n_new, power)
        del n_old, n_new
        inv_lr = 1.0 / lr
        p_old -= p_new          # p_old now holds -(p_new - p_old)
        p_old *= inv_lr
        p_old *= w64            # -sigma * w
        z64 = as_f64(xp, z)
        z64 += g64
        z64 += p_old
        z[...] = z64
        del p_old, g64
        p_new += self.beta
        p_new *= inv_lr
        p_new += quad_l2
        num = xp.copysign(xp.float64(self.lambda1), z64)
        num -= z64
        num /= p_new
        lr_wd = lr * self._decoupled()
        if lr_wd:
            w64 *= lr_wd
            num -= w64
        active = xp.abs(z64) > self.lambda1 if closed else xp.abs(z64) >= self.lambda1
        w[...] = xp.where(active, num, 0.0)


def _powered(xp, n, power: float):
    """``n ** power`` in float64; +-0.5 as sqrt and 1/sqrt (correctly rounded on every backend,
    as the compiled and CUDA kernels take them)."""
    if power == 0.5:
        return xp.sqrt(n)
    if power == -0.5:
        out = xp.sqrt(n)
        return xp.divide(1.0, out, out=out)
    return n ** power
