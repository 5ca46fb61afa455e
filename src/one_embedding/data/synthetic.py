"""Synthetic Criteo-like data: real cardinalities, Zipf ids, a label a model can learn.

Row ``r`` is a pure function of (seed, r): each of its random numbers is a hash of a counter
(``synthetic_math``), so any batch size, rank split, thread or GPU thread sees the same rows. Three
generators compute them, bit for bit alike: ``rows`` (numba, all cores), ``reference_rows``
(numpy, the test oracle) and ``DeviceSynthetic`` (a CUDA kernel, ``kernels/cuda/synthetic.cu``).

Per row:

* ids: for column c, a Zipf rank ``k`` in ``1..N_c`` with ``P(k) ∝ k**-alpha`` (exact bounded-Zipf
  sampling: ranks up to 4096 by inversion of a CDF table, the tail by rejection-inversion,
  Hörmann & Derflinger 1996: O(1) memory for any ``N_c``),
  scattered over ``0..N_c-1`` by ``id = ((k - 1) * m_c + shift_c) mod N_c`` (a bijection, so hot
  ids are not all small), then made global with ``key = offset_c + id`` (``offset_c`` = sum of
  earlier cardinalities).
* dense: latent ``z ~ N(0, 1)`` per column (the normal quantile of a uniform ``u``),
  ``x = floor(exp(mu_j + sigma_j z))``, missing with probability ``missing_j``, stored as
  ``log(x + 1)`` (missing -> 0), as ``schema.dense_log`` does. For x < 4096, x is read from a
  table of the thresholds on ``u`` where it steps (``synthetic_math.dense_tables``).
* label: ``Bernoulli(sigmoid(bias + w · z[:4] + sum_c g(k_c) e(key_c)))`` where ``e(key)`` is a
  hashed per-key effect, uniform in ``[-a, a]`` with ``a = effect_amplitude * sqrt(3 / F)``, and
  ``g(k) = head_rank / (head_rank + k - 1)`` fades it along the Zipf rank ``k``: frequent ids, which
  a model sees often enough to learn, carry the signal (hidden-logit AUC ~0.87-0.90; a per-id
  click-rate encoding fitted on 40k rows already reaches ~0.77-0.80). ``bias`` is calibrated so
  the click rate is ``click_rate``.
  ``hidden_logits`` exposes the true logit, whose AUC bounds what a model can reach.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from ..errors import ConfigError
from . import synthetic_math as sm
from .schema import NUM_DENSE, Batch, resolve_cardinalities, splitmix64
from .tsv import Chunk

_KNUTH_PRIME = 2654435761  # prime > any cardinality here, so m_c = P mod N_c is coprime with N_c


_ROW_SALT = 0xDA7A5EED
_CALIBRATION_ROWS = 4096
#: ids are ((k - 1) * m_c + shift_c) mod N_c in uint64: N_c * P must stay below 2**64
_MAX_CARDINALITY = (1 << 64) // _KNUTH_PRIME
_NORMAL_COEFFS = np.array([sm.NORMAL_A, sm.NORMAL_B, sm.NORMAL_C, sm.NORMAL_D, sm.NORMAL_E,
                           sm.NORMAL_F], np.float64)


class ZipfSampler:
    """Exact samples of a bounded Zipf law ``P(k) = k**-alpha / H_{n,alpha}``, k in 1..n.

    Ranks 1..head by inversion of a CDF table; the tail head+1..n by rejection-inversion against
    the continuous hat ``h(x) = x**-alpha`` (acceptance above 90% for every alpha and n; nothing
    of size n is allocated). alpha > 0 (alpha = 1 included). The arithmetic is
    ``synthetic_math.ZipfMath`` (the same bits in numpy, numba and CUDA).
    """

    def __init__(self, n: int, alpha: float, head: int = sm.ZIPF_HEAD):
        if n < 1:
            raise ConfigError(f"Zipf n={n}: use a cardinality >= 1")
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ConfigError(f"Zipf alpha={alpha}: use a positive exponent such as 1.05")
        self.n, self.alpha = int(n), float(alpha)
        if head < 1:
            raise ConfigError(f"Zipf head={head}: use a table of >= 1 ranks")
        self.math = sm.ZipfMath(self.n, self.alpha, head)

    @property
    def params(self) -> tuple[float, float, float]:
        """(h_top, h_n, s): the tail's constants, as the generators' kernels take them."""
        return self.math.params

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """(size,) int64 ranks in 1..n, from ``rng``'s uniforms."""
        return self.math.ranks(lambda attempt, todo: rng.random(todo.size), size)

    def pmf(self, k: np.ndarray) -> np.ndarray:
        """Exact probabilities for small n (test oracle): (len(k),) float64."""
        weights = np.arange(1, self.n + 1, dtype=np.float64) ** -self.alpha
        return weights[np.asarray(k) - 1] / weights.sum()


