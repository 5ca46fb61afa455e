"""one_embedding.torch.TorchEmbedding: parity with torch.nn.Embedding (values, gradients, 10 SGD
steps), the zero-copy claims, prepared steps, gradient accumulation, and clear errors."""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import one_embedding as oe  # noqa: E402
from one_embedding.torch import TorchEmbedding  # noqa: E402

import helpers

ROOT = str(helpers.ROOT)
V, F, E, B = 60, 3, 4, 16  # keys 0..V-1, ids (B, F), rows (E,)
TOL = 1e-5


def store_options(kind, path):
    if kind == "device_mem":
        return oe.make_device_mem_store_options(None, capacity=V)
    # a cache of a few rows: most lines are evicted to the SSD table and read back
    return oe.make_cached_ssd_store_options(0.0005, str(path), engine=kind.split(":")[1])


def make_embedding(kind="device_mem", path=None, tables=None):
    return oe.MultiTableEmbedding("t", E, np.float32, np.int64, tables, store_options(kind, path))


def initial_rows(emb):
    """(V, E) the rows keys 0..V-1 start from (a lookup stores nothing)."""
    return emb(np.arange(V)).copy()


class Model(torch.nn.Module):
    """ids (B, F) -> lookup (B, F, E) -> flatten -> Linear -> ReLU -> Linear -> logit (B,)."""

    def __init__(self, lookup, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lookup = lookup
        self.mlp = torch.nn.Sequential(torch.nn.Linear(F * E, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, ids):
        return self.mlp(self.lookup(ids).flatten(1)).squeeze(1)


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = torch.from_numpy(rng.integers(0, V, size=(B, F)))  # 48 draws of 60: duplicates
        yield ids, torch.from_numpy((rng.random(B) < 0.5).astype(np.float32))


# ---------------------------------------------------------------- parity with nn.Embedding


def test_forward_values_and_gradients_equal_nn_embedding():
    emb = make_embedding()
    reference = torch.nn.Embedding(V, E, _weight=torch.tensor(initial_rows(emb)))
    lookup = TorchEmbedding(emb)
    ids = next(batches(1))[0]
    out, want = lookup(ids), reference(ids)
    assert out.shape == (B, F, E) and out.dtype == torch.float32 and out.requires_grad
    assert torch.equal(out, want)
    g = torch.randn(B, F, E, generator=torch.Generator().manual_seed(1))
    (out * g).sum().backward()
    (want * g).sum().backward()
    # SGD with lr 1 turns the summed row gradient into the row change
    before = emb(np.arange(V)).copy()
    oe.Optimizer(oe.optim.SGD(lr=1.0), embeddings=[emb]).step()
    assert helpers.rel_err(before - emb(np.arange(V)), reference.weight.grad) <= TOL


@pytest.mark.parametrize("kind", ["device_mem", "cached_ssd:slots", "cached_ssd:rocksdb"])
def test_ten_sgd_steps_equal_the_same_model_on_nn_embedding(kind, tmp_path):
    emb = make_embedding(kind, tmp_path)
    ours = Model(TorchEmbedding(emb))
    theirs = Model(torch.nn.Embedding(V, E, _weight=torch.tensor(initial_rows(emb))))
    row_opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb])
    dense_ours = torch.optim.SGD(ours.mlp.parameters(), lr=0.5)
    dense_theirs = torch.optim.SGD(theirs.parameters(), lr=0.5)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    for ids, labels in batches(10):
        loss_a = loss_fn(ours(ids), labels)
        loss_a.backward()
        row_opt.step(); dense_ours.step()
        row_opt.zero_grad(); dense_ours.zero_grad()
        loss_b = loss_fn(theirs(ids), labels)
        loss_b.backward()
        dense_theirs.step(); dense_theirs.zero_grad()
        losses.append((loss_a.item(), loss_b.item()))
    ours_l, theirs_l = np.array(losses).T
    assert helpers.rel_err(ours_l, theirs_l) <= TOL, losses
    assert theirs_l[-1] != theirs_l[0]  # it trained
    for a, b in zip(ours.mlp.parameters(), theirs.mlp.parameters()):
        assert helpers.rel_err(a.detach(), b.detach()) <= TOL
    assert helpers.rel_err(emb(np.arange(V)), theirs.lookup.weight.detach()) <= TOL
    if kind != "device_mem":
        assert emb.store_stats()[0]["evictions"] > 0  # rows went to the SSD table and back
    emb.close()


