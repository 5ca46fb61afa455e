// The embedding side's data movement: unique + inverse (a hash-table dedup, and the atomic step
// of the sort-based unique it replaced, kept as the benchmark's baseline), segment sums in a
// fixed tree order, row gathers (also straight into the dot interaction's input; each at 4 or
// 16 bytes per thread, as the layout allows), and initial values on a miss.
//
// The sorts and prefix sums around these kernels run in CuPy (kernels/device_ops.py); each op's
// result is independent of thread timing (the dedup's buckets are not, its outputs are), so the
// whole op is deterministic and equals its numpy twin bit for bit (segment sums: adds in the tree
// order of common.cuh, from +0, as parallel/unique.py; gathers: copies;
// initial values: the integer hash is exact, the float64 transforms may differ from numpy's libm
// in the last ulp, which survives the rounding to float32 only rarely).
#include "common.cuh"
#include "precision.cuh"
#include "vector.cuh"

// first[segment[j]] = min over j of order[j]: the first position of each run of equal keys.
// order: (n,) i64 positions of the keys in key-sorted order; segment: (n,) i64 run of each sorted
// key; first: (n_segments,) i64, preset to n by the caller. A minimum does not depend on which
// thread gets there first. T: unused (one instantiation per row type, as every kernel).
template <typename T>
__global__ void embedding_unique_first(const oe::i64* order, const oe::i64* segment, oe::i64 n,
                                       oe::i64* first) {
  for (oe::i64 j = oe::grid_thread(); j < n; j += oe::grid_threads()) {
    atomicMin((long long*)&first[segment[j]], (long long)order[j]);
  }
}

// ---- Dedup with a hash table: unique keys in first-occurrence order, the inverse and first
// positions, in four passes over the ids with no sort (device_unique.unique_ids launches them).
//
// table: (capacity + 1, 2) u64, bucket b = [key, first], capacity a power of two (mask =
// capacity - 1) of at least twice the ids, so a probe always meets an empty bucket. Buckets
// 0..mask are an open-addressing table, linear probing from splitmix64(key) & mask; key ==
// DEDUP_EMPTY marks an empty bucket. Since every uint64 is a valid key, the key equal to
// DEDUP_EMPTY itself never enters the table: it has the side bucket `capacity`. `first` is the
// smallest position of the bucket's key among the ids (int64 bits), n while no id claimed it.
//
// Two different keys may race for one bucket, so which bucket a key gets varies from run to run;
// nothing else does: each key gets exactly one bucket, whose `first` ends as the minimum of its
// positions, and every output is computed from these minima alone.
namespace oe {
namespace dedup {

constexpr u64 EMPTY = ~0ull;

// The first bucket of `key`'s probe that holds it or was empty, claimed for it (atomicCAS on the
// key word). A plain read first: a bucket holding another key is passed and one holding `key` is
// taken without an atomic (a key word never changes once set, so a stale read is only a stale
// EMPTY, which the atomicCAS then settles).
__device__ __forceinline__ i64 claim(u64* table, i64 mask, u64 key) {
  if (key == EMPTY) return mask + 1;
  i64 b = (i64)(splitmix64(key) & (u64)mask);
  for (;;) {
    const u64 seen = racy_read(&table[2 * b]);
    if (seen == key) return b;
    if (seen == EMPTY) {
      const u64 before = atomicCAS(&table[2 * b], EMPTY, key);
      if (before == EMPTY || before == key) return b;
    }
    b = (b + 1) & mask;
  }
}

}  // namespace dedup
}  // namespace oe

// Pass 0: every bucket empty, its first position n. table: (n_buckets, 2) u64.
template <typename T>
__global__ void embedding_dedup_clear(oe::u64* table, oe::i64 n_buckets, oe::i64 n) {
  for (oe::i64 b = oe::grid_thread(); b < n_buckets; b += oe::grid_threads()) {
    table[2 * b] = oe::dedup::EMPTY;
    table[2 * b + 1] = (oe::u64)n;
  }
}

