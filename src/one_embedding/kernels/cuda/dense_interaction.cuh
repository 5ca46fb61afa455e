// Device helpers of dense.cu's fused dot interaction (kernels/dense_ops.py): the one-block-per-
// sample kernels' shared-memory capacity, the pair order, where a sample's features live in each
// input layout and how they are read (rounded to ``kind``) and staged in shared memory, and how an
// output row's elements are formed and stored (fp32, or 16-bit patterns alone). The kernels
// themselves stay in dense.cu (one source per kernel family, cuda_module's rule).
#pragma once
#include "common.cuh"
#include "precision.cuh"

namespace oe {
namespace dense {


template <typename T>
__device__ __forceinline__ T rounded(T v, int kind) {
  return kind == precision::NONE ? v : T(precision::round_to((float)v, kind));
}

// Shared-memory capacity of the one-block-per-sample interaction kernels (in elements of T): the
// sample's features with rows padded to D + 1, and its pair gradients. DLRM's 27 x 128 features
// take 27 x 129 = 3483; 4352 doubles are 34 KiB, under the 48 KiB of static shared memory.
constexpr int TILE_ELEMENTS = 4352;
constexpr int TILE_PAIRS = 1024;

// Pair index of (r, c), c < r (c <= r with the diagonal), in cuda_module.pair_table's order.
__device__ __forceinline__ int pair_index(int r, int c, int self_interaction) {
  return (self_interaction ? r * (r + 1) / 2 : r * (r - 1) / 2) + c;
}

// Feature f of sample s: the first f1 features live in ``first`` (B, f1, dim), the rest in
// ``rest`` (B, f2, dim): DLRM's [bottom output, embeddings] read in place.
template <typename T>
__device__ __forceinline__ const T* feature(const T* first, const T* rest, i64 s, int f, int f1,
                                            int f2, int dim) {
  return f < f1 ? first + (s * f1 + f) * (i64)dim : rest + (s * f2 + (f - f1)) * (i64)dim;
}

// The interaction's input layouts (``packed``): 0, the two parts above read in place; PACKED,
// one (B, f1 + f2, dim) buffer of T in ``first`` (``rest`` unused); PACKED_BITS, the same buffer
// of fp16 / bf16 patterns (``kind`` 1 / 2) in ``bits``: the rows the embedding gathered straight
// into the interaction's input (kernels/layout_ops.py). f1 / f2 still split the gradient into
// dfirst / drest.
constexpr int PACKED = 1;
constexpr int PACKED_BITS = 2;

// Element d of feature f of sample s, rounded to ``kind``. A 16-bit pattern decodes exactly to a
// value of ``kind``, which rounding would leave unchanged.
template <typename T>
__device__ __forceinline__ T load(const T* first, const T* rest, const unsigned short* bits,
                                  int packed, i64 s, int f, int d, int f1, int f2, int dim,
                                  int kind) {
  if (packed == PACKED_BITS) {
    const unsigned short b = bits[(s * (f1 + f2) + f) * (i64)dim + d];
    return T(kind == precision::FP16 ? precision::half_bits_to_float(b)
                                     : precision::bf16_bits_to_float(b));
  }
  const T* x = packed == PACKED ? first + (s * (f1 + f2) + f) * (i64)dim
                                : feature(first, rest, s, f, f1, f2, dim);
  return rounded(x[d], kind);
}

// Global loads of a sample's features a thread of the one-block-per-sample kernels issues before
// the first of their shared-memory stores.
constexpr int STAGE_AHEAD = 8;

// Copies sample s's features, rounded to ``kind`` (``load``), into shared memory: item k of the
// (F, dim / G) groups of G consecutive values of a row goes to put(k, values) (G values of T),
// threadIdx.x, + blockDim.x, ... of the block taking them. A thread loads STAGE_AHEAD values (of
// STAGE_AHEAD / G items) before it stores the first, so that many loads are in flight per thread
// where a load-then-store loop had one, most of the kernels' time per sample (the dots read
// shared memory). dim % G == 0. Every value lands where it did one at a time.
template <int G, typename T, typename Put>
__device__ __forceinline__ void stage_features(const T* first, const T* rest,
                                               const unsigned short* bits, int packed, i64 s,
                                               int f1, int f2, int dim, int kind, const Put& put) {
  constexpr int ITEMS = STAGE_AHEAD / G;
  const int groups = dim / G;
  const int n = (f1 + f2) * groups;
  for (int base = threadIdx.x; base < n; base += ITEMS * blockDim.x) {
    T values[ITEMS][G];
    ONE_EMBEDDING_UNROLL
    for (int a = 0; a < ITEMS; ++a) {
      const int k = base + a * blockDim.x;
      const int row = k / groups;
      const int d = (k - row * groups) * G;
      ONE_EMBEDDING_UNROLL
      for (int j = 0; j < G; ++j) {
        values[a][j] = k < n ? load(first, rest, bits, packed, s, row, d + j, f1, f2, dim, kind)
                             : T(0);
      }
    }
    ONE_EMBEDDING_UNROLL
    for (int a = 0; a < ITEMS; ++a) {
      const int k = base + a * blockDim.x;
      if (k < n) put(k, values[a]);
    }
  }
}

// Element j of sample s's output row [concat | dot(r, c) over the pairs (pair_table's order),
// rounded to out_kind | zero padding]; dot(r, c): the sample's x_r . x_c.
template <typename T, typename Dot>
__device__ __forceinline__ T output_value(const T* concat, i64 s, int j, int n_concat,
                                          int n_pairs, int self_interaction, int out_kind,
                                          const Dot& dot) {
  if (j < n_concat) return concat[s * n_concat + j];
  if (j >= n_concat + n_pairs) return T(0);
  const int p = j - n_concat;
  int r = 0;  // invert pair_index: the row r whose pairs hold p
  while (pair_index(r + 1, 0, self_interaction) <= p) ++r;
  return rounded(dot(r, p - pair_index(r, 0, self_interaction)), out_kind);
}

// Stores output element i: its value in out, or (bits_only, fp16 / bf16) only its 16-bit
// pattern in out_bits, the operand the next layer's product reads (the concat columns rounded
// there as that product's cast rounded them).
template <typename T>
__device__ __forceinline__ void store_output(T* out, unsigned short* out_bits, int bits_only,
                                             int kind, i64 i, T v) {
  if (bits_only) {
    out_bits[i] = precision::to_bits((float)v, kind);
  } else {
    out[i] = v;
  }
}

// Sample s's output row (output_value) stored (store_output), element j by thread threadIdx.x,
// + blockDim.x, ... of the block; dot(r, c) from the staged features.
template <typename T, typename Dot>
__device__ __forceinline__ void write_outputs(const T* concat, i64 s, int n_concat, int n_pairs,
                                              int width, int self_interaction, int kind,
                                              int out_kind, T* out, unsigned short* out_bits,
                                              int bits_only, const Dot& dot) {
  for (int j = threadIdx.x; j < width; j += blockDim.x) {
    store_output(out, out_bits, bits_only, kind, s * (i64)width + j,
                 output_value(concat, s, j, n_concat, n_pairs, self_interaction, out_kind, dot));
  }
}

}  // namespace dense
}  // namespace oe
