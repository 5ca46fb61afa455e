// MLP elementwise kernels: bias + activation (with a bit-packed ReLU mask) and counter-hash dropout.
//
// Mask layout (ReLU and dropout alike): element i of the flat (rows, cols) array is bit i % 32 of
// word i / 32 (see oe::mask_bit). A warp owns whole words: lane k handles element 32 * word + k,
// and __ballot_sync assembles the word, so no atomics and no read-modify-write are needed.
#include "common.cuh"

// y[i] = v: oe::bias_act_forward_words' store.
template <typename T>
struct StoreY {
  T* y;
  __device__ __forceinline__ void operator()(oe::i64 i, T v) const { y[i] = v; }
};

// y = relu(h + b) or h + b, elementwise over (rows, cols); y may alias h
// (oe::bias_act_forward_words). Grid-stride over mask words; blockDim.x must be a multiple of 32.
// h, y: (rows, cols); b: (cols,); relu_mask: (ceil(rows * cols / 32),), written when relu != 0.
template <typename T>
__global__ void mlp_bias_act_forward(const T* h, const T* b, oe::i64 rows, int cols, int relu,
                                     T* y, unsigned* relu_mask, int ahead) {
  oe::bias_act_forward_words(h, b, rows * (oe::i64)cols, cols, relu, StoreY<T>{y}, relu_mask,
                             ahead);
}

// dy[i] and dh[i] = g: oe::bias_act_backward_chunk's load and store.
template <typename T>
struct LoadDy {
  const T* dy;
  __device__ __forceinline__ T operator()(oe::i64 i) const { return dy[i]; }
};

template <typename T>
struct StoreDh {
  T* dh;
  __device__ __forceinline__ void operator()(oe::i64 i, T g) const { dh[i] = g; }
};

// dh = dy * mask (dy when has_mask == 0) and per-chunk column sums of dh
// (oe::bias_act_backward_chunk). Grid (ceil(cols / 32), n_chunks), block (32, COLUMN_BLOCK_ROWS);
// chunk g covers rows [g * rows_per_chunk, min((g + 1) * rows_per_chunk, rows)).
// dy, dh: (rows, cols); relu_mask: bit-packed; db_partial: (n_chunks, cols), summed on the host side.
template <typename T>
__global__ void mlp_bias_act_backward(const T* dy, const unsigned* relu_mask, int has_mask,
                                      oe::i64 rows, int cols, oe::i64 rows_per_chunk, T* dh,
                                      T* db_partial, int ahead) {
  oe::bias_act_backward_chunk(LoadDy<T>{dy}, relu_mask, has_mask, rows, cols, rows_per_chunk,
                              StoreDh<T>{dh}, db_partial, ahead);
}

// keep[i] = uniform01(counter_hash(seed, step, i, 0)) > rate; y = (x * keep) * scale with
// scale = T(1 / (1 - rate)), the reference's exact operation order.
// x, y: (n,) flat; keep_mask: (ceil(n / 32),). Grid-stride over mask words as above.
template <typename T>
__global__ void mlp_dropout_forward(const T* x, oe::i64 n, double rate, T scale, oe::u64 seed,
                                    oe::u64 step, T* y, unsigned* keep_mask) {
  const oe::i64 n_words = (n + 31) >> 5;
  const int lane = threadIdx.x & 31;
  const oe::i64 first_warp = ((oe::i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const oe::i64 n_warps = ((oe::i64)gridDim.x * blockDim.x) >> 5;
  const oe::u64 key_state = oe::counter_key_state(seed, step);
  for (oe::i64 word = first_warp; word < n_words; word += n_warps) {
    const oe::i64 i = (word << 5) + lane;
    bool keep = false;
    if (i < n) {
      keep = oe::uniform01(oe::counter_hash(key_state, (oe::u64)i, 0u)) > rate;
      y[i] = (x[i] * T(keep ? 1 : 0)) * scale;
    }
    const unsigned bits = __ballot_sync(oe::FULL_WARP, keep);
    if (lane == 0) keep_mask[word] = bits;
  }
}

// dx = (dy * keep) * scale. dy, dx: (n,) flat; keep_mask from mlp_dropout_forward.
template <typename T>
__global__ void mlp_dropout_backward(const T* dy, const unsigned* keep_mask, oe::i64 n, T scale,
                                     T* dx) {
  const oe::i64 stride = (oe::i64)gridDim.x * blockDim.x;
  for (oe::i64 i = (oe::i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    dx[i] = (dy[i] * T(oe::mask_bit(keep_mask, i))) * scale;
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(mlp_bias_act_forward)
ONE_EMBEDDING_KERNEL(mlp_bias_act_backward)
ONE_EMBEDDING_KERNEL(mlp_dropout_forward)
ONE_EMBEDDING_KERNEL(mlp_dropout_backward)
#endif
