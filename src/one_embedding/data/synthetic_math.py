"""The synthetic rows' arithmetic, written so numpy, numba and CUDA compute the same bits.

Every random number of row ``r`` is a hash of a counter: ``row_key = splitmix64(r ^ row_salt)``
and draw ``(stream, attempt)`` is ``splitmix64(row_key ^ (stream << 24 | attempt))``, so a row is
a pure function of (seed, r) and any split of the rows over batches, threads or GPU threads gives
the same values. The only float operations are +, -, *, /, sqrt, floor, frexp and ldexp, which
IEEE 754 rounds correctly on every machine; ``log`` and ``exp`` are written out of them here
(fdlibm's polynomials, < 1 ulp) instead of calling libm or CUDA's, whose last bits differ. The
expressions below, ``synthetic.cu`` and the numba kernel keep one order of operations, and none
may be contracted into a fused multiply-add (nvcc --fmad=false; numba without fastmath).

Three implementations of one definition:

* ``*_np`` functions: numpy, vectorised over rows: the reference
  (``SyntheticCriteo.reference_rows``);
* ``generate_rows``: numba, a ``prange`` over rows (the CPU generator);
* ``kernels/cuda/synthetic.cu``: one GPU thread per row (the device generator).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic

# fdlibm's log (e_log.c) and exp (e_exp.c) constants
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e+00
SQRT_HALF = 0.70710678118654757
LG1, LG2, LG3 = 6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01
LG4, LG5, LG6 = 2.222219843214978396e-01, 1.818357216161805012e-01, 1.531383769920937332e-01
LG7 = 1.479819860511658591e-01
P1, P2, P3 = 1.66666666666666019037e-01, -2.77777777770155933842e-03, 6.61375632143793436117e-05
P4, P5 = -1.65339022054652515390e-06, 4.13813679705723846039e-08
#: exp(x) is +inf above this and 0 below EXP_MIN (results stay normal numbers, no ldexp rounding)
EXP_MAX, EXP_MIN = 709.0, -708.0
#: |t| below this: log1p(t)/t and expm1(t)/t from their series
SERIES_BELOW = 1e-8
#: Wichura's AS 241 (PPND16) coefficients of the normal quantile: central region, |q| <= 0.425
NORMAL_A = (3.387132872796366608, 133.14166789178437745, 1971.5909503065514427,
            13731.693765509461125, 45921.953931549871457, 67265.770927008700853,
            33430.575583588128105, 2509.0809287301226727)
NORMAL_B = (1.0, 42.313330701600911252, 687.1870074920579083, 5394.1960214247511077,
            21213.794301586595867, 39307.89580009271061, 28729.085735721942674,
            5226.495278852545925)
# r = sqrt(-log(min(u, 1-u))) <= 5
NORMAL_C = (1.42343711074968357734, 4.6303378461565452959, 5.7694972214606914055,
            3.64784832476320460504, 1.27045825245236838258, 0.24178072517745061177,
            0.0227238449892691845833, 7.7454501427834140764e-4)
NORMAL_D = (1.0, 2.05319162663775882187, 1.6763848301838038494, 0.68976733498510000455,
            0.14810397642748007459, 0.0151986665636164571966, 5.475938084995344946e-4,
            1.05075007164441684324e-9)
# r > 5
NORMAL_E = (6.6579046435011037772, 5.4637849111641143699, 1.7848265399172913358,
            0.29656057182850489123, 0.026532189526576123093, 0.0012426609473880784386,
            2.71155556874348757815e-5, 2.01033439929228813265e-7)
NORMAL_F = (1.0, 0.59983220655588793769, 0.13692988092273580531, 0.0148753612908506148525,
            7.868691311456132591e-4, 1.8463183175100546818e-5, 1.4215117583164458887e-7,
            2.04426310338993978564e-15)

# counters of a row's draws: stream << 24 | attempt
ATTEMPT_BITS = 24
STREAM_DENSE = 1 << 20          # + dense column j: its latent normal
STREAM_MISSING = STREAM_DENSE + 64   # + j: is dense column j missing
STREAM_LABEL = STREAM_DENSE + 128    # the label's uniform
MAX_FEATURES = STREAM_DENSE          # sparse column c draws its Zipf ranks from stream c

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1, MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
TWO_M53 = 2.0 ** -53


# ------------------------------------------------------------------- numpy (vectorised) reference

def splitmix64_np(x):
    z = (np.asarray(x, np.uint64) + GOLDEN).astype(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


def log_np(x):
    """log(x) for x > 0 (float64 arrays)."""
    m, e = np.frexp(np.asarray(x, np.float64))
    low = m < SQRT_HALF
    m = np.where(low, m * 2.0, m)
    k = (e - low).astype(np.float64)
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (LG2 + w * (LG4 + w * LG6))
    t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)))
    r = t2 + t1
    hfsq = 0.5 * f * f
    return k * LN2_HI - ((hfsq - (s * (hfsq + r) + k * LN2_LO)) - f)


def exp_np(x):
    """exp(x): +inf above EXP_MAX, 0 below EXP_MIN (float64 arrays)."""
    x = np.asarray(x, np.float64)
    xc = np.clip(x, EXP_MIN, EXP_MAX)
    k = np.floor(xc * INV_LN2 + 0.5)
    hi = xc - k * LN2_HI
    lo = k * LN2_LO
    r = hi - lo
    t = r * r
    c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))))
    y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi)
    out = np.ldexp(y, k.astype(np.int32))
    return np.where(x > EXP_MAX, np.inf, np.where(x < EXP_MIN, 0.0, out))


def log1p_over_x_np(t):
    """log(1 + t) / t for t > -1: log(u) / (u - 1) with u = 1 + t rounded (Goldberg)."""
    t = np.asarray(t, np.float64)
    small = np.abs(t) < SERIES_BELOW
    u = np.where(small, 2.0, 1.0 + t)
    return np.where(small, (1.0 - t / 2.0) + (t * t) / 3.0, log_np(u) / (u - 1.0))


def expm1_over_x_np(t):
    """(exp(t) - 1) / t: (u - 1) / log(u) with u = exp(t) (Kahan)."""
    t = np.asarray(t, np.float64)
    small = np.abs(t) < SERIES_BELOW
    u = np.where(small, 2.0, exp_np(np.where(small, 0.0, t)))
    return np.where(small, (1.0 + t / 2.0) + (t * t) / 6.0, (u - 1.0) / log_np(u))


def _poly_np(coefficients, r):
    acc = coefficients[-1] * np.ones_like(r)
    for a in coefficients[-2::-1]:
        acc = acc * r + a
    return acc


def normal_np(u):
    """The standard normal quantile of u in (0, 1) (AS 241, ~1e-16 relative)."""
    q = u - 0.5
    central = np.abs(q) <= 0.425
    r = 0.180625 - q * q
    z_central = q * _poly_np(NORMAL_A, r) / _poly_np(NORMAL_B, r)
    tail = np.where(q < 0.0, u, 1.0 - u)
    tail = np.where(central, 0.5, tail)
    r = np.sqrt(-log_np(tail))
    near = r <= 5.0
    rc, re = r - 1.6, r - 5.0
    z_tail = np.where(near, _poly_np(NORMAL_C, rc) / _poly_np(NORMAL_D, rc),
                      _poly_np(NORMAL_E, re) / _poly_np(NORMAL_F, re))
    z_tail = np.where(q < 0.0, -z_tail, z_tail)
    return np.where(central, z_central, z_tail)


def uniform_np(h):
    """(h >> 11) * 2**-53: [0, 1) from uint64 hashes."""
    return (h >> np.uint64(11)).astype(np.float64) * TWO_M53


def open_uniform_np(h):
    """((h >> 11) + 0.5) * 2**-53: (0, 1), for quantiles."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * TWO_M53