def test_gradient_accumulation_over_two_backwards_before_one_step():
    emb = make_embedding()
    reference = torch.nn.Embedding(V, E, _weight=torch.tensor(initial_rows(emb)))
    lookup = TorchEmbedding(emb)
    for ids, _ in batches(2, seed=5):
        lookup(ids).pow(2).sum().backward()
        reference(ids).pow(2).sum().backward()
    before = emb(np.arange(V)).copy()
    oe.Optimizer(oe.optim.SGD(lr=1.0), embeddings=[emb]).step()
    assert helpers.rel_err(before - emb(np.arange(V)), reference.weight.grad) <= TOL


def test_table_ids_padding_and_a_prepared_step():
    tables = [oe.make_table_options(oe.make_constant_initializer(float(t))) for t in range(F)]
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, tables,
                                 oe.make_device_mem_store_options(None, capacity=V), padding_idx=0)
    lookup = TorchEmbedding(emb)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    out = lookup(ids)  # column j is table j; padding id 0 gives zeros
    assert out[0, 0].eq(0).all() and out[1, 0].eq(0).all() and out[1, 2].eq(2).all()
    swapped = lookup(ids, table_ids=torch.tensor([2, 1, 0]))
    assert swapped[1, 0].eq(2).all() and swapped[1, 2].eq(0).all()
    state = emb.prepare(ids.numpy())
    prepared = lookup(state)
    assert torch.equal(prepared, out) and prepared.requires_grad
    prepared.sum().backward()
    oe.Optimizer(oe.optim.SGD(lr=1.0), embeddings=[emb]).step()
    np.testing.assert_array_equal(emb(np.array([3, 5]), np.array([0, 2])), [[-1.0] * E, [1.0] * E])
    with pytest.raises(oe.InputError, match="table_ids were given with a prepared StepState"):
        lookup(emb.prepare(ids.numpy()), table_ids=torch.tensor([0, 1, 2]))


def test_no_grad_output_needs_no_backward():
    emb = make_embedding()
    lookup = TorchEmbedding(emb)
    with torch.no_grad():
        out = lookup(torch.arange(6).reshape(2, 3))
    assert not out.requires_grad and out.shape == (2, 3, E)
    assert not emb.has_gradients


def test_dense_parameters_of_a_model_exclude_the_rows():
    lookup = TorchEmbedding(make_embedding())
    assert list(lookup.parameters()) == [] and lookup.state_dict() == {}
    assert "embedding_dim=4" in repr(lookup) and lookup.embedding_dim == E


# ---------------------------------------------------------------- zero copy


def test_ids_rows_and_gradients_cross_without_a_copy(monkeypatch):
    emb = make_embedding()
    seen = {}
    prepare, embed, backward = emb.prepare, emb.embed, emb.backward

    def spy_prepare(ids, table_ids=None, **kwargs):
        seen["ids"] = ids
        return prepare(ids, table_ids, **kwargs)

    def spy_embed(state):
        seen["rows"] = embed(state)
        return seen["rows"]

    def spy_backward(grad, state=None):
        seen["grad"] = grad
        return backward(grad, state=state)

    monkeypatch.setattr(emb, "prepare", spy_prepare)
    monkeypatch.setattr(emb, "embed", spy_embed)
    monkeypatch.setattr(emb, "backward", spy_backward)
    ids = torch.arange(12).reshape(4, 3)
    out = TorchEmbedding(emb)(ids)
    grads = []
    out.register_hook(grads.append)
    (out * torch.ones(4, 3, E)).sum().backward()
    assert np.shares_memory(seen["ids"], ids.numpy())
    assert np.shares_memory(seen["rows"], out.detach().numpy())
    assert np.shares_memory(seen["grad"], grads[0].numpy())


def updated_rows(use):
    """The rows of keys 0..11 after one SGD step of a loss that ``use(lookup)`` builds."""
    emb = make_embedding()
    opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb])
    use(TorchEmbedding(emb)).backward()
    opt.step()
    rows = emb(np.arange(12))
    emb.close()
    return rows


