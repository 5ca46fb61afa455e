"""SmartDecayAdam: Adam whose embedding rows decay by the steps since they were last updated.

OneFlow's ``flow.one_embedding.SmartDecayAdam`` (python/oneflow/one_embedding.py: an ``Adam``
whose graph runs ``one_embedding_smart_decay_sparse_adam_update`` on the embedding rows,
oneflow/user/kernels/one_embedding_update_kernels.cu ``SmartDecaySparseAdamUpdateKernel``, after
caffe2's SmartDecaySparseAdam). A row not seen for a while catches up on the decay it missed.
With t the global step (from 1), ``k = t - last``, ``last`` the step that last updated the row (0
for a new row) and g' the gradient after the loss-scale factor, plus ``wd * w`` (OneFlow's L2):

    m' = b1^k * m + (1 - b1) * g'
    v' = b2^k * v + (1 - b2) * g'^2
    catchup = m * b1 * (1 - b1^(k-1)) / (1 - b1)    when k > 1, else 0
    w -= lr * (m' + catchup) / (sqrt(v') + eps);  last = t

No bias correction on rows (OneFlow's kernel applies none; it requires do_bias_correction=True
for the dense parameters). Dense parameters take plain Adam, as in OneFlow.

The line is OneFlow's: ``[w (E) | m (E) | v (E) | pad | last (int64)]``, the int64 starting at
the first 8-byte boundary after the three blocks and stored as two float32 slots of its
little-endian words: ``storage_dim = 3E + (3E odd) + 2`` floats (``required_storage_dim``), so a
table written by OneFlow reads here and back. The int64's low word is a float32 bit pattern, a
finite one for steps below 2**31 - 8388609 (``MAX_STEP``).
"""
from __future__ import annotations

import numpy as np

from one_embedding import host_sync
from one_embedding.errors import ConfigError, InputError
from one_embedding.optim import kernels
from one_embedding.optim.base import as_f64
from one_embedding.optim.row_optimizers import Adam

__all__ = ["SmartDecayAdam", "MAX_STEP"]

#: steps whose int64 low word, read as float32, stays finite (rows are checked for finite values)
MAX_STEP = 0x7F7FFFFF