def draw_np(row_key, stream, attempt=0):
    counter = np.uint64((int(stream) << ATTEMPT_BITS) | int(attempt))
    return splitmix64_np(row_key ^ counter)


#: Zipf ranks 1..ZIPF_HEAD come from a table (its CDF), the rest by rejection-inversion
ZIPF_HEAD = 4096
#: dense values floor(exp(mu + sigma z)) below DENSE_TABLE come from a table of thresholds on u
DENSE_TABLE = 4096
#: buckets of the tables' guides (a power of 2, so u * GUIDE is exact)
GUIDE = 1024
#: table padding: above every uniform, so a scan stops there
PAD = 2.0


def guide_of(table: np.ndarray) -> np.ndarray:
    """(GUIDE,) int32: entry g counts the values of ascending ``table`` that are <= g / GUIDE, so
    ``lookup`` scans from there: ``count(table <= u)`` in O(1) expected steps."""
    return np.searchsorted(table, np.arange(GUIDE) / GUIDE, side="right").astype(np.int32)


def lookup_np(table: np.ndarray, u):
    """count(table <= u) per u: what the kernels' guided scan computes."""
    return np.searchsorted(table, u, side="right")


class ZipfMath:
    """Exact samples of the bounded Zipf law ``P(k) ∝ k**-alpha``, k in 1..n: ranks up to
    ``head`` by inversion of a CDF table (computed once on the host, shared by every generator),
    the rest by rejection-inversion (Hörmann & Derflinger 1996) restricted to head+1..n on this
    module's log / exp, with the hat's antiderivative ``H``, its inverse and the squeeze ``s``.

    ``cdf``: (head,) float64 padded with PAD, the cumulative probabilities of ranks 1..len;
    ``p_head`` its last value (1.0 when the table holds all n ranks); ``params`` = (h_top, h_n,
    s) float64 for the tail: ``u`` uniform in [h_n, h_top)."""

    def __init__(self, n: int, alpha: float, head: int = ZIPF_HEAD):
        self.n, self.alpha = int(n), float(alpha)
        self.one_minus_alpha = 1.0 - self.alpha
        size = min(self.n, int(head))
        weights = np.arange(1, size + 1, dtype=np.float64) ** -self.alpha
        head_sum = float(weights.sum())
        total = head_sum + self._tail_sum(size + 1, self.n)
        cdf = np.cumsum(weights) / total
        if size == self.n:
            cdf[-1] = 1.0
        self.cdf = np.full(int(head), PAD)
        self.cdf[:size] = cdf
        self.p_head = float(cdf[-1])
        self.guide = guide_of(self.cdf)
        k0 = np.array([size + 1.0])
        h_top = float((self.H(k0 + 0.5) - self.h(k0))[0])
        h_n = float(self.H(np.array([self.n + 0.5]))[0])
        s = 2.0 - float(self.H_inv(self.H(np.array([2.5])) - self.h(np.array([2.0])))[0])
        self.params = (h_top, h_n, s)

    def _tail_sum(self, a: int, b: int) -> float:
        """sum of k**-alpha for k = a..b (Euler-Maclaurin; exact to ~1e-15 for a > 1000)."""
        if a > b:
            return 0.0
        if b - a < 100_000:
            return float((np.arange(a, b + 1, dtype=np.float64) ** -self.alpha).sum())
        al = self.alpha
        log_ratio = math.log(b / a)
        t = (1.0 - al) * log_ratio
        integral = a ** (1.0 - al) * (math.expm1(t) / t if t != 0.0 else 1.0) * log_ratio
        f = lambda x: x ** -al      # noqa: E731
        df = lambda x: -al * x ** (-al - 1.0)      # noqa: E731
        d3f = lambda x: -al * (al + 1.0) * (al + 2.0) * x ** (-al - 3.0)      # noqa: E731
        return integral + (f(a) + f(b)) / 2.0 + (df(b) - df(a)) / 12.0 - (d3f(b) - d3f(a)) / 720.0

    def h(self, x):
        return exp_np(-self.alpha * log_np(x))

    def H(self, x):
        log_x = log_np(x)
        return expm1_over_x_np(self.one_minus_alpha * log_x) * log_x

    def H_inv(self, y):
        return exp_np(log1p_over_x_np(self.one_minus_alpha * y) * y)

    def ranks(self, uniforms_of_attempt, size: int) -> np.ndarray:
        """(size,) int64 ranks in 1..n; ``uniforms_of_attempt(attempt, rows)`` gives the [0, 1)
        uniforms of that attempt for the rows (indices) still to draw: attempt 0 picks the rank
        from the table when below p_head, attempts 1, 2, ... draw the tail."""
        h_top, h_n, s = self.params
        first = uniforms_of_attempt(0, np.arange(size))
        out = (lookup_np(self.cdf, first) + 1).astype(np.int64)
        todo = np.flatnonzero(first >= self.p_head)
        low = float(min(self.n, len(self.cdf)) + 1)
        attempt = 1
        with np.errstate(invalid="ignore", divide="ignore"):
            while todo.size:
                u = h_n + uniforms_of_attempt(attempt, todo) * (h_top - h_n)
                x = self.H_inv(u)
                k = np.minimum(np.maximum(np.floor(x + 0.5), low), float(self.n))
                accept = (k - x <= s) | (u >= self.H(k + 0.5) - self.h(k))
                out[todo[accept]] = k[accept].astype(np.int64)
                todo = todo[~accept]
                attempt += 1
        return out


