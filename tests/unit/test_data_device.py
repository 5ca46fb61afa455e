"""Data at the device's pace, without a GPU: the synthetic generators agree bit for bit (numba,
numpy reference, the CUDA kernel on the host emulator), the device loaders yield the host
loader's batches, and the staging path runs on the base launcher (numpy, no streams)."""
import shutil
from pathlib import Path

import numpy as np
import pytest

from one_embedding.data import BatchLoader, SyntheticCriteo, ZipfSampler
from one_embedding.data import synthetic_math as sm
from one_embedding.data.device import DeviceBatches, DeviceSynthetic, DeviceSyntheticLoader
from one_embedding.errors import ConfigError
from one_embedding.kernels import cuda_module as cm
from one_embedding.kernels.device_ops import Launcher

SOURCES = {
    "kaggle default": dict(cardinalities="kaggle", scale=0.01, seed=3),
    "mlperf tails": dict(cardinalities="mlperf40m", scale=0.05, seed=4),
    "alpha 1, tiny head": dict(cardinalities=[3, 5, 17, 9000], alpha=1.0, seed=2),
    "alpha 2.5": dict(cardinalities=[1, 70_000], alpha=2.5, seed=9),
    "alpha 0.5": dict(cardinalities=[50_000, 6000], alpha=0.5, seed=1),
}


def _equal(got, want):
    for name, a, b in zip(("dense", "ids", "labels", "logits"), got, want):
        a = np.asarray(a)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), f"{name}: {(a != b).sum()} values differ"


@pytest.mark.parametrize("name", list(SOURCES))
def test_numba_generator_equals_numpy_reference_bit_for_bit(name):
    src = SyntheticCriteo(**SOURCES[name])
    for start, count in ((0, 3000), (10**12 + 17, 500)):
        _equal(src.generate(start, count), src.reference_rows(start, count))


def test_tails_and_dense_tables_are_exercised():
    """The cases above reach every branch: Zipf tails, dense values past the table, missing."""
    src = SyntheticCriteo(**SOURCES["mlperf tails"])
    dense, ids, _, _ = src.generate(0, 20_000)
    ranks_past_head = 0
    for c, n in enumerate(src.cardinalities):
        if n > sm.ZIPF_HEAD:
            head_ids = set(src._zipf_ids[c, :sm.ZIPF_HEAD].tolist())
            ranks_past_head += int((~np.isin(ids[:, c], list(head_ids))).sum())
    assert ranks_past_head > 1000
    past_table = np.float32(np.log(sm.DENSE_TABLE + 1.0))
    assert (dense[:, 4] >= past_table).mean() > 0.1     # mu 7, sigma 2: a quarter past 4096
    assert ((dense == 0).mean(0)[[0, 11]] > 0.4).all()