// Pass 1, a thread per id: claim the key's bucket and lower its first position to i (the minimum
// does not depend on the order the threads get there; first positions only decrease, so a read
// showing one at most i makes the atomic a no-op and it is skipped, which spares a hot key's
// bucket most of its atomics). keys: (n,) u64; bucket_of: (n,) i64, each id's bucket.
template <typename T>
__global__ void embedding_dedup_insert(const oe::u64* keys, oe::i64 n, oe::u64* table,
                                       oe::i64 mask, oe::i64* bucket_of) {
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    const oe::i64 b = oe::dedup::claim(table, mask, keys[i]);
    bucket_of[i] = b;
    if ((oe::i64)oe::racy_read(&table[2 * b + 1]) > i) {
      atomicMin((long long*)&table[2 * b + 1], (long long)i);
    }
  }
}

// Pass 2, a thread per id, after pass 1 completed: first_of[i] = the first position of id i's
// key (in place of its bucket), is_first[i] = 1 where that is i itself. first_of: (n,) i64, in:
// bucket_of of pass 1; is_first: (n,) u8.
template <typename T>
__global__ void embedding_dedup_first(const oe::u64* table, oe::i64 n, oe::i64* first_of,
                                      unsigned char* is_first) {
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    const oe::i64 f = (oe::i64)table[2 * first_of[i] + 1];
    first_of[i] = f;
    is_first[i] = f == i ? 1 : 0;
  }
}

// Pass 3, a thread per id: rank (n,) i64 is the inclusive prefix sum of is_first, so the unique
// key first seen at position f has id rank[f] - 1 (ids in first-occurrence order).
// inverse[i] = that id of id i's key; the first id of each key also writes unique_out and
// first_out at its id. keys, first_of, inverse: (n,); unique_out (u,) u64, first_out (u,) i64.
template <typename T>
__global__ void embedding_dedup_output(const oe::u64* keys, const oe::i64* first_of,
                                       const oe::i64* rank, oe::i64 n, oe::i64* inverse,
                                       oe::u64* unique_out, oe::i64* first_out) {
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    const oe::i64 f = first_of[i];
    const oe::i64 id = rank[f] - 1;
    inverse[i] = id;
    if (f == i) {
      unique_out[id] = keys[i];
      first_out[id] = i;
    }
  }
}

// Pass 3 of the fixed-capacity dedup (device_unique.unique_ids_fixed): embedding_dedup_output
// into outputs of capacity n, the unique count u = rank[n - 1] left on the device. Positions
// u..n-1 of unique_out and first_out get key 0 and position 0, so that every later gather by
// them stays in bounds; the kernels after it take the count and skip those positions.
// keys, first_of, rank, inverse, unique_out, first_out: (n,).
template <typename T>
__global__ void embedding_dedup_output_fixed(const oe::u64* keys, const oe::i64* first_of,
                                             const oe::i64* rank, oe::i64 n, oe::i64* inverse,
                                             oe::u64* unique_out, oe::i64* first_out) {
  const oe::i64 count = rank[n - 1];
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    const oe::i64 f = first_of[i];
    const oe::i64 id = rank[f] - 1;
    inverse[i] = id;
    if (f == i) {
      unique_out[id] = keys[i];
      first_out[id] = i;
    }
    if (i >= count) {
      unique_out[i] = 0;
      first_out[i] = 0;
    }
  }
}

// out[s, c] = sum of values[r, c] over the rows r of segment s, for each segment of at most
// oe::SUM_CHUNK rows: added in ascending r from +0 (the tree order's base case, common.cuh); the
// rows of the longer segments are left to embedding_tree_level, and their out rows untouched.
// values: (n, dim); rows_by_segment: (n,) i64, the rows sorted by (segment, row); offsets:
// (n_segments + 1,) i64, segment s owns rows_by_segment[offsets[s]:offsets[s + 1]]; out:
// (n_segments, dim). One thread per (segment, column): a column's additions happen in one thread,
// in row order, so the sum is the serial one bit for bit.
template <typename T>
__global__ void embedding_segment_sum(const T* values, int dim, const oe::i64* rows_by_segment,
                                      const oe::i64* offsets, oe::i64 n_segments, T* out) {
  const oe::i64 total = n_segments * dim;
  for (oe::i64 i = oe::grid_thread(); i < total; i += oe::grid_threads()) {
    const oe::i64 s = i / dim;
    const int c = (int)(i - s * dim);
    const oe::i64 begin = offsets[s], end = offsets[s + 1];
    if (end - begin <= oe::SUM_CHUNK) {
      out[i] = oe::ordered_row_sum(values, dim, rows_by_segment, begin, end, c);
    }
  }
}

