"""Dot feature interaction (DLRM), with OneFlow's options: self_interaction, output_concat,
output_padding, and the ``pooling="sum"`` variant.

Math (REFERENCE.md, "Fused operators"): with X (B, F, D) the stacked features and Z = X Xᵀ per
sample, an output row is ::

    [ output_concat (C) | Z[r, c] for (r, c) in (1,0), (2,0), (2,1), (3,0), ... | zeros (pad) ]

with c < r (c <= r when self_interaction). Width C + F(F-1)/2 + pad; DLRM pads 479 to 480.
``pooling="sum"`` instead returns 0.5 * ((Σ_f x_f)² - Σ_f x_f²): (B, D), the FM term per dimension.

On numpy arrays the compiled kernels of ``kernels.cpu_ops`` read a list of two feature arrays
in place (DLRM's [bottom output (B, D), embeddings (B, F, D)]): no (B, F + 1, D) concatenation
forward, and the backward writes each part's gradient into its own contiguous array.
"""
from __future__ import annotations

import numpy as np

from ..backend import array_namespace
from ..errors import ConfigError, InputError
from ..kernels import cpu_ops, ops_for
from . import amp
from .module import Module, check_features, keeps_activations

POOLINGS = ("none", "sum")


def num_pairs(num_features: int, self_interaction: bool = False) -> int:
    """Entries of Z kept per sample: F(F-1)/2, or F(F+1)/2 with self_interaction."""
    f = int(num_features)
    return f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2


def padding_to_multiple(width: int, multiple: int) -> int:
    """Zero columns that round ``width`` up to a multiple of ``multiple`` (479, 8 -> 1)."""
    if multiple <= 0:
        raise ConfigError(f"multiple={multiple} must be positive")
    return (-int(width)) % int(multiple)


