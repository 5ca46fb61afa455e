// Fused dense kernels of the AMP path (nn.amp, kernels/dense_ops.py): the operand cast of the
// tensor-core GEMMs, bias + activation + cast as one pass after a GEMM (and its backward with the
// cast of the gradient both backward GEMMs read), the DLRM dot interaction
// as one kernel each way (no batched GEMM, no (B, F, F) buffer, no concatenation; its backward
// register-blocked where the sample allows), and the BCE loss fused with the gradient of the
// last (one-output) layer.
//
// ``kind`` (precision.cuh): 0 fp32, 1 fp16, 2 bf16, 3 tf32. Products take operands rounded to
// ``kind`` and accumulate in T; the interaction's products and input gradient leave rounded to
// the half type (fp16 / bf16; tf32 results stay fp32), as nn.amp defines them. The float64
// instantiations round through float (gradient checks run with kind 0).
#include "common.cuh"
#include "precision.cuh"
#include "dense_interaction.cuh"
#include "vector.cuh"

// x (n,) -> bits (n,) u16 of its fp16 / bf16 values (want_bits, kind 1 or 2) and / or rounded
// (n,) T = x rounded to ``kind`` (want_rounded). Unwanted outputs are never touched.
template <typename T>
__global__ void dense_cast(const T* x, oe::i64 n, int kind, int want_bits, unsigned short* bits,
                           int want_rounded, T* rounded) {
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    const float v = (float)x[i];
    if (want_bits) bits[i] = oe::precision::to_bits(v, kind);
    if (want_rounded) rounded[i] = T(oe::precision::round_to(v, kind));
  }
}

// y[i] = v (unless write_y is 0) and, with kind 1 / 2, its 16-bit pattern:
// oe::bias_act_forward_words' store.
template <typename T>
struct StoreCast {
  T* y;
  unsigned short* y_bits;
  int kind;
  int write_y;
  __device__ __forceinline__ void operator()(oe::i64 i, T v) const {
    if (write_y) y[i] = v;
    if (kind == oe::precision::FP16 || kind == oe::precision::BF16) {
      y_bits[i] = oe::precision::to_bits((float)v, kind);
    }
  }
};

// y = relu(h + b) (or h + b) in T, its bit-packed ReLU mask (as mlp_bias_act_forward), and with
// kind 1 / 2 the 16-bit copy of y that the next layer's GEMM reads: one pass after the GEMM.
// h, y: (rows, cols), y may alias h; b: (cols,); relu_mask: (ceil(rows * cols / 32),) when relu;
// y_bits: (rows, cols) u16 when kind is 1 or 2. write_y == 0 (kind 1 / 2 only): y is not
// written, a hidden layer's output that only the next GEMM reads, as y_bits (4 of the 10 bytes
// an element costs this pass, and the fp32 array its backward would have kept). Grid-stride over
// mask words, whole warps (oe::bias_act_forward_words).
template <typename T>
__global__ void dense_bias_act_cast(const T* h, const T* b, oe::i64 rows, int cols, int relu,
                                    int kind, T* y, unsigned* relu_mask, unsigned short* y_bits,
                                    int write_y, int ahead) {
  oe::bias_act_forward_words(h, b, rows * (oe::i64)cols, cols, relu,
                             StoreCast<T>{y, y_bits, kind, write_y}, relu_mask, ahead);
}

// dy[i], rounded to ``kind`` first when ``kind`` is not 0 (a gradient the layer above left
// unrounded: the rounding its own pass would have made, made here on the read).
template <typename T>
struct LoadRounded {
  const T* dy;
  int kind;
  __device__ __forceinline__ T operator()(oe::i64 i) const {
    return oe::dense::rounded(dy[i], kind);
  }
};

// The 16-bit pattern (kind 1 / 2) of g, stored at element i.
struct StoreBits {
  unsigned short* bits;
  int kind;
  template <typename V>
  __device__ __forceinline__ void operator()(oe::i64 i, V g) const {
    bits[i] = oe::precision::to_bits((float)g, kind);
  }
};

