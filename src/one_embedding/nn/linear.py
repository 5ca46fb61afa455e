"""Linear layers with fused bias + ReLU, dropout, and the MLP built from them.

Each Linear computes ``y = act(x Wᵀ + b)``: a float BLAS matmul, then one fused kernel adds the
bias and applies the ReLU in place and keeps the ReLU mask for backward. Under fp16 / bf16 on
CuPy the forward's epilogue also writes the output's 16-bit copy for the next layer's product (in
an MLP, a hidden output only that product reads is written as the copy alone), and the backward
writes the bias + ReLU gradient only as the 16-bit pattern its two products read.

On numpy arrays the matmuls read W and the saved input in place (``x @ Wᵀ``, ``dhᵀ @ x`` and
``dh @ W`` are sgemm calls with transpose flags, never copies), and the bias + ReLU passes are
the compiled kernels of ``kernels.cpu_ops``: one pass forward, one pass backward (mask and bias
gradient together). A layer with one output (a logit) runs as matrix-vector products and its
input gradient as the outer product dh ⊗ w, where a k = 1 sgemm would run at ~1 GFLOP/s.
"""
from __future__ import annotations

import numbers

import numpy as np

from ..backend import array_namespace
from ..errors import ConfigError, InputError
from ..kernels import cpu_ops, ops_for
from . import amp
from .init import linear_weights, make_rng
from .module import Module, Parameter, check_features, keeps_activations


#: under fp16 / bf16 on CuPy, Linear's backward writes dh only as the 16-bit pattern its two
#: products read (``dense_ops.bias_act_backward_cast``, one pass); False: bias_act_backward
#: writes dh in fp32 and each product casts it (the path before; the same bits)
FUSED_BACKWARD_CAST = True
#: under fp16 / bf16 on CuPy, an MLP's hidden output that only the next layer's products read is
#: written only as its 16-bit copy (``MLP._output_in_fp32``); False: also in fp32 (the path
#: before; the same bits)
HIDDEN_OUTPUTS_AS_BITS = True


def _positive_int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    return int(value)


