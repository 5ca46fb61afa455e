// DCN cross layers.
//   vector (v1): x_next = x0 * (xl · w) + b + xl                  (w, b: (D,))
//   matrix (v2): x_next = (xl Wᵀ + b) * x0 + xl                   (W: (D, D), b: (D,))
// v1 is fused completely (one warp per row for the row dot products, then a column reduction
// for dw, db). v2's matmuls (xl Wᵀ, du W, duᵀ xl) run in cuBLAS through cupy.matmul; these
// kernels fuse the elementwise work around them.
#include "common.cuh"

// One warp per row; blockDim.x a multiple of 32. x0, xl, out: (rows, dim); w, b: (dim,).
template <typename T>
__global__ void cross_vector_forward(const T* x0, const T* xl, const T* w, const T* b,
                                     oe::i64 rows, int dim, T* out) {
  const int lane = threadIdx.x & 31;
  const oe::i64 first_warp = ((oe::i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const oe::i64 n_warps = ((oe::i64)gridDim.x * blockDim.x) >> 5;
  for (oe::i64 r = first_warp; r < rows; r += n_warps) {
    const oe::i64 base = r * dim;
    T dot = T(0);
    for (int d = lane; d < dim; d += 32) dot += xl[base + d] * w[d];
    const T s = oe::warp_sum(dot);
    for (int d = lane; d < dim; d += 32) out[base + d] = x0[base + d] * s + b[d] + xl[base + d];
  }
}

// Row part of the v1 backward, one warp per row:
//   s = xl · w, ds = dnext · x0, dx0 = dnext * s, dxl = ds * w + dnext; ds is kept for dw.
// dnext, x0, xl, dx0, dxl: (rows, dim); w: (dim,); ds: (rows,).
template <typename T>
__global__ void cross_vector_backward_rows(const T* dnext, const T* x0, const T* xl, const T* w,
                                           oe::i64 rows, int dim, T* dx0, T* dxl, T* ds) {
  const int lane = threadIdx.x & 31;
  const oe::i64 first_warp = ((oe::i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const oe::i64 n_warps = ((oe::i64)gridDim.x * blockDim.x) >> 5;
  for (oe::i64 r = first_warp; r < rows; r += n_warps) {
    const oe::i64 base = r * dim;
    T dot_w = T(0);
    T dot_g = T(0);
    for (int d = lane; d < dim; d += 32) {
      dot_w += xl[base + d] * w[d];
      dot_g += dnext[base + d] * x0[base + d];
    }
    const T s = oe::warp_sum(dot_w);
    const T g = oe::warp_sum(dot_g);
    for (int d = lane; d < dim; d += 32) {
      const T dn = dnext[base + d];
      dx0[base + d] = dn * s;
      dxl[base + d] = g * w[d] + dn;
    }
    if (lane == 0) ds[r] = g;
  }
}

// Parameter part of the v1 backward, per-chunk column sums:
//   dw_partial[g, d] = sum over the chunk's rows of ds[r] * xl[r, d]
//   db_partial[g, d] = sum over the chunk's rows of dnext[r, d]
// Grid (ceil(dim / 32), n_chunks), block (32, COLUMN_BLOCK_ROWS), chunks as in mlp.cu.
template <typename T>
__global__ void cross_vector_backward_params(const T* dnext, const T* xl, const T* ds,
                                             oe::i64 rows, int dim, oe::i64 rows_per_chunk,
                                             T* dw_partial, T* db_partial) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  const oe::i64 row_begin = (oe::i64)blockIdx.y * rows_per_chunk;
  const oe::i64 row_end = min(row_begin + rows_per_chunk, rows);
  T acc_w = T(0);
  T acc_b = T(0);
  if (col < dim) {
    for (oe::i64 r = row_begin + threadIdx.y; r < row_end; r += blockDim.y) {
      const oe::i64 i = r * dim + col;
      acc_w += ds[r] * xl[i];
      acc_b += dnext[i];
    }
  }
  const T total_w = oe::column_block_sum(acc_w);
  const T total_b = oe::column_block_sum(acc_b);
  if (threadIdx.y == 0 && col < dim) {
    dw_partial[(oe::i64)blockIdx.y * dim + col] = total_w;
    db_partial[(oe::i64)blockIdx.y * dim + col] = total_b;
  }
}

// v2 forward epilogue, after t = xl Wᵀ: out = (t + b) * x0 + xl. Grid-stride, one element per
// thread. t, x0, xl, out: (rows, dim); b: (dim,). out may alias t.
template <typename T>
__global__ void cross_matrix_forward_epilogue(const T* t, const T* b, const T* x0, const T* xl,
                                              oe::i64 rows, int dim, T* out) {
  const oe::i64 n = rows * (oe::i64)dim;
  const oe::i64 stride = (oe::i64)gridDim.x * blockDim.x;
  for (oe::i64 i = (oe::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = (t[i] + b[i % dim]) * x0[i] + xl[i];
  }
}

// v2 backward elementwise part, after t = xl Wᵀ:
//   dx0 = dnext * (t + b), du = dnext * x0, db_partial = per-chunk column sums of du.
// Grid (ceil(dim / 32), n_chunks), block (32, COLUMN_BLOCK_ROWS). dx0 may alias t.
template <typename T>
__global__ void cross_matrix_backward_elementwise(const T* dnext, const T* x0, const T* t,
                                                  const T* b, oe::i64 rows, int dim,
                                                  oe::i64 rows_per_chunk, T* dx0, T* du,
                                                  T* db_partial) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  const oe::i64 row_begin = (oe::i64)blockIdx.y * rows_per_chunk;
  const oe::i64 row_end = min(row_begin + rows_per_chunk, rows);
  T acc = T(0);
  if (col < dim) {
    const T bias = b[col];
    for (oe::i64 r = row_begin + threadIdx.y; r < row_end; r += blockDim.y) {
      const oe::i64 i = r * dim + col;
      const T dn = dnext[i];
      const T g = dn * x0[i];
      dx0[i] = (t[i] + bias) * dn;
      du[i] = g;
      acc += g;
    }
  }
  const T total = oe::column_block_sum(acc);
  if (threadIdx.y == 0 && col < dim) db_partial[(oe::i64)blockIdx.y * dim + col] = total;
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(cross_vector_forward)
ONE_EMBEDDING_KERNEL(cross_vector_backward_rows)
ONE_EMBEDDING_KERNEL(cross_vector_backward_params)
ONE_EMBEDDING_KERNEL(cross_matrix_forward_epilogue)
ONE_EMBEDDING_KERNEL(cross_matrix_backward_elementwise)
#endif
