// Synthetic Criteo rows on the device: one thread per row, the arithmetic of
// one_embedding/data/synthetic_math.py operation for operation, so a row's ids, dense values,
// label and logit are the bits the CPU generator (numba) and the numpy reference compute.
//
// Only correctly rounded operations (+ - * / sqrt floor frexp ldexp) touch floats; log and exp are
// fdlibm's polynomials written out here, never CUDA's log()/exp() (whose last bits differ from
// the host's). Compiled with --fmad=false (cuda_module.COMPILE_OPTIONS): no a*b+c is contracted.
#include "common.cuh"

namespace synth {

constexpr int ATTEMPT_BITS = 24;
constexpr oe::u64 STREAM_DENSE = 1ull << 20;
constexpr oe::u64 STREAM_MISSING = STREAM_DENSE + 64;
constexpr oe::u64 STREAM_LABEL = STREAM_DENSE + 128;
constexpr int GUIDE = 1024;
constexpr double TWO_M53 = 1.0 / 9007199254740992.0;
constexpr double LN2_HI = 6.93147180369123816490e-01;
constexpr double LN2_LO = 1.90821492927058770002e-10;
constexpr double INV_LN2 = 1.44269504088896338700e+00;
constexpr double SQRT_HALF = 0.70710678118654757;
constexpr double LG1 = 6.666666666666735130e-01, LG2 = 3.999999999940941908e-01;
constexpr double LG3 = 2.857142874366239149e-01, LG4 = 2.222219843214978396e-01;
constexpr double LG5 = 1.818357216161805012e-01, LG6 = 1.531383769920937332e-01;
constexpr double LG7 = 1.479819860511658591e-01;
constexpr double P1 = 1.66666666666666019037e-01, P2 = -2.77777777770155933842e-03;
constexpr double P3 = 6.61375632143793436117e-05, P4 = -1.65339022054652515390e-06;
constexpr double P5 = 4.13813679705723846039e-08;
constexpr double EXP_MAX = 709.0, EXP_MIN = -708.0;
constexpr double SERIES_BELOW = 1e-8;

// splitmix64 with its increment (common.cuh's oe::splitmix64 is the finalizer alone)
__device__ __forceinline__ oe::u64 mix(oe::u64 x) { return oe::splitmix64(x + oe::GOLDEN); }

__device__ __forceinline__ double uniform(oe::u64 h) { return (double)(h >> 11) * TWO_M53; }

__device__ __forceinline__ double log_(double x) {
  int e;
  double m = frexp(x, &e);
  if (m < SQRT_HALF) {
    m = m * 2.0;
    e = e - 1;
  }
  const double k = (double)e;
  const double f = m - 1.0;
  const double s = f / (2.0 + f);
  const double z = s * s;
  const double w = z * z;
  const double t1 = w * (LG2 + w * (LG4 + w * LG6));
  const double t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)));
  const double r = t2 + t1;
  const double hfsq = 0.5 * f * f;
  return k * LN2_HI - ((hfsq - (s * (hfsq + r) + k * LN2_LO)) - f);
}

__device__ __forceinline__ double exp_(double x) {
  if (x > EXP_MAX) return 1.0 / 0.0;
  if (x < EXP_MIN) return 0.0;
  const double k = floor(x * INV_LN2 + 0.5);
  const double hi = x - k * LN2_HI;
  const double lo = k * LN2_LO;
  const double r = hi - lo;
  const double t = r * r;
  const double c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))));
  const double y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi);
  return ldexp(y, (int)k);
}

__device__ __forceinline__ double log1p_over_x(double t) {
  if ((t < 0.0 ? -t : t) < SERIES_BELOW) return (1.0 - t / 2.0) + (t * t) / 3.0;
  const double u = 1.0 + t;
  return log_(u) / (u - 1.0);
}

__device__ __forceinline__ double expm1_over_x(double t) {
  if ((t < 0.0 ? -t : t) < SERIES_BELOW) return (1.0 + t / 2.0) + (t * t) / 6.0;
  const double u = exp_(t);
  return (u - 1.0) / log_(u);
}

// c[7] r^7 + ... + c[0] by Horner, as synthetic_math._poly
__device__ __forceinline__ double poly(const double* c, double r) {
  double acc = c[7];
  for (int i = 6; i >= 0; --i) acc = acc * r + c[i];
  return acc;
}

// AS 241's normal quantile; coeffs: (6, 8) A..F
__device__ double normal(double u, const double* coeffs) {
  const double q = u - 0.5;
  if ((q < 0.0 ? -q : q) <= 0.425) {
    const double r = 0.180625 - q * q;
    return q * poly(coeffs, r) / poly(coeffs + 8, r);
  }
  const double tail = q < 0.0 ? u : 1.0 - u;
  const double r = sqrt(-log_(tail));
  double z;
  if (r <= 5.0) {
    const double rc = r - 1.6;
    z = poly(coeffs + 16, rc) / poly(coeffs + 24, rc);
  } else {
    const double re = r - 5.0;
    z = poly(coeffs + 32, re) / poly(coeffs + 40, re);
  }
  return q < 0.0 ? -z : z;
}

// count(table[0..] <= u) for an ascending table ending in a value above 1, with its guide
__device__ __forceinline__ int lookup(const double* table, const int* guide, double u) {
  int i = guide[(int)(u * GUIDE)];
  while (table[i] <= u) ++i;
  return i;
}