class Linear(Module):
    """``y = relu(x Wᵀ + b)`` (``relu=True``) or ``x Wᵀ + b``.

    x: (B, in_features) -> y: (B, out_features), both in ``dtype`` (float32 or float64).
    W: (out_features, in_features), b: (out_features,), initialized by ``init`` (see ``nn.init``).
    """

    def __init__(self, in_features: int, out_features: int, *, relu: bool = False, init: str = "dlrm",
                 seed=0, dtype=np.float32, name: str = "linear"):
        self.in_features = _positive_int("in_features", in_features)
        self.out_features = _positive_int("out_features", out_features)
        self.relu = bool(relu)
        self.dtype = _check_dtype(dtype)
        w, b = linear_weights(make_rng(seed), self.in_features, self.out_features, init, self.dtype)
        self.weight = Parameter(w, f"{name}.weight")
        self.bias = Parameter(b, f"{name}.bias")
        self._x = self._mask = self._x_bits = self.out_bits = None

    def forward(self, x, x_bits=None, *, fp32_output: bool = True):
        """x: (B, in_features) -> (B, out_features).

        Under AMP the product takes x and W rounded to the precision and keeps its fp32
        accumulator (``amp.matmul(..., fp32_result=True)``), and bias + ReLU run in fp32. On
        CuPy with fp16 / bf16 the GEMM's epilogue is one pass (``dense_ops.bias_act_cast_forward``)
        that also writes y's 16-bit copy, kept as ``out_bits`` for the next layer's GEMM
        (``x_bits``: this layer's input as such bits, from the layer before; then x is not cast
        again, neither here nor for the weight gradient).

        A hidden layer whose output only the next layer's products read (``MLP``) needs no fp32
        copy of it: on that path ``fp32_output=False`` writes the output only as ``out_bits``
        and returns None, and the next layer takes ``x=None`` with those ``x_bits`` (B,
        in_features) uint16. Elsewhere (numpy, fp32, tf32) y is returned as always."""
        w = self.weight.data
        if x is None:
            if not self._takes_bits(x_bits, w):
                raise InputError("Linear.forward(x=None) needs x_bits, the (B, in_features) "
                                 "uint16 output of a layer before it under fp16 / bf16 on CuPy "
                                 f"(amp {amp.current()!r}, x_bits "
                                 f"{getattr(x_bits, 'shape', None)} {getattr(x_bits, 'dtype', '')})")
            check_features(x_bits, "Linear input bits", 2, self.in_features, np.uint16)
            xp = array_namespace(x_bits, w)
        else:
            check_features(x, "Linear input", 2, self.in_features, w.dtype)
            xp = array_namespace(x, w)
        self.out_bits = None
        if x is None or (amp.active() and xp is not np and amp.current() in amp.HALF_PRECISIONS
                         and x.dtype == np.float32):
            from ..kernels import dense_ops

            # a uint16 operand is its own 16-bit pattern (kernels.gemm)
            h = amp.matmul(x_bits if x is None else x, w.T, fp32_result=True, a_bits=x_bits)
            y, mask, self.out_bits = dense_ops.bias_act_cast_forward(
                h, self.bias.data, self.relu, amp.current(), write_y=fp32_output)
        elif amp.active():  # the product on tensor cores (nn.amp), bias + ReLU in fp32
            ops = cpu_ops if xp is np else ops_for(xp)
            y, mask = ops.bias_act_forward(amp.matmul(x, w.T, fp32_result=True),
                                           self.bias.data, self.relu)
        elif xp is np:
            # a single output: one matrix-vector product, (B,) viewed as (B, 1)
            h = (x @ w[0])[:, None] if self.out_features == 1 else x @ w.T
            y, mask = cpu_ops.bias_act_forward(h, self.bias.data, self.relu)
        else:  # cuBLAS through kernels.gemm (amp.matmul): a CUDA graph can capture it
            y, mask = ops_for(xp).bias_act_forward(amp.matmul(x, w.T), self.bias.data, self.relu)
        if keeps_activations():  # for backward (an inference forward keeps nothing: nn.inference)
            self._x, self._mask, self._x_bits = x, mask, x_bits
        return y

    @staticmethod
    def _takes_bits(x_bits, w) -> bool:
        """Whether a forward may take its input as 16-bit patterns alone: fp16 / bf16 on CuPy."""
        return (x_bits is not None and amp.active() and amp.current() in amp.HALF_PRECISIONS
                and w.dtype == np.float32 and array_namespace(x_bits, w) is not np)

    def _input(self):
        """The saved input as a product's operand: x, or its 16-bit patterns where the layer
        below wrote no fp32 copy (``forward(fp32_output=False)``)."""
        return self._x if self._x is not None else self._x_bits

    def _input_fp32(self):
        """The saved input in fp32 (decoded from its 16-bit patterns where it exists only as
        them: exact, they are its rounded values), for the one-pass last-layer kernels."""
        if self._x is not None:
            return self._x
        return amp.from_bits(self._x_bits)

    def fuses_backward_cast(self, dy) -> bool:
        """Whether ``backward(dy)`` takes the one-pass path of fp16 / bf16 on CuPy
        (``dense_ops.bias_act_backward_cast``), which can also round ``dy`` as it reads it."""
        return (FUSED_BACKWARD_CAST and amp.active() and amp.current() in amp.HALF_PRECISIONS
                and dy.dtype == np.float32 and array_namespace(dy) is not np
                and not (self.out_features == 1 and not self.relu))

    def backward(self, dy, *, dy_rounded: bool = True, round_dx: bool = True):
        """dy: (B, out_features) -> dx (B, in_features); adds to weight.grad and bias.grad.

        Under fp16 / bf16 the input gradient dx leaves rounded to the half type (nn.amp). Two
        keywords let a stack of layers skip that rounding pass where the layer below rounds as it
        reads (``MLP.backward``): ``round_dx=False`` returns dx unrounded when this layer takes
        the one-pass path (``fuses_backward_cast``); ``dy_rounded=False`` says dy is such an
        unrounded dx, rounded here first (as it is read on the one-pass path). Either way the
        results are the bits of the rounded chain."""
        if self._x is None and self._x_bits is None:
            raise InputError("Linear.backward() without a forward(): run forward first")
        check_features(dy, "Linear output gradient", 2, self.out_features, self.weight.data.dtype)
        w, x = self.weight.data, self._input()
        xp = array_namespace(dy, w)
        fused_cast = self.fuses_backward_cast(dy)
        if not dy_rounded and not fused_cast and amp.current() in amp.HALF_PRECISIONS:
            dy = amp.round_to(dy)
        if amp.active() and xp is not np and self.out_features == 1 and not self.relu \
                and dy.dtype == np.float32:
            return self._backward_last_fused(dy)
        if fused_cast:
            # dh exists only as the fp16 / bf16 pattern both products read: one pass
            from ..kernels import dense_ops

            dh_bits, db = dense_ops.bias_act_backward_cast(
                xp.ascontiguousarray(dy), self._mask, amp.current(), round_input=not dy_rounded)
            self.weight.grad += amp.matmul(dh_bits.T, x, fp32_result=True, b_bits=self._x_bits)
            dx = amp.matmul(dh_bits, w, fp32_result=not round_dx)
        elif amp.active():  # both products on tensor cores; the weight gradient keeps an fp32
            # result (a sum over the batch: in fp16 it overflowed under the loss scale, nn.amp)
            dh, db = (cpu_ops if xp is np else ops_for(xp)).bias_act_backward(dy, self._mask)
            self.weight.grad += amp.matmul(dh.T, x, fp32_result=True, b_bits=self._x_bits)
            dx = amp.matmul(dh, w)
        elif xp is np:
            dh, db = cpu_ops.bias_act_backward(dy, self._mask)
            if self.out_features == 1:
                self.weight.grad[0] += dh[:, 0] @ x                  # (in,): xᵀ dh as one gemv
                dx = dh * w                                          # (B, 1) * (1, in): outer product
            else:
                self.weight.grad += dh.T @ x
                dx = dh @ w
        else:
            dh, db = ops_for(xp).bias_act_backward(dy, self._mask)
            self.weight.grad += amp.matmul(dh.T, x)
            dx = amp.matmul(dh, w)
        self.bias.grad += db
        self._x = self._mask = self._x_bits = None
        return dx


    def _backward_last_fused(self, dy):
        """A one-output layer's backward under AMP on CuPy as one kernel
        (``dense_ops.last_layer_backward``): dx = dy ⊗ w, the weight gradient's column sums and
        the bias gradient in one pass, rounded as the general path rounds them (a k = 1 GEMM, a
        skinny GEMM and a column reduction before)."""
        from ..kernels import dense_ops

        xp = array_namespace(dy)
        dx, dw, db = dense_ops.last_layer_backward(
            xp.ascontiguousarray(dy.reshape(-1)), xp.ascontiguousarray(self._input_fp32()),
            xp.ascontiguousarray(self.weight.data[0]), amp.current())
        self.weight.grad[0] += dw
        self.bias.grad += db
        self._x = self._mask = self._x_bits = None
        return dx

    @property
    def is_logit_layer(self) -> bool:
        """One output and no ReLU: a layer whose output is (a term of) the logit, whose backward
        ``loss_and_backward`` fuses with the loss."""
        return self.out_features == 1 and not self.relu

    def loss_and_backward(self, logits, labels, scale: float = 1.0, launch=None):
        """The mean BCE-with-logits loss fused with this one-output layer's backward, one kernel
        (``kernels.dense_ops.bce_last_layer``) in place of ``BCEWithLogits`` forward + backward
        and ``backward`` (three launches under AMP, five in fp32: the loss, its gradient, the
        bias gradient and two products). For the device path: CuPy arrays, or on the GPU
        dry run the emulator as the CuPy launcher (``launch`` None: the current device's).

        logits: (B,) the model's logits after this layer's ``forward`` (its output, or a sum it
        is a term of: the gradient of a sum's term is the sum's); labels: (B,) in [0, 1] (cast
        to the logits' dtype; a bad label raises through ``host_sync.check``, deferred on the
        device); scale: the factor of the gradient (a rank's share of the global mean times the
        loss scale) -> (loss: 0-d float64 array, the unscaled mean, on the device;
        dlogits (B,) = scale * (sigmoid(logits) - labels) / B; dx (B, in_features)). Adds to
        weight.grad and bias.grad; dtypes those of the logits (float32, or float64).

        Rounding as ``backward``'s under ``nn.amp`` (dlogits and w rounded to the precision for
        dx, which leaves half-typed under fp16 / bf16; dlogits and x rounded for the fp32 sum of
        dw). The sums over the batch (dw, db, the loss) are the kernel's blocked sums, so the
        result equals the unfused path within float32 rounding of those sums, not bit for bit."""
        from ..kernels import dense_ops
        from .loss import checked_labels

        if not self.is_logit_layer:
            raise InputError(f"{self.weight.name[:-len('.weight')] or 'Linear'}: the loss fuses "
                             f"only with a one-output layer without ReLU (this one has "
                             f"{self.out_features} outputs, relu={self.relu})")
        if self._x is None and self._x_bits is None:
            raise InputError("Linear.loss_and_backward() without a forward(): run forward first")
        logits, labels = checked_labels(logits, labels)
        x = self._input_fp32()
        xp = array_namespace(x)
        x = xp.ascontiguousarray(x)
        loss, dlogits, dx, dw, db = dense_ops.bce_last_layer(
            xp.ascontiguousarray(logits), xp.ascontiguousarray(labels), x,
            xp.ascontiguousarray(self.weight.data[0]), scale, amp.current(), launch=launch)
        self.weight.grad[0] += dw
        self.bias.grad += db
        self._x = self._mask = self._x_bits = None
        return loss, dlogits, dx