def test_log_and_exp_are_within_an_ulp_of_libm():
    x = np.concatenate([np.geomspace(1e-300, 1e300, 20_000), np.linspace(0.5, 3, 20_000)])
    np.testing.assert_array_max_ulp(sm.log_np(x), np.log(x), maxulp=1)
    y = np.linspace(-700, 700, 40_001)
    np.testing.assert_array_max_ulp(sm.exp_np(y), np.exp(y), maxulp=1)
    u = np.linspace(1e-12, 1 - 1e-12, 10_001)
    z = sm.normal_np(u)
    np.testing.assert_allclose(sm.normal_cdf(z), u, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("n, alpha, head", [(50, 1.05, 8), (200, 0.7, 1), (40, 2.0, 39)])
def test_zipf_head_table_and_tail_together_follow_the_exact_law(n, alpha, head):
    sampler = ZipfSampler(n, alpha, head=head)
    assert sampler.math.p_head < 1.0
    draws = 200_000
    counts = np.bincount(sampler.sample(np.random.default_rng(5), draws), minlength=n + 1)
    assert counts[0] == 0 and counts[n + 1:].sum() == 0
    expected = sampler.pmf(np.arange(1, n + 1)) * draws
    chi2 = ((counts[1:n + 1] - expected) ** 2 / expected).sum()
    assert chi2 < (n - 1) + 5 * np.sqrt(2 * (n - 1)) + 1
    assert abs(sampler.math.p_head - sampler.pmf(np.arange(1, head + 1)).sum()) < 1e-12


def test_zipf_tail_sum_matches_the_direct_sum():
    z = sm.ZipfMath(10, 1.05)
    direct = float((np.arange(5000, 400_001, dtype=np.float64) ** -1.05).sum())
    assert abs(z._tail_sum(5000, 400_000) - direct) < 1e-13 * direct


def test_large_cardinality_is_refused_with_the_limit():
    with pytest.raises(ConfigError, match="at most"):
        SyntheticCriteo([1 << 40])


# ------------------------------------------------------------------ the CUDA kernel, emulated

@pytest.fixture(scope="module")
def data_lib(request, tmp_path_factory):
    from cuda_emulation import build

    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("cuda_emulation") if cache is not None else tmp_path_factory.mktemp("emu")
    return build(cm.DATA_FAMILIES, Path(folder))


@pytest.fixture
def data_launcher(data_lib, emulation_seed):
    """The synthetic kernel on the host emulator (its stress mode under ``stress_seeds``: every
    table read bounds-checked against a guard page)."""
    from cuda_emulation import EmulatedLauncher

    return EmulatedLauncher(data_lib, cm.DATA_FAMILIES, seed=emulation_seed)


@pytest.mark.stress_seeds
@pytest.mark.parametrize("name", list(SOURCES))
def test_emulated_kernel_equals_cpu_generator(name, data_launcher):
    src = SyntheticCriteo(**SOURCES[name])
    device = DeviceSynthetic(src, data_launcher)
    _equal(device.rows(5, 2100), src.generate(5, 2100))
    positions = np.random.default_rng(0).integers(0, 1 << 40, 700)
    singles = [src.generate(int(p), 1) for p in positions]
    want = [np.concatenate([one[i] for one in singles]) for i in range(4)]
    _equal(device.rows_at(positions), want)
    assert "synthetic_rows" in data_launcher.launched


@pytest.mark.parametrize("split, world, start, size", [("train", 1, 0, 384), ("eval", 2, 1, 64),
                                                     (None, 1, 3, 384)])
def test_device_synthetic_loader_yields_the_loaders_batches(split, world, start, size,
                                                           data_launcher):
    src = SyntheticCriteo("kaggle", scale=0.01, seed=7, num_rows=5000, block_rows=700)
    for rank in range(world):
        loader = BatchLoader(src, size, split=split, rank=rank, world=world,
                             drop_last=split == "train", read_ahead=0)
        loader.set_epoch(0, start_batch=start)
        want = list(loader)
        got = list(DeviceSyntheticLoader(loader, data_launcher))
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            for k in ("dense", "ids", "labels"):
                assert np.asarray(getattr(g, k)).tobytes() == getattr(w, k).tobytes()


def test_device_synthetic_loader_refuses_shuffle_and_file_sources(tmp_path):
    src = SyntheticCriteo("kaggle", scale=0.01, num_rows=100)
    with pytest.raises(ConfigError, match="shuffle=False"):
        DeviceSyntheticLoader(BatchLoader(src, 10, shuffle=True), Launcher())
    with pytest.raises(ConfigError, match="SyntheticCriteo"):
        DeviceSynthetic(object(), Launcher())


# ------------------------------------------------------------------ staging, base launcher

class CountingLauncher(Launcher):
    """The base launcher, counting staging buffers and uploads."""

    def __init__(self):
        self.buffers = self.uploads = 0

    def host_empty(self, shape, dtype):
        self.buffers += 1
        return super().host_empty(shape, dtype)

    def to_device(self, host):
        self.uploads += 1
        return super().to_device(host)


def test_device_batches_yield_the_loaders_batches_through_a_ring_of_buffers():
    src = SyntheticCriteo("kaggle", scale=0.01, seed=1, num_rows=6000)
    want = list(BatchLoader(src, 500, read_ahead=0))
    launcher = CountingLauncher()
    got = list(DeviceBatches(BatchLoader(src, 500), launcher, depth=2))
    assert len(got) == len(want) == 12
    for g, w in zip(got, want):
        for k in ("dense", "ids", "labels"):
            np.testing.assert_array_equal(getattr(g, k), getattr(w, k))
    # 3 buffer sets of 3 arrays, reused: no allocation per batch; each batch uploaded once
    assert launcher.buffers == 9 and launcher.uploads == 36


def test_device_batches_reraise_loader_errors_and_stop_early(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\n")
    with pytest.raises(Exception, match="bad.tsv|line|column"):
        list(DeviceBatches(BatchLoader([bad], 4), Launcher()))
    src = SyntheticCriteo("kaggle", scale=0.01, num_rows=100_000)
    batches = DeviceBatches(BatchLoader(src, 100), Launcher(), depth=2)
    for i, _ in enumerate(batches):
        if i == 2:
            break
    with pytest.raises(ConfigError, match="depth=0"):
        DeviceBatches(BatchLoader(src, 100), Launcher(), depth=0)