// The backward of bias + ReLU with the cast of its result for the two GEMMs that read it: dh =
// dy * mask (oe::bias_act_backward_chunk, as mlp_bias_act_backward: NaN and inf pass as numpy's
// dy * mask), written only as its 16-bit pattern (kind 1 / 2) that both products take, and the
// per-chunk column sums of dh in T for the bias gradient, in mlp_bias_act_backward's order (so
// the same db). One pass where the unfused path wrote dh in T and cast it twice. round_input:
// dy is the layer above's input gradient left unrounded (its rounding pass skipped), rounded to
// ``kind`` here as it is read, so the same dh and db. Grid (ceil(cols / 32), n_chunks), block
// (32, COLUMN_BLOCK_ROWS); chunk g covers rows [g * rows_per_chunk, ...). dy: (rows, cols);
// relu_mask: bit-packed (read when has_mask); dh_bits: (rows, cols) u16; db_partial:
// (n_chunks, cols).
template <typename T>
__global__ void dense_bias_act_backward_cast(const T* dy, const unsigned* relu_mask, int has_mask,
                                             oe::i64 rows, int cols, oe::i64 rows_per_chunk,
                                             int kind, int round_input, unsigned short* dh_bits,
                                             T* db_partial, int ahead) {
  oe::bias_act_backward_chunk(LoadRounded<T>{dy, round_input ? kind : 0}, relu_mask, has_mask,
                              rows, cols, rows_per_chunk, StoreBits{dh_bits, kind}, db_partial,
                              ahead);
}

// out (batch, width) = [concat | x_r . x_c for the pairs | zero padding], one thread per output
// element; each dot reads the sample's two rows (cached) and accumulates in T over operands
// rounded to ``kind``; the dot leaves rounded to the half type (kind 1 / 2). The concat columns
// pass through unrounded. concat: (batch, n_concat), unused when n_concat == 0. bits_only (kind
// 1 / 2): the row is stored only as its 16-bit patterns in out_bits (batch, width) u16 (the next
// layer's operand; out untouched), else in out (batch, width) (out_bits untouched).
template <typename T>
__global__ void dense_interaction_forward(const T* first, const T* rest,
                                          const unsigned short* bits, int packed, const T* concat,
                                          oe::i64 batch, int f1, int f2, int dim,
                                          int self_interaction, int kind, int n_concat,
                                          int n_pairs, int width, T* out,
                                          unsigned short* out_bits, int bits_only) {
  const oe::i64 n = batch * (oe::i64)width;
  const int out_kind = kind == oe::precision::TF32 ? oe::precision::NONE : kind;
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    const oe::i64 s = i / width;
    oe::dense::store_output(out, out_bits, bits_only, kind, i, oe::dense::output_value(
        concat, s, (int)(i - s * width), n_concat, n_pairs, self_interaction, out_kind,
        [&](int r, int c) {
          T acc = T(0);
          for (int d = 0; d < dim; ++d) {
            acc += oe::dense::load(first, rest, bits, packed, s, r, d, f1, f2, dim, kind) *
                   oe::dense::load(first, rest, bits, packed, s, c, d, f1, f2, dim, kind);
          }
          return acc;
        }));
  }
}

// The gradient of dense_interaction_forward, one thread per (sample, feature f, d) and per
// concat column: dx_f[d] = sum over f's pairs (f, g) of dout[pair] * x_g[d] (2 dout x_f[d] on the
// diagonal), the pair gradients and x rounded to ``kind``, accumulated in T, the result rounded
// to the half type. dfirst / drest have the shapes of first / rest; dconcat: (batch, n_concat),
// = dout's first n_concat columns, unused when n_concat == 0. Padding columns get no gradient.
template <typename T>
__global__ void dense_interaction_backward(const T* dout, const T* first, const T* rest,
                                           const unsigned short* bits, int packed,
                                           oe::i64 batch, int f1, int f2, int dim,
                                           int self_interaction, int kind, int n_concat,
                                           int width, T* dfirst, T* drest, T* dconcat) {
  const int f = f1 + f2;
  const oe::i64 per_sample = (oe::i64)f * dim + n_concat;
  const oe::i64 n = batch * per_sample;
  const int out_kind = kind == oe::precision::TF32 ? oe::precision::NONE : kind;
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    const oe::i64 s = i / per_sample;
    const oe::i64 k = i - s * per_sample;
    const T* g = dout + s * width;
    if (k >= (oe::i64)f * dim) {
      const int c = (int)(k - (oe::i64)f * dim);
      dconcat[s * n_concat + c] = g[c];
      continue;
    }
    const int row = (int)(k / dim);
    const int d = (int)(k - (oe::i64)row * dim);
    T acc = T(0);
    for (int other = 0; other < f; ++other) {
      if (other == row && !self_interaction) continue;
      const int r = other > row ? other : row;
      const int c = other > row ? row : other;
      T grad = oe::dense::rounded(g[n_concat + oe::dense::pair_index(r, c, self_interaction)], kind);
      if (other == row) grad = grad + grad;
      const T x = oe::dense::load(first, rest, bits, packed, s, other, d, f1, f2, dim, kind);
      acc += grad * x;
    }
    const T v = oe::dense::rounded(acc, out_kind);
    if (row < f1) {
      dfirst[(s * f1 + row) * (oe::i64)dim + d] = v;
    } else {
      drest[(s * f2 + (row - f1)) * (oe::i64)dim + d] = v;
    }
  }
}