class Dropout(Module):
    """Inverted dropout with counter-based randomness: identical masks on numpy and CUDA.

    Keeps an element where u > rate (u from ``kernels.reference.dropout_uniform(seed, step)``) and
    scales it by 1 / (1 - rate). ``step`` counts this layer's training forwards, so a run replays
    bit-identically from the seed. Identity in eval mode or with rate 0.
    """

    #: the next mask depends on it, so a checkpoint keeps it
    state_fields = ("step",)

    def __init__(self, rate: float, seed: int = 0):
        rate = float(rate)
        if not 0.0 <= rate < 1.0:
            raise ConfigError(f"dropout rate={rate} must be in [0, 1)")
        self.rate, self.seed, self.step = rate, int(seed), 0
        self._keep = None

    def forward(self, x):
        """x: (B, N) -> (B, N)."""
        if not self.training or self.rate == 0.0:
            self._keep = None
            return x
        ops = ops_for(array_namespace(x))
        y, self._keep = ops.dropout_forward(x, self.rate, self.seed, self.step)
        self.step += 1
        return y

    def backward(self, dy):
        if self._keep is None:
            return dy
        dx = ops_for(array_namespace(dy)).dropout_backward(dy, self._keep, self.rate)
        self._keep = None
        return dx


class MLP(Module):
    """A stack of Linear layers with fused bias + ReLU, optional dropout after each hidden layer.

    ``sizes`` are the output widths: ``MLP(13, [512, 256, 128])`` maps (B, 13) -> (B, 128).
    Every layer has a ReLU except the last one when ``last_relu=False`` (a logit layer). Dropout
    (``dropout > 0``) follows every ReLU layer, so a logit layer's output is never dropped.
    """

    def __init__(self, in_features: int, sizes, *, last_relu: bool = True, dropout: float = 0.0,
                 init: str = "dlrm", seed=0, dtype=np.float32, name: str = "mlp"):
        sizes = list(sizes)
        if not sizes:
            raise ConfigError(f"{name}: an MLP needs at least one layer size, got {sizes}")
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) \
                or not 0.0 <= float(dropout) < 1.0:
            raise ConfigError(f"{name}: dropout={dropout!r} must be a number in [0, 1)")
        self.in_features = _positive_int("in_features", in_features)
        self.sizes = tuple(_positive_int(f"{name} layer size", s) for s in sizes)
        self.out_features = self.sizes[-1]
        seq = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        child_seeds = seq.spawn(len(sizes))
        widths = (self.in_features,) + self.sizes
        self.layers = [
            Linear(widths[i], widths[i + 1], relu=(i < len(sizes) - 1 or last_relu), init=init,
                   seed=child_seeds[i], dtype=dtype, name=f"{name}.{i}")
            for i in range(len(sizes))
        ]
        # a distinct dropout stream per layer, derived from the model's seed
        base = int(seq.generate_state(1, np.uint32)[0])
        self.dropouts = [Dropout(dropout, seed=(base << 8) + i) if dropout > 0 and layer.relu else None
                         for i, layer in enumerate(self.layers)]
        self.dropout = float(dropout)

    @property
    def dtype(self):
        return self.layers[0].dtype

    def _children(self):
        yield from self.layers
        yield from (d for d in self.dropouts if d is not None)

    def forward(self, x, x_bits=None):
        """x: (B, in_features) -> (B, sizes[-1]); ``x_bits``: x's fp16 / bf16 patterns when the
        layer before wrote them (then x may be None: ``Linear.forward``).

        Under fp16 / bf16 on CuPy a hidden layer's output that goes straight (no dropout) into
        a layer with several outputs exists only as the 16-bit copy that layer's products read
        (``Linear.forward(fp32_output=False)``): no fp32 write, no fp32 array kept for the
        backward. The input of a logit layer stays fp32 (its one-pass backward reads it)."""
        bits = x_bits
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, x_bits=bits, fp32_output=self._output_in_fp32(i))
            bits, layer.out_bits = getattr(layer, "out_bits", None), None  # the next layer's now
            if self.dropouts[i] is not None:
                bits = None  # dropout changes x: the next layer casts it itself
                x = self.dropouts[i].forward(x)
        return x

    def takes_input_bits(self) -> bool:
        """Whether the layer before may hand this MLP its output as 16-bit patterns alone
        (``forward(None, x_bits)``): its first layer is no logit layer (``_output_in_fp32``)."""
        return HIDDEN_OUTPUTS_AS_BITS and not self.layers[0].is_logit_layer

    def _output_in_fp32(self, i: int) -> bool:
        """Whether layer i's output is needed in fp32, not only as its 16-bit copy: the MLP's
        output, a dropout's input, or a logit layer's input."""
        return (not HIDDEN_OUTPUTS_AS_BITS or i == len(self.layers) - 1
                or self.dropouts[i] is not None or self.layers[i + 1].is_logit_layer)

    def backward(self, dy):
        """dy: (B, sizes[-1]) -> dx (B, in_features)."""
        return self._backward_below(len(self.layers), dy)

    def _backward_below(self, top: int, dy):
        """The backward of layers top-1 .. 0 from dy, the gradient of layer top-1's output
        (after its dropout). Under fp16 / bf16 on CuPy a layer whose input gradient goes
        straight (no dropout) into another layer's one-pass backward leaves it unrounded, and
        that layer rounds it as it reads it: one pass over the gradient fewer, the same bits."""
        rounded = True
        for i in reversed(range(top)):
            if self.dropouts[i] is not None:
                dy = self.dropouts[i].backward(dy)
            layer = self.layers[i]
            handoff = (i > 0 and self.dropouts[i - 1] is None and layer.fuses_backward_cast(dy)
                       and self.layers[i - 1].fuses_backward_cast(dy))
            dy = layer.backward(dy, dy_rounded=rounded, round_dx=not handoff)
            rounded = not handoff
        return dy

    def loss_and_backward(self, logits, labels, scale: float = 1.0, launch=None):
        """The mean BCE loss fused with the last layer's backward (``Linear.loss_and_backward``),
        then the other layers' backward: logits (B,), labels (B,) -> (loss 0-d float64 array,
        dlogits (B,), dx (B, in_features)). The last layer must be a logit layer (one output,
        ``last_relu=False``: no dropout follows it)."""
        last = self.layers[-1]
        loss, dlogits, dy = last.loss_and_backward(logits, labels, scale, launch=launch)
        return loss, dlogits, self._backward_below(len(self.layers) - 1, dy)


def _check_dtype(dtype):
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise ConfigError(f"dtype={dt} is not supported: use np.float32 (or np.float64 for gradient checks)")
    return dt
