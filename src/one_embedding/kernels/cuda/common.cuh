// Shared device helpers for every kernel family (the dense layers: mlp, interaction, cross, fm,
// loss; the embedding side: hashindex, cache, embedding, optim, codec).
//
// Compiled by NVRTC at run time (cupy.RawModule) and by nvcc in CI, so it includes no host header:
// only built-in types and CUDA's own math functions. Kernels are templates on the float type T
// (float or double) and are named "<family>_<what>" so profiles read well.
#pragma once

namespace oe {

typedef unsigned long long u64;
typedef long long i64;

// The counter hash of one_embedding/initializers.py, bit for bit:
//   h = mix(mix(mix(seed ^ SEED_SALT) ^ key) + (column << 8 | stream) * GOLDEN)
// with mix the splitmix64 finalizer, all in wrapping uint64 arithmetic.
constexpr u64 GOLDEN = 0x9E3779B97F4A7C15ull;
constexpr u64 SEED_SALT = 0x5851F42D4C957F2Dull;
constexpr u64 MIX1 = 0xBF58476D1CE4E5B9ull;
constexpr u64 MIX2 = 0x94D049BB133111EBull;

__device__ __forceinline__ u64 splitmix64(u64 z) {
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  return z ^ (z >> 31);
}

// mix(mix(seed ^ SEED_SALT) ^ key): the part of the hash shared by every column of one key.
__device__ __forceinline__ u64 counter_key_state(u64 seed, u64 key) {
  return splitmix64(key ^ splitmix64(seed ^ SEED_SALT));
}

__device__ __forceinline__ u64 counter_hash(u64 key_state, u64 column, unsigned stream) {
  return splitmix64(key_state + ((column << 8) | (u64)stream) * GOLDEN);
}

// Top 53 bits -> [0, 1). Exact in double (the integer is below 2**53), as in numpy.
__device__ __forceinline__ double uniform01(u64 h) {
  return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

// Overloads, so templates on T call the float or double CUDA math function without host headers.
__device__ __forceinline__ float exp_t(float x) { return expf(x); }
__device__ __forceinline__ double exp_t(double x) { return exp(x); }
__device__ __forceinline__ float log1p_t(float x) { return log1pf(x); }
__device__ __forceinline__ double log1p_t(double x) { return log1p(x); }

constexpr unsigned FULL_WARP = 0xffffffffu;

// Grid-stride loops: the flat index of this thread and the thread count of the grid, and the same
// for warps (kernels where a warp owns one item per step: a key, a set, a row).
__device__ __forceinline__ i64 grid_thread() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * blockDim.x; }
__device__ __forceinline__ i64 grid_warp() { return grid_thread() >> 5; }
__device__ __forceinline__ i64 grid_warps() { return grid_threads() >> 5; }

// Sum over the 32 lanes of a warp; every lane gets the total. All lanes must call it.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_WARP, v, offset);
  return v;
}

