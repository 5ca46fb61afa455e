// The "full" key -> slot hash index on the device: open addressing with linear probing, the
// layout and hash of tiers/hash_index.py, so both find the same keys the same way.
//
// table: (capacity, 2) u64, bucket b = [key, slot], capacity a power of two (mask = capacity - 1),
// home bucket mix64(key) & mask. slot == EMPTY (all ones: -1 as int64) marks an empty bucket, so
// every uint64 is a valid key. No deletions, so a probe chain has no holes: the first bucket that
// holds the key or is empty ends a probe.
//
// T is the float type of the rows behind the index (the slots index them); only
// hashindex_find reads rows, the other kernels are the same code for both instantiations.
#include "common.cuh"

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

// One warp finds keys[i]: the 32 lanes read 32 consecutive buckets at once and one ballot finds
// the first bucket that ends the probe, so a chain of up to 32 buckets costs one round of loads.
// Lane 0 writes out_slots[i] (slot or -1) and, when out_buckets is given, out_buckets[i] (bucket
// or -1); when line_size > 0 the lanes copy the found line rows[slot] into out[out_rows[i]]
// (into out[i] when out_rows is null).
template <typename T>
__device__ __forceinline__ void find_one(const u64* table, i64 mask, const u64* keys, i64 i,
                                         const T* rows, int line_size, const i64* out_rows, T* out,
                                         i64* out_slots, i64* out_buckets) {
  const int lane = threadIdx.x & 31;
  const u64 key = keys[i];
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
  const bool found = bucket >= 0;
  if (lane == 0) {
    out_slots[i] = found ? (i64)slot : -1;
    if (out_buckets != nullptr) out_buckets[i] = bucket;
  }
  if (found && line_size > 0) {
    const T* src = rows + (i64)slot * line_size;
    T* dst = out + (out_rows != nullptr ? out_rows[i] : i) * line_size;
    for (int c = lane; c < line_size; c += 32) dst[c] = src[c];
  }
}

}  // namespace hashindex
}  // namespace oe

// Warp per key (oe::hashindex::find_one). keys: (n,) u64; out_slots: (n,) i64 slot or -1;
// out_buckets: (n,) i64 bucket or -1. When line_size > 0 the line of every found key is copied
// too: out[out_rows[i]] = rows[slot] (rows: (slot_limit, line_size), out: (N, line_size),
// out_rows: (n,) i64); otherwise rows, out and out_rows are not read.
template <typename T>
__global__ void hashindex_find(const oe::u64* table, oe::i64 mask, const oe::u64* keys, oe::i64 n,
                               const T* rows, int line_size, const oe::i64* out_rows, T* out,
                               oe::i64* out_slots, oe::i64* out_buckets) {
  for (oe::i64 i = oe::grid_warp(); i < n; i += oe::grid_warps()) {
    oe::hashindex::find_one(table, mask, keys, i, rows, line_size, out_rows, out, out_slots,
                            out_buckets);
  }
}

// hashindex_find of a fixed-capacity batch (device_unique.unique_ids_fixed): only the first
// live[0] of the n keys are looked up; the others get slot NOT_LOOKED_UP (-2) and nothing else
// (no probe, no line copied). The line of found key i goes to out[i] (when line_size > 0).
// keys, out_slots: (n,); out: (n, line_size); live: (1,) i64 on the device.
template <typename T>
__global__ void hashindex_find_live(const oe::u64* table, oe::i64 mask, const oe::u64* keys,
                                    oe::i64 n, const oe::i64* live, const T* rows, int line_size,
                                    T* out, oe::i64* out_slots) {
  const oe::i64 count = live[0];
  for (oe::i64 i = oe::grid_warp(); i < n; i += oe::grid_warps()) {
    if (i >= count) {   // the same i in every lane of the warp: it leaves together
      if ((threadIdx.x & 31) == 0) out_slots[i] = oe::hashindex::NOT_LOOKED_UP;
      continue;
    }
    oe::hashindex::find_one(table, mask, keys, i, rows, line_size, (const oe::i64*)nullptr, out,
                            out_slots, (oe::i64*)nullptr);
  }
}

// rows[slots[i]] = lines[i] for the first live[0] of n lines (a put of a fixed-capacity batch;
// the other positions are not read). rows: (R, line_size) T; slots: (n,) i64 in [0, R);
// lines: (n, line_size) T; live: (1,) i64. One thread per element.
template <typename T>
__global__ void hashindex_put_rows(T* rows, int line_size, const oe::i64* slots, const T* lines,
                                   oe::i64 n, const oe::i64* live) {
  const oe::i64 total = live[0] * line_size;
  for (oe::i64 t = oe::grid_thread(); t < total && t < n * line_size; t += oe::grid_threads()) {
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

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(hashindex_find)
ONE_EMBEDDING_KERNEL(hashindex_find_live)
ONE_EMBEDDING_KERNEL(hashindex_put_rows)
ONE_EMBEDDING_KERNEL(hashindex_insert)
ONE_EMBEDDING_KERNEL(hashindex_insert_where)
#endif
