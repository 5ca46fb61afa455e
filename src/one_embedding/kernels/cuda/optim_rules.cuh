// The row optimizer rules and their drivers, for optim.cu's kernels (the top of optim.cu says what
// they compute and how): oe::optim's gradient sources (RowGrads, SummedGrads), rules (Sgd,
// Momentum, Adagrad, Adam, Ftrl, SmartDecayAdam: one element's update each), the elements a
// driver keeps (EveryElement, DenseSegments) and the drivers (update_elements, update_vectors,
// update). Included by optim.cu after common.cuh and vector.cuh; no host header (NVRTC has none).
#pragma once
#include "common.cuh"
#include "vector.cuh"

namespace oe {
namespace optim {

// The gradient term every update starts from, as the CPU kernels form it: g * factor (grad_scale,
// negated with maximize), plus l2 * w only when l2 != 0 (so a run without L2 decay adds nothing,
// not even a 0 * w).
__device__ __forceinline__ double gradient_term(double g, double factor, double l2, double w) {
  double gi = g * factor;
  if (l2 != 0.0) gi = gi + l2 * w;
  return gi;
}

// n ** power in double; +-0.5 as sqrt and 1 / sqrt (correctly rounded), as the CPU kernels.
__device__ __forceinline__ double ftrl_powered(double n, double power) {
  if (power == 0.5) return sqrt(n);
  if (power == -0.5) return 1.0 / sqrt(n);
  return pow(n, power);
}

// x ** k for an integer k >= 0 by squaring, in the order optim/kernels.py's _powi multiplies.
__device__ __forceinline__ double powi(double x, i64 k) {
  double result = 1.0;
  while (k > 0) {
    if (k & 1) result = result * x;
    x = x * x;
    k >>= 1;
  }
  return result;
}

// A row's last-update step: an int64 in the line, OneFlow's layout (two float32 slots holding its
// little-endian words, or one double).
__device__ __forceinline__ i64 load_step(const float* p) {
  return (i64)(((u64)__float_as_uint(p[1]) << 32) | (u64)__float_as_uint(p[0]));
}
__device__ __forceinline__ i64 load_step(const double* p) { return __double_as_longlong(p[0]); }
__device__ __forceinline__ void store_step(float* p, i64 step) {
  p[0] = __uint_as_float((unsigned)((u64)step & 0xffffffffull));
  p[1] = __uint_as_float((unsigned)((u64)step >> 32));
}
__device__ __forceinline__ void store_step(double* p, i64 step) {
  p[0] = __longlong_as_double(step);
}


// Gradient sources: the value of element t = (row, column) of the (n, dim) gradient, in double.
template <typename T>
struct RowGrads {
  const T* grads;
  __device__ __forceinline__ double operator()(i64 t) const { return (double)grads[t]; }
  // elements t .. t + LANES - 1 (t a multiple of LANES) in one 16-byte load
  __device__ __forceinline__ void group(i64 t, double* g) const {
    typedef typename Vector16<T>::type V;
    const V v = *as_vectors<const V>(grads + t);
    ONE_EMBEDDING_UNROLL
    for (int c = 0; c < Vector16<T>::LANES; ++c) g[c] = (double)reinterpret_cast<const T*>(&v)[c];
  }
};

// The sum of segment s's rows of values at column c in the tree order of common.cuh, as
// embedding_segment_sum and embedding_tree_level sum it: a segment of at most SUM_CHUNK rows is
// summed here (row order from +0 in T, embedding_segment_sum's loop); a longer one's total was
// summed by the tree's level kernels beforehand into long_totals (n, dim) T (rows of the long
// segments only), and is read from there. Either way the same float bit for bit.
template <typename T>
__device__ __forceinline__ T segment_total(const T* values, int dim, const i64* rows_by_segment,
                                           const i64* offsets, const T* long_totals, i64 s,
                                           int c) {
  const i64 begin = offsets[s], end = offsets[s + 1];
  if (end - begin > SUM_CHUNK) return long_totals[s * dim + c];
  return ordered_row_sum(values, dim, rows_by_segment, begin, end, c);
}

// ordered_row_sum of the LANES = 16 / sizeof(T) consecutive columns c .. c + LANES - 1 at once,
// each row's group read as one 16-byte vector (Vector16, vector.cuh): out[j] is the sum at column
// c + j, added in row order from +0 as ordered_row_sum adds it, so the same bits; a quarter of
// the loads. values 16-byte aligned, dim and c multiples of LANES (the host decides:
// device_ops.run_update's group_reads).
template <typename T>
__device__ __forceinline__ void ordered_row_sum_group(const T* values, int dim,
                                                      const i64* rows_by_segment, i64 begin,
                                                      i64 end, int c, T* out) {
  typedef typename Vector16<T>::type V;
  constexpr int kAhead = 8;
  constexpr int LANES = Vector16<T>::LANES;
  ONE_EMBEDDING_UNROLL
  for (int j = 0; j < LANES; ++j) out[j] = T(0);
  i64 k = begin;
  for (; k + kAhead <= end; k += kAhead) {
    V v[kAhead];
    ONE_EMBEDDING_UNROLL
    for (int a = 0; a < kAhead; ++a) {
      v[a] = *as_vectors<const V>(values + rows_by_segment[k + a] * dim + c);
    }
    ONE_EMBEDDING_UNROLL
    for (int a = 0; a < kAhead; ++a) {
      const T* lanes = reinterpret_cast<const T*>(&v[a]);
      ONE_EMBEDDING_UNROLL
      for (int j = 0; j < LANES; ++j) out[j] += lanes[j];
    }
  }
  for (; k < end; ++k) {
    const V v = *as_vectors<const V>(values + rows_by_segment[k] * dim + c);
    const T* lanes = reinterpret_cast<const T*>(&v);
    ONE_EMBEDDING_UNROLL
    for (int j = 0; j < LANES; ++j) out[j] += lanes[j];
  }
}

template <typename T>
struct SummedGrads {
  const T* values;
  const i64* rows_by_segment;
  const i64* offsets;
  const T* long_totals;
  int dim;
  int vector;  // group reads 16-byte vectors of values and long_totals (both 16-byte aligned)
  __device__ __forceinline__ double operator()(i64 t) const {
    const i64 s = t / dim;
    return (double)segment_total(values, dim, rows_by_segment, offsets, long_totals, s,
                                 (int)(t - s * dim));
  }
  // elements t .. t + LANES - 1 of one segment, each summed as above (per column, tree order):
  // with `vector`, all LANES columns at once, a row's group one 16-byte load (the same sums)
  __device__ __forceinline__ void group(i64 t, double* g) const {
    constexpr int LANES = Vector16<T>::LANES;
    if (!vector) {
      ONE_EMBEDDING_UNROLL
      for (int c = 0; c < LANES; ++c) g[c] = (*this)(t + c);
      return;
    }
    const i64 s = t / dim;
    const int c = (int)(t - s * dim);
    const i64 begin = offsets[s], end = offsets[s + 1];
    T sums[LANES];
    if (end - begin > SUM_CHUNK) {
      typedef typename Vector16<T>::type V;
      const V v = *as_vectors<const V>(long_totals + s * dim + c);
      ONE_EMBEDDING_UNROLL
      for (int j = 0; j < LANES; ++j) sums[j] = reinterpret_cast<const T*>(&v)[j];
    } else {
      ordered_row_sum_group(values, dim, rows_by_segment, begin, end, c, sums);
    }
    ONE_EMBEDDING_UNROLL
    for (int j = 0; j < LANES; ++j) g[j] = (double)sums[j];
  }
};

// The rules, one element at a time: x[0] = w, x[k] = state k (k = 1 .. states()), in double,
// read from the line; the rule updates them in place from g (the element's gradient, in double)
// and the drivers round each back to T once. row: the line's index (SmartDecayAdam reads the
// row's last step there).

// SGD: w -= lr * (g * factor + wd * w) (decoupled and L2 decay coincide without state).
struct Sgd {
  double factor, lr, wd;
  __device__ __forceinline__ int states() const { return 0; }
  __device__ __forceinline__ void operator()(double* x, double g, i64) const {
    const double w = x[0];
    x[0] = w - lr * (g * factor + wd * w);
  }
};

// Momentum: m = beta * m + keep * g'; d = g' + beta * m (nesterov) or m; w -= lr * d + lr_wd * w
// (keep = 1 - dampening; state 1 = m).
struct Momentum {
  double factor, l2, lr, beta, keep;
  int nesterov;
  double lr_wd;
  __device__ __forceinline__ int states() const { return 1; }
  __device__ __forceinline__ void operator()(double* x, double grad, i64) const {
    const double w = x[0];
    const double g = gradient_term(grad, factor, l2, w);
    double m = beta * x[1] + keep * g;
    x[1] = m;
    if (nesterov) m = g + beta * m;
    x[0] = w - lr * m - lr_wd * w;
  }
};

// Adagrad: s += g'^2; w -= clr * g' / (sqrt(s) + eps) + clr_wd * w (state 1 = s).
struct Adagrad {
  double factor, l2, clr, eps, clr_wd;
  __device__ __forceinline__ int states() const { return 1; }
  __device__ __forceinline__ void operator()(double* x, double grad, i64) const {
    const double w = x[0];
    const double g = gradient_term(grad, factor, l2, w);
    const double s = x[1] + g * g;
    x[1] = s;
    x[0] = w - clr * g / (sqrt(s) + eps) - clr_wd * w;
  }
};

// Adam: m = b1 m + (1 - b1) g'; v = b2 v + (1 - b2) g'^2; with amsgrad v_max = max(v_max, v) is
// used for v below; w -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps) + lr_wd * w
// (states 1, 2, 3 = m, v, v_max; v_max is neither read nor written without amsgrad).
struct Adam {
  double factor, l2, b1, b2, step_size, inv_sqrt_bc2, eps, lr_wd;
  int amsgrad;
  __device__ __forceinline__ int states() const { return amsgrad ? 3 : 2; }
  __device__ __forceinline__ void operator()(double* x, double grad, i64) const {
    const double w = x[0];
    const double g = gradient_term(grad, factor, l2, w);
    const double m = b1 * x[1] + (1.0 - b1) * g;
    double v = b2 * x[2] + (1.0 - b2) * (g * g);
    x[1] = m;
    x[2] = v;
    if (amsgrad) {
      const double v_max = x[3];
      v = v > v_max ? v : v_max;  // Python's max(v_max, v)
      x[3] = v;
    }
    x[0] = w - step_size * (m / (sqrt(v) * inv_sqrt_bc2 + eps)) - lr_wd * w;
  }
};

// FTRL, both conventions of optim/ftrl.py: n' = n + g'^2; z += g' - (P(n') - P(n)) / lr * w;
// n = n'; w = (sign(z) l1 - z) / ((beta + P(n')) / lr + quad_l2) - lr_wd * w outside the dead
// zone (|z| < l1, or |z| <= l1 when closed), else 0; P(n) = n ** power (states 1, 2 = n, z).
struct Ftrl {
  double factor, l2, inv_lr, power, l1, quad_l2, beta;
  int closed;
  double lr_wd;
  __device__ __forceinline__ int states() const { return 2; }
  __device__ __forceinline__ void operator()(double* x, double grad, i64) const {
    const double w = x[0];
    const double g = gradient_term(grad, factor, l2, w);
    const double acc = x[1];
    const double acc_new = acc + g * g;
    const double p_old = ftrl_powered(acc, power);
    const double p_new = ftrl_powered(acc_new, power);
    const double z = x[2] + g - (p_new - p_old) * inv_lr * w;
    x[1] = acc_new;
    x[2] = z;
    if (fabs(z) > l1 || (!closed && fabs(z) == l1)) {
      double out = (copysign(l1, z) - z) / ((beta + p_new) * inv_lr + quad_l2);
      if (lr_wd != 0.0) out = out - lr_wd * w;
      x[0] = out;
    } else {
      x[0] = 0.0;
    }
  }
};

// SmartDecayAdam on embedding rows (OneFlow's SmartDecaySparseAdamUpdateKernel): with
// k = t - (the row's last step), m' = b1^k m + (1 - b1) g'; v' = b2^k v + (1 - b2) g'^2;
// catchup = m b1 (1 - b1^(k-1)) / (1 - b1) when k > 1; w -= lr (m' + catchup) / (sqrt(v') + eps)
// (states 1, 2 = m, v; the step at column step_col of the line). The steps are read here and
// written by optim_smart_decay_adam_steps afterwards: a thread must not see its row's new step.
template <typename T>
struct SmartDecayAdam {
  const T* lines;
  int line_size;
  double factor, l2, b1, b2, lr, eps;
  i64 t;
  int step_col;
  __device__ __forceinline__ int states() const { return 2; }
  __device__ __forceinline__ void operator()(double* x, double grad, i64 row) const {
    const i64 k = t - load_step(lines + row * line_size + step_col);
    const double w = x[0];
    const double g = gradient_term(grad, factor, l2, w);
    const double m_old = x[1];
    const double catchup = k > 1 ? m_old * b1 * (1.0 - powi(b1, k - 1)) / (1.0 - b1) : 0.0;
    const double m = powi(b1, k) * m_old + (1.0 - b1) * g;
    const double v = powi(b2, k) * x[2] + (1.0 - b2) * (g * g);
    x[1] = m;
    x[2] = v;
    x[0] = w - lr * (m + catchup) / (sqrt(v) + eps);
  }
};

// The most states a rule keeps (Adam with amsgrad).
constexpr int MAX_STATES = 3;

// Which elements a driver updates (element index t of the (n, dim) gradient): every one for the
// row kernels; for optim_dense_<rule> those of a dense parameter whose gradient is not all zero.
struct EveryElement {
  __device__ __forceinline__ bool operator()(i64) const { return true; }
};

// The dense parameters of one parameter group laid end to end in one flat line
// (kernels/dense_update.py): segment j is elements [starts[j], starts[j] + sizes[j]) of the
// weights (and of each state block and of the gradient), starts ascending; the elements between
// segments are padding. nonzero: (count,) int, 1 where the segment's gradient holds a non-zero
// element (optim_dense_nonzero); nullptr when only `segment` is used.
struct DenseSegments {
  const i64* starts;
  const i64* sizes;
  const int* nonzero;
  int count;
  // the segment holding element t, or -1 (padding): a binary search of starts
  __device__ __forceinline__ int segment(i64 t) const {
    int lo = 0, hi = count - 1, found = -1;
    while (lo <= hi) {
      const int mid = (lo + hi) >> 1;
      if (starts[mid] <= t) {
        found = mid;
        lo = mid + 1;
      } else {
        hi = mid - 1;
      }
    }
    return found >= 0 && t < starts[found] + sizes[found] ? found : -1;
  }
  // updated: in a segment whose gradient is not all zero (padding and such segments keep their bits)
  __device__ __forceinline__ bool operator()(i64 t) const {
    const int j = segment(t);
    return j >= 0 && nonzero[j] != 0;
  }
};

// The rows whose update stored an inf or NaN (the finite-rows check of the step, made as the
// values are stored instead of by a pass that read every updated line again): bad[i] = 1 for
// such a row i; bad (n,) u8 zeroed by the host, and several threads of a row may write the same
// 1. bad == nullptr: no check (the dense parameters' update).
struct NonFiniteRows {
  unsigned char* bad;
  template <typename T>
  __device__ __forceinline__ void note(i64 i, T stored) const {
    if (bad != nullptr && non_finite(stored)) bad[i] = 1;
  }
};

// One thread per (row, column): reads the element's weight and states (4-byte accesses for
// float), applies the rule, stores each result rounded once to T.
template <typename T, typename Grads, typename Rule, typename Keep>
__device__ __forceinline__ void update_elements(T* lines, int line_size, const Grads& grad, i64 n,
                                                int dim, const Rule& rule, const Keep& keep,
                                                const NonFiniteRows& flags) {
  const int states = rule.states();
  for (i64 t = grid_thread(); t < n * dim; t += grid_threads()) {
    if (!keep(t)) continue;
    const i64 i = t / dim;
    T* at = lines + i * line_size + (t - i * dim);
    double x[1 + MAX_STATES];
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k <= MAX_STATES; ++k) {
      if (k <= states) x[k] = (double)at[(i64)k * dim];
    }
    rule(x, grad(t), i);
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k <= MAX_STATES; ++k) {
      if (k <= states) {
        const T stored = T(x[k]);
        at[(i64)k * dim] = stored;
        flags.note(i, stored);
      }
    }
  }
}