// ---- The tree order of the long segments' sums (more than oe::SUM_CHUNK rows; common.cuh):
// device_unique.long_segment_totals launches, for level = 1, 2, .., levels (levels from the row
// count, on the host), embedding_tree_counts, a prefix sum of its counts (CuPy), then
// embedding_tree_level. Level k holds tree_items(L, k) values of each long segment of L rows,
// stored consecutively per segment, segments in order, ending at ends_k[s] (the prefix sum);
// at the last level every long segment has one value, its total, written into out[s].

// counts[s] = tree_items(L, level) for each segment s < live[0] of L > SUM_CHUNK rows, else 0.
// offsets: (n_segments + 1,) i64 as for embedding_segment_sum; live: (1,) i64 on the device, the
// segments to sum (n_segments, or a fixed-capacity batch's unique count: the segments from it on
// are placeholders, not read); counts: (n_segments,) i64. T: unused.
template <typename T>
__global__ void embedding_tree_counts(const oe::i64* offsets, const oe::i64* live,
                                      oe::i64 n_segments, int level, oe::i64* counts) {
  const oe::i64 limit = live[0] < n_segments ? live[0] : n_segments;
  for (oe::i64 s = oe::grid_thread(); s < n_segments; s += oe::grid_threads()) {
    oe::i64 count = 0;
    if (s < limit) {
      const oe::i64 length = offsets[s + 1] - offsets[s];
      if (length > oe::SUM_CHUNK) count = oe::tree_items(length, level);
    }
    counts[s] = count;
  }
}

// One level of the tree: value j of level `level` (j < ends[n_segments - 1]) is the sum, from +0
// in T, of the chunk of SUM_CHUNK consecutive values of the level below that it covers (the
// segment's rows at level 1, read through rows_by_segment; below_values at the higher levels),
// or a copy of that level's value where the segment already has only one (its total: a copy,
// not +0 + x, so a total is never added twice). values, rows_by_segment, offsets: as for
// embedding_segment_sum; below_ends: (n_segments,) i64, the ends of the level below (unused at
// level 1); below_values: (>= below_ends[n_segments - 1], dim) T (unused at level 1); ends:
// (n_segments,) i64, this level's; capacity: the host's upper bound of this level's value count
// (the threads past the real count return); last == 0: value j goes to out[j] (out: (capacity,
// dim), the level's values), else to out[s] (out: (n_segments, dim), the long segments' totals,
// written there only). One thread per (value, column).
template <typename T>
__global__ void embedding_tree_level(const T* values, int dim, const oe::i64* rows_by_segment,
                                     const oe::i64* offsets, oe::i64 n_segments, int level,
                                     const oe::i64* below_ends, const T* below_values,
                                     const oe::i64* ends, oe::i64 capacity, int last, T* out) {
  const oe::i64 count = ends[n_segments - 1];
  const oe::i64 total = (count < capacity ? count : capacity) * dim;
  for (oe::i64 t = oe::grid_thread(); t < total; t += oe::grid_threads()) {
    const oe::i64 j = t / dim;
    const int c = (int)(t - j * dim);
    const oe::i64 s = oe::owner_of(ends, n_segments, j);
    const oe::i64 length = offsets[s + 1] - offsets[s];
    const oe::i64 chunk = j - (ends[s] - oe::tree_items(length, level));
    const oe::i64 below = oe::tree_items(length, level - 1);
    const oe::i64 first = chunk * oe::SUM_CHUNK;
    const oe::i64 stop = first + oe::SUM_CHUNK < below ? first + oe::SUM_CHUNK : below;
    T acc;
    if (level == 1) {
      acc = oe::ordered_row_sum(values, dim, rows_by_segment, offsets[s] + first,
                                offsets[s] + stop, c);
    } else {
      const oe::i64 base = below_ends[s] - below;
      if (below == 1) {
        acc = below_values[base * dim + c];
      } else {
        acc = T(0);
        for (oe::i64 k = first; k < stop; ++k) acc += below_values[(base + k) * dim + c];
      }
    }
    out[(last ? s : j) * dim + c] = acc;
  }
}

// out[i, c] = src[index[i], c], or 0 where index[i] < 0 (padding). src: (rows, src_stride),
// its first dim columns read (src_stride > dim: the embedding columns of whole lines, read in
// place); index: (n,) i64; out: (n, dim). One thread per output element, consecutive threads on
// consecutive columns of a row.
template <typename T>
__global__ void embedding_gather(const T* src, int dim, int src_stride, const oe::i64* index,
                                 oe::i64 n, T* out) {
  const oe::i64 total = n * dim;
  for (oe::i64 i = oe::grid_thread(); i < total; i += oe::grid_threads()) {
    const oe::i64 r = i / dim;
    const oe::i64 source = index[r];
    out[i] = source >= 0 ? src[source * src_stride + (i - r * dim)] : T(0);
  }
}

