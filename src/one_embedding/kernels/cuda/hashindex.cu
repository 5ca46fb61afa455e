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

// Warp per key: the 32 lanes read 32 consecutive buckets at once and one ballot finds the first
// bucket that ends the probe, so a chain of up to 32 buckets costs one round of loads.
// keys: (n,) u64; out_slots: (n,) i64 slot or -1; out_buckets: (n,) i64 bucket or -1.
// When line_size > 0 the line of every found key is copied too: out[out_rows[i]] = rows[slot]
// (rows: (slot_limit, line_size), out: (N, line_size), out_rows: (n,) i64); otherwise rows, out
// and out_rows are not read.
template <typename T>
__global__ void hashindex_find(const oe::u64* table, oe::i64 mask, const oe::u64* keys, oe::i64 n,
                               const T* rows, int line_size, const oe::i64* out_rows, T* out,
                               oe::i64* out_slots, oe::i64* out_buckets) {
  const int lane = threadIdx.x & 31;
  for (oe::i64 i = oe::grid_warp(); i < n; i += oe::grid_warps()) {
    const oe::u64 key = keys[i];
    const oe::i64 start = oe::hashindex::home(key, mask);
    oe::i64 bucket = -1;
    oe::u64 slot = oe::hashindex::EMPTY;
    // the load factor stays below 1, so some bucket is empty and the loop ends; `ends` is the same
    // in every lane, so the whole warp leaves together
    for (oe::i64 offset = 0;; offset += 32) {
      const oe::i64 b = (start + offset + lane) & mask;
      const oe::u64 k = table[2 * b];
      const oe::u64 s = table[2 * b + 1];
      const bool empty = s == oe::hashindex::EMPTY;
      const unsigned ends = __ballot_sync(oe::FULL_WARP, empty || k == key);
      if (ends) {
        const int first = __ffs((int)ends) - 1;
        slot = __shfl_sync(oe::FULL_WARP, s, first);
        if (slot != oe::hashindex::EMPTY) bucket = (start + offset + first) & mask;
        break;
      }
    }
    const bool found = bucket >= 0;
    if (lane == 0) {
      out_slots[i] = found ? (oe::i64)slot : -1;
      out_buckets[i] = bucket;
    }
    if (found && line_size > 0) {
      const T* src = rows + (oe::i64)slot * line_size;
      T* dst = out + out_rows[i] * line_size;
      for (int c = lane; c < line_size; c += 32) dst[c] = src[c];
    }
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
ONE_EMBEDDING_KERNEL(hashindex_insert)
ONE_EMBEDDING_KERNEL(hashindex_insert_where)
#endif
