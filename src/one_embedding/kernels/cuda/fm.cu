// Factorization machine, second-order term summed over the dimension (DeepFM's FM logit):
//   out[s] = sum_d 0.5 * ((sum_f x[s, f, d])^2 - sum_f x[s, f, d]^2)
//   dx[s, f, d] = dout[s] * (sum_f' x[s, f', d] - x[s, f, d])
// One warp per sample: lanes stride over d, each lane loops over the F features of its d.
#include "common.cuh"

// x: (batch, F, D); out: (batch,). blockDim.x is a multiple of 32.
template <typename T>
__global__ void fm_forward(const T* x, oe::i64 batch, int n_features, int dim, T* out) {
  const int lane = threadIdx.x & 31;
  const oe::i64 first_warp = ((oe::i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const oe::i64 n_warps = ((oe::i64)gridDim.x * blockDim.x) >> 5;
  const oe::i64 sample_stride = (oe::i64)n_features * dim;
  for (oe::i64 s = first_warp; s < batch; s += n_warps) {
    const T* xs = x + s * sample_stride;
    T sum_sq = T(0);   // sum_d (sum_f x)^2
    T sq_sum = T(0);   // sum_d sum_f x^2
    for (int d = lane; d < dim; d += 32) {
      T col = T(0);
      for (int f = 0; f < n_features; ++f) {
        const T v = xs[(oe::i64)f * dim + d];
        col += v;
        sq_sum += v * v;
      }
      sum_sq += col * col;
    }
    const T total = oe::warp_sum(sum_sq - sq_sum);
    if (lane == 0) out[s] = T(0.5) * total;
  }
}

// dout: (batch,); x, dx: (batch, F, D).
template <typename T>
__global__ void fm_backward(const T* dout, const T* x, oe::i64 batch, int n_features, int dim,
                            T* dx) {
  const int lane = threadIdx.x & 31;
  const oe::i64 first_warp = ((oe::i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const oe::i64 n_warps = ((oe::i64)gridDim.x * blockDim.x) >> 5;
  const oe::i64 sample_stride = (oe::i64)n_features * dim;
  for (oe::i64 s = first_warp; s < batch; s += n_warps) {
    const T* xs = x + s * sample_stride;
    T* dxs = dx + s * sample_stride;
    const T g = dout[s];
    for (int d = lane; d < dim; d += 32) {
      T col = T(0);
      for (int f = 0; f < n_features; ++f) col += xs[(oe::i64)f * dim + d];
      for (int f = 0; f < n_features; ++f) {
        const oe::i64 k = (oe::i64)f * dim + d;
        dxs[k] = (col - xs[k]) * g;
      }
    }
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(fm_forward)
ONE_EMBEDDING_KERNEL(fm_backward)
#endif
