"""``one_embedding.Optimizer``: one row optimizer applied to embeddings and dense parameters.

::

    opt = one_embedding.Optimizer(one_embedding.optim.Adagrad(lr=0.1), embeddings=[emb],
                                  parameters=model.parameters())
    loss.backward-equivalent ...; opt.step(); opt.zero_grad()

``step()`` advances the global step t (Adam's bias correction, Adagrad's lr_decay), updates every
embedding row that received a gradient through ``emb.backward`` since the last step and every
dense parameter from its ``.grad`` with state kept here, then writes the lines back into the
store. A step with no gradient at all (no embedding backward, every dense grad zero) changes
nothing and does not advance t. The embedding rows are computed first and checked: an update that
would make a row non-finite raises ``InputError`` before anything (rows, dense weights, t) changes.

Ranks: dense parameters are data parallel. With several ranks, ``step()`` first sums every dense
gradient over the ranks (one all-reduce of all of them), so each rank applies the same update;
compute each rank's loss gradient as its share of the global batch's mean (divide by the global
batch size, not the rank's). Embedding rows need nothing: the gradient shuffle sums them on the
key's owner.

Parameter groups (``optim.groups``): the row optimizer built on OneFlow's list of dicts updates
each group's dense parameters and embeddings with the group's ``lr`` and ``weight_decay``, after
clipping the group's gradients (dense and the step's embedding rows together, summed over the
ranks) when it sets ``clip_grad_max_norm``, as OneFlow's graph does. An embedding given here and
named by no group belongs to the only group.

``step(closure=None)`` follows PyTorch: a closure, when given, is called first (it recomputes the
loss and the gradients) and its value is returned. Mixed precision: ``loss_scale=`` a number (a
static scale) or a ``one_embedding.optim.LossScaler`` (dynamic). The gradients then carry the scale;
the step multiplies every gradient by ``1/scale`` inside the update, and a step in which any
gradient is inf/nan (a dense ``.grad``, or an embedding gradient that ``scaler.backward`` refused)
changes nothing, discards the gradients (``zero_grad``), does not advance t, and lets the scaler
back off (``skipped`` is then True). With several ranks the decision is taken jointly.
"""
from __future__ import annotations

import numpy as np

from .backend import array_namespace
from .errors import ConfigError, InputError
from .optim.groups import clip_coefficient
from .optim.loss_scale import LossScaler, all_finite
from .parallel.comm import Communicator, default_comm
from . import host_sync


