"""Every dense parameter of a parameter group updated by one kernel launch (the device path).

The array expressions of a row optimizer's ``_vectorized`` update are one CuPy kernel each
(casts to float64, the rule's terms, the cast back), and the device path's ``masked_update`` adds
a reduction, a negation, a copy of the weight and of each state and a select per parameter so
that an all-zero gradient leaves the parameter alone: for DLRM's 16 dense parameters 144 launches
a step under SGD, 288 under Adagrad, 448 under Adam (``python -m benchmarks.dense_update_ops``
counts them), each a few microseconds of GPU and more of host time (the CUDA graph captures the
dense step, not the update).

``FlatDense`` lays the group's weights, each optimizer state and the gradients end to end in
flat device buffers and makes every ``Parameter.data``, ``Parameter.grad`` and state array a
view into them. A step is then three launches whatever the number of parameters:

- ``nonzero.fill(0)`` and ``optim_dense_nonzero``: a flag per parameter, set where its gradient
  holds a non-zero element (NaN counts, -0.0 does not: ``numpy.any``'s rule);
- ``optim_dense_<rule>`` (``cuda/optim.cu``): the row optimizer kernels' rule over the flat line
  (n = 1 line, dim = the flat length), skipping the parameters whose flag is 0 and the padding,
  16 bytes per thread where the flat length allows.

The same bits as ``optimizer.update`` on numpy (the compiled CPU kernels of ``optim.kernels``)
for every parameter, and as ``optimizer.masked_update``'s semantics: a parameter whose gradient is
all zero keeps its weight and states, bit for bit. Each parameter starts on a 256-byte boundary
(``ALIGN`` floats), as a fresh CuPy allocation does, so the matrix products read the views as
they read their own arrays. ``zero_grad`` is one fill of the flat gradient.

Who else holds the arrays: the model reads ``Parameter.data`` / ``.grad`` through the parameter at
each use, and a checkpoint load writes into them in place; a caller that rebinds one
(``Parameter.to``, an assignment) leaves the buffers behind: ``intact()`` is then False and the
optimizer lays them out again (a copy of each), or leaves the group to the per-parameter path
when the arrays no longer qualify (``eligible``).
"""
from __future__ import annotations

import numpy as np

from . import device_ops
from .device_ops import Launcher

#: floats between the starts of two parameters' places: 256 bytes, CuPy's allocation alignment
ALIGN = 64
#: the kernels index the flat line with an int (line_size, dim)
MAX_FLAT = (1 << 31) - 1


def supported(optimizer) -> bool:
    """Whether ``optim_dense_<rule>`` exists for this row optimizer: SGD (with or without
    momentum), Adagrad, Adam and Ftrl; not SmartDecayAdam, whose rule reads a per-row step that
    a dense parameter does not have."""
    from ..optim import SGD, Adagrad, Adam, Ftrl

    return isinstance(optimizer, (SGD, Adagrad, Adam, Ftrl)) and not optimizer.row_columns


def eligible(launch: Launcher, params, n_states: int) -> bool:
    """Whether ``params`` (``nn.Parameter``) can share one ``FlatDense``: every weight and
    gradient a float32 array of ``launch.xp`` with the same shape, no two of them sharing memory
    (tied weights stay tied on the per-parameter path), and the flat line short enough for the
    kernels' int indices."""
    xp = launch.xp
    total = 0
    for p in params:
        for a in (p.data, p.grad):
            if a is None or not isinstance(a, xp.ndarray) or a.dtype != np.float32 \
                    or a.shape != p.data.shape:
                return False
        total = _aligned(total) + p.data.size
    # parameters that share memory (tied weights) would be untied by copies of their own
    spans = sorted((address, address + a.nbytes) for p in params for a in (p.data, p.grad)
                   for address in (device_ops.array_address(a),))
    if any(start < end for (_, end), (start, _) in zip(spans, spans[1:])):
        return False
    return bool(params) and (1 + n_states) * _aligned(total) <= MAX_FLAT


def _aligned(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


class FlatDense:
    """The dense parameters of one group in flat buffers (see the module docstring).

    params: the group's ``nn.Parameter`` list (eligible); states: per parameter, the optimizer's
    list of its ``n_states`` state arrays (shaped like it), whose items are replaced by views
    here (the lists are kept: ``intact`` reads them); launch: where the kernels run. Attributes: ``lines`` (1, (1 + n_states) * total)
    float32, ``grads`` (total,) float32, ``starts`` / ``sizes`` (count,) int64 device arrays,
    ``nonzero`` (count,) int32, the per-parameter flags of the last ``find_nonzero``."""

    def __init__(self, params, states, n_states: int, launch: Launcher):
        xp = launch.xp
        self.launch, self.n_states = launch, int(n_states)
        self.params = list(params)
        starts, total = [], 0
        for p in self.params:
            start = _aligned(total)
            starts.append(start)
            total = start + p.data.size
        self.total = _aligned(total)   # a multiple of 4: the 16-byte path's groups
        sizes = [p.data.size for p in self.params]
        self.lines = xp.zeros((1, (1 + self.n_states) * self.total), dtype=xp.float32)
        self.grads = xp.zeros(self.total, dtype=xp.float32)
        self.starts = xp.asarray(np.asarray(starts, dtype=np.int64))
        self.sizes = xp.asarray(np.asarray(sizes, dtype=np.int64))
        self.nonzero = xp.zeros(len(self.params), dtype=xp.int32)
        flat = self.lines.reshape(-1)
        for p, own, start in zip(self.params, states, starts):
            shape, size = p.data.shape, p.data.size
            place = flat[start:start + size].reshape(shape)
            place[...] = p.data
            p.data = place
            grad = self.grads[start:start + size].reshape(shape)
            grad[...] = p.grad
            p.grad = grad
            for k in range(self.n_states):
                block = (k + 1) * self.total + start
                view = flat[block:block + size].reshape(shape)
                view[...] = own[k]
                own[k] = view
        self._state_lists = list(states)
        self._views = [(p.data, p.grad, tuple(own)) for p, own in zip(self.params, states)]

    def intact(self) -> bool:
        """True while every parameter's data and grad, and every array in the optimizer's state
        lists given to the constructor, are still this object's views."""
        return all(p.data is data and p.grad is grad and len(own) == len(views)
                   and all(a is b for a, b in zip(own, views))
                   for p, own, (data, grad, views) in zip(self.params, self._state_lists,
                                                            self._views))

    def find_nonzero(self) -> None:
        """``nonzero[j]`` = 1 where parameter j's gradient holds a non-zero element, else 0
        (two launches, no host read)."""
        self.nonzero.fill(0)
        device_ops.launch_threads(self.launch, "optim", "dense_nonzero", np.float32, self.total,
                                  (self.grads, np.int64(self.total), self.starts, self.sizes,
                                   np.int32(len(self.params)), self.nonzero))

    def any_nonzero(self):
        """0-d device bool: some parameter's gradient is not all zero (after ``find_nonzero``)."""
        return self.nonzero.any()

    def update(self, optimizer, step: int) -> None:
        """One step of ``optimizer`` (the group's, bound to its lr and factor) on every parameter
        whose flag ``find_nonzero`` set: what ``optimizer.update(p.data, states, p.grad, step)``
        computes on numpy, bit for bit, in one launch."""
        device_ops.run_update(optimizer, self.lines, (1, self.total), step, self.launch, "dense_",
                              (self.grads, self.starts, self.sizes, self.nonzero,
                               np.int32(len(self.params))), None, (self.grads,))

    def zero_grad(self) -> None:
        """Every parameter's gradient (and the padding) to 0: one fill."""
        self.grads.fill(0)