def normal_cdf(t: np.ndarray) -> np.ndarray:
    """Phi(t), host only (math.erfc): the dense tables' thresholds."""
    values = [0.5 * math.erfc(-v / math.sqrt(2.0)) for v in np.ravel(t)]
    return np.array(values).reshape(np.shape(t))


def dense_tables(mu: np.ndarray, sigma: np.ndarray, size: int = DENSE_TABLE):
    """Per dense column j: thresholds (J, size + 1) float64, where x = floor(exp(mu + sigma z)) is
    >= m exactly when u = Phi(z) >= thresholds[j, m - 1] (m = 1..size; PAD after), their guides
    (J, GUIDE) int32, and values (J, size) float32 = log(x + 1) for x = 0..size-1."""
    m = np.arange(1, size + 1, dtype=np.float64)
    thresholds = np.full((len(mu), size + 1), PAD)
    for j in range(len(mu)):
        thresholds[j, :size] = normal_cdf((np.log(m) - mu[j]) / sigma[j])
    guides = np.stack([guide_of(t) for t in thresholds])
    values = np.tile(np.log1p(np.arange(size, dtype=np.float64)).astype(np.float32), (len(mu), 1))
    return thresholds, guides, values


# ------------------------------------------------------------------- numba (scalar, per row)

@njit(cache=True, nogil=True, inline="always")
def _splitmix64(x):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@intrinsic
def _f64_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