// The same two kernels, one block per sample (grid-stride over samples), for a sample that fits
// shared memory (F (D + 1) <= TILE_ELEMENTS, P <= TILE_PAIRS; kernels/dense_ops.py checks): the
// sample's rounded features are loaded once (rows padded to D + 1, so the lanes of a warp
// reading one column of different rows hit different banks) and every dot reads them there.
// Same arguments, same results, bit for bit, as the kernels above.
//
// Every interaction kernel reads its features in any of the layouts of ``load`` (``packed``,
// ``bits``); the results depend on the values only, never on the layout.
template <typename T>
__global__ void dense_interaction_forward_tile(const T* first, const T* rest,
                                          const unsigned short* bits, int packed, const T* concat,
                                               oe::i64 batch, int f1, int f2, int dim,
                                               int self_interaction, int kind, int n_concat,
                                               int n_pairs, int width, T* out,
                                               unsigned short* out_bits, int bits_only) {
  __shared__ T xs[oe::dense::TILE_ELEMENTS];
  const int stride = dim + 1;
  const int out_kind = kind == oe::precision::TF32 ? oe::precision::NONE : kind;
  for (oe::i64 s = blockIdx.x; s < batch; s += gridDim.x) {
    oe::dense::stage_features<1>(first, rest, bits, packed, s, f1, f2, dim, kind,
                                 [&](int k, const T* values) {
                                   const int row = k / dim;
                                   xs[row * stride + (k - row * dim)] = values[0];
                                 });
    __syncthreads();
    oe::dense::write_outputs(concat, s, n_concat, n_pairs, width, self_interaction, kind,
                             out_kind, out, out_bits, bits_only,
                             [&](int r, int c) {
                               T acc = T(0);
                               for (int d = 0; d < dim; ++d) {
                                 acc += xs[r * stride + d] * xs[c * stride + d];
                               }
                               return acc;
                             });
    __syncthreads();  // the next sample overwrites xs
  }
}

// dense_interaction_forward_tile with the sample's features as 16-byte vectors in shared memory
// (LANES = 4 floats / 2 doubles; rows of dim / LANES vectors padded by one, so the lanes of a
// warp reading one group of different rows hit different banks): a dot reads a vector of each
// row per LANES products, where the tile kernel read a value of each per product (DLRM: 256
// shared loads a dot there, 64 here; x_r's mostly broadcasts). Each dot adds the same products
// in the same order (d = 0, 1, ...): the same bits. For a sample with dim a multiple of LANES
// and F (dim + LANES) <= TILE_ELEMENTS (kernels/dense_ops.fits_blocked). Arguments as the tile
// kernel's.
template <typename T>
__global__ void dense_interaction_forward_vector(const T* first, const T* rest,
                                                 const unsigned short* bits, int packed,
                                                 const T* concat, oe::i64 batch, int f1, int f2,
                                                 int dim, int self_interaction, int kind,
                                                 int n_concat, int n_pairs, int width, T* out,
                                                 unsigned short* out_bits, int bits_only) {
  typedef typename oe::Vector16<T>::type V;
  constexpr int LANES = oe::Vector16<T>::LANES;
  __shared__ V xs[oe::dense::TILE_ELEMENTS / LANES];
  const int groups = dim / LANES;
  const int stride = groups + 1;
  const int out_kind = kind == oe::precision::TF32 ? oe::precision::NONE : kind;
  for (oe::i64 s = blockIdx.x; s < batch; s += gridDim.x) {
    oe::dense::stage_features<LANES>(first, rest, bits, packed, s, f1, f2, dim, kind,
                                     [&](int k, const T* values) {
                                       V v;
                                       T* lanes = reinterpret_cast<T*>(&v);
                                       for (int j = 0; j < LANES; ++j) lanes[j] = values[j];
                                       const int row = k / groups;
                                       xs[row * stride + (k - row * groups)] = v;
                                     });
    __syncthreads();
    oe::dense::write_outputs(concat, s, n_concat, n_pairs, width, self_interaction, kind,
                             out_kind, out, out_bits, bits_only,
                             [&](int r, int c) {
                               T acc = T(0);
                               for (int g = 0; g < groups; ++g) {
                                 const V a = xs[r * stride + g];
                                 const V b = xs[c * stride + g];
                                 const T* x = reinterpret_cast<const T*>(&a);
                                 const T* y = reinterpret_cast<const T*>(&b);
                                 ONE_EMBEDDING_UNROLL
                                 for (int l = 0; l < LANES; ++l) acc += x[l] * y[l];
                               }
                               return acc;
                             });
    __syncthreads();  // the next sample overwrites xs
  }
}