class DotInteraction(Module):
    """features: (B, F, D) (or a list of (B, F_i, D) / (B, D) arrays, stacked along F),
    output_concat: (B, C) or None -> (B, C + P + output_padding); with pooling="sum": (B, D).

    No parameters; keeps the input dtype.
    """

    def __init__(self, self_interaction: bool = False, output_padding: int = 0, pooling: str = "none"):
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling={pooling!r} is not one of {POOLINGS}")
        if int(output_padding) != output_padding or output_padding < 0:
            raise ConfigError(f"output_padding={output_padding!r} must be an integer >= 0")
        if pooling == "sum" and output_padding:
            raise ConfigError("pooling='sum' returns (B, D): it takes no output_padding; use 0")
        self.self_interaction = bool(self_interaction)
        self.output_padding = int(output_padding)
        self.pooling = pooling
        self._x = None
        self._n_concat = 0
        self._split = None
        self._fused = None
        self.out_bits = None

    def output_width(self, num_features: int, concat_width: int = 0, dim: int | None = None) -> int:
        """Columns of the output for F features and a C-wide output_concat (D for pooling="sum")."""
        if self.pooling == "sum":
            return dim
        return concat_width + num_pairs(num_features, self.self_interaction) + self.output_padding

    def _stack(self, features, concatenate=True):
        """-> (B, F, D) features; with ``concatenate=False`` a list of (B, F_i, D) parts instead
        (2-d parts viewed as (B, 1, D)), for the kernels that read parts in place."""
        if not isinstance(features, (list, tuple)):
            check_features(features, "interaction features", 3)
            if keeps_activations():
                self._split = None
            return features
        if not features:
            raise InputError("interaction features: an empty list; pass at least one (B, F, D) array")
        parts = [f[:, None, :] if getattr(f, "ndim", 0) == 2 else f for f in features]
        for i, p in enumerate(parts):
            check_features(p, f"interaction features[{i}]", 3)
            if p.shape[0] != parts[0].shape[0] or p.shape[2] != parts[0].shape[2]:
                raise InputError(
                    f"interaction features[{i}] has shape {tuple(features[i].shape)}, which does not "
                    f"match batch {parts[0].shape[0]} and dim {parts[0].shape[2]} of features[0]"
                )
        if keeps_activations():
            self._split = [(p.shape[1], getattr(f, "ndim", 0) == 2)
                           for f, p in zip(features, parts)]
        if not concatenate:
            return parts
        return array_namespace(*parts).concatenate(parts, axis=1)

    def forward(self, features, output_concat=None, *, fp32_output: bool = True):
        """The interaction of ``features`` (class docstring). ``fp32_output=False``: on the CuPy
        fp16 / bf16 path the output is written only as its 16-bit patterns, kept as
        ``out_bits`` (B, width) uint16, and None is returned (the next layer's product reads
        nothing else: ``Linear.forward(None, x_bits=...)``); elsewhere it changes nothing."""
        self._fused = None
        self.out_bits = None
        if amp.active() and self.pooling == "none":
            listed = isinstance(features, (list, tuple))
            xp = array_namespace(*(features if listed else [features]))
            if xp is not np and (features[0] if listed else features).dtype == np.float32:
                return self._forward_fused(features, output_concat, fp32_output)
            # half precision (nn.amp): the features rounded as they enter the pairwise products,
            # and the products as they leave (fp16 / bf16; tf32 results stay fp32);
            # output_concat passes through unchanged
            features = ([amp.round_to(f) for f in features] if listed else amp.round_to(features))
            out = self._forward(features, output_concat)
            if amp.current() in amp.HALF_PRECISIONS:
                n = 0 if output_concat is None else output_concat.shape[1]
                out[:, n:] = amp.round_to(out[:, n:])
            return out
        return self._forward(features, output_concat)

    def _bits_only(self, fp32_output: bool) -> bool:
        return not fp32_output and amp.current() in amp.HALF_PRECISIONS

    def _kept_output(self, out, bits_only: bool):
        """The fused kernels' result as ``forward`` returns it (``fp32_output``)."""
        if not bits_only:
            return out
        self.out_bits = out
        return None

    def _forward_fused(self, features, output_concat, fp32_output=True):
        """The CuPy AMP path: one kernel (kernels/dense_ops.py) reads the parts in place, rounds
        the operands in registers, and writes concat | products | padding: the numerics of the
        numpy path above, without its rounding passes, batched GEMM and (B, F, F) buffer."""
        from ..kernels import dense_ops

        parts = self._stack(features, concatenate=False)
        parts = parts if isinstance(parts, list) else [parts]
        xp = array_namespace(*parts)
        first = xp.ascontiguousarray(parts[0])
        rest = (xp.ascontiguousarray(parts[1]) if len(parts) == 2 else
                xp.concatenate(parts[1:], axis=1) if len(parts) > 2 else
                xp.empty((first.shape[0], 0, first.shape[2]), dtype=first.dtype))
        if output_concat is not None:
            check_features(output_concat, "output_concat", 2, dtype=first.dtype)
            if output_concat.shape[0] != first.shape[0]:
                raise InputError(f"output_concat has batch {output_concat.shape[0]} but the "
                                 f"features have {first.shape[0]}")
            output_concat = xp.ascontiguousarray(output_concat)
        if keeps_activations():  # for backward (an inference forward keeps nothing)
            self._n_concat = 0 if output_concat is None else output_concat.shape[1]
            self._fused = ("split", [p.shape[1] for p in parts], first, rest)
            self._x = [first, rest]
        bits_only = self._bits_only(fp32_output)
        return self._kept_output(dense_ops.interaction_forward(
            first, rest, output_concat, self.self_interaction, self.output_padding, amp.current(),
            bits_only=bits_only), bits_only)

    def forward_packed(self, features, output_concat=None, *, fp32_output: bool = True):
        """The interaction of a ``kernels.layout_ops.InteractionInput`` (data (B, S, D): the
        model's own features at slots ``:first_slot``, the embeddings the gather wrote after),
        output_concat (B, C) or None -> (B, C + P + output_padding): ``forward`` on the values,
        bit for bit. ``backward`` then returns ([the gradient of slots :first_slot, as (B, D)
        when first_slot is 1, then of the embeddings (B, S - first_slot, D)], doutput_concat).

        CuPy under AMP: one kernel reads the buffer (16-bit under fp16 / bf16); CuPy fp32: the
        batched-GEMM path on the buffer itself (no concatenation); numpy: ``forward`` on the
        decoded values (the reference, and the CPU model of the dry run). ``fp32_output`` as in
        ``forward``."""
        self.out_bits = None
        if self.pooling != "none":
            raise ConfigError("forward_packed is the pairwise interaction: pooling='sum' takes "
                              "its features through forward")
        if features.precision != amp.current():
            raise InputError(f"the interaction input was cast for amp {features.precision!r} but "
                             f"{amp.current()!r} is in effect: build it under the same autocast")
        data, n_first = features.data, features.first_slot
        split = [(n_first, n_first == 1), (data.shape[1] - n_first, False)]
        xp = array_namespace(data)
        if xp is np or not amp.active():
            out = self.forward(features.values(), output_concat)
            if keeps_activations():
                self._split = split
            return out
        return self._forward_packed_fused(features, output_concat, split, fp32_output)

    def _forward_packed_fused(self, features, output_concat, split, fp32_output=True):
        from ..kernels import dense_ops

        data, n_first = features.data, features.first_slot
        xp = array_namespace(data)
        self._fused = None
        if output_concat is not None:
            check_features(output_concat, "output_concat", 2, dtype=np.float32)
            if output_concat.shape[0] != data.shape[0]:
                raise InputError(f"output_concat has batch {output_concat.shape[0]} but the "
                                 f"features have {data.shape[0]}")
            output_concat = xp.ascontiguousarray(output_concat)
        if keeps_activations():
            self._n_concat = 0 if output_concat is None else output_concat.shape[1]
            self._fused = ("packed", data, n_first)
            self._x = data
            self._split = split
        bits_only = self._bits_only(fp32_output)
        return self._kept_output(dense_ops.interaction_forward_packed(
            data, n_first, output_concat, self.self_interaction, self.output_padding,
            amp.current(), bits_only=bits_only), bits_only)

    def _backward_fused(self, dout):
        from ..kernels import dense_ops

        if self._fused[0] == "packed":
            _, data, n_first = self._fused
            dfirst, drest, dconcat = dense_ops.interaction_backward_packed(
                array_namespace(dout, data).ascontiguousarray(dout), data, n_first,
                self._n_concat, self.self_interaction, amp.current())
            self._x = self._fused = None
            return [g[:, 0] if was_2d else g
                    for g, (_, was_2d) in zip([dfirst, drest], self._split)], dconcat
        _, widths, first, rest = self._fused
        xp = array_namespace(dout, first)
        dfirst, drest, dconcat = dense_ops.interaction_backward(
            xp.ascontiguousarray(dout), first, rest, self._n_concat, self.self_interaction,
            amp.current())
        grads, start = [dfirst], 0
        for width in widths[1:]:
            grads.append(drest if len(widths) == 2 else drest[:, start:start + width])
            start += width
        self._x = self._fused = None
        if self._split is None:
            return grads[0], dconcat
        return [g[:, 0] if was_2d else g for g, (_, was_2d) in zip(grads, self._split)], dconcat

    def _forward(self, features, output_concat):
        listed = isinstance(features, (list, tuple))
        xp = array_namespace(*(features if listed else [features]), output_concat)
        # on numpy the compiled kernels read a list's parts in place; CuPy and pooling="sum" stack them
        fused = xp is np and self.pooling == "none"
        x = self._stack(features, concatenate=not fused)
        if self.pooling == "sum":
            if output_concat is not None:
                raise ConfigError("pooling='sum' takes no output_concat")
            if keeps_activations():
                self._x = x
            s = x.sum(axis=1)
            return 0.5 * (s * s - (x * x).sum(axis=1))
        parts = x if isinstance(x, list) else [x]
        batch = parts[0].shape[0]
        if output_concat is not None:
            # the dtype the stacked features have (dtypes, not arrays: result_type must not touch cupy data)
            dtype = np.result_type(*(p.dtype for p in parts))
            check_features(output_concat, "output_concat", 2, dtype=dtype)
            if output_concat.shape[0] != batch:
                raise InputError(
                    f"output_concat has batch {output_concat.shape[0]} but the features have {batch}"
                )
        if keeps_activations():
            self._x = x
            self._n_concat = 0 if output_concat is None else output_concat.shape[1]
        if fused:
            return cpu_ops.dot_interaction_forward(x, output_concat, self.self_interaction,
                                                   self.output_padding)
        return ops_for(xp).dot_interaction_forward(
            xp.ascontiguousarray(x), output_concat, self.self_interaction, self.output_padding
        )

    def backward(self, dout):
        """dout: the output's gradient -> (dfeatures, doutput_concat or None); dfeatures has the
        structure of the forward's ``features`` (an array, or a list with the same shapes)."""
        x = self._x
        if x is None:
            raise InputError("DotInteraction.backward() without a forward(): run forward first")
        if getattr(self, "_fused", None) is not None:
            return self._backward_fused(dout)
        parts = x if isinstance(x, list) else [x]
        xp = array_namespace(dout, *parts)
        if self.pooling == "sum":
            # d/dx_f of 0.5((Σx)² - Σx²) = Σx - x_f
            dx = (x.sum(axis=1, keepdims=True) - x) * dout[:, None, :]
            dconcat = None
        else:
            f = sum(p.shape[1] for p in parts)
            width = self._n_concat + num_pairs(f, self.self_interaction) + self.output_padding
            want = parts[0].shape[0], width
            if tuple(dout.shape) != want:
                raise InputError(f"interaction output gradient has shape {tuple(dout.shape)}, expected {want}")
            ops = cpu_ops if xp is np else ops_for(xp)
            if amp.active():  # the gradient of the products enters in half precision
                dout = xp.concatenate([dout[:, :self._n_concat],
                                       amp.round_to(dout[:, self._n_concat:])], axis=1)
            dx, dconcat = ops.dot_interaction_backward(
                xp.ascontiguousarray(dout), x, self._n_concat, self.self_interaction
            )
            if amp.current() in amp.HALF_PRECISIONS:  # ... and leaves it so (fp16 / bf16)
                dx = [amp.round_to(g) for g in dx] if isinstance(dx, list) else amp.round_to(dx)
        self._x = None
        if self._split is None:
            return dx, dconcat
        if isinstance(dx, list):  # one gradient per part already (cpu_ops)
            return [g[:, 0] if was_2d else g for g, (_, was_2d) in zip(dx, self._split)], dconcat
        grads, start = [], 0
        for width, was_2d in self._split:
            g = dx[:, start:start + width]
            grads.append(g[:, 0] if was_2d else g)
            start += width
        return grads, dconcat