@intrinsic
def _bits_f64(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@njit(cache=True, nogil=True, inline="always")
def _frexp(x):
    """math.frexp for a positive normal x (a bit field, not a libm call): (m in [0.5, 1), e)."""
    bits = _f64_bits(x)
    e = ((bits >> 52) & 0x7FF) - 1022
    return _bits_f64((bits & 0xFFFFFFFFFFFFF) | (1022 << 52)), e


@njit(cache=True, nogil=True, inline="always")
def _ldexp(y, k):
    """math.ldexp(y, k) for y in [0.5, 4) and a normal result: y * 2**k, exact."""
    return y * _bits_f64(np.int64(k + 1023) << 52)


@njit(cache=True, nogil=True, inline="always")
def _log(x):
    m, e = _frexp(x)
    if m < SQRT_HALF:
        m = m * 2.0
        e = e - 1
    k = float(e)
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (LG2 + w * (LG4 + w * LG6))
    t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)))
    r = t2 + t1
    hfsq = 0.5 * f * f
    return k * LN2_HI - ((hfsq - (s * (hfsq + r) + k * LN2_LO)) - f)


@njit(cache=True, nogil=True, inline="always")
def _exp(x):
    if x > EXP_MAX:
        return math.inf
    if x < EXP_MIN:
        return 0.0
    k = math.floor(x * INV_LN2 + 0.5)
    hi = x - k * LN2_HI
    lo = k * LN2_LO
    r = hi - lo
    t = r * r
    c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))))
    y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi)
    return _ldexp(y, int(k))


@njit(cache=True, nogil=True, inline="always")
def _log1p_over_x(t):
    if abs(t) < SERIES_BELOW:
        return (1.0 - t / 2.0) + (t * t) / 3.0
    u = 1.0 + t
    return _log(u) / (u - 1.0)


@njit(cache=True, nogil=True, inline="always")
def _expm1_over_x(t):
    if abs(t) < SERIES_BELOW:
        return (1.0 + t / 2.0) + (t * t) / 6.0
    u = _exp(t)
    return (u - 1.0) / _log(u)


@njit(cache=True, nogil=True, inline="always")
def _poly(c, r):
    acc = c[7]
    for i in range(6, -1, -1):
        acc = acc * r + c[i]
    return acc


@njit(cache=True, nogil=True)
def _normal(u, na, nb, nc, nd, ne, nf):
    q = u - 0.5
    if abs(q) <= 0.425:
        r = 0.180625 - q * q
        return q * _poly(na, r) / _poly(nb, r)
    tail = u if q < 0.0 else 1.0 - u
    r = math.sqrt(-_log(tail))
    if r <= 5.0:
        rc = r - 1.6
        z = _poly(nc, rc) / _poly(nd, rc)
    else:
        re = r - 5.0
        z = _poly(ne, re) / _poly(nf, re)
    return -z if q < 0.0 else z


@njit(cache=True, nogil=True, inline="always")
def _uniform(h):
    return float(h >> np.uint64(11)) * TWO_M53


@njit(cache=True, nogil=True, inline="always")
def _lookup(table, guide, row, u):
    """count(table[row] <= u): the guide's count at floor(u * GUIDE), then a scan (each table
    row ends in PAD)."""
    i = guide[row, int(u * GUIDE)]
    while table[row, i] <= u:
        i += 1
    return i