template <typename T>
__global__ void dense_interaction_backward_tile(const T* dout, const T* first, const T* rest,
                                           const unsigned short* bits, int packed,
                                                oe::i64 batch, int f1, int f2, int dim,
                                                int self_interaction, int kind, int n_concat,
                                                int width, T* dfirst, T* drest, T* dconcat) {
  __shared__ T xs[oe::dense::TILE_ELEMENTS];
  __shared__ T gs[oe::dense::TILE_PAIRS];
  const int f = f1 + f2;
  const int stride = dim + 1;
  const int n_pairs = self_interaction ? f * (f + 1) / 2 : f * (f - 1) / 2;
  const int out_kind = kind == oe::precision::TF32 ? oe::precision::NONE : kind;
  for (oe::i64 s = blockIdx.x; s < batch; s += gridDim.x) {
    const T* g = dout + s * width;
    for (int k = threadIdx.x; k < f * dim; k += blockDim.x) {
      const int row = k / dim;
      const int d = k - row * dim;
      xs[row * stride + d] =
          oe::dense::load(first, rest, bits, packed, s, row, d, f1, f2, dim, kind);
    }
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
      gs[p] = oe::dense::rounded(g[n_concat + p], kind);
    }
    for (int c = threadIdx.x; c < n_concat; c += blockDim.x) dconcat[s * n_concat + c] = g[c];
    __syncthreads();
    for (int k = threadIdx.x; k < f * dim; k += blockDim.x) {
      const int row = k / dim;
      const int d = k - row * dim;
      T acc = T(0);
      for (int other = 0; other < f; ++other) {
        if (other == row && !self_interaction) continue;
        const int r = other > row ? other : row;
        const int c = other > row ? row : other;
        T grad = gs[oe::dense::pair_index(r, c, self_interaction)];
        if (other == row) grad = grad + grad;
        acc += grad * xs[other * stride + d];
      }
      const T v = oe::dense::rounded(acc, out_kind);
      if (row < f1) {
        dfirst[(s * f1 + row) * (oe::i64)dim + d] = v;
      } else {
        drest[(s * f2 + (row - f1)) * (oe::i64)dim + d] = v;
      }
    }
    __syncthreads();  // the next sample overwrites xs and gs
  }
}

// The gradient of the dot interaction again, one block per sample, register-blocked for the
// DLRM shapes (dim a multiple of 4, F (D) <= TILE_ELEMENTS, F round4(F) <= TILE_PAIRS;
// kernels/dense_ops.py checks): dX = G X with G the (F, F) matrix of the pair gradients, G[a, b]
// = dout[pair(a, b)] (twice it on the diagonal with self_interaction; never read on the diagonal
// without), rounded to ``kind``. Each thread owns BLOCK_ROWS rows and one 16-byte group of
// columns (LANES = 4 floats / 2 doubles) and, for each other feature in ascending order, loads
// that feature's group once (one 16-byte shared load) and G's BLOCK_ROWS entries (broadcasts:
// the threads of a warp share their rows) for BLOCK_ROWS x LANES products. The _tile kernel
// loads a feature value and a pair gradient per product and recomputes the pair index each
// time: a DLRM sample (27 x 128 floats) takes it 3456 x 26 x 2 = 179,712 shared loads, here
// 7 row groups x 32 column groups x 27 features x 5 = 30,240 (one vector, 4 broadcasts). Each output still adds the same products in the same order (other = 0, 1, ..., F - 1,
// the diagonal skipped without self_interaction), so the bits of the two kernels above.
// Shared memory: xs (F, dim / LANES) 16-byte groups of the rounded features, unpadded (the
// lanes of a warp read consecutive groups of one row); gt (F, round4(F)): gt[other, row] =
// G[row, other], rows padded with zeros (never used). Arguments as
// dense_interaction_backward_tile.
namespace oe {
namespace dense {
constexpr int BLOCK_ROWS = 4;
}  // namespace dense
}  // namespace oe