// The gather of embedding_gather written straight into the dot interaction's input layout
// (kernels/layout_ops.py): row r of the (n_rows, dim) result is feature f = r % per_sample of
// sample b = r / per_sample and lands at out[b, first_slot + f, :] of the (batch, slots, dim)
// buffer. src: (rows, src_stride), its first dim columns read; index: (n_rows,) i64 (< 0: a
// zero row, padding), or, with has_index == 0, unused and row r reads src[r] (the bottom MLP's
// output into slot 0).
// ``kind`` (precision.cuh) 1 / 2 writes the fp16 / bf16 pattern of each value into out_bits
// (round to nearest even, as nn.amp.round_to: the cast the interaction applies to its operands)
// and leaves out untouched; any other kind copies the value into out and leaves out_bits
// untouched. One thread per element, consecutive threads on consecutive columns of a row.
template <typename T>
__global__ void embedding_gather_into(const T* src, int dim, int src_stride,
                                      const oe::i64* index, int has_index, oe::i64 n_rows,
                                      int per_sample, int slots, int first_slot,
                                      int kind, T* out, unsigned short* out_bits) {
  const oe::i64 total = n_rows * dim;
  const bool half = kind == oe::precision::FP16 || kind == oe::precision::BF16;
  for (oe::i64 i = oe::grid_thread(); i < total; i += oe::grid_threads()) {
    const oe::i64 r = i / dim;
    const int c = (int)(i - r * dim);
    const oe::i64 source = has_index ? index[r] : r;
    const T v = source >= 0 ? src[source * src_stride + c] : T(0);
    const oe::i64 sample = r / per_sample;
    const int feature = (int)(r - sample * per_sample);
    const oe::i64 at = (sample * slots + first_slot + feature) * (oe::i64)dim + c;
    if (half) {
      out_bits[at] = oe::precision::to_bits((float)v, kind);
    } else {
      out[at] = v;
    }
  }
}

// ---- The two gathers at 16 bytes per thread: one thread per group of LANES = 16 / sizeof(T)
// columns (oe::Vector16, vector.cuh: a float4 / double2 load and store), the row's index read
// once per group, and 32-bit division where the groups of the launch fit (always, in practice).
// Launched instead of the scalar kernels above when dim and src_stride are multiples of LANES
// and the arrays' addresses are multiples of the vector's size (device_ops.vector_lanes checks it
// on the host); the same copies and the same rounding, so the same bits. groups = dim / LANES,
// src_groups = src_stride / LANES; the other parameters are those of the scalar kernels.
namespace oe {
namespace gather {

// Items (16-byte groups of a row) a thread of the vector gathers takes at a time: their index
// and row loads are all issued before the first store, so a thread has that many in flight.
constexpr int AHEAD = 4;

// Row r = t / groups of item t, and its group t - r * groups, in 32-bit arithmetic when narrow.
__device__ __forceinline__ i64 row_of(i64 t, int groups, bool narrow) {
  return narrow ? (i64)((unsigned)t / (unsigned)groups) : t / groups;
}

// The fp16 / bf16 patterns of a vector's values (precision::to_bits on each, as the scalar
// kernel does on each element).
__device__ __forceinline__ ushort4 to_bits(const float4& v, int kind) {
  ushort4 b;
  b.x = precision::to_bits(v.x, kind);
  b.y = precision::to_bits(v.y, kind);
  b.z = precision::to_bits(v.z, kind);
  b.w = precision::to_bits(v.w, kind);
  return b;
}
__device__ __forceinline__ ushort2 to_bits(const double2& v, int kind) {
  ushort2 b;
  b.x = precision::to_bits((float)v.x, kind);
  b.y = precision::to_bits((float)v.y, kind);
  return b;
}

}  // namespace gather
}  // namespace oe

