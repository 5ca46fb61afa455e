// Fused row optimizer updates on whole lines, the numba kernels of optim/kernels.py expression for
// expression: every stored value is read, the update is computed in float64 and each result is
// rounded once to the line's type. (Compiled with --fmad=false, so no product is
// fused into an addition and the float64 results equal the CPU's, except pow, whose last ulp may
// differ; sqrt and division are correctly rounded on both.)
//
// lines: (n, line_size) T, a line = [w (dim) | state 1 (dim) | state 2 (dim) | ...]. One thread per
// (row, column), or, with `vector` set by the host (device_ops.row_update_vector: dim and
// line_size multiples of Vector16<T>::LANES, the arrays read as vectors 16-byte aligned), one
// thread per (row, group of 4 float / 2 double columns) that loads and stores the weight's and
// each state's columns as one 16-byte vector and updates each element by the same rule (the same
// bits); the scalar hyper-parameters arrive prepared on the host exactly as each optimizer's
// _kernel prepares them for optim/kernels.py (factor, l2, lr * decoupled wd, bias corrections, ...).
//
// Each rule exists once (oe::optim::Sgd, Momentum, ...: one element's update), over a gradient
// source and a driver (update_elements, update_vectors), and is launched three ways:
//   optim_<rule>:        grads (n, dim) T, one gradient row per line (the summed gradients);
//   optim_summed_<rule>: the gradient of line s is summed here from the rows of a backward
//     (values (m, dim) T, rows_by_segment (m,) i64 and offsets (n + 1,) i64 as for
//     embedding_segment_sum), in the same order (the tree order of common.cuh, in T: a line of at
//     most SUM_CHUNK rows summed here, a longer line's total read from long_totals (n, dim) T,
//     which the tree's level kernels wrote), so the update equals embedding_segment_sum followed
//     by optim_<rule> bit for bit and the short lines' summed gradient is never written;
//   optim_dense_<rule>:  every dense parameter of a parameter group at once, laid end to end in
//     one flat line (n = 1, dim = the flat length, kernels/dense_update.py), skipping the
//     parameters whose gradient is all zero (oe::optim::DenseSegments): one launch where the
//     array expressions took 9 (SGD) to 28 (Adam) per parameter (benchmarks/dense_update_ops.py).
#include "common.cuh"
#include "vector.cuh"
#include "optim_rules.cuh"