@njit(cache=True, nogil=True, inline="always")
def _zipf_tail(row_key, column, n, alpha, low, h_top, h_n, s):
    """A rank in low..n by rejection-inversion (attempts 1, 2, ...)."""
    one_minus_alpha = 1.0 - alpha
    attempt = 1
    while True:
        counter = np.uint64((column << ATTEMPT_BITS) | attempt)
        u = h_n + _uniform(_splitmix64(row_key ^ counter)) * (h_top - h_n)
        x = _exp(_log1p_over_x(one_minus_alpha * u) * u)
        k = math.floor(x + 0.5)
        k = min(max(k, low), float(n))
        if k - x <= s:
            return k
        kh = k + 0.5
        log_kh = _log(kh)
        big_h = _expm1_over_x(one_minus_alpha * log_kh) * log_kh
        small_h = _exp(-alpha * _log(k))
        if u >= big_h - small_h:
            return k
        attempt += 1


@njit(cache=True, nogil=True, parallel=True)
def generate_rows(start, count, row_salt, effect_salt, cards, offsets, mults, shifts, zipf_cdf,
                  zipf_guide, zipf_params, zipf_ids, zipf_terms, alpha, head_rank, amp, bias,
                  mu, sigma, missing, weights, normal_coeffs, dense_thresholds, dense_guide,
                  dense_values, dense, ids, labels, logits):
    """Rows start..start+count-1 into dense (count, 13) float32, ids (count, F) int64, labels
    (count,) float32 and logits (count,) float64. cards / offsets / mults / shifts: (F,) int64;
    zipf_cdf (F, ZIPF_HEAD) float64, zipf_guide (F, GUIDE) int32, zipf_params (F, 4) float64
    (p_head, h_top, h_n, s); zipf_ids (F, ZIPF_HEAD) int64 and zipf_terms (F, ZIPF_HEAD) float64:
    the key and the label term of each head rank, as the tail's code computes them; amp: (F,)
    float64; mu / sigma / missing: (13,), weights: (W,) float64; normal_coeffs: (6, 8) float64
    (AS 241's A..F); dense_thresholds (13, T + 1) float64, dense_guide (13, GUIDE) int32,
    dense_values (13, T) float32 (``dense_tables``)."""
    num_features = cards.shape[0]
    num_dense = mu.shape[0]
    head = zipf_cdf.shape[1]
    table = dense_values.shape[1]
    na, nb, nc = normal_coeffs[0], normal_coeffs[1], normal_coeffs[2]
    nd, ne, nf = normal_coeffs[3], normal_coeffs[4], normal_coeffs[5]
    for i in prange(count):
        row_key = _splitmix64(np.uint64(start + i) ^ row_salt)
        effects = 0.0
        for c in range(num_features):
            u = _uniform(_splitmix64(row_key ^ np.uint64(c << ATTEMPT_BITS)))
            if u < zipf_params[c, 0]:
                r = _lookup(zipf_cdf, zipf_guide, c, u)
                ids[i, c] = zipf_ids[c, r]
                effects = effects + zipf_terms[c, r]
                continue
            k = _zipf_tail(row_key, c, cards[c], alpha, float(min(cards[c], head) + 1),
                           zipf_params[c, 1], zipf_params[c, 2], zipf_params[c, 3])
            rank = np.uint64(k)
            key = np.uint64(offsets[c]) + ((rank - np.uint64(1)) * np.uint64(mults[c])
                                           + np.uint64(shifts[c])) % np.uint64(cards[c])
            ids[i, c] = np.int64(key)
            weight = head_rank / ((head_rank + k) - 1.0)
            unit = _uniform(_splitmix64(key ^ effect_salt))
            effects = effects + ((2.0 * unit - 1.0) * weight) * amp[c]
        dot = 0.0
        for j in range(num_dense):
            h = _splitmix64(row_key ^ np.uint64((STREAM_DENSE + j) << ATTEMPT_BITS))
            u = (float(h >> np.uint64(11)) + 0.5) * TWO_M53
            if j < weights.shape[0]:
                dot = dot + _normal(u, na, nb, nc, nd, ne, nf) * weights[j]
            h = _splitmix64(row_key ^ np.uint64((STREAM_MISSING + j) << ATTEMPT_BITS))
            if _uniform(h) < missing[j]:
                dense[i, j] = np.float32(0.0)
                continue
            x = _lookup(dense_thresholds, dense_guide, j, u)
            if x < table:
                dense[i, j] = dense_values[j, x]
            else:
                z = _normal(u, na, nb, nc, nd, ne, nf)
                big = max(math.floor(_exp(mu[j] + sigma[j] * z)), float(table))
                dense[i, j] = np.float32(_log(big + 1.0))
        logit = (bias + dot) + effects
        logits[i] = logit
        h = _splitmix64(row_key ^ np.uint64(STREAM_LABEL << ATTEMPT_BITS))
        p = 1.0 / (1.0 + _exp(-logit))
        labels[i] = np.float32(1.0) if _uniform(h) < p else np.float32(0.0)
