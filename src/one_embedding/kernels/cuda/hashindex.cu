// The "full" key -> slot hash index on the device: open addressing with linear probing, the
// layout and hash of tiers/hash_index.py, so both find the same keys the same way.
//
// table: (capacity, 2) u64, bucket b = [key, slot], capacity a power of two (mask = capacity - 1),
// home bucket mix64(key) & mask. slot == EMPTY (all ones: -1 as int64) marks an empty bucket, so
// every uint64 is a valid key. No deletions, so a probe chain has no holes: the first bucket that
// holds the key or is empty ends a probe.
//
// T is the float type of the rows behind the index (the slots index them); only the finds and
// hashindex_put_rows touch rows, the other kernels are the same code for both instantiations.
//
// Line copies (`vector` != 0): the kernels that copy lines take `int vector`, set by the host
// (device_ops.line_vector) when line_size is a multiple of Vector16<T>::LANES (4 float, 2 double)
// and the rows' and the lines' arrays start on 16-byte boundaries; every line then does too
// (an offset of whole lines), and each lane moves 16 bytes per access (oe::copy_line,
// vector.cuh), else 4 (float) or 8 (double). The same copies, so the same bits either way.
#include "common.cuh"
#include "vector.cuh"

namespace oe {
namespace hashindex {

constexpr u64 EMPTY = ~0ull;

__device__ __forceinline__ i64 home(u64 key, i64 mask) { return (i64)(splitmix64(key) & (u64)mask); }

// Inserts one key known to be absent with its slot: linear probing from the home bucket, an empty
// bucket claimed by atomicCAS on its slot word. No reader runs in the inserting kernels (finds are
// later launches), so the key may follow its slot.
__device__ __forceinline__ void insert(u64* table, i64 mask, u64 key, i64 slot) {
  i64 b = home(key, mask);
  while (atomicCAS(&table[2 * b + 1], EMPTY, (u64)slot) != EMPTY) b = (b + 1) & mask;
  table[2 * b] = key;
}

}  // namespace hashindex
}  // namespace oe

namespace oe {
namespace hashindex {

// The slot hashindex_find_live writes for a position at or past the live count: not looked up.
constexpr i64 NOT_LOOKED_UP = -2;

// One warp probes for `key`: the 32 lanes read 32 consecutive buckets at once and one ballot
// finds the first bucket that ends the probe, so a chain of up to 32 buckets costs one round of
// loads. Every lane gets the key's slot (EMPTY when absent) and bucket (-1 when absent). The
// whole warp must call it with the same key.
__device__ __forceinline__ void probe(const u64* table, i64 mask, u64 key, u64* slot_out,
                                      i64* bucket_out) {
  const int lane = threadIdx.x & 31;
  const i64 start = home(key, mask);
  i64 bucket = -1;
  u64 slot = EMPTY;
  // the load factor stays below 1, so some bucket is empty and the loop ends; `ends` is the same
  // in every lane, so the whole warp leaves together
  for (i64 offset = 0;; offset += 32) {
    const i64 b = (start + offset + lane) & mask;
    const u64 k = table[2 * b];
    const u64 s = table[2 * b + 1];
    const bool empty = s == EMPTY;
    const unsigned ends = __ballot_sync(FULL_WARP, empty || k == key);
    if (ends) {
      const int first = __ffs((int)ends) - 1;
      slot = __shfl_sync(FULL_WARP, s, first);
      if (slot != EMPTY) bucket = (start + offset + first) & mask;
      break;
    }
  }
  *slot_out = slot;
  *bucket_out = bucket;
}

// One warp finds keys[i] (probe). Lane 0 writes out_slots[i] (slot or -1) and, when out_buckets
// is given, out_buckets[i] (bucket or -1); when line_size > 0 the lanes copy the found line
// rows[slot] into out[out_rows[i]] (into out[i] when out_rows is null), 16 bytes per lane when
// `vector` is set (see the top of this file).
template <typename T>
__device__ __forceinline__ void find_one(const u64* table, i64 mask, const u64* keys, i64 i,
                                         const T* rows, int line_size, int vector,
                                         const i64* out_rows, T* out, i64* out_slots,
                                         i64* out_buckets) {
  const int lane = threadIdx.x & 31;
  u64 slot;
  i64 bucket;
  probe(table, mask, keys[i], &slot, &bucket);
  const bool found = bucket >= 0;
  if (lane == 0) {
    out_slots[i] = found ? (i64)slot : -1;
    if (out_buckets != nullptr) out_buckets[i] = bucket;
  }
  if (found && line_size > 0) {
    const T* src = rows + (i64)slot * line_size;
    T* dst = out + (out_rows != nullptr ? out_rows[i] : i) * line_size;
    copy_line(dst, src, line_size, vector, lane);
  }
}

}  // namespace hashindex
}  // namespace oe