// One gradient row per line: grads (n, dim) T. vector: 1 where dim and line_size are multiples
// of Vector16<T>::LANES and lines and grads are 16-byte aligned (device_ops.row_update_vector):
// 16-byte accesses (oe::optim::update_vectors), else one element per thread; the same bits.
// bad: (n,) u8 zeroed by the host; bad[i] = 1 where a value the update stored in row i is inf
// or NaN (oe::optim::NonFiniteRows: the step's finite-rows check). The summed kernels below
// take it alike (their rows from the live count on: never updated, never flagged).
template <typename T>
__global__ void optim_sgd(T* lines, int line_size, const T* grads, oe::i64 n, int dim,
                          double factor, double lr, double wd, unsigned char* bad, int vector) {
  const oe::optim::Sgd rule{factor, lr, wd};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_momentum(T* lines, int line_size, const T* grads, oe::i64 n, int dim,
                               double factor, double l2, double lr, double beta, double keep,
                               int nesterov, double lr_wd, unsigned char* bad, int vector) {
  const oe::optim::Momentum rule{factor, l2, lr, beta, keep, nesterov, lr_wd};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_adagrad(T* lines, int line_size, const T* grads, oe::i64 n, int dim,
                              double factor, double l2, double clr, double eps, double clr_wd,
                              unsigned char* bad, int vector) {
  const oe::optim::Adagrad rule{factor, l2, clr, eps, clr_wd};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_adam(T* lines, int line_size, const T* grads, oe::i64 n, int dim,
                           double factor, double l2, double b1, double b2, double step_size,
                           double inv_sqrt_bc2, double eps, double lr_wd, int amsgrad,
                           unsigned char* bad, int vector) {
  const oe::optim::Adam rule{factor, l2, b1, b2, step_size, inv_sqrt_bc2, eps, lr_wd, amsgrad};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_ftrl(T* lines, int line_size, const T* grads, oe::i64 n, int dim,
                           double factor, double l2, double inv_lr, double power, double l1,
                           double quad_l2, double beta, int closed, double lr_wd,
                           unsigned char* bad, int vector) {
  const oe::optim::Ftrl rule{factor, l2, inv_lr, power, l1, quad_l2, beta, closed, lr_wd};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_smart_decay_adam(T* lines, int line_size, const T* grads, oe::i64 n, int dim,
                                       double factor, double l2, double b1, double b2, double lr,
                                       double eps, oe::i64 t, int step_col,
                                       unsigned char* bad, int vector) {
  const oe::optim::SmartDecayAdam<T> rule{lines, line_size, factor, l2, b1, b2, lr, eps, t,
                                          step_col};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

// The gradient summed per line from a backward's rows: values (m, dim) T; rows_by_segment (m,)
// i64, the rows sorted by (line, row); offsets (n + 1,) i64, line s owns
// rows_by_segment[offsets[s]:offsets[s + 1]] (device_unique.segment_order); long_totals (n, dim)
// T, the totals of the lines of more than SUM_CHUNK rows (device_unique.long_segment_totals;
// the other rows of it are not read). live: (1,) i64 on
// the device, the lines to update: n, or the count of a fixed-capacity batch
// (device_unique.unique_ids_fixed), whose lines from it on are placeholders left untouched
// (their threads find nothing to do). vector: bit 0 as optim_<rule>'s vector (the lines read as
// vectors); bit 1 (with bit 0; values and long_totals 16-byte aligned, device_ops.run_update's
// group_reads) each row's group of columns also summed from 16-byte reads of values
// (oe::optim::ordered_row_sum_group: the same sums, a quarter of the loads), else column by
// column.
template <typename T>
__global__ void optim_summed_sgd(T* lines, int line_size, const T* values,
                                 const oe::i64* rows_by_segment, const oe::i64* offsets,
                                 const T* long_totals, const oe::i64* live, oe::i64 n, int dim,
                                 double factor, double lr, double wd,
                                 unsigned char* bad, int vector) {
  const oe::optim::SummedGrads<T> grad{values, rows_by_segment, offsets, long_totals, dim,
                                        vector & 2};
  const oe::i64 rows = live[0] < n ? live[0] : n;   // the lines past the live count: left alone
  const oe::optim::Sgd rule{factor, lr, wd};
  oe::optim::update(lines, line_size, grad, rows, dim, rule, vector & 1,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_summed_momentum(T* lines, int line_size, const T* values,
                                      const oe::i64* rows_by_segment, const oe::i64* offsets,
                                      const T* long_totals, const oe::i64* live, oe::i64 n,
                                      int dim, double factor, double l2, double lr, double beta,
                                      double keep, int nesterov, double lr_wd,
                                      unsigned char* bad, int vector) {
  const oe::optim::SummedGrads<T> grad{values, rows_by_segment, offsets, long_totals, dim,
                                        vector & 2};
  const oe::i64 rows = live[0] < n ? live[0] : n;   // the lines past the live count: left alone
  const oe::optim::Momentum rule{factor, l2, lr, beta, keep, nesterov, lr_wd};
  oe::optim::update(lines, line_size, grad, rows, dim, rule, vector & 1,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_summed_adagrad(T* lines, int line_size, const T* values,
                                     const oe::i64* rows_by_segment, const oe::i64* offsets,
                                     const T* long_totals, const oe::i64* live, oe::i64 n, int dim,
                                     double factor, double l2, double clr, double eps,
                                     double clr_wd, unsigned char* bad, int vector) {
  const oe::optim::SummedGrads<T> grad{values, rows_by_segment, offsets, long_totals, dim,
                                        vector & 2};
  const oe::i64 rows = live[0] < n ? live[0] : n;   // the lines past the live count: left alone
  const oe::optim::Adagrad rule{factor, l2, clr, eps, clr_wd};
  oe::optim::update(lines, line_size, grad, rows, dim, rule, vector & 1,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_summed_adam(T* lines, int line_size, const T* values,
                                  const oe::i64* rows_by_segment, const oe::i64* offsets,
                                  const T* long_totals, const oe::i64* live, oe::i64 n, int dim,
                                  double factor, double l2, double b1, double b2, double step_size,
                                  double inv_sqrt_bc2, double eps, double lr_wd, int amsgrad,
                                  unsigned char* bad, int vector) {
  const oe::optim::SummedGrads<T> grad{values, rows_by_segment, offsets, long_totals, dim,
                                        vector & 2};
  const oe::i64 rows = live[0] < n ? live[0] : n;   // the lines past the live count: left alone
  const oe::optim::Adam rule{factor, l2, b1, b2, step_size, inv_sqrt_bc2, eps, lr_wd, amsgrad};
  oe::optim::update(lines, line_size, grad, rows, dim, rule, vector & 1,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_summed_ftrl(T* lines, int line_size, const T* values,
                                  const oe::i64* rows_by_segment, const oe::i64* offsets,
                                  const T* long_totals, const oe::i64* live, oe::i64 n, int dim,
                                  double factor, double l2, double inv_lr, double power, double l1,
                                  double quad_l2, double beta, int closed, double lr_wd,
                                  unsigned char* bad, int vector) {
  const oe::optim::SummedGrads<T> grad{values, rows_by_segment, offsets, long_totals, dim,
                                        vector & 2};
  const oe::i64 rows = live[0] < n ? live[0] : n;   // the lines past the live count: left alone
  const oe::optim::Ftrl rule{factor, l2, inv_lr, power, l1, quad_l2, beta, closed, lr_wd};
  oe::optim::update(lines, line_size, grad, rows, dim, rule, vector & 1,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

template <typename T>
__global__ void optim_summed_smart_decay_adam(T* lines, int line_size, const T* values,
                                              const oe::i64* rows_by_segment,
                                              const oe::i64* offsets, const T* long_totals,
                                              const oe::i64* live, oe::i64 n, int dim,
                                              double factor, double l2, double b1, double b2,
                                              double lr, double eps, oe::i64 t, int step_col,
                                              unsigned char* bad, int vector) {
  const oe::optim::SummedGrads<T> grad{values, rows_by_segment, offsets, long_totals, dim,
                                        vector & 2};
  const oe::i64 rows = live[0] < n ? live[0] : n;   // the lines past the live count: left alone
  const oe::optim::SmartDecayAdam<T> rule{lines, line_size, factor, l2, b1, b2, lr, eps, t,
                                          step_col};
  oe::optim::update(lines, line_size, grad, rows, dim, rule, vector & 1,
                    oe::optim::EveryElement(), oe::optim::NonFiniteRows{bad});
}

// out (dim,) T = the summed gradient of line segment[0] alone, as optim_summed_<rule> sums it
// (what a failed check reports about that line). segment: (1,) i64 in [0, n).
template <typename T>
__global__ void optim_summed_row(const T* values, int dim, const oe::i64* rows_by_segment,
                                 const oe::i64* offsets, const T* long_totals,
                                 const oe::i64* segment, T* out) {
  for (oe::i64 c = oe::grid_thread(); c < dim; c += oe::grid_threads()) {
    out[c] = oe::optim::segment_total(values, dim, rows_by_segment, offsets, long_totals,
                                      segment[0], (int)c);
  }
}

// Record step t as every row's last update (after optim_smart_decay_adam, in stream order).
template <typename T>
__global__ void optim_smart_decay_adam_steps(T* lines, int line_size, oe::i64 n, oe::i64 t,
                                             int step_col) {
  for (oe::i64 row = oe::grid_thread(); row < n; row += oe::grid_threads()) {
    oe::optim::store_step(lines + row * line_size + step_col, t);
  }
}

// --- every dense parameter of a group in one launch (kernels/dense_update.py)
//
// lines: (1, line_size) T, the group's flat line [weights (dim) | state 1 (dim) | ...]; grads:
// (dim,) T, the flat gradient; starts, sizes: (segments,) i64, each parameter's place in both
// (oe::optim::DenseSegments); nonzero: (segments,) int from optim_dense_nonzero. n is 1. The
// parameters whose gradient is all zero, and the padding between parameters, keep their bits.

// nonzero[j] = 1 where segment j of grads holds an element != 0 (NaN counts, -0.0 does not:
// numpy's any()); the caller zeroes nonzero first. grads: (total,) T.
template <typename T>
__global__ void optim_dense_nonzero(const T* grads, oe::i64 total, const oe::i64* starts,
                                    const oe::i64* sizes, int segments, int* nonzero) {
  const oe::optim::DenseSegments where{starts, sizes, nullptr, segments};
  for (oe::i64 t = oe::grid_thread(); t < total; t += oe::grid_threads()) {
    if (grads[t] != T(0)) {
      const int j = where.segment(t);
      // every writer stores the same 1; reading first keeps most of them off the one address
      if (j >= 0 && nonzero[j] == 0) nonzero[j] = 1;
    }
  }
}

template <typename T>
__global__ void optim_dense_sgd(T* lines, int line_size, const T* grads, const oe::i64* starts,
                                const oe::i64* sizes, const int* nonzero, int segments, oe::i64 n,
                                int dim, double factor, double lr, double wd, int vector) {
  const oe::optim::Sgd rule{factor, lr, wd};
  const oe::optim::DenseSegments keep{starts, sizes, nonzero, segments};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector, keep);
}

template <typename T>
__global__ void optim_dense_momentum(T* lines, int line_size, const T* grads,
                                     const oe::i64* starts, const oe::i64* sizes,
                                     const int* nonzero, int segments, oe::i64 n, int dim,
                                     double factor, double l2, double lr, double beta, double keep,
                                     int nesterov, double lr_wd, int vector) {
  const oe::optim::Momentum rule{factor, l2, lr, beta, keep, nesterov, lr_wd};
  const oe::optim::DenseSegments live{starts, sizes, nonzero, segments};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector, live);
}

template <typename T>
__global__ void optim_dense_adagrad(T* lines, int line_size, const T* grads,
                                    const oe::i64* starts, const oe::i64* sizes,
                                    const int* nonzero, int segments, oe::i64 n, int dim,
                                    double factor, double l2, double clr, double eps,
                                    double clr_wd, int vector) {
  const oe::optim::Adagrad rule{factor, l2, clr, eps, clr_wd};
  const oe::optim::DenseSegments keep{starts, sizes, nonzero, segments};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector, keep);
}

template <typename T>
__global__ void optim_dense_adam(T* lines, int line_size, const T* grads, const oe::i64* starts,
                                 const oe::i64* sizes, const int* nonzero, int segments,
                                 oe::i64 n, int dim, double factor, double l2, double b1,
                                 double b2, double step_size, double inv_sqrt_bc2, double eps,
                                 double lr_wd, int amsgrad, int vector) {
  const oe::optim::Adam rule{factor, l2, b1, b2, step_size, inv_sqrt_bc2, eps, lr_wd, amsgrad};
  const oe::optim::DenseSegments keep{starts, sizes, nonzero, segments};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector, keep);
}

template <typename T>
__global__ void optim_dense_ftrl(T* lines, int line_size, const T* grads, const oe::i64* starts,
                                 const oe::i64* sizes, const int* nonzero, int segments,
                                 oe::i64 n, int dim, double factor, double l2, double inv_lr,
                                 double power, double l1, double quad_l2, double beta, int closed,
                                 double lr_wd, int vector) {
  const oe::optim::Ftrl rule{factor, l2, inv_lr, power, l1, quad_l2, beta, closed, lr_wd};
  const oe::optim::DenseSegments keep{starts, sizes, nonzero, segments};
  oe::optim::update(lines, line_size, oe::optim::RowGrads<T>{grads}, n, dim, rule, vector, keep);
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(optim_sgd)
ONE_EMBEDDING_KERNEL(optim_momentum)
ONE_EMBEDDING_KERNEL(optim_adagrad)
ONE_EMBEDDING_KERNEL(optim_adam)
ONE_EMBEDDING_KERNEL(optim_ftrl)
ONE_EMBEDDING_KERNEL(optim_smart_decay_adam)
ONE_EMBEDDING_KERNEL(optim_smart_decay_adam_steps)
ONE_EMBEDDING_KERNEL(optim_summed_sgd)
ONE_EMBEDDING_KERNEL(optim_summed_momentum)
ONE_EMBEDDING_KERNEL(optim_summed_adagrad)
ONE_EMBEDDING_KERNEL(optim_summed_adam)
ONE_EMBEDDING_KERNEL(optim_summed_ftrl)
ONE_EMBEDDING_KERNEL(optim_summed_smart_decay_adam)
ONE_EMBEDDING_KERNEL(optim_summed_row)
ONE_EMBEDDING_KERNEL(optim_dense_nonzero)
ONE_EMBEDDING_KERNEL(optim_dense_sgd)
ONE_EMBEDDING_KERNEL(optim_dense_momentum)
ONE_EMBEDDING_KERNEL(optim_dense_adagrad)
ONE_EMBEDDING_KERNEL(optim_dense_adam)
ONE_EMBEDDING_KERNEL(optim_dense_ftrl)
#endif