// embedding_gather, 16 bytes per thread (see above). out: (n, dim) viewed as (n, groups) vectors.
template <typename T>
__global__ void embedding_gather_vector(const T* src, int groups, int src_groups,
                                        const oe::i64* index, oe::i64 n, T* out) {
  typedef typename oe::Vector16<T>::type V;
  const oe::i64 total = n * groups;
  if (total == 0) return;
  const V* from = oe::as_vectors<const V>(src);
  V* to = oe::as_vectors<V>(out);
  const bool narrow = total <= 0x7fffffffll;
  const oe::i64 stride = oe::grid_threads();
  // gather::AHEAD items at a time: their indices, then their rows, are loaded before the first
  // store (an item's row waits on its index; the items do not wait on each other)
  for (oe::i64 t = oe::grid_thread(); t < total; t += oe::gather::AHEAD * stride) {
    oe::i64 at[oe::gather::AHEAD];
    V v[oe::gather::AHEAD];
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k < oe::gather::AHEAD; ++k) {
      const oe::i64 item = t + k * stride;
      const oe::i64 r = oe::gather::row_of(item < total ? item : 0, groups, narrow);
      const oe::i64 source = item < total ? index[r] : -1;
      at[k] = source >= 0 ? source * src_groups + (item - r * groups) : -1;
    }
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k < oe::gather::AHEAD; ++k) {
      v[k] = at[k] >= 0 ? from[at[k]] : V{};  // +0 in every lane, as T(0)
    }
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k < oe::gather::AHEAD; ++k) {
      if (t + k * stride < total) to[t + k * stride] = v[k];
    }
  }
}

// embedding_gather_into, 16 bytes read per thread (see above); the fp16 / bf16 kinds write the
// group's LANES patterns at once (8 bytes for float). Row r's group g lands at vector
// (sample * slots + first_slot + feature) * groups + g of out (or out_bits): the element offset
// of the scalar kernel divided by LANES, exact since dim is a multiple of LANES, so the store is
// aligned whenever out's (out_bits') address is. Only the array the kind writes is viewed as
// vectors: the other is the caller's 1-element placeholder.
template <typename T>
__global__ void embedding_gather_into_vector(const T* src, int groups, int src_groups,
                                             const oe::i64* index, int has_index, oe::i64 n_rows,
                                             int per_sample, int slots, int first_slot,
                                             int kind, T* out, unsigned short* out_bits) {
  typedef typename oe::Vector16<T>::type V;
  typedef typename oe::Vector16<T>::bits B;
  const oe::i64 total = n_rows * groups;
  if (total == 0) return;
  const bool half = kind == oe::precision::FP16 || kind == oe::precision::BF16;
  const V* from = oe::as_vectors<const V>(src);
  V* to = half ? nullptr : oe::as_vectors<V>(out);
  B* to_bits = half ? oe::as_vectors<B>(out_bits) : nullptr;
  const bool narrow = total <= 0x7fffffffll;
  const oe::i64 stride = oe::grid_threads();
  // gather::AHEAD items at a time, as embedding_gather_vector
  for (oe::i64 t = oe::grid_thread(); t < total; t += oe::gather::AHEAD * stride) {
    oe::i64 from_at[oe::gather::AHEAD];
    oe::i64 to_at[oe::gather::AHEAD];
    V v[oe::gather::AHEAD];
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k < oe::gather::AHEAD; ++k) {
      const oe::i64 item = t + k * stride;
      const bool inside = item < total;
      const oe::i64 r = oe::gather::row_of(inside ? item : 0, groups, narrow);
      const int g = (int)((inside ? item : 0) - r * groups);
      const oe::i64 source = !inside ? -1 : has_index ? index[r] : r;
      from_at[k] = source >= 0 ? source * src_groups + g : -1;
      const oe::i64 sample = narrow ? (oe::i64)((unsigned)r / (unsigned)per_sample)
                                    : r / per_sample;
      const int feature = (int)(r - sample * per_sample);
      to_at[k] = inside ? (sample * slots + first_slot + feature) * (oe::i64)groups + g : -1;
    }
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k < oe::gather::AHEAD; ++k) v[k] = from_at[k] >= 0 ? from[from_at[k]] : V{};
    ONE_EMBEDDING_UNROLL
    for (int k = 0; k < oe::gather::AHEAD; ++k) {
      if (to_at[k] < 0) continue;
      if (half) {
        to_bits[to_at[k]] = oe::gather::to_bits(v[k], kind);
      } else {
        to[to_at[k]] = v[k];
      }
    }
  }
}