// Sum over a 1-D block whose size is a multiple of 32 (at most 1024). Every thread must call it;
// the total is valid in thread 0. Safe to call more than once per kernel.
template <typename T>
__device__ T block_sum(T v) {
  __shared__ T warp_totals[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_totals[warp] = v;
  __syncthreads();
  T total = T(0);
  if (warp == 0) {
    total = lane < (int)(blockDim.x >> 5) ? warp_totals[lane] : T(0);
    total = warp_sum(total);
  }
  __syncthreads();
  return total;
}

// Unrolled loops of constant count (over a vector's lanes, a line's blocks, the loads a thread
// issues ahead): their arrays stay in registers (the host emulator's g++ knows no such pragma).
#ifdef __CUDACC__
#define ONE_EMBEDDING_UNROLL _Pragma("unroll")
#else
#define ONE_EMBEDDING_UNROLL
#endif

// Rows whose loads bias_act_backward_chunk issues before the first of their stores.
constexpr int BACKWARD_AHEAD = 8;

// Column reductions use blocks of (32, COLUMN_BLOCK_ROWS) threads: threadIdx.x picks a column
// among 32 neighbours (coalesced row reads), threadIdx.y strides over the rows of a chunk.
constexpr int COLUMN_BLOCK_ROWS = 8;

// Sum of acc over threadIdx.y for each threadIdx.x; valid in the threads with threadIdx.y == 0.
// Every thread of the block must call it. The fixed order keeps results deterministic.
template <typename T>
__device__ T column_block_sum(T acc) {
  __shared__ T partial[COLUMN_BLOCK_ROWS][32];
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  T total = T(0);
  if (threadIdx.y == 0) {
    for (int k = 0; k < COLUMN_BLOCK_ROWS; ++k) total += partial[k][threadIdx.x];
  }
  __syncthreads();
  return total;
}

// A read of a global word that other threads of the same launch may be writing (a hash table's
// key word, an atomic minimum): volatile, so each call reads memory, never a register's copy. The
// host emulator defines ONE_EMBEDDING_RACY_READ_HOOK as a point, right after the read, where its
// stress mode may switch threads, so the tests see the word change between this read and the
// atomic that follows it.
__device__ __forceinline__ u64 racy_read(const u64* p) {
  const u64 value = *(const volatile u64*)p;
#ifdef ONE_EMBEDDING_RACY_READ_HOOK
  ONE_EMBEDDING_RACY_READ_HOOK();
#endif
  return value;
}

// The exponent all ones: inf or NaN.
__device__ __forceinline__ bool non_finite(float v) {
  return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool non_finite(double v) {
  return ((u64)__double_as_longlong(v) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// Bit i of a bit-packed mask: word i / 32, bit i % 32 (little-endian within the word), the
// layout of numpy.packbits(bitorder="little") viewed as little-endian uint32.
__device__ __forceinline__ unsigned mask_bit(const unsigned* mask, i64 i) {
  return (mask[i >> 5] >> (unsigned)(i & 31)) & 1u;
}

// Words of bias_act_forward_words whose h and b loads a warp issues before the first store.
constexpr int FORWARD_AHEAD = 4;

// y = relu(h + b) (relu != 0) or h + b over the flat (rows, cols) array of n elements, handed to
// store(i, y) (y may alias h), and the bit-packed ReLU mask (as mask_bit reads it) when relu:
// grid-stride over the 32-element mask words with whole warps, lane k on element 32 word + k,
// __ballot_sync assembling each word (no atomics). A warp takes FORWARD_AHEAD of its words at a
// time and loads all their h and b before the first store (a word's store only follows its own
// loads, so an aliased y is safe), keeping that many loads in flight where it had one. The same
// values as one word at a time, bit for bit. mlp_bias_act_forward and dense_bias_act_cast (which
// also stores y's 16-bit copy). ahead == 0: one word at a time throughout (the kernels before,
// kept as a benchmark's baseline: cuda_module.LOADS_AHEAD). Every thread of the grid must call it
// (the ballots).
template <typename T, typename Store>
__device__ __forceinline__ void bias_act_forward_words(const T* h, const T* b, i64 n, int cols,
                                                       int relu, const Store& store,
                                                       unsigned* relu_mask, int ahead) {
  const i64 n_words = (n + 31) >> 5;
  const int lane = threadIdx.x & 31;
  const i64 stride = grid_warps();
  // h + b of this lane's element of a word (0 past n), and the rest of the word's work
  const auto loaded = [&](i64 word) -> T {
    const i64 i = (word << 5) + lane;
    return i < n ? h[i] + b[i % cols] : T(0);
  };
  const auto finish = [&](i64 word, T x) {
    const i64 i = (word << 5) + lane;
    bool positive = false;
    if (i < n) {
      if (relu) {
        x = x < T(0) ? T(0) : x;  // numpy.maximum(x, 0): NaN and -0.0 pass through
        positive = x > T(0);
      }
      store(i, x);
    }
    if (relu) {  // the loop bounds are the warp's: every lane reaches the ballot
      const unsigned bits = __ballot_sync(FULL_WARP, positive);
      if (lane == 0) relu_mask[word] = bits;
    }
  };
  i64 word = grid_warp();
  for (; ahead && word + (FORWARD_AHEAD - 1) * stride < n_words; word += FORWARD_AHEAD * stride) {
    T v[FORWARD_AHEAD];
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k < FORWARD_AHEAD; ++k) v[k] = loaded(word + k * stride);
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k < FORWARD_AHEAD; ++k) finish(word + k * stride, v[k]);
  }
  for (; word < n_words; word += stride) finish(word, loaded(word));
}

// The backward of bias + ReLU over one column chunk (mlp_bias_act_backward, and
// dense_bias_act_backward_cast, which reads dy through a rounding and stores its result as 16-bit
// patterns): each thread's column of rows [blockIdx.y * rows_per_chunk, ...) strided by
// blockDim.y, g = load(i) * mask (a multiply, so NaN and inf behave as numpy's dy * mask) handed
// to store(i, g), and the chunk's column sum of g written to db_partial (n_chunks, cols) in
// column_block_sum's order. Grid (ceil(cols / 32), n_chunks), block (32, COLUMN_BLOCK_ROWS);
// every thread of the block must call it.
template <typename T, typename Load, typename Store>
__device__ __forceinline__ void bias_act_backward_chunk(const Load& load, const unsigned* relu_mask,
                                                        int has_mask, i64 rows, int cols,
                                                        i64 rows_per_chunk, const Store& store,
                                                        T* db_partial, int ahead) {
  const int col = blockIdx.x * 32 + threadIdx.x;
  const i64 row_begin = (i64)blockIdx.y * rows_per_chunk;
  const i64 row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;
  T acc = T(0);
  if (col < cols) {
    // BACKWARD_AHEAD rows' dy and mask words are loaded before the first of them is stored:
    // a store (which may alias dy: the compiler keeps the order) no longer waits out each row's
    // load, so a warp has that many loads in flight instead of one. The same rows, in the same
    // order, so the same values, stores and sum. ahead == 0: one row at a time (the kernels
    // before, a benchmark's baseline: cuda_module.LOADS_AHEAD).
    const i64 step = blockDim.y;
    // row r's element: dy (through load) and its mask word, then g = dy * mask stored and added
    const auto word_of = [&](i64 i) { return has_mask ? relu_mask[i >> 5] : 0u; };
    const auto finish = [&](i64 i, T g, unsigned word) {
      if (has_mask) g = g * T((word >> (unsigned)(i & 31)) & 1u);
      store(i, g);
      acc += g;
    };
    i64 r = row_begin + threadIdx.y;
    for (; ahead && r + (BACKWARD_AHEAD - 1) * step < row_end; r += BACKWARD_AHEAD * step) {
      T v[BACKWARD_AHEAD];
      unsigned words[BACKWARD_AHEAD];
      ONE_EMBEDDING_UNROLL
      for (int k = 0; k < BACKWARD_AHEAD; ++k) {
        const i64 i = (r + k * step) * cols + col;
        v[k] = load(i);
        words[k] = word_of(i);
      }
      ONE_EMBEDDING_UNROLL
      for (int k = 0; k < BACKWARD_AHEAD; ++k) finish((r + k * step) * cols + col, v[k], words[k]);
    }
    for (; r < row_end; r += step) {
      const i64 i = r * cols + col;
      finish(i, load(i), word_of(i));
    }
  }
  const T total = column_block_sum(acc);
  if (threadIdx.y == 0 && col < cols) db_partial[(i64)blockIdx.y * cols + col] = total;
}

// The sum of rows rows_by_segment[begin:end] of values (rows of stride dim) at column c, added in
// row order from +0 in T (so the same float bit for bit as a plain loop). The adds are a chain, but
// the loads are not: eight rows' indices and values are loaded before the first of their adds, so
// a run of rows waits on memory once per eight rows, not once per row. The segment sums call it
// on runs of at most SUM_CHUNK rows (the tree order below).
template <typename T>
__device__ __forceinline__ T ordered_row_sum(const T* values, int dim, const i64* rows_by_segment,
                                             i64 begin, i64 end, int c) {
  constexpr int kAhead = 8;
  T acc = T(0);
  i64 k = begin;
  for (; k + kAhead <= end; k += kAhead) {
    T v[kAhead];
    ONE_EMBEDDING_UNROLL
    for (int j = 0; j < kAhead; ++j) v[j] = values[rows_by_segment[k + j] * dim + c];
    ONE_EMBEDDING_UNROLL
    for (int j = 0; j < kAhead; ++j) acc += v[j];
  }
  for (; k < end; ++k) acc += values[rows_by_segment[k] * dim + c];
  return acc;
}

// ---- The tree order of a segment sum (parallel/unique.py segment_sum, its CPU twin).
// A segment's rows r_0..r_{L-1} (in row order) sum as: L <= SUM_CHUNK: in row order from +0 in T;
// else the rows split into consecutive chunks of SUM_CHUNK (the last may be shorter), each chunk
// summed in row order from +0, and the list of the chunk partials summed by the same rule,
// recursively (10^5 rows -> 3125 partials -> 98 -> 4 -> one). A segment of at most SUM_CHUNK
// rows is one thread's loop (ordered_row_sum); a longer one is summed level by level, a thread
// per (chunk, column) (embedding_tree_level), so no thread adds more than SUM_CHUNK values.
constexpr int SUM_CHUNK = 32;

// How many values a segment of `length` rows (length > SUM_CHUNK) has after `level` levels of
// the tree: ceil(length / SUM_CHUNK) applied `level` times (level 0: its rows; 1 at the top).
__device__ __forceinline__ i64 tree_items(i64 length, int level) {
  for (int k = 0; k < level; ++k) length = (length + SUM_CHUNK - 1) / SUM_CHUNK;
  return length;
}

// The first s in [0, n) with ends[s] > j (n if none): the segment owning item j of a level whose
// segments' items end at ends (n,) i64, ascending (an inclusive prefix sum of their counts).
__device__ __forceinline__ i64 owner_of(const i64* ends, i64 n, i64 j) {
  i64 lo = 0, hi = n;
  while (lo < hi) {
    const i64 mid = lo + (hi - lo) / 2;
    if (ends[mid] > j) hi = mid; else lo = mid + 1;
  }
  return lo;
}

}  // namespace oe

// Explicit instantiation for nvcc (scripts/compile_cuda.sh defines ONE_EMBEDDING_INSTANTIATE):
// taking the address of both float types makes nvcc compile each template body. NVRTC gets the
// same list through name_expressions (cuda_module.py reads these lines from the source). A host
// build (tests/unit/test_cuda_sources.py's emulator) defines its own ONE_EMBEDDING_KERNEL first.
#ifndef ONE_EMBEDDING_KERNEL
#define ONE_EMBEDDING_KERNEL(name) \
  void* name##_instances[] = {(void*)&name<float>, (void*)&name<double>};
#endif