template <typename T>
__global__ void dense_interaction_backward_blocked(const T* dout, const T* first, const T* rest,
                                                   const unsigned short* bits, int packed,
                                                   oe::i64 batch, int f1, int f2, int dim,
                                                   int self_interaction, int kind, int n_concat,
                                                   int width, T* dfirst, T* drest, T* dconcat) {
  typedef typename oe::Vector16<T>::type V;
  constexpr int LANES = oe::Vector16<T>::LANES;
  constexpr int ROWS = oe::dense::BLOCK_ROWS;
  __shared__ V xs[oe::dense::TILE_ELEMENTS / LANES];
  __shared__ T gt[oe::dense::TILE_PAIRS];
  const int f = f1 + f2;
  const int g_stride = (f + ROWS - 1) / ROWS * ROWS;
  const int groups = dim / LANES;
  const int items = g_stride / ROWS * groups;
  const int out_kind = kind == oe::precision::TF32 ? oe::precision::NONE : kind;
  for (oe::i64 s = blockIdx.x; s < batch; s += gridDim.x) {
    const T* g = dout + s * width;
    oe::dense::stage_features<LANES>(first, rest, bits, packed, s, f1, f2, dim, kind,
                                     [&](int k, const T* values) {
                                       V v;
                                       T* lanes = reinterpret_cast<T*>(&v);
                                       for (int j = 0; j < LANES; ++j) lanes[j] = values[j];
                                       xs[k] = v;
                                     });
    for (int k = threadIdx.x; k < f * g_stride; k += blockDim.x) {
      const int other = k / g_stride;
      const int row = k - other * g_stride;
      T v = T(0);
      if (row < f && (row != other || self_interaction)) {
        const int r = other > row ? other : row;
        const int c = other > row ? row : other;
        v = oe::dense::rounded(g[n_concat + oe::dense::pair_index(r, c, self_interaction)], kind);
        if (row == other) v = v + v;
      }
      gt[k] = v;
    }
    for (int c = threadIdx.x; c < n_concat; c += blockDim.x) dconcat[s * n_concat + c] = g[c];
    __syncthreads();
    for (int item = threadIdx.x; item < items; item += blockDim.x) {
      const int row0 = item / groups * ROWS;
      const int group = item - row0 / ROWS * groups;
      T acc[ROWS][LANES];
      ONE_EMBEDDING_UNROLL
      for (int i = 0; i < ROWS; ++i) {
        ONE_EMBEDDING_UNROLL
        for (int j = 0; j < LANES; ++j) acc[i][j] = T(0);
      }
      for (int other = 0; other < f; ++other) {
        const V loaded = xs[other * groups + group];
        const T* x = reinterpret_cast<const T*>(&loaded);
        ONE_EMBEDDING_UNROLL
        for (int i = 0; i < ROWS; ++i) {
          if (other == row0 + i && !self_interaction) continue;
          const T grad = gt[other * g_stride + row0 + i];
          ONE_EMBEDDING_UNROLL
          for (int j = 0; j < LANES; ++j) acc[i][j] += grad * x[j];
        }
      }
      ONE_EMBEDDING_UNROLL
      for (int i = 0; i < ROWS; ++i) {
        const int row = row0 + i;
        if (row >= f) break;
        T* out = row < f1 ? dfirst + (s * f1 + row) * (oe::i64)dim
                          : drest + (s * f2 + (row - f1)) * (oe::i64)dim;
        ONE_EMBEDDING_UNROLL
        for (int j = 0; j < LANES; ++j) {
          out[group * LANES + j] = oe::dense::rounded(acc[i][j], out_kind);
        }
      }
    }
    __syncthreads();  // the next sample overwrites xs and gt
  }
}