namespace oe {
namespace init {

constexpr int CONSTANT = 0;
constexpr int UNIFORM = 1;
constexpr int NORMAL = 2;
constexpr int TRUNC_NORMAL = 3;
constexpr int TRUNC_NORMAL_TRIES = 8;  // initializers.TRUNC_NORMAL_TRIES
constexpr double PI = 3.141592653589793;

// Box-Muller on streams (2 pair, 2 pair + 1), as initializers._normal.
__device__ __forceinline__ double standard_normal(u64 key_state, u64 column, int pair) {
  const double u1 = uniform01(counter_hash(key_state, column, (unsigned)(2 * pair)));
  const double u2 = uniform01(counter_hash(key_state, column, (unsigned)(2 * pair + 1)));
  return sqrt(-2.0 * log1p(-u1)) * cos(2.0 * PI * u2);
}

// Python's max(a, b) and min(a, b) (the CPU kernel's): the first argument unless the second is
// strictly larger (smaller).
__device__ __forceinline__ double py_max(double a, double b) { return b > a ? b : a; }
__device__ __forceinline__ double py_min(double a, double b) { return b < a ? b : a; }
__device__ __forceinline__ float py_maxf(float a, float b) { return b > a ? b : a; }
__device__ __forceinline__ float py_minf(float a, float b) { return b < a ? b : a; }

}  // namespace init
}  // namespace oe

namespace oe {
namespace init {

// The initial value of one element, initializers._fill_initial's: computed in float64 from the
// counter hash and rounded to float32 once. kind: 0 constant (p0), 1 uniform [p0, p1), 2 normal
// (mean p0, std p1), 3 truncated normal (p0, p1, bounds [p2, p3]).
__device__ __forceinline__ float value(u64 key_state, u64 column, int kind, double p0, double p1,
                                       double p2, double p3) {
  double v;
  if (kind == CONSTANT) {
    v = p0;
  } else if (kind == UNIFORM) {
    v = p0 + (p1 - p0) * uniform01(counter_hash(key_state, column, 0u));
  } else if (kind == NORMAL) {
    v = p0 + p1 * standard_normal(key_state, column, 0);
  } else {
    bool found = false;
    v = 0.0;
    for (int pair = 0; pair < TRUNC_NORMAL_TRIES && !found; ++pair) {
      const double x = p0 + p1 * standard_normal(key_state, column, pair);
      if (x >= p2 && x <= p3) {
        v = x;
        found = true;
      }
    }
    if (!found) v = py_min(py_max(p0, p2), p3);
  }
  float f = (float)v;
  if (kind == TRUNC_NORMAL) f = py_minf(py_maxf(f, (float)p2), (float)p3);
  return f;
}

}  // namespace init
}  // namespace oe

// Initial values of new keys, initializers._fill_initial element for element:
// lines[rows[i], out_offset + j] = init(keys[i], column col_start + j) for j < n_cols, computed in
// float64 from the counter hash and rounded to float32 once (stored as T: a float64 line gets the
// float32 value). kind, p0..p3: as oe::init::value. lines: (N, line_size); rows: (n,) i64;
// keys: (n,) u64. One thread per (i, j).
template <typename T>
__global__ void embedding_init(T* lines, int line_size, const oe::i64* rows, const oe::u64* keys,
                               oe::i64 n, oe::i64 col_start, int n_cols, int out_offset,
                               oe::u64 seed, int kind, double p0, double p1, double p2,
                               double p3) {
  const oe::i64 total = n * n_cols;
  for (oe::i64 t = oe::grid_thread(); t < total; t += oe::grid_threads()) {
    const oe::i64 i = t / n_cols;
    const int j = (int)(t - i * n_cols);
    const oe::u64 key_state = oe::counter_key_state(seed, keys[i]);
    const float f = oe::init::value(key_state, (oe::u64)(col_start + j), kind, p0, p1, p2, p3);
    lines[rows[i] * line_size + out_offset + j] = T(f);
  }
}