class Optimizer:
    """OneFlow's ``one_embedding.Optimizer(optimizer, embeddings)``: applies ``optimizer`` (a row
    optimizer: SGD, Adagrad, Adam, Ftrl) to the rows of ``embeddings`` and to the dense
    ``parameters`` (or to the ``params`` the row optimizer was built with, OneFlow's form).
    comm: the communicator of the dense all-reduce (default: the first embedding's);
    loss_scale: None, a number (static) or a ``LossScaler`` (see the module docstring)."""

    def __init__(self, optimizer, embeddings=(), parameters=(), comm: Communicator | None = None,
                 loss_scale=None):
        for attr in ("update", "initial_state", "n_states", "required_size_factor",
                     "param_groups", "for_group"):
            if not hasattr(optimizer, attr):
                raise ConfigError(
                    f"optimizer={optimizer!r} is not a row optimizer: use one of "
                    "one_embedding.optim.SGD, Adagrad, Adam, Ftrl"
                )
        self.optimizer = optimizer
        groups = optimizer.param_groups
        self.parameters = list(parameters)
        given = optimizer.params
        if given and self.parameters:
            raise ConfigError("the dense parameters are given twice, to the row optimizer "
                              "(its params) and to Optimizer(parameters=...): pass them once")
        if self.parameters:
            if len(groups) > 1:
                raise ConfigError("Optimizer(parameters=...) with a row optimizer of "
                                  f"{len(groups)} parameter groups: put the parameters into "
                                  "the groups' 'params'")
            groups[0].parameters = list(self.parameters)  # the row optimizer had none
            groups[0].params = groups[0].params + list(self.parameters)
        self.embeddings = _embeddings_by_group(groups, _embedding_list(embeddings))
        self.parameters = optimizer.params  # OneFlow's form: Optimizer(SGD(model.parameters()))
        self.loss_scaler = LossScaler.of(loss_scale)
        self.skipped = False
        if not self.embeddings and not self.parameters:
            raise ConfigError("Optimizer needs embeddings=[...] and/or parameters=[...] to update")
        for emb in self.embeddings:
            emb.check_optimizer(optimizer)
        self._dense_states = []
        self._flats = []   # kernels.dense_update.FlatDense per group, on the device path
        for p in self.parameters:
            xp = array_namespace(p.data)
            self._dense_states.append(
                [xp.full_like(p.data, v) for v in optimizer.initial_state()]
            )
        self.step_count = 0
        for emb in self.embeddings:
            emb.bind_optimizer(optimizer)
        if comm is None:
            comm = self.embeddings[0].comm if self.embeddings else default_comm()
        self.comm = comm
        optimizer._wrapped = True  # its own step() would update the parameters a second time

    @property
    def param_groups(self) -> list:
        """The row optimizer's parameter groups (OneFlow's ``one_embedding.Optimizer`` shares
        them too): each holds its ``"params"`` (dense parameters and embeddings), ``"lr"``,
        ``"weight_decay"``, ``"clip_grad_max_norm"``, ``"clip_grad_norm_type"`` (writable) and
        the optimizer-wide hyper-parameters (read only); see ``optim.groups``."""
        return self.optimizer.param_groups

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = value

    def step(self, closure=None):
        """One update of every embedding row and dense parameter that received a gradient.

        closure: optional callable that recomputes the loss (and the gradients); it is called
        first and its value returned (PyTorch's convention). Returns None without one.
        """
        loss = closure() if closure is not None else None
        for p in self.parameters:
            if p.grad is not None and p.grad.shape != p.data.shape:
                raise InputError(
                    f"parameter {getattr(p, 'name', '?')!r} has grad of shape {p.grad.shape} "
                    f"but data of shape {p.data.shape}"
                )
        if self.comm.world > 1:
            self._allreduce_dense_grads()
        self.skipped = False
        flats = self._flat_dense()
        scaler = self.loss_scaler
        if scaler is not None and self._overflowed(scaler, flats):
            self.skipped = True
            self.zero_grad()  # gradients at the old scale must not reach a later step
            scaler.update(found_inf=True)
            return loss
        if scaler is None and host_sync.deferred_checks() is None:
            self._refuse_non_finite_dense()
        # a parameter whose gradient is all zero is left alone (its state too); on the device
        # path that is decided on the device (``masked_update``, the flat groups' flags), without
        # a read
        on_device = host_sync.deferred_checks() is not None
        in_flat = {id(p) for flat in flats for p in flat.params}
        for flat in flats:
            flat.find_nonzero()
        dense = [(p, states) for p, states in zip(self.parameters, self._dense_states)
                 if id(p) not in in_flat and p.grad is not None and (on_device or host_sync.flag(
                     p.grad.any(), "optimizer: dense grad nonzero"))]
        if not dense and not any(emb.has_gradients for emb in self.embeddings) and not (
                flats and (on_device or any(host_sync.flag(
                    flat.any_nonzero(), "optimizer: dense grad nonzero") for flat in flats))):
            for emb in self.embeddings:   # a backward of no row (an empty batch) is done with
                emb.zero_grad()
            return loss  # nothing received a gradient: the step does not count
        t = self.step_count + 1
        # unscaled inside the update, where it reads the gradient: no pass over the grads
        factor = 1.0 / scaler.scale if scaler is not None else self.optimizer.grad_scale
        # clipping needs the per-key sums for its norm; without it they may be summed inside
        # the row update (kernels/fused_update.py)
        lazy_sums = not any(group.clips for group in self.optimizer.param_groups)
        taken = [emb.take_gradients(lazy_sums=lazy_sums) for emb in self.embeddings]
        bound = self._bind_groups(dense, taken, factor)
        staged = [emb.stage_gradients(bound[id(emb)], t, rows)
                  for emb, rows in zip(self.embeddings, taken)]
        for p, states in dense:
            if on_device:
                masked_update(bound[id(p)], p.data, states, p.grad, t)
            else:
                bound[id(p)].update(p.data, states, p.grad, t)
        for flat in flats:   # a group's parameters share its bound optimizer
            flat.update(bound[id(flat.params[0])], t)
        self.step_count = t
        for emb, update in zip(self.embeddings, staged):
            emb.commit_gradients(update)
        if scaler is not None:
            scaler.update(found_inf=False)
        return loss

    def _flat_dense(self) -> list:
        """The ``kernels.dense_update.FlatDense`` of each parameter group whose dense parameters
        one launch updates: on the device path (the embeddings' launcher, else CuPy parameters)
        a group without clipping (its norm leaves out all-zero gradients, read on the host),
        with a rule that has a flat kernel and eligible arrays. Laid out at the first step and
        again when a caller rebound an array (``FlatDense.intact``); [] on the CPU path."""
        from .kernels import dense_update

        launch = self._dense_launcher()
        if launch is None or not dense_update.supported(self.optimizer):
            self._flats = []
            return self._flats
        index = {id(p): i for i, p in enumerate(self.parameters)}
        flats = []
        for group in self.optimizer.param_groups:
            params = [p for p in group.parameters if id(p) in index]
            if not params or group.clips:
                continue
            known = next((f for f in self._flats if f.group is group), None)
            if known is not None and known.launch is launch and known.params == params \
                    and known.intact():
                flats.append(known)
            elif dense_update.eligible(launch, params, self.optimizer.n_states):
                states = [self._dense_states[index[id(p)]] for p in params]
                flat = dense_update.FlatDense(params, states, self.optimizer.n_states, launch)
                flat.group = group
                flats.append(flat)
        self._flats = flats
        return flats

    def _dense_launcher(self):
        """Where the dense update's kernels run: the first embedding's device launcher, else
        the current CuPy device's when the parameters are CuPy arrays; None on the CPU path."""
        from .kernels import device_ops

        for emb in self.embeddings:
            launch = getattr(emb, "launch", None)
            if launch is not None:
                return launch
        if self.parameters and array_namespace(self.parameters[0].data) is not np:
            return device_ops.resolve(None)
        return None

    def _bind_groups(self, dense, taken, factor: float) -> dict:
        """{id(parameter or embedding): the row optimizer bound to its group for this step}:
        the group's lr and weight_decay, and ``factor`` times its clipping coefficient."""
        rows = {id(emb): t[3] for emb, t in zip(self.embeddings, taken) if t is not None}
        bound = {}
        for group in self.optimizer.param_groups:
            coef = 1.0
            if group.clips:
                members = {id(p) for p in group.parameters}
                coef = clip_coefficient(
                    group["clip_grad_max_norm"], group["clip_grad_norm_type"],
                    [p.grad for p, _ in dense if id(p) in members],
                    [rows[id(e)] for e in group.embeddings if id(e) in rows], factor, self.comm)
            one = self.optimizer.for_group(group, factor * coef)
            bound.update({id(x): one for x in group.parameters + group.embeddings})
        return bound

    def _overflowed(self, scaler: LossScaler, flats=()) -> bool:
        """True when this step's gradients hold an inf/nan on any rank. Dense gradients were
        summed over the ranks already (a non-finite one reaches every rank); an embedding
        gradient refused by ``scaler.backward`` is known only locally, so the flag is summed.
        A flat group's gradients are checked as one array (one read, not one per parameter)."""
        in_flat = {id(p) for flat in flats for p in flat.params}
        grads = [flat.grads for flat in flats] + [p.grad for p in self.parameters
                                                  if id(p) not in in_flat]
        local = scaler.found_inf or not all_finite(*grads)
        if self.comm.world > 1:
            local = bool(self.comm.allreduce_sum(np.array([float(local)]))[0] > 0)
        return local

    def _refuse_non_finite_dense(self) -> None:
        """InputError naming the first dense parameter whose gradient holds an inf / NaN,
        before anything is updated (as a row whose update would not be finite is refused):
        without a loss scale to skip the step, it would make the parameter NaN for good. On the
        CPU path only (the device path reads nothing back mid-step)."""
        if self._dense_launcher() is not None:
            return   # the device path: a read of the device each step; not checked there
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads or all_finite(*grads):
            return
        for p in self.parameters:
            if p.grad is not None and not all_finite(p.grad):
                raise InputError(
                    f"parameter {getattr(p, 'name', '?')!r} has a non-finite gradient: nothing "
                    "was updated; call zero_grad(), then lower the learning rate, clip the "
                    "gradients (clip_grad_max_norm) or use a loss scale (which skips such steps)")

    def _allreduce_dense_grads(self) -> None:
        """Sum every dense gradient over the ranks, all in one message."""
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:
            return
        xp = array_namespace(*grads)
        flat = xp.concatenate([g.reshape(-1) for g in grads])
        summed = self.comm.allreduce_sum(flat)
        offset = 0
        for g in grads:
            g[...] = summed[offset:offset + g.size].reshape(g.shape)
            offset += g.size

    def state_dict(self) -> dict:
        """The dense side's state (PyTorch's convention): ``step_count``, ``lr`` (each group's
        as ``group_lr`` when there are several), the row optimizer's ``modes`` (weight decay
        rule, Ftrl's convention: a run resumes with the rule it began with) and every dense
        parameter's optimizer state arrays as host copies, keyed ``<param name>.<state name>``.
        Embedding rows keep their state in the store (their snapshot)."""
        from .backend import to_numpy

        state = {"step_count": self.step_count, "lr": float(self.optimizer.lr),
                 "modes": self.optimizer.mode_state()}
        if len(self.param_groups) > 1:
            state["group_lr"] = [float(g["lr"]) for g in self.param_groups]
        for p, arrays in zip(self.parameters, self._dense_states):
            for name, a in zip(self.optimizer.state_names, arrays):
                state[f"{p.name}.{name}"] = to_numpy(a).copy()
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from a ``state_dict()`` of an Optimizer over the same parameters (the argument
        named as in PyTorch and OneFlow). The saved modes apply (``RowOptimizer.adopt_modes``);
        a state saved before issue 23 records none and continues with the decoupled weight decay
        and TensorFlow's Ftrl it ran with."""
        state = state_dict
        for p, arrays in zip(self.parameters, self._dense_states):
            for name, a in zip(self.optimizer.state_names, arrays):
                key = f"{p.name}.{name}"
                if key not in state or tuple(state[key].shape) != tuple(a.shape):
                    raise InputError(f"optimizer state_dict has no {key!r} of shape {a.shape}: "
                                     "load a state saved by the same optimizer and model")
                a[...] = array_namespace(a).asarray(state[key])
        # a state without "modes" was saved before issue 23 changed the defaults
        self.optimizer.adopt_modes(state.get("modes"), "the optimizer state")
        self.step_count = int(state["step_count"])
        self.optimizer.lr = float(state["lr"])
        for group, lr in zip(self.param_groups, state.get("group_lr", ())):
            group["lr"] = float(lr)
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    def zero_grad(self) -> None:
        for emb in self.embeddings:
            emb.zero_grad()
        done = set()
        for flat in self._flats:
            if flat.intact():
                flat.zero_grad()   # one fill for the group
                done.update(id(p) for p in flat.params)
        for p in self.parameters:
            if p.grad is not None and id(p) not in done:
                p.grad[...] = 0


