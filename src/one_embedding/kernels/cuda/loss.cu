// Binary cross-entropy with logits, in the stable form
//   loss_i = max(z, 0) - z * y + log1p(exp(-|z|)),   dloss/dz_i = (sigmoid(z) - y) / B.
#include "common.cuh"

// Per-block sums of loss_i, accumulated in double whatever T is (the mean of millions of terms).
// logits, labels: (n,); block_sums: (gridDim.x,) double. blockDim.x a multiple of 32.
template <typename T>
__global__ void loss_bce_forward(const T* logits, const T* labels, oe::i64 n,
                                 double* block_sums) {
  double acc = 0.0;
  const oe::i64 stride = (oe::i64)gridDim.x * blockDim.x;
  for (oe::i64 i = (oe::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T z = logits[i];
    const T abs_z = z < T(0) ? -z : z;
    const T per = (z > T(0) ? z : T(0)) - z * labels[i] + oe::log1p_t(oe::exp_t(-abs_z));
    acc += (double)per;
  }
  const double total = oe::block_sum(acc);
  if (threadIdx.x == 0) block_sums[blockIdx.x] = total;
}

// dlogits = (sigmoid(z) - y) / B, sigmoid taken from exp(-|z|) so it never overflows.
template <typename T>
__global__ void loss_bce_backward(const T* logits, const T* labels, oe::i64 n, T* dlogits) {
  const oe::i64 stride = (oe::i64)gridDim.x * blockDim.x;
  const T count = T(n);
  for (oe::i64 i = (oe::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T z = logits[i];
    const T e = oe::exp_t(z < T(0) ? z : -z);
    const T sig = z >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
    dlogits[i] = (sig - labels[i]) / count;
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(loss_bce_forward)
ONE_EMBEDDING_KERNEL(loss_bce_backward)
#endif