class SmartDecayAdam(Adam):
    """OneFlow's ``SmartDecayAdam(params, lr=0.001, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.0, amsgrad=False, do_bias_correction=True)`` (see the module docstring).

    Embedding rows need ``storage_dim=required_storage_dim(E)`` (3E + 2 floats, E even); no
    ``size_factor`` gives that line. ``weight_decay`` is OneFlow's L2 term; the decoupled form,
    amsgrad and ``do_bias_correction=False`` are refused (OneFlow's row kernel has none of them).
    """

    #: per-row columns after the state blocks (one int64 each, OneFlow's layout)
    row_columns = ("last_step",)

    def __init__(self, params=None, lr: float = 0.001, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 do_bias_correction: bool = True, *, maximize: bool = False,
                 weight_decay_mode: str | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, do_bias_correction,
                         maximize=maximize, weight_decay_mode=weight_decay_mode)
        if self.weight_decay_mode != "l2":
            raise ConfigError("SmartDecayAdam: weight_decay_mode='decoupled': OneFlow's row "
                              "kernel adds weight_decay * w to the gradient only; leave "
                              "weight_decay_mode out")
        if self.amsgrad:
            raise ConfigError("SmartDecayAdam: amsgrad=True: OneFlow's SmartDecayAdam keeps m "
                              "and v only; use Adam(amsgrad=True)")
        if not self.do_bias_correction:
            raise ConfigError("SmartDecayAdam: do_bias_correction=False: OneFlow requires True "
                              "(the dense parameters' Adam corrects; the rows never do)")

    # --- layout -------------------------------------------------------------------------------
    def row_column_offset(self, embedding_dim: int) -> int:
        """Float offset in the line of the int64 last step: the three blocks, rounded up to an
        8-byte boundary."""
        blocks = (1 + self.n_states) * int(embedding_dim)
        return blocks + blocks % 2

    def required_storage_dim(self, embedding_dim: int) -> int:
        return self.row_column_offset(embedding_dim) + 2

    def required_size_factor(self) -> int:
        raise ConfigError("SmartDecayAdam's line holds an int64 step per row after its three "
                          "blocks: no size_factor gives it; set storage_dim="
                          "optimizer.required_storage_dim(embedding_dim) (3E + 2 for an even E)")

    def check_size_factor(self, size_factor: int) -> None:
        self.required_size_factor()

    # --- rows ---------------------------------------------------------------------------------
    def check_last_steps(self, xp, words, t: int) -> None:
        """Raise InputError unless every row's recorded step (words: (n, 2) uint32) is before t."""
        if t > MAX_STEP:
            raise InputError(f"step={t} is past {MAX_STEP}: SmartDecayAdam stores the step in the "
                             "line, whose low word must stay a finite float32")
        if words.shape[0] == 0:
            return
        last = int(host_sync.scalar(xp.max(_steps_of(xp, words)), "SmartDecayAdam: last step"))
        if last >= t:
            raise InputError(
                f"a row was last updated at step {last}, not before this step {t}: the step count "
                "restarted under rows that kept theirs; load the optimizer state saved with the "
                "rows (its step_count), or continue from a step past theirs")

    def _update_rows(self, xp, w, states, g, last_step, lr, t, factor) -> None:
        if not self.row_columns or w.ndim != 2:
            raise InputError("last_step is for embedding lines: w (n, E) and last_step (n, 2)")
        if tuple(last_step.shape) != (w.shape[0], 2) or last_step.dtype != np.float32:
            raise InputError(f"last_step has shape {tuple(last_step.shape)} and dtype "
                             f"{last_step.dtype}: pass the line's two float32 slots, (n, 2)")
        words = last_step.view(xp.uint32)
        self.check_last_steps(xp, words, t)
        b1, b2 = self.betas
        if xp is np and self.use_compiled:
            kernels.smart_decay_adam_kernel(w, states[0], states[1], words, g, factor,
                                            self._l2(), b1, b2, lr, self.eps, t)
            return
        k = t - _steps_of(xp, words)                       # (n,) int64
        w64 = as_f64(xp, w)
        g64 = self._scaled_grad(xp, g, w64, factor, self._l2())
        m, v = states
        m64, v64 = as_f64(xp, m), as_f64(xp, v)
        back = xp.where(k > 1, _powi(xp, b1, k - 1), 1.0)[:, None]
        catchup = xp.where((k > 1)[:, None], m64 * b1 * (1.0 - back) / (1.0 - b1), 0.0)
        m64 = _powi(xp, b1, k)[:, None] * m64 + (1.0 - b1) * g64
        v64 = _powi(xp, b2, k)[:, None] * v64 + (1.0 - b2) * (g64 * g64)
        m[...] = m64
        v[...] = v64
        w[...] = w64 - lr * (m64 + catchup) / (xp.sqrt(v64) + self.eps)
        words[:, 0] = np.uint32(t & 0xFFFFFFFF)
        words[:, 1] = np.uint32(t >> 32)


def _steps_of(xp, words):
    """(n, 2) uint32 little-endian words -> (n,) int64 steps."""
    return ((words[:, 1].astype(xp.uint64) << xp.uint64(32)) |
            words[:, 0].astype(xp.uint64)).astype(xp.int64)


def _powi(xp, x: float, k):
    """x ** k (k: int64 array >= 0) by squaring, as optim.kernels._powi multiplies."""
    k = k.copy()
    result = xp.ones(k.shape, xp.float64)
    base = float(x)
    while host_sync.flag((k > 0).any(), "SmartDecayAdam: power loop"):
        odd = (k & 1) == 1
        result = xp.where(odd, result * base, result)
        base = base * base
        k >>= 1
    return result