def test_two_lookups_in_one_loss_equal_one_lookup_of_both():
    ids_a, ids_b = torch.arange(6).reshape(2, 3), torch.arange(3, 12).reshape(3, 3)
    two = updated_rows(lambda lookup: lookup(ids_a).sum() + 2 * lookup(ids_b).sum())
    one = updated_rows(lambda lookup: (lookup(torch.cat([ids_a.reshape(-1), ids_b.reshape(-1)]))
                                       * torch.cat([torch.ones(6, 1), 2 * torch.ones(9, 1)])).sum())
    np.testing.assert_allclose(two, one, rtol=1e-6)
    assert not np.array_equal(two, updated_rows(lambda lookup: lookup(ids_a).sum()))


def test_a_direct_forward_between_lookup_and_backward_is_fine():
    def use(lookup):
        out = lookup(torch.arange(6).reshape(2, 3))
        lookup.embedding(np.arange(3))  # e.g. an evaluation lookup in between
        return out.sum()

    np.testing.assert_array_equal(updated_rows(use),
                                  updated_rows(lambda lookup: lookup(torch.arange(6)).sum()))


def test_backward_twice_through_one_lookup_adds():
    def twice(lookup):
        loss = lookup(torch.arange(6)).sum()
        loss.backward(retain_graph=True)
        return loss

    np.testing.assert_allclose(updated_rows(twice),
                               updated_rows(lambda lookup: 2 * lookup(torch.arange(6)).sum()),
                               rtol=1e-6)


def test_bad_inputs():
    with pytest.raises(oe.ConfigError, match="has no forward"):
        TorchEmbedding(torch.nn.Embedding(3, 2).weight)
    lookup = TorchEmbedding(make_embedding())
    with pytest.raises(oe.InputError, match="ids have dtype float32"):
        lookup(torch.zeros(2, 3))
    with pytest.raises(oe.InputError, match="device meta.*ids.cpu"):
        lookup(torch.zeros(2, 3, dtype=torch.long, device="meta"))
    with pytest.raises(oe.InputError, match="grad_out holds a non-finite value"):
        (lookup(torch.arange(3)) * float("nan")).sum().backward()


def test_missing_torch_is_a_clear_import_error_and_the_package_never_imports_torch():
    code = ("import sys; import one_embedding\n"
            "assert 'torch' not in sys.modules, 'import one_embedding imported torch'\n"
            "sys.modules['torch'] = None  # as if torch were not installed\n"
            "try:\n    import one_embedding.torch\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install 'one_embedding[torch]'" in r.stdout


def test_docstring_example_runs():
    import doctest

    import one_embedding.torch as module

    assert doctest.testmod(module).failed == 0


# ---------------------------------------------------------------- a device embedding
def one_step_through_torch(device):
    """Output and updated rows of one SGD step through TorchEmbedding, rows on ``device``."""
    store = oe.make_device_mem_store_options(None, capacity=V)
    emb = oe.MultiTableEmbedding("t", E, np.float32, np.int64, None, store, device=device)
    opt = oe.Optimizer(oe.optim.SGD(lr=0.5), embeddings=[emb])
    lookup = TorchEmbedding(emb)
    out = lookup(torch.arange(12).reshape(4, 3) % 7)           # duplicate ids: gradients add
    (out * out).sum().backward()
    opt.step()
    rows = lookup(torch.arange(8)).detach().numpy().copy()
    emb.close()
    return out.detach().numpy().copy(), rows


def test_a_device_embedding_through_torch_equals_the_cpu_one(launch):
    """The device path (host emulator of the CUDA kernels as the GPU: arrays stay numpy, so the
    tensors stay on the CPU) gives the CPU embedding's bits through TorchEmbedding."""
    want_out, want_rows = one_step_through_torch(None)
    got_out, got_rows = one_step_through_torch(launch)
    np.testing.assert_array_equal(got_out, want_out)
    np.testing.assert_array_equal(got_rows, want_rows)
    fresh = make_embedding()
    assert not np.array_equal(want_rows[:7], initial_rows(fresh)[:7])  # the step changed them
    fresh.close()


def test_cuda_ids_need_an_embedding_on_the_gpu():
    ids = (torch.zeros(2, 3, dtype=torch.long, device="cuda") if torch.cuda.is_available()
           else _FakeCudaTensor())
    lookup = TorchEmbedding(make_embedding())
    with pytest.raises(oe.InputError, match="device cuda.*ids.cpu\\(\\).*device='cuda'"):
        lookup(ids)


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports a CUDA device (this machine has no GPU)."""

    def __new__(cls):
        return torch.Tensor._make_subclass(cls, torch.zeros(2, 3, dtype=torch.long))

    @property
    def device(self):
        return torch.device("cuda", 0)