// The whole line of every row i with missing[i] != 0, in one launch for every table: element j
// of the embedding columns [0, width) gets init(keys[i], column j) with the initializer of the
// column holding j in table table_ids[i]; the state columns [width, line_size) get 0. The other
// rows are left alone, so no compaction (and no count read back) comes first.
// lines: (n, line_size); missing: (n,) u8; table_ids: (n,) int; keys: (n,) u64;
// col_of: (width,) int, the column holding each element; kinds: (n_tables * n_columns,) int and
// params: (n_tables * n_columns * 4,) double, table-major. One thread per (i, j).
template <typename T>
__global__ void embedding_init_missing(T* lines, int line_size, const unsigned char* missing,
                                       const int* table_ids, const oe::u64* keys, oe::i64 n,
                                       int width, const int* col_of, int n_columns,
                                       const int* kinds, const double* params, oe::u64 seed) {
  const oe::i64 total = n * line_size;
  for (oe::i64 t = oe::grid_thread(); t < total; t += oe::grid_threads()) {
    const oe::i64 i = t / line_size;
    if (!missing[i]) continue;
    const int j = (int)(t - i * line_size);
    float f = 0.0f;
    if (j < width) {
      const int spec = table_ids[i] * n_columns + col_of[j];
      const double* p = params + 4 * (oe::i64)spec;
      f = oe::init::value(oe::counter_key_state(seed, keys[i]), (oe::u64)j, kinds[spec], p[0],
                          p[1], p[2], p[3]);
    }
    lines[t] = T(f);
  }
}

namespace oe {
namespace rows {

// The rows of a fixed-capacity batch the kernels below touch: the first live[0] of n.
__device__ __forceinline__ i64 live_rows(const i64* live, i64 n) {
  return live[0] < n ? live[0] : n;
}

}  // namespace rows
}  // namespace oe

// lines[i, start + c] = value for c < width in every row i below the live count with found[i]
// == 0 (a new key's optimizer state, or a per-row column, reset before its first update);
// the other rows are not touched, the rows from live[0] on not even read. lines: (n, line_size);
// found: (n,) u8; live: (1,) i64 on the device. One thread per (row, column).
template <typename T>
__global__ void embedding_fill_missing(T* lines, int line_size, const unsigned char* found,
                                       oe::i64 n, const oe::i64* live, int start, int width,
                                       double value) {
  const oe::i64 total = oe::rows::live_rows(live, n) * width;
  for (oe::i64 t = oe::grid_thread(); t < total; t += oe::grid_threads()) {
    const oe::i64 i = t / width;
    if (!found[i]) lines[i * line_size + start + (t - i * width)] = T(value);
  }
}

// lines[i] = put_lines[source[i]] for every row i below the live count with source[i] >= 0
// (the write-log patch of a refresh: the rows whose key a later put wrote); the others are not
// touched. lines: (n, line_size); source: (n,) i64; put_lines: (m, line_size); live: (1,) i64.
// One warp per row: it reads source[i] once and skips the row or copies the line
// (oe::copy_line, 16 bytes per lane when ``vector``: device_ops.line_vector of both arrays).
// A thread per element before read source[i] for each of the row's values.
template <typename T>
__global__ void embedding_patch_rows(T* lines, int line_size, const oe::i64* source,
                                     const T* put_lines, oe::i64 n, const oe::i64* live,
                                     int vector) {
  const oe::i64 rows = oe::rows::live_rows(live, n);
  const int lane = threadIdx.x & 31;
  for (oe::i64 i = oe::grid_warp(); i < rows; i += oe::grid_warps()) {
    const oe::i64 from = source[i];
    if (from >= 0) {
      oe::copy_line(lines + i * line_size, put_lines + from * line_size, line_size, vector, lane);
    }
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(embedding_unique_first)
ONE_EMBEDDING_KERNEL(embedding_dedup_clear)
ONE_EMBEDDING_KERNEL(embedding_dedup_insert)
ONE_EMBEDDING_KERNEL(embedding_dedup_first)
ONE_EMBEDDING_KERNEL(embedding_dedup_output)
ONE_EMBEDDING_KERNEL(embedding_dedup_output_fixed)
ONE_EMBEDDING_KERNEL(embedding_segment_sum)
ONE_EMBEDDING_KERNEL(embedding_tree_counts)
ONE_EMBEDDING_KERNEL(embedding_tree_level)
ONE_EMBEDDING_KERNEL(embedding_gather)
ONE_EMBEDDING_KERNEL(embedding_gather_into)
ONE_EMBEDDING_KERNEL(embedding_gather_vector)
ONE_EMBEDDING_KERNEL(embedding_gather_into_vector)
ONE_EMBEDDING_KERNEL(embedding_init)
ONE_EMBEDDING_KERNEL(embedding_init_missing)
ONE_EMBEDDING_KERNEL(embedding_fill_missing)
ONE_EMBEDDING_KERNEL(embedding_patch_rows)
#endif
