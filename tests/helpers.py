"""Helpers shared by test modules (``tests/`` is on sys.path: see conftest.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from one_embedding.backend import to_numpy
from one_embedding.tiers import TierCounters

#: the tests folder, the repository, and the real Criteo rows beside the repository
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: the package's source folder in the checkout (a src/ layout)
PACKAGE = ROOT / "src" / "one_embedding"
CRITEO_DIR = ROOT.parent / "shared" / "data" / "criteo"

#: the relative tolerance of parity with PyTorch autograd and the numpy references
TOL = 1e-5


def _host(a) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor
        return a.detach().cpu().numpy()
    return to_numpy(a)


def rel_err(ours, theirs) -> float:
    """Max |ours - theirs| relative to max |theirs| (floored at 1e-30); shapes must be equal.
    Either side may be numpy, CuPy or a torch tensor."""
    ours, theirs = np.asarray(_host(ours), np.float64), np.asarray(_host(theirs), np.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    scale = max(float(np.abs(theirs).max(initial=0.0)), 1e-30)
    return float(np.abs(ours - theirs).max(initial=0.0)) / scale


def close(ours, theirs, tol: float = TOL) -> None:
    """``rel_err(ours, theirs) <= tol``."""
    err = rel_err(ours, theirs)
    assert err <= tol, err


def close_at_dtype(actual, expected, dtype) -> None:
    """``actual`` within the tolerance of ``dtype`` (float32 1e-5, float64 1e-12) of ``expected``,
    relative to max(1, max |expected|)."""
    tol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-12
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(to_numpy(actual), np.float64), expected, rtol=tol,
                               atol=tol * scale)


def max_rel_diff(a, b) -> float:
    """Largest |a - b| / |b| over the elements (|b| floored at 1e-12)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def auc(labels, scores) -> float:
    """ROC AUC as the Mann-Whitney statistic with average ranks for ties (a pair of equal scores
    counts half), written independently of ``one_embedding.metrics``."""
    labels, scores = np.asarray(labels), np.asarray(scores, np.float64)
    values, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # rank of each distinct value's last copy (1-based)
    average_rank = (last - (counts - 1) / 2.0)[inverse]
    n_pos = int((labels == 1).sum())
    n_neg = labels.size - n_pos
    return float((average_rank[labels == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def leaf(a):
    """A torch leaf tensor (requires_grad) holding a copy of ``a`` (needs torch)."""
    import torch

    return torch.tensor(np.ascontiguousarray(a), requires_grad=True)


class TierProbe:
    """Drives one tier alone the way the chain drives each level: ``find`` into a buffer and
    count with the same ``TierCounters``. ``find(keys)`` returns (found (n,) bool, lines
    (n_found, line_size) float32 in key order); other attributes pass through to the tier."""

    def __init__(self, tier):
        self.tier = tier
        self.counters = TierCounters()

    def find(self, keys):
        keys = np.ascontiguousarray(keys, np.uint64)
        out = np.empty((keys.shape[0], self.tier.line_size), np.float32)
        missing = self.tier.find(keys, out, np.arange(keys.shape[0], dtype=np.int64))
        self.counters.record_find(keys.shape[0], missing.shape[0])
        found = np.ones(keys.shape[0], np.bool_)
        found[missing] = False
        return found, out[found]

    def insert_or_assign(self, keys, lines):
        ev_keys, ev_lines = self.tier.insert_or_assign(keys, lines)
        self.counters.record_write(np.asarray(keys).shape[0], ev_keys.shape[0])
        return ev_keys, ev_lines

    def stats(self) -> dict:
        return {**self.tier.describe(), **self.counters.as_dict()}

    def __len__(self) -> int:
        return len(self.tier)

    def __getattr__(self, name):
        return getattr(self.tier, name)

def row_optimizer_cases() -> dict:
    """name -> factory of every row-optimizer setting the update kernels must match in (the
    device twins of tests/gpu and their emulation): each optimizer, weight-decay mode, Adam
    variant and Ftrl convention."""
    from one_embedding.optim import SGD, Adagrad, Adam, Ftrl

    return {
        "sgd": lambda: SGD(lr=0.1),
        "sgd_wd": lambda: SGD(lr=0.1, weight_decay=0.01),
        "momentum": lambda: SGD(lr=0.05, momentum=0.9),
        "momentum_dampening_l2": lambda: SGD(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.02,
                                             weight_decay_mode="l2"),
        "nesterov_decoupled": lambda: SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                                          weight_decay_mode="decoupled"),
        "momentum_wd": lambda: SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
        "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
        "adagrad_decay_wd": lambda: Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.01, eps=1e-6),
        "adagrad_decoupled": lambda: Adagrad(lr=0.1, weight_decay=0.01, weight_decay_mode="decoupled"),
        "adagrad_l2_maximize": lambda: Adagrad(lr=0.1, weight_decay=0.05, weight_decay_mode="l2",
                                               maximize=True),
        "adam": lambda: Adam(lr=0.01),
        "adam_wd_no_bias_correction": lambda: Adam(lr=0.01, weight_decay=0.1, do_bias_correction=False),
        "adam_decoupled": lambda: Adam(lr=0.01, weight_decay=0.1, weight_decay_mode="decoupled"),
        "adam_amsgrad_l2": lambda: Adam(lr=0.01, betas=(0.8, 0.99), amsgrad=True, weight_decay=0.01,
                                        weight_decay_mode="l2"),
        "ftrl": lambda: Ftrl(lr=0.1, convention="oneflow"),
        "ftrl_l1_l2_beta": lambda: Ftrl(lr=0.05, lambda1=0.01, lambda2=0.1, beta=0.5, weight_decay=0.01,
                                        convention="oneflow"),
        "ftrl_half_decoupled": lambda: Ftrl(lr=0.05, lr_power=0.5, lambda1=0.01, weight_decay=0.01,
                                            weight_decay_mode="decoupled", convention="oneflow"),
        "ftrl_power": lambda: Ftrl(lr=0.05, lr_power=-0.7, initial_accumulator_value=0.5,
                                   convention="oneflow"),
        "ftrl_tensorflow": lambda: Ftrl(lr=0.1, convention="tensorflow"),
        "ftrl_tensorflow_l1_l2_beta": lambda: Ftrl(lr=0.05, lambda1=0.01, lambda2=0.1, beta=0.5,
                                                   weight_decay=0.01, convention="tensorflow"),
    }


def write_criteo_tsv(path, rows: int, seed: int = 0) -> None:
    """rows lines of raw Criteo: label, 13 integers (some missing), 26 hex categoricals."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            ints = ["" if rng.random() < 0.1 else str(rng.integers(0, 100)) for _ in range(13)]
            cats = [f"{rng.integers(0, 50) * 2654435761 % 2**32:08x}" for _ in range(26)]
            label = int(rng.random() < 0.3 + 0.4 * (cats[0] < "80000000"))
            f.write("\t".join([str(label), *ints, *cats]) + "\n")


class LineCopies:
    """Watches a launcher's launches of the kernels that copy whole lines (those with an ``int
    vector`` parameter: ``hashindex.cu``'s finds and put, ``cache.cu``'s find and insert):
    ``seen`` gets (kernel, line_size, vector) per launch, as the device glue chose them; with
    ``force`` set (0 or 1) the kernel runs with that ``vector`` instead (0: the one-element copies
    to compare against; 1: a 16-byte copy the glue refused). Installed on the launcher's ``run``
    through pytest's ``monkeypatch``, so it is undone after the test; works on the emulator and on
    the CuPy launcher alike. ``families``: whose kernels to watch (``("optim",)``: the row
    optimizer kernels, whose ``vector`` picks their 16-byte path the same way)."""

    def __init__(self, monkeypatch, launcher, force: int | None = None,
                 families: tuple[str, ...] = ("hashindex", "cache")):
        from cuda_emulation import kernel_parameters

        self.force = force
        self.seen: list[tuple[str, int, int]] = []
        self._at = {}
        for family in families:
            for kernel, params in kernel_parameters(family).items():
                names = [name for _, name in params]
                if "vector" in names:
                    self._at[kernel] = (names.index("line_size"), names.index("vector"))
        original = launcher.run

        def run(family, name, dtype, grid, block, args):
            where = self._at.get(f"{family}_{name}")
            if where is not None:
                size_at, vector_at = where
                self.seen.append((f"{family}_{name}", int(args[size_at]), int(args[vector_at])))
                if self.force is not None:
                    args = args[:vector_at] + (np.int32(self.force),) + args[vector_at + 1:]
            original(family, name, dtype, grid, block, args)

        monkeypatch.setattr(launcher, "run", run)

    def kernels(self) -> set[str]:
        return {kernel for kernel, _, _ in self.seen}

    def vectors(self, with_lines: bool = True) -> set[int]:
        """The ``vector`` values chosen for the launches that copy lines (line_size > 0), or for
        those that copy none."""
        return {vector for _, size, vector in self.seen if (size > 0) == with_lines}


def check_slot_snapshot(open_store, path, model: dict, name: str = "s") -> None:
    """A fresh slot store ``open_store(path)`` loads snapshot ``name`` (fully verified) to
    exactly ``model`` ({key: line})."""
    from one_embedding.store.snapshots import SnapshotDirectory

    store = open_store(path)
    try:
        folder = SnapshotDirectory(str(path)).path(name)
        store.verify_snapshot(folder, full=True)
        store.load_snapshot(folder)
        assert len(store) == len(model)
        keys = np.array(sorted(model), np.uint64)
        out = np.zeros((keys.shape[0], store.line_size), np.float32)
        assert store.find(keys, out, np.arange(keys.shape[0])).shape[0] == 0
        np.testing.assert_array_equal(out, np.stack([model[k] for k in keys.tolist()]))
    finally:
        store.close()


def slot_lines(keys, line: int, salt: float = 0.0) -> np.ndarray:
    """(n, line) float32 lines that tell their key (and ``salt``) apart: keys (n,) uint64."""
    k = (np.asarray(keys, np.uint64) % np.uint64(1 << 20)).astype(np.float64)[:, None]
    return (k * 0.001 + np.arange(line) + salt).astype(np.float32)


def save_slot_snapshot(store, path, name: str = "s") -> None:
    """Snapshot ``name`` of a slot store under ``path``, as the shard saves one."""
    from one_embedding.store.snapshots import SnapshotDirectory

    SnapshotDirectory(str(path)).save(name, store.save_snapshot, {})


def write_slot_lines(store, model: dict, keys, salt: float = 0.0) -> None:
    """``slot_lines`` of ``keys`` into ``store`` and into ``model`` ({key: line})."""
    lines = slot_lines(keys, store.line_size, salt)
    store.insert_or_assign(keys, lines)
    model.update(zip(np.asarray(keys).tolist(), lines))