// The BCE loss fused with the backward of the last layer (logits = x w + b, one output):
//   dz_i = (sigmoid(z_i) - y_i) / B * scale          (scale: the loss scale, 1 without)
//   dx[i, k] = round(round(dz_i) * round(w_k))        (the input gradient, nn.amp's dh w)
//   dw[k] = sum_i round(dz_i) * round(x[i, k])        (fp32 result, per-chunk partials)
//   db = sum_i dz_i;  loss = sum_i max(z, 0) - z y + log1p(exp(-|z|))   (per-chunk partials)
// rounding to ``kind`` (0: none). Grid (ceil(K / 32), n_chunks), block (32, COLUMN_BLOCK_ROWS) as
// the column reductions of mlp.cu; the column blocks with blockIdx.x == 0 also write dz, db and
// the loss. logits, labels, dz: (B,); x, dx: (B, K); w: (K,); dw_partial: (n_chunks, K);
// db_partial, loss_partial: (n_chunks,) (loss in double).
//
// has_loss == 0 is the last layer's backward alone (Linear.backward of a one-output layer): then
// ``logits`` holds the logit gradient dz itself, g = dz_i * scale, labels is not read and the
// loss partials are 0.
template <typename T>
__global__ void dense_bce_last_layer(const T* logits, const T* labels, const T* x, const T* w,
                                     oe::i64 rows, int k_cols, T scale, int kind, int has_loss,
                                     oe::i64 rows_per_chunk, T* dz, T* dx, T* dw_partial,
                                     T* db_partial, double* loss_partial) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  const oe::i64 row_begin = (oe::i64)blockIdx.y * rows_per_chunk;
  const oe::i64 row_end = min(row_begin + rows_per_chunk, rows);
  const int out_kind = kind == oe::precision::TF32 ? oe::precision::NONE : kind;
  const bool row_owner = blockIdx.x == 0 && threadIdx.x == 0;
  const T count = T(rows);
  const T w_col = col < k_cols ? oe::dense::rounded(w[col], kind) : T(0);
  T acc_w = T(0);
  T acc_b = T(0);
  double acc_loss = 0.0;
  for (oe::i64 r = row_begin + threadIdx.y; r < row_end; r += blockDim.y) {
    const T z = logits[r];
    T g = z * scale;
    if (has_loss) {
      const T y = labels[r];
      const T e = oe::exp_t(z < T(0) ? z : -z);
      const T sig = z >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
      g = ((sig - y) / count) * scale;
      if (row_owner) acc_loss += (double)((z > T(0) ? z : T(0)) - z * y + oe::log1p_t(e));
    }
    if (row_owner) {
      dz[r] = g;
      acc_b += g;
    }
    if (col < k_cols) {
      const T g_r = oe::dense::rounded(g, kind);
      dx[r * k_cols + col] = oe::dense::rounded(g_r * w_col, out_kind);
      acc_w += g_r * oe::dense::rounded(x[r * k_cols + col], kind);
    }
  }
  const T total_w = oe::column_block_sum(acc_w);
  if (threadIdx.y == 0 && col < k_cols) dw_partial[(oe::i64)blockIdx.y * k_cols + col] = total_w;
  if (blockIdx.x == 0) {
    const T total_b = oe::column_block_sum(acc_b);
    const double total_loss = oe::column_block_sum(acc_loss);
    if (threadIdx.y == 0 && threadIdx.x == 0) {
      db_partial[blockIdx.y] = total_b;
      loss_partial[blockIdx.y] = total_loss;
    }
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(dense_cast)
ONE_EMBEDDING_KERNEL(dense_bias_act_cast)
ONE_EMBEDDING_KERNEL(dense_bias_act_backward_cast)
ONE_EMBEDDING_KERNEL(dense_interaction_forward)
ONE_EMBEDDING_KERNEL(dense_interaction_backward)
ONE_EMBEDDING_KERNEL(dense_interaction_forward_tile)
ONE_EMBEDDING_KERNEL(dense_interaction_forward_vector)
ONE_EMBEDDING_KERNEL(dense_interaction_backward_tile)
ONE_EMBEDDING_KERNEL(dense_interaction_backward_blocked)
ONE_EMBEDDING_KERNEL(dense_bce_last_layer)
#endif