// Warp per key (oe::hashindex::find_one). keys: (n,) u64; out_slots: (n,) i64 slot or -1;
// out_buckets: (n,) i64 bucket or -1. When line_size > 0 the line of every found key is copied
// too: out[out_rows[i]] = rows[slot] (rows: (slot_limit, line_size), out: (N, line_size),
// out_rows: (n,) i64); otherwise rows, out and out_rows are not read. vector: 16-byte copies
// (the top of this file; 0 when line_size is 0).
template <typename T>
__global__ void hashindex_find(const oe::u64* table, oe::i64 mask, const oe::u64* keys, oe::i64 n,
                               const T* rows, int line_size, int vector, const oe::i64* out_rows,
                               T* out, oe::i64* out_slots, oe::i64* out_buckets) {
  for (oe::i64 i = oe::grid_warp(); i < n; i += oe::grid_warps()) {
    oe::hashindex::find_one(table, mask, keys, i, rows, line_size, vector, out_rows, out,
                            out_slots, out_buckets);
  }
}

// hashindex_find of a fixed-capacity batch (device_unique.unique_ids_fixed): only the first
// live[0] of the n keys are looked up; the others get slot NOT_LOOKED_UP (-2) and nothing else
// (no probe, no line copied). The line of found key i goes to out[i] (when line_size > 0).
// keys, out_slots: (n,); out: (n, line_size); live: (1,) i64 on the device; vector: as
// hashindex_find's.
template <typename T>
__global__ void hashindex_find_live(const oe::u64* table, oe::i64 mask, const oe::u64* keys,
                                    oe::i64 n, const oe::i64* live, const T* rows, int line_size,
                                    int vector, T* out, oe::i64* out_slots) {
  const oe::i64 count = live[0];
  for (oe::i64 i = oe::grid_warp(); i < n; i += oe::grid_warps()) {
    if (i >= count) {   // the same i in every lane of the warp: it leaves together
      if ((threadIdx.x & 31) == 0) out_slots[i] = oe::hashindex::NOT_LOOKED_UP;
      continue;
    }
    oe::hashindex::find_one(table, mask, keys, i, rows, line_size, vector,
                            (const oe::i64*)nullptr, out, out_slots, (oe::i64*)nullptr);
  }
}

// The fixed-capacity dedup's output pass (embedding_dedup_output_fixed, kernels/cuda/embedding.cu)
// with hashindex_find_live fused into it: each unique key is probed in the index as it is
// written, so the unique keys are not read back by a second kernel. A warp owns 32 consecutive
// ids per loop step: each lane writes its id's inverse and, at a first occurrence, the unique key
// and first position (at positions from the count on: key 0, position 0, slot NOT_LOOKED_UP);
// then the warp probes the first occurrences' keys one after another (ballot), lane 0 writing the
// slot (or -1) and the lanes copying a found key's line into its row of out.
// keys, first_of, rank (inclusive prefix sum of the first occurrences), inverse, unique_out,
// first_out, out_slots: (n,); table: (capacity, 2) u64 of the index, mask = capacity - 1;
// rows: (R, line_size) T; out: (n, line_size) T, rows from the count on untouched; vector: as
// hashindex_find's.
template <typename T>
__global__ void hashindex_dedup_output_find(const oe::u64* keys, const oe::i64* first_of,
                                            const oe::i64* rank, oe::i64 n, oe::i64* inverse,
                                            oe::u64* unique_out, oe::i64* first_out,
                                            const oe::u64* table, oe::i64 mask, const T* rows,
                                            int line_size, int vector, T* out,
                                            oe::i64* out_slots) {
  const oe::i64 count = rank[n - 1];
  const int lane = threadIdx.x & 31;
  // every lane of a warp runs the same steps (the ballots need the whole warp)
  for (oe::i64 base = oe::grid_warp() * 32; base < n; base += oe::grid_warps() * 32) {
    const oe::i64 i = base + lane;
    bool first = false;
    oe::u64 key = 0;
    oe::i64 id = 0;
    if (i < n) {
      const oe::i64 f = first_of[i];
      id = rank[f] - 1;
      inverse[i] = id;
      if (f == i) {
        key = keys[i];
        unique_out[id] = key;
        first_out[id] = i;
        first = true;
      }
      if (i >= count) {
        unique_out[i] = 0;
        first_out[i] = 0;
        out_slots[i] = oe::hashindex::NOT_LOOKED_UP;
      }
    }
    for (unsigned todo = __ballot_sync(oe::FULL_WARP, first); todo != 0; todo &= todo - 1) {
      const int src = __ffs((int)todo) - 1;
      const oe::u64 k = __shfl_sync(oe::FULL_WARP, key, src);
      const oe::i64 row = __shfl_sync(oe::FULL_WARP, id, src);
      oe::u64 slot;
      oe::i64 bucket;
      oe::hashindex::probe(table, mask, k, &slot, &bucket);
      const bool found = bucket >= 0;
      if (lane == 0) out_slots[row] = found ? (oe::i64)slot : -1;
      if (found && line_size > 0) {
        const T* src_line = rows + (oe::i64)slot * line_size;
        oe::copy_line(out + row * line_size, src_line, line_size, vector, lane);
      }
    }
  }
}

