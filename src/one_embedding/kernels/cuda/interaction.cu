// Dot interaction, DLRM style: out = [concat | Z[r, c] over the kept pairs | zero padding] with
// Z = X Xᵀ per sample. The batched GEMMs (Z = X Xᵀ forward, dX = dS X backward) run in cuBLAS
// through cupy.matmul; these kernels do the triangle gather + concat + padding (forward) and the
// symmetric scatter dS = dZ + dZᵀ + the concat gradient (backward).
//
// pairs: (n_pairs, 2) int32 table of (row, col) in output order, built by
// cuda_module.pair_table: (1,0),(2,0),(2,1),(3,0),... (c < r), or with the diagonal (c <= r).
#include "common.cuh"

// One thread per output element, grid-stride over batch * width.
// z: (batch, F, F); concat: (batch, n_concat), unused when n_concat == 0;
// out: (batch, width) with width = n_concat + n_pairs + pad.
template <typename T>
__global__ void interaction_gather_forward(const T* z, const T* concat, const int* pairs,
                                           oe::i64 batch, int n_features, int n_concat,
                                           int n_pairs, int width, T* out) {
  const oe::i64 n = batch * (oe::i64)width;
  const oe::i64 stride = (oe::i64)gridDim.x * blockDim.x;
  const oe::i64 sample_stride = (oe::i64)n_features * n_features;
  for (oe::i64 i = (oe::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const oe::i64 s = i / width;
    const int j = (int)(i - s * width);
    T v = T(0);
    if (j < n_concat) {
      v = concat[s * n_concat + j];
    } else if (j < n_concat + n_pairs) {
      const int p = j - n_concat;
      const int r = pairs[2 * p];
      const int c = pairs[2 * p + 1];
      v = z[s * sample_stride + (oe::i64)r * n_features + c];
    }
    out[i] = v;
  }
}

// One thread per (sample, j) with j < n_concat + n_pairs; the padding columns of dout get no
// gradient. dsym: (batch, F, F), zeroed by the caller; each pair (r, c) writes dsym[r, c] and
// dsym[c, r] (2 * g once on the diagonal), and no two pairs touch the same entry, so plain stores
// suffice. dout: (batch, width); dconcat: (batch, n_concat), unused when n_concat == 0.
template <typename T>
__global__ void interaction_scatter_backward(const T* dout, const int* pairs, oe::i64 batch,
                                             int n_features, int n_concat, int n_pairs,
                                             int width, T* dsym, T* dconcat) {
  const int used = n_concat + n_pairs;
  const oe::i64 n = batch * (oe::i64)used;
  const oe::i64 stride = (oe::i64)gridDim.x * blockDim.x;
  const oe::i64 sample_stride = (oe::i64)n_features * n_features;
  for (oe::i64 i = (oe::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const oe::i64 s = i / used;
    const int j = (int)(i - s * used);
    const T g = dout[s * width + j];
    if (j < n_concat) {
      dconcat[s * n_concat + j] = g;
    } else {
      const int p = j - n_concat;
      const int r = pairs[2 * p];
      const int c = pairs[2 * p + 1];
      T* ds = dsym + s * sample_stride;
      if (r == c) {
        ds[(oe::i64)r * n_features + r] = g + g;
      } else {
        ds[(oe::i64)r * n_features + c] = g;
        ds[(oe::i64)c * n_features + r] = g;
      }
    }
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(interaction_gather_forward)
ONE_EMBEDDING_KERNEL(interaction_scatter_backward)
#endif