def _embedding_list(embeddings) -> list:
    """``embeddings=`` as a list, each an embedding (OneFlow's form: ``embeddings=[emb]``)."""
    if hasattr(embeddings, "check_optimizer") or not hasattr(embeddings, "__iter__") \
            or isinstance(embeddings, (str, bytes, dict)):
        raise ConfigError(f"embeddings={embeddings!r} is not a list of embeddings: pass a list, "
                          "e.g. embeddings=[emb] (OneFlow's form), even for one embedding")
    embeddings = list(embeddings)
    for i, emb in enumerate(embeddings):
        if not (hasattr(emb, "check_optimizer") and hasattr(emb, "bind_optimizer")):
            raise ConfigError(f"embeddings[{i}]={emb!r} is not an embedding: pass "
                              "embeddings=[emb, ...] of MultiTableEmbedding or "
                              "MultiTableMultiColumnEmbedding")
    return embeddings


def _embeddings_by_group(groups, embeddings: list) -> list:
    """Every embedding to update: those given, then those only the groups name. One a group does
    not name joins the only group; with several groups it must be named."""
    named = [e for g in groups for e in g.embeddings]
    for emb in embeddings:
        if any(emb is e for e in named):
            continue
        if len(groups) > 1:
            raise ConfigError(
                f"embedding {getattr(emb, 'name', emb)!r} is in none of the row optimizer's "
                f"{len(groups)} parameter groups: add it to the 'params' of the group whose lr, "
                "weight_decay and clipping it follows (OneFlow's groups name its shadow "
                "parameter)")
        groups[0].embeddings.append(emb)
    return embeddings + [e for e in named if not any(e is x for x in embeddings)]


def masked_update(bound, w, states, g, step: int) -> None:
    """``bound.update(w, states, g, step)`` where ``g`` has a non-zero entry; elsewhere ``w``
    and ``states`` keep their values, bit for bit, decided on the device (no host read): the
    values are saved, the update runs, and a select on the device puts the saved values back
    when ``g`` is all zero.

    w, g: same shape float arrays (numpy or cupy); states: arrays shaped like ``w``."""
    xp = array_namespace(w, g)
    keep = ~g.any()                                             # 0-d device bool
    before = [w.copy()] + [s.copy() for s in states]
    bound.update(w, states, g, step)
    for now, old in zip([w] + list(states), before):
        xp.copyto(now, old, where=keep)