// rows[slots[i]] = lines[i] for the first live[0] of n lines (a put of a fixed-capacity batch;
// the other positions are not read). rows: (R, line_size) T; slots: (n,) i64 in [0, R);
// lines: (n, line_size) T; live: (1,) i64. One thread per element, or, when `vector` is set (the
// top of this file), per Vector16<T> of LANES elements: groups = line_size / LANES per line.
template <typename T>
__global__ void hashindex_put_rows(T* rows, int line_size, int vector, const oe::i64* slots,
                                   const T* lines, oe::i64 n, const oe::i64* live) {
  const oe::i64 count = live[0] < n ? live[0] : n;
  if (count <= 0 || line_size <= 0) return;
  if (vector) {
    typedef typename oe::Vector16<T>::type V;
    const int groups = line_size / oe::Vector16<T>::LANES;
    V* to = oe::as_vectors<V>(rows);
    const V* from = oe::as_vectors<const V>(lines);
    for (oe::i64 t = oe::grid_thread(); t < count * groups; t += oe::grid_threads()) {
      const oe::i64 i = t / groups;
      to[slots[i] * groups + (t - i * groups)] = from[t];
    }
    return;
  }
  for (oe::i64 t = oe::grid_thread(); t < count * line_size; t += oe::grid_threads()) {
    const oe::i64 i = t / line_size;
    rows[slots[i] * line_size + (t - i * line_size)] = lines[t];
  }
}

// Inserts keys known to be absent (and unique) with their slots, a thread per key. Threads race
// for buckets, so which bucket a key lands in may vary from run to run, but the set of (key, slot)
// pairs, and so every find, does not. keys, slots: (n,).
template <typename T>
__global__ void hashindex_insert(oe::u64* table, oe::i64 mask, const oe::u64* keys,
                                 const oe::i64* slots, oe::i64 n) {
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    oe::hashindex::insert(table, mask, keys[i], slots[i]);
  }
}

// hashindex_insert for the keys with is_new[i] != 0 only (the others are skipped), so a caller
// need not compact the new keys first (and read their count back). keys, slots, is_new: (n,).
template <typename T>
__global__ void hashindex_insert_where(oe::u64* table, oe::i64 mask, const oe::u64* keys,
                                       const oe::i64* slots, const unsigned char* is_new,
                                       oe::i64 n) {
  for (oe::i64 i = oe::grid_thread(); i < n; i += oe::grid_threads()) {
    if (is_new[i]) oe::hashindex::insert(table, mask, keys[i], slots[i]);
  }
}

// An index of a batch's own keys by position: keys[i] inserted with slot i for every i below
// live[0], or below n when has_live is 0 (live is then not read). A fixed-capacity batch's
// placeholder keys from its count on stay out. The write log's patch (write_log.py) finds a
// lookup's keys in a logged put this way. keys: (n,), distinct below the count; table: empty
// buckets ((capacity, 2) u64, slot words EMPTY), capacity >= the count / the load limit.
template <typename T>
__global__ void hashindex_insert_positions(oe::u64* table, oe::i64 mask, const oe::u64* keys,
                                           oe::i64 n, const oe::i64* live, int has_live) {
  const oe::i64 count = (has_live && live[0] < n) ? live[0] : n;
  for (oe::i64 i = oe::grid_thread(); i < count; i += oe::grid_threads()) {
    oe::hashindex::insert(table, mask, keys[i], i);
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(hashindex_find)
ONE_EMBEDDING_KERNEL(hashindex_find_live)
ONE_EMBEDDING_KERNEL(hashindex_dedup_output_find)
ONE_EMBEDDING_KERNEL(hashindex_put_rows)
ONE_EMBEDDING_KERNEL(hashindex_insert)
ONE_EMBEDDING_KERNEL(hashindex_insert_where)
ONE_EMBEDDING_KERNEL(hashindex_insert_positions)
#endif
