"""Helpers shared by the PyTorch parity tests (import only after pytest.importorskip("torch"))."""
import numpy as np
import torch

TOL = 1e-5


def close(ours, theirs, tol=TOL):
    """Max abs difference, relative to the largest |value| of the torch result, is within tol."""
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
    ours = np.asarray(ours)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    scale = max(float(np.abs(theirs).max()), 1e-30)
    err = float(np.abs(ours.astype(np.float64) - theirs.astype(np.float64)).max()) / scale
    assert err <= tol, err


def leaf(a):
    """A torch leaf tensor (requires_grad) holding a copy of ``a``."""
    return torch.tensor(np.ascontiguousarray(a), requires_grad=True)