class SyntheticCriteo:
    """Deterministic synthetic Criteo rows.

    cardinalities: "kaggle", "mlperf40m", "mlperf_v1" or a list of ints (one per sparse column);
    scale: multiplies every cardinality (each stays >= 1); alpha: Zipf exponent;
    num_rows: stream length (needed by the loader; None = unbounded for ``rows``/``batch``);
    click_rate: target mean label.

    ``rows(start, count)`` -> Chunk with dense (count, 13) float32, ids (count, F) int64 global
    keys, labels (count,) float32, positions = row numbers.
    """

    DENSE_MU = np.array([1.0, 3.0, 2.0, 1.5, 7.0, 3.5, 1.5, 2.5, 4.0, 0.3, 1.0, 0.5, 2.0])
    DENSE_SIGMA = np.array([1.2, 2.0, 1.0, 0.8, 2.0, 1.5, 1.2, 1.0, 1.3, 0.5, 0.8, 1.0, 1.0])
    DENSE_MISSING = np.array([.45, 0., .2, .2, .03, .22, .04, 0., .04, .45, .04, .77, .2])
    DENSE_WEIGHTS = np.array([0.8, -0.6, 0.5, 0.4])

    def __init__(self, cardinalities="kaggle", *, scale: float = 1.0, alpha: float = 1.05,
                 seed: int = 0, num_rows: int | None = None, block_rows: int = 4096,
                 click_rate: float = 0.25, effect_amplitude: float = 3.0, head_rank: float = 50.0):
        self.cardinalities = resolve_cardinalities(cardinalities, scale)
        self.num_features = len(self.cardinalities)
        if not 0.0 < click_rate < 1.0:
            raise ConfigError(f"click_rate={click_rate}: use a rate strictly between 0 and 1")
        if block_rows < 1 or (num_rows is not None and num_rows < 0):
            raise ConfigError(f"block_rows={block_rows}, num_rows={num_rows}: use block_rows >= 1 "
                              f"and num_rows >= 0 or None")
        too_big = [n for n in self.cardinalities if n > _MAX_CARDINALITY]
        if too_big or self.num_features >= sm.MAX_FEATURES:
            raise ConfigError(f"cardinalities {too_big or len(self.cardinalities)}: use at most "
                              f"{sm.MAX_FEATURES - 1} columns of at most {_MAX_CARDINALITY} ids")
        self.alpha, self.seed, self.head_rank = float(alpha), int(seed), float(head_rank)
        self.num_rows, self.block_rows = num_rows, int(block_rows)
        card = np.array(self.cardinalities, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(card)[:-1]]).astype(np.int64)
        self.samplers = [ZipfSampler(int(n), self.alpha) for n in card]
        self._card = card
        self._mult = np.array([_KNUTH_PRIME % n for n in card], np.int64)
        columns = np.arange(len(card), dtype=np.uint64)
        shifts = splitmix64(columns + np.uint64(self.seed) * np.uint64(977))
        self._shift = (shifts % card.astype(np.uint64)).astype(np.int64)
        self._zipf_cdf = np.stack([s.math.cdf for s in self.samplers])
        self._zipf_guide = np.stack([s.math.guide for s in self.samplers])
        self._zipf = np.array([(s.math.p_head,) + s.params for s in self.samplers],
                              np.float64).reshape(-1, 4)
        self._dense_tables = sm.dense_tables(self.DENSE_MU, self.DENSE_SIGMA)
        # every column carries signal; uniform(-a, a) has sd a/sqrt(3), so the summed id effect
        # has sd effect_amplitude whatever the number of columns
        self._amp = np.full(len(card), effect_amplitude * np.sqrt(3.0 / len(card)))
        self._salt = splitmix64(np.array([self.seed ^ 0x5EED], np.uint64))[0]
        # the head ranks' keys and label terms, so a kernel drawing a head rank only looks up
        head = self._zipf_cdf.shape[1]
        self._zipf_ids = np.zeros((len(card), head), np.int64)
        self._zipf_terms = np.zeros((len(card), head), np.float64)
        for c in range(len(card)):
            ranks = np.arange(1, min(int(card[c]), head) + 1, dtype=np.float64)
            key, term = self._key_and_term(c, ranks)
            self._zipf_ids[c, :len(ranks)] = key.astype(np.int64)
            self._zipf_terms[c, :len(ranks)] = term
        self._row_salt = splitmix64(np.array([self.seed ^ _ROW_SALT], np.uint64))[0]
        self.bias = 0.0
        self.bias = self._calibrate(click_rate)

    @property
    def total_keys(self) -> int:
        return int(sum(self.cardinalities))

    def _calibrate(self, click_rate: float) -> float:
        logits = self.reference_rows(0, _CALIBRATION_ROWS)[3]
        low, high = -30.0, 30.0
        for _ in range(60):
            mid = (low + high) / 2
            if np.mean(1.0 / (1.0 + np.exp(-(logits + mid)))) < click_rate:
                low = mid
            else:
                high = mid
        return (low + high) / 2

    def kernel_constants(self) -> dict:
        """Everything the row kernels take besides the row range, as numpy arrays / scalars:
        row_salt, effect_salt (uint64); cards, offsets, mults, shifts (F,) int64; the Zipf
        tables zipf_cdf (F, ZIPF_HEAD) float64, zipf_guide (F, GUIDE) int32, zipf_params (F, 4)
        float64 (p_head, h_top, h_n, s); alpha, head_rank, bias (float); amp (F,), mu, sigma,
        missing (13,), weights (4,) float64; normal_coeffs (6, 8) float64; the dense tables
        dense_thresholds (13, T + 1) float64, dense_guide (13, GUIDE) int32, dense_values (13, T)
        float32 (``synthetic_math.dense_tables``)."""
        thresholds, guides, values = self._dense_tables
        return dict(row_salt=np.uint64(self._row_salt), effect_salt=np.uint64(self._salt),
                    cards=self._card, offsets=self.offsets, mults=self._mult,
                    shifts=self._shift, zipf_cdf=self._zipf_cdf, zipf_guide=self._zipf_guide,
                    zipf_params=self._zipf, zipf_ids=self._zipf_ids, zipf_terms=self._zipf_terms,
                    alpha=self.alpha,
                    head_rank=self.head_rank, amp=self._amp, bias=float(self.bias),
                    mu=self.DENSE_MU.astype(np.float64), sigma=self.DENSE_SIGMA.astype(np.float64),
                    missing=self.DENSE_MISSING.astype(np.float64),
                    weights=self.DENSE_WEIGHTS.astype(np.float64), normal_coeffs=_NORMAL_COEFFS,
                    dense_thresholds=thresholds, dense_guide=guides, dense_values=values)

    def generate(self, start: int, count: int):
        """Rows start..start+count-1 from the numba kernel (all cores, the GIL released):
        (dense (count, 13) float32, ids (count, F) int64, labels (count,) float32,
        logits (count,) float64)."""
        dense = np.empty((count, NUM_DENSE), np.float32)
        ids = np.empty((count, self.num_features), np.int64)
        labels = np.empty(count, np.float32)
        logits = np.empty(count, np.float64)
        if count:
            sm.generate_rows(np.int64(start), np.int64(count), **self.kernel_constants(),
                             dense=dense, ids=ids, labels=labels, logits=logits)
        return dense, ids, labels, logits

    def reference_rows(self, start: int, count: int):
        """The same rows as ``generate`` from vectorised numpy (the test oracle, ~10x slower)."""
        rows = np.arange(start, start + count, dtype=np.int64).astype(np.uint64)
        row_key = sm.splitmix64_np(rows ^ np.uint64(self._row_salt))
        ids = np.empty((count, self.num_features), np.int64)
        effects = np.zeros(count)
        for c, sampler in enumerate(self.samplers):
            def uniforms(attempt, todo, c=c):
                return sm.uniform_np(sm.draw_np(row_key[todo], c, attempt))

            k = sampler.math.ranks(uniforms, count).astype(np.float64)
            key, term = self._key_and_term(c, k)
            ids[:, c] = key.astype(np.int64)
            effects = effects + term
        dense = np.empty((count, NUM_DENSE), np.float32)
        dot = np.zeros(count)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            for j in range(NUM_DENSE):
                u = sm.open_uniform_np(sm.draw_np(row_key, sm.STREAM_DENSE + j))
                z = sm.normal_np(u)
                if j < len(self.DENSE_WEIGHTS):
                    dot = dot + z * self.DENSE_WEIGHTS[j]
                missing = sm.uniform_np(sm.draw_np(row_key, sm.STREAM_MISSING + j))
                thresholds, _, values = self._dense_tables
                x = sm.lookup_np(thresholds[j], u)
                table = values.shape[1]
                big = np.maximum(np.floor(sm.exp_np(self.DENSE_MU[j] + self.DENSE_SIGMA[j] * z)),
                                 float(table))
                value = np.where(x < table, values[j, np.minimum(x, table - 1)],
                                 sm.log_np(big + 1.0).astype(np.float32))
                dense[:, j] = np.where(missing < self.DENSE_MISSING[j], np.float32(0.0), value)
            logits = (self.bias + dot) + effects
            p = 1.0 / (1.0 + sm.exp_np(-logits))
        labels = (sm.uniform_np(sm.draw_np(row_key, sm.STREAM_LABEL)) < p).astype(np.float32)
        return dense, ids, labels, logits

    def _key_and_term(self, c: int, k: np.ndarray):
        """Column c's global keys (uint64) and label terms (float64) of Zipf ranks k (float64)."""
        rank = k.astype(np.uint64)
        key = (np.uint64(self.offsets[c]) + ((rank - np.uint64(1)) * np.uint64(self._mult[c])
                                             + np.uint64(self._shift[c]))
               % np.uint64(self._card[c]))
        weight = self.head_rank / ((self.head_rank + k) - 1.0)
        unit = sm.uniform_np(sm.splitmix64_np(key ^ np.uint64(self._salt)))
        return key, ((2.0 * unit - 1.0) * weight) * self._amp[c]

    def rows(self, start: int, count: int, *, with_logits: bool = False):
        """Rows start..start+count-1 as a Chunk (and their hidden logits (count,) float64)."""
        if start < 0 or count < 0:
            raise ConfigError(f"rows(start={start}, count={count}): both must be >= 0")
        dense, ids, labels, logits = self.generate(start, count)
        chunk = Chunk(dense, ids, labels, np.arange(start, start + count, dtype=np.int64))
        return (chunk, logits) if with_logits else chunk

    def batch(self, batch_size: int, index: int = 0) -> Batch:
        """Batch ``index`` of size ``batch_size``: rows index*B .. (index+1)*B - 1."""
        return self.rows(index * batch_size, batch_size).batch()

    def hidden_logits(self, start: int, count: int) -> np.ndarray:
        """The true logits of rows start..start+count-1: (count,) float64."""
        return self.rows(start, count, with_logits=True)[1]

    # the loader's source protocol: blocks are the units
    def units(self, min_units: int = 1) -> list[int]:
        """Block numbers covering num_rows (``min_units`` is accepted for the source protocol)."""
        if self.num_rows is None:
            raise ConfigError("SyntheticCriteo(num_rows=None) is unbounded: pass num_rows to use "
                              "it as a loader source")
        return list(range(-(-self.num_rows // self.block_rows)))

    def chunk_positions(self, block: int) -> list[np.ndarray]:
        """The positions (row numbers) of each chunk ``read_unit(block)`` yields (one), without
        generating the rows: [(rows,) int64]. The loader uses it to skip work when it resumes."""
        start = block * self.block_rows
        return [np.arange(start, start + min(self.block_rows, self.num_rows - start),
                          dtype=np.int64)]

    def read_unit(self, block: int) -> Iterator[Chunk]:
        start = block * self.block_rows
        yield self.rows(start, min(self.block_rows, self.num_rows - start))

    def __iter__(self) -> Iterator[Chunk]:
        for unit in self.units():
            yield from self.read_unit(unit)