// One thread per (row, group of LANES = 16 / sizeof(T) consecutive columns): the weight's and
// each state's LANES columns are loaded and stored as one 16-byte vector (Vector16<T>), the
// gradients come from grad.group (a vector for RowGrads; per column, in the tree order, for
// SummedGrads) and each element is updated by the same rule as update_elements, so the same bits.
// Requires dim and line_size multiples of LANES and lines (and RowGrads' grads) 16-byte aligned,
// so that a group never straddles two blocks of the line (device_ops.row_update_vector decides).
template <typename T, typename Grads, typename Rule, typename Keep>
__device__ __forceinline__ void update_vectors(T* lines, int line_size, const Grads& grad, i64 n,
                                               int dim, const Rule& rule, const Keep& keep,
                                               const NonFiniteRows& flags) {
  typedef typename Vector16<T>::type V;
  constexpr int LANES = Vector16<T>::LANES;
  const int states = rule.states();
  const int groups = dim / LANES;
  for (i64 t = grid_thread(); t < n * groups; t += grid_threads()) {
    const i64 i = t / groups;
    const int j = (int)(t - i * groups) * LANES;
    T* at = lines + i * line_size + j;
    V block[1 + MAX_STATES];
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k <= MAX_STATES; ++k) {
      if (k <= states) block[k] = *as_vectors<V>(at + (i64)k * dim);
    }
    double g[LANES];
    grad.group(i * dim + j, g);
    ONE_EMBEDDING_UNROLL
    for (int c = 0; c < LANES; ++c) {
      if (!keep(i * dim + j + c)) continue;   // stored back as loaded: the same bits
      double x[1 + MAX_STATES];
      ONE_EMBEDDING_UNROLL
      for (int k = 0; k <= MAX_STATES; ++k) {
        if (k <= states) x[k] = (double)reinterpret_cast<const T*>(&block[k])[c];
      }
      rule(x, g[c], i);
      ONE_EMBEDDING_UNROLL
      for (int k = 0; k <= MAX_STATES; ++k) {
        if (k <= states) {
          const T stored = T(x[k]);
          reinterpret_cast<T*>(&block[k])[c] = stored;
          flags.note(i, stored);
        }
      }
    }
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k <= MAX_STATES; ++k) {
      if (k <= states) *as_vectors<V>(at + (i64)k * dim) = block[k];
    }
  }
}

// The kernels' body: vector (set by the host) picks update_vectors, else update_elements.
// Uniform over the grid: no divergence. keep: which elements to update (every one by default);
// flags: the rows a stored value made non-finite (none noted by default).
template <typename T, typename Grads, typename Rule, typename Keep = EveryElement>
__device__ __forceinline__ void update(T* lines, int line_size, const Grads& grad, i64 n, int dim,
                                       const Rule& rule, int vector, const Keep& keep = Keep(),
                                       const NonFiniteRows& flags = NonFiniteRows{nullptr}) {
  if (vector) {
    update_vectors(lines, line_size, grad, n, dim, rule, keep, flags);
  } else {
    update_elements(lines, line_size, grad, n, dim, rule, keep, flags);
  }
}

}  // namespace optim
}  // namespace oe
