"""Parameters and the layer base class: explicit forward/backward, no autograd engine.

A layer's ``forward`` keeps what its ``backward`` needs; ``backward`` returns the input gradients
and accumulates (``+=``) the parameter gradients into ``Parameter.grad`` (DESIGN.md, decision 3).
Gradients accumulate until ``zero_grad()``, so several backward passes sum, as in PyTorch.
"""
from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod

import numpy as np

from ..backend import array_namespace
from ..errors import InputError


_mode = threading.local()


def keeps_activations() -> bool:
    """False inside ``inference()`` on this thread: a forward then keeps nothing for backward."""
    return not getattr(_mode, "inference", 0)


@contextlib.contextmanager
def inference():
    """Forwards on this thread keep no activations (no backward can follow): several threads
    can run one model's forward side by side, and nothing of a batch stays referenced."""
    _mode.inference = getattr(_mode, "inference", 0) + 1
    try:
        yield
    finally:
        _mode.inference -= 1


class Parameter:
    """A trainable array and its gradient.

    data: the weights (any shape, float32 or float64; numpy or cupy); grad: same shape and dtype,
    zeros until a backward adds to it; name: a dotted path such as ``"top_mlp.2.weight"``.
    """

    __slots__ = ("data", "grad", "name")

    def __init__(self, data, name: str = ""):
        xp = array_namespace(data)
        self.data = xp.ascontiguousarray(data)
        self.grad = xp.zeros_like(self.data)
        self.name = str(name)

    @property
    def shape(self):
        return self.data.shape

    def zero_grad(self) -> None:
        self.grad[...] = 0

    def to(self, xp) -> "Parameter":
        """Move data and grad to namespace ``xp`` (numpy or cupy) in place; returns self."""
        if xp is np:
            from ..backend import to_numpy

            self.data, self.grad = to_numpy(self.data), to_numpy(self.grad)
        else:
            self.data, self.grad = xp.asarray(self.data), xp.asarray(self.grad)
        return self

    def __repr__(self) -> str:
        return f"Parameter({self.name!r}, shape={tuple(self.data.shape)}, dtype={self.data.dtype})"


class Module(ABC):
    """Base of layers and models: parameter discovery, train/eval, zero_grad.

    Parameters are found in attribute order, recursing into sub-modules and lists of them;
    ``parameters()`` yields each once. Sub-classes implement ``forward`` and ``backward``.
    """

    training = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @abstractmethod
    def forward(self, *args, **kwargs):
        """Compute the output and keep what backward needs."""

    @abstractmethod
    def backward(self, *args, **kwargs):
        """Return input gradients and accumulate parameter gradients."""

    def _children(self):
        for value in vars(self).values():
            if isinstance(value, (Parameter, Module)):
                yield value
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, (Parameter, Module)):
                        yield item

    def parameters(self):
        """Every Parameter of this module and its sub-modules, each once, in a stable order."""
        seen = set()
        stack = [iter(self._children())]
        while stack:
            item = next(stack[-1], None)
            if item is None:
                stack.pop()
            elif isinstance(item, Parameter):
                if id(item) not in seen:
                    seen.add(id(item))
                    yield item
            else:
                stack.append(iter(item._children()))

    def named_parameters(self):
        """(name, Parameter) pairs; names come from ``Parameter.name``."""
        for p in self.parameters():
            yield p.name, p

    def modules(self):
        """This module and every sub-module, depth first."""
        yield self
        for child in self._children():
            if isinstance(child, Module):
                yield from child.modules()

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode: bool = True) -> "Module":
        """Training mode (dropout active) or, with ``mode=False``, evaluation mode."""
        for m in self.modules():
            m.training = bool(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def to(self, xp) -> "Module":
        """Move every parameter to namespace ``xp`` (numpy or cupy); build optimizers after."""
        for p in self.parameters():
            p.to(xp)
        return self

    def num_parameters(self) -> int:
        return int(sum(p.data.size for p in self.parameters()))

    #: integer attributes besides the parameters that a checkpoint keeps (e.g. a dropout's step
    #: counter, which seeds its next mask)
    state_fields: tuple = ()

    def named_modules(self, prefix: str = ""):
        """(dotted attribute path, module) for this module and every sub-module, depth first."""
        yield prefix, self
        for attr, value in vars(self).items():
            items = value if isinstance(value, (list, tuple)) else [value]
            for i, item in enumerate(items):
                if isinstance(item, Module) and item is not self:
                    path = attr if value is item else f"{attr}.{i}"
                    yield from item.named_modules(f"{prefix}.{path}" if prefix else path)

    def state_dict(self) -> dict:
        """PyTorch's convention: {name: value} of every parameter (a host numpy copy, named by
        ``Parameter.name``) and every ``state_fields`` entry (an int, named
        ``<module path>.<field>``). Enough to continue training bit-identically."""
        from ..backend import to_numpy

        state = {}
        for p in self.parameters():
            if p.name in state:
                raise InputError(f"two parameters are named {p.name!r}: give them distinct names")
            state[p.name] = np.array(to_numpy(p.data))
        for path, module in self.named_modules():
            for f in module.state_fields:
                state[f"{path}.{f}" if path else f] = int(getattr(module, f))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``: every entry must be present, with the same shapes."""
        want = self.state_dict()
        missing = sorted(set(want) - set(state))
        unexpected = sorted(set(state) - set(want))
        if missing or unexpected:
            raise InputError(f"state_dict does not fit this model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}: load a state saved by the same model")
        for p in self.parameters():
            value = np.asarray(state[p.name])
            if value.shape != p.data.shape:
                raise InputError(f"parameter {p.name!r} has shape {p.data.shape} but the "
                                 f"state_dict holds {value.shape}")
            xp = array_namespace(p.data)
            p.data[...] = xp.asarray(value.astype(p.data.dtype, copy=False))
        for path, module in self.named_modules():
            for f in module.state_fields:
                setattr(module, f, int(state[f"{path}.{f}" if path else f]))


def check_features(x, name: str, ndim: int, width: int | None = None, dtype=None, axis: int = -1):
    """Validate a layer input; raise InputError naming the offending shape or dtype."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != ndim:
        raise InputError(f"{name} must be a {ndim}-d array, got shape {shape}")
    if width is not None and shape[axis] != width:
        raise InputError(
            f"{name} has {shape[axis]} features on axis {axis} (shape {tuple(shape)}) but the layer "
            f"was built for {width}"
        )
    if dtype is not None and x.dtype != dtype:
        raise InputError(
            f"{name} has dtype {x.dtype} but the layer's parameters are {np.dtype(dtype)}: cast the "
            f"input (x.astype({np.dtype(dtype).name})) or build the layer with dtype={x.dtype}"
        )