// a Zipf rank in low..n by rejection-inversion, attempts 1, 2, ...
__device__ double zipf_tail(oe::u64 row_key, oe::u64 column, oe::i64 n, double alpha, double low,
                            double h_top, double h_n, double s) {
  const double one_minus_alpha = 1.0 - alpha;
  for (oe::u64 attempt = 1;; ++attempt) {
    const oe::u64 counter = (column << ATTEMPT_BITS) | attempt;
    const double u = h_n + uniform(mix(row_key ^ counter)) * (h_top - h_n);
    const double x = exp_(log1p_over_x(one_minus_alpha * u) * u);
    double k = floor(x + 0.5);
    k = k < low ? low : k;
    k = k > (double)n ? (double)n : k;
    if (k - x <= s) return k;
    const double log_kh = log_(k + 0.5);
    const double big_h = expm1_over_x(one_minus_alpha * log_kh) * log_kh;
    const double small_h = exp_(-alpha * log_(k));
    if (u >= big_h - small_h) return k;
  }
}

}  // namespace synth

// The rows at positions (count,) int64 (SyntheticCriteo.kernel_constants names every table):
//   cards / offsets / mults / shifts: (F,); zipf_cdf, zipf_ids, zipf_terms: (F, head);
//   zipf_guide: (F, 1024); zipf_params: (F, 4) = p_head, h_top, h_n, s; amp: (F,);
//   dense_consts: mu (J,), sigma (J,), missing (J,), weights (W,) concatenated;
//   normal_coeffs: (6, 8); dense_thresholds: (J, table + 1); dense_guide: (J, 1024);
//   dense_values: (J, table) float.
// Out: dense (count, J) T, ids (count, F) int64, labels (count,) T, logits (count,) double.
template <typename T>
__global__ void synthetic_rows(const oe::i64* positions, oe::i64 count, int num_features,
                               int num_dense, int num_weights, oe::u64 row_salt,
                               oe::u64 effect_salt,
                               const oe::i64* cards, const oe::i64* offsets,
                               const oe::i64* mults, const oe::i64* shifts,
                               const double* zipf_cdf, const int* zipf_guide,
                               const double* zipf_params, const oe::i64* zipf_ids,
                               const double* zipf_terms, int head, double alpha,
                               double head_rank, const double* amp, double bias,
                               const double* dense_consts, const double* normal_coeffs,
                               const double* dense_thresholds, const int* dense_guide,
                               const float* dense_values, int table, T* dense, oe::i64* ids,
                               T* labels, double* logits) {
  const double* mu = dense_consts;
  const double* sigma = dense_consts + num_dense;
  const double* missing = dense_consts + 2 * num_dense;
  const double* weights = dense_consts + 3 * num_dense;
  for (oe::i64 i = oe::grid_thread(); i < count; i += oe::grid_threads()) {
    const oe::u64 row_key = synth::mix((oe::u64)positions[i] ^ row_salt);
    double effects = 0.0;
    for (int c = 0; c < num_features; ++c) {
      const oe::u64 column = (oe::u64)c;
      const double u = synth::uniform(synth::mix(row_key ^ (column << synth::ATTEMPT_BITS)));
      if (u < zipf_params[4 * c]) {
        const int r = synth::lookup(zipf_cdf + (oe::i64)c * head,
                                    zipf_guide + (oe::i64)c * synth::GUIDE, u);
        ids[i * num_features + c] = zipf_ids[(oe::i64)c * head + r];
        effects = effects + zipf_terms[(oe::i64)c * head + r];
        continue;
      }
      const oe::i64 n = cards[c];
      const double low = (double)((n < head ? n : (oe::i64)head) + 1);
      const double k = synth::zipf_tail(row_key, column, n, alpha, low, zipf_params[4 * c + 1],
                                        zipf_params[4 * c + 2], zipf_params[4 * c + 3]);
      const oe::u64 rank = (oe::u64)k;
      const oe::u64 key = (oe::u64)offsets[c] +
                          ((rank - 1ull) * (oe::u64)mults[c] + (oe::u64)shifts[c]) % (oe::u64)n;
      ids[i * num_features + c] = (oe::i64)key;
      const double weight = head_rank / ((head_rank + k) - 1.0);
      const double unit = synth::uniform(synth::mix(key ^ effect_salt));
      effects = effects + ((2.0 * unit - 1.0) * weight) * amp[c];
    }
    double dot = 0.0;
    for (int j = 0; j < num_dense; ++j) {
      const oe::u64 stream = (synth::STREAM_DENSE + (oe::u64)j) << synth::ATTEMPT_BITS;
      const double u = ((double)(synth::mix(row_key ^ stream) >> 11) + 0.5) * synth::TWO_M53;
      if (j < num_weights) dot = dot + synth::normal(u, normal_coeffs) * weights[j];
      const oe::u64 gone = (synth::STREAM_MISSING + (oe::u64)j) << synth::ATTEMPT_BITS;
      float value;
      if (synth::uniform(synth::mix(row_key ^ gone)) < missing[j]) {
        value = 0.0f;
      } else {
        const int x = synth::lookup(dense_thresholds + (oe::i64)j * (table + 1),
                                    dense_guide + (oe::i64)j * synth::GUIDE, u);
        if (x < table) {
          value = dense_values[(oe::i64)j * table + x];
        } else {
          const double z = synth::normal(u, normal_coeffs);
          double big = floor(synth::exp_(mu[j] + sigma[j] * z));
          big = big > (double)table ? big : (double)table;
          value = (float)synth::log_(big + 1.0);
        }
      }
      dense[i * num_dense + j] = (T)value;
    }
    const double logit = (bias + dot) + effects;
    logits[i] = logit;
    const double p = 1.0 / (1.0 + synth::exp_(-logit));
    const oe::u64 label_stream = synth::STREAM_LABEL << synth::ATTEMPT_BITS;
    labels[i] = synth::uniform(synth::mix(row_key ^ label_stream)) < p ? T(1) : T(0);
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(synthetic_rows)
#endif
