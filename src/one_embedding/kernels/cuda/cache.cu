// The set-associative LRU / LFU cache on the device, deterministic: the same hits, victims and
// evictions as cache/set_associative.py for the same call sequence.
//
// State, per set of `ways` <= 32 ways (the line of (set, way) is row set * ways + way):
//   way_keys  (n_sets, ways) u64   key held by the way
//   way_stamp (n_sets, ways) i64   touch stamp; -1: the way is empty
//   way_freq  (n_sets, ways) i64   touches since the line came in (LFU)
//   way_dirty (n_sets, ways) u8    1: the line is newer than the copy below (written since the
//                                  host last flushed it); a clean victim leaves without a copy
//   rows      (n_sets * ways, line_size) T
//
// A batch's positions are grouped by set before a launch (cache/device.py): order (n,) i64 holds
// the positions sorted by (set, position), group g is order[starts[g]:starts[g + 1]], all of set
// set_ids[g]. The host does not know how many groups there are (it would have to read the count
// back): it passes room for n, and the groups past the real ones are empty and skipped, before
// their warp touches any set. One warp owns a group and handles its keys one after the other in
// batch order, so within a set everything happens in the order the CPU cache runs it; sets never
// interact. A touch stamps the way with clock + position: unlike the CPU's clock, which advances
// by one per touch across all sets, but in the same order within every set (and every call's
// stamps exceed the previous call's, the host advancing clock by the batch size), and only that
// order chooses victims. A new key takes the first empty way (an erase leaves holes anywhere in
// a set), as on the CPU.
//
// A warp keeps its set's state in shared memory. Lane w owns way w: it alone writes the way's
// entry and it alone reads it outside victim scans, so hits need no barrier; a victim scan reads
// every entry and is fenced by __syncwarp on both sides.
//
// Line copies: `vector` (set by the host, device_ops.line_vector, when line_size is a multiple of
// Vector16<T>::LANES and the line arrays start on 16-byte boundaries) makes each lane move 16
// bytes per access (oe::copy_line, vector.cuh) instead of one element; the same bits either way.
#include "common.cuh"
#include "vector.cuh"

namespace oe {
namespace cache {

constexpr int MAX_WARPS_PER_BLOCK = 32;  // 1024 threads
constexpr int LRU = 0;  // policy codes of set_associative.py; 1 is LFU

struct SetState {
  u64 keys[32];
  i64 stamp[32];
  i64 freq[32];
  unsigned char dirty[32];  // cache_insert's only
};

// Way of a full set that the next miss displaces: the smallest stamp (LRU), or the smallest
// (freq, stamp) (LFU). Stamps of used ways are distinct, so the choice is unique.
__device__ __forceinline__ int victim(const SetState& s, int ways, int policy) {
  int best = 0;
  for (int w = 1; w < ways; ++w) {
    if (policy == LRU) {
      if (s.stamp[w] < s.stamp[best]) best = w;
    } else if (s.freq[w] < s.freq[best] ||
               (s.freq[w] == s.freq[best] && s.stamp[w] < s.stamp[best])) {
      best = w;
    }
  }
  return best;
}

__device__ __forceinline__ void load_set(SetState& s, const u64* way_keys, const i64* way_stamp,
                                         const i64* way_freq, i64 base, int ways, int lane) {
  if (lane < ways) {
    s.keys[lane] = way_keys[base + lane];
    s.stamp[lane] = way_stamp[base + lane];
    s.freq[lane] = way_freq[base + lane];
  }
}

}  // namespace cache
}  // namespace oe

// Lookup with touches. For every position p of the batch: when keys[p] is held, its line goes to
// out[out_rows[p]], the way is stamped clock + p and its freq counted, and hit[p] = 1; else
// hit[p] = 0 and out is untouched. keys: (n,) u64; order, starts, set_ids: the grouping above
// (n_groups groups); out: (N, line_size); out_rows, hit: (n,); vector: 16-byte copies (above).
template <typename T>
__global__ void cache_find(const oe::u64* way_keys, oe::i64* way_stamp, oe::i64* way_freq,
                           const T* rows, int ways, int line_size, int vector, const oe::u64* keys,
                           const oe::i64* order, const oe::i64* starts, const oe::i64* set_ids,
                           oe::i64 n_groups, oe::i64 clock, const oe::i64* out_rows, T* out,
                           int* hit) {
  __shared__ oe::cache::SetState states[oe::cache::MAX_WARPS_PER_BLOCK];
  oe::cache::SetState& s = states[threadIdx.x >> 5];
  const int lane = threadIdx.x & 31;
  for (oe::i64 g = oe::grid_warp(); g < n_groups; g += oe::grid_warps()) {
    if (starts[g] == starts[g + 1]) continue;  // a spare group: no key, no set (warp-uniform)
    const oe::i64 base = set_ids[g] * ways;
    oe::cache::load_set(s, way_keys, way_stamp, way_freq, base, ways, lane);
    for (oe::i64 j = starts[g]; j < starts[g + 1]; ++j) {
      const oe::i64 p = order[j];
      const oe::u64 key = keys[p];
      const bool mine = lane < ways && s.stamp[lane] >= 0 && s.keys[lane] == key;
      const unsigned hits = __ballot_sync(oe::FULL_WARP, mine);
      if (hits) {
        const int w = __ffs((int)hits) - 1;
        if (lane == w) {
          s.stamp[w] = clock + p;
          s.freq[w] += 1;
        }
        oe::copy_line(out + out_rows[p] * line_size, rows + (base + w) * line_size, line_size,
                      vector, lane);
      }
      if (lane == 0) hit[p] = hits != 0u;
    }
    if (lane < ways) {
      way_stamp[base + lane] = s.stamp[lane];
      way_freq[base + lane] = s.freq[lane];
    }
    __syncwarp();  // the entries are written back before the next group reloads them
  }
}

// Write every key's line, in batch order within each set; a written way is dirty. A hit rewrites
// the line (freq + 1); a miss takes the first free way, or displaces the victim. A dirty victim's
// key and line are recorded at the position of the key that displaced it: ev_keys[p],
// ev_lines[p], ev_flag[p] = 1 (ev_flag is zeroed by the caller); a clean one (its copy below is
// the same) leaves without a copy: ev_flag[p] = 3. A victim stamped in this same call (stamp >=
// clock, so dirty) may have been displaced once before in this call, carrying its older line;
// that earlier record is marked ev_flag = 2 (superseded), so each key leaves once, with its
// newest line, as on the CPU. new_flag[p] = 1 when keys[p] was not held. lines, ev_lines:
// (n, line_size); flags: (n,); vector: 16-byte copies (above).
template <typename T>
__global__ void cache_insert(oe::u64* way_keys, oe::i64* way_stamp, oe::i64* way_freq,
                             unsigned char* way_dirty, T* rows, int ways, int line_size,
                             int vector, int policy, const oe::u64* keys, const T* lines,
                             const oe::i64* order, const oe::i64* starts,
                             const oe::i64* set_ids, oe::i64 n_groups, oe::i64 clock,
                             oe::u64* ev_keys, T* ev_lines, int* ev_flag, int* new_flag) {
  __shared__ oe::cache::SetState states[oe::cache::MAX_WARPS_PER_BLOCK];
  oe::cache::SetState& s = states[threadIdx.x >> 5];
  const int lane = threadIdx.x & 31;
  for (oe::i64 g = oe::grid_warp(); g < n_groups; g += oe::grid_warps()) {
    if (starts[g] == starts[g + 1]) continue;  // a spare group: no key, no set (warp-uniform)
    const oe::i64 base = set_ids[g] * ways;
    oe::cache::load_set(s, way_keys, way_stamp, way_freq, base, ways, lane);
    if (lane < ways) s.dirty[lane] = way_dirty[base + lane];
    const oe::i64 group_begin = starts[g];
    for (oe::i64 j = group_begin; j < starts[g + 1]; ++j) {
      const oe::i64 p = order[j];
      const oe::u64 key = keys[p];
      const bool mine = lane < ways && s.stamp[lane] >= 0 && s.keys[lane] == key;
      const unsigned hits = __ballot_sync(oe::FULL_WARP, mine);
      int w;
      bool evict = false;
      // the first empty way (erased ways leave holes anywhere in the set)
      const unsigned empty = __ballot_sync(oe::FULL_WARP, lane < ways && s.stamp[lane] < 0);
      if (hits) {
        w = __ffs((int)hits) - 1;
      } else if (empty) {
        w = __ffs((int)empty) - 1;
      } else {
        __syncwarp();  // every owner's update of an earlier key is visible to the scan
        w = oe::cache::victim(s, ways, policy);
        const oe::u64 victim_key = s.keys[w];
        const oe::i64 victim_stamp = s.stamp[w];
        evict = s.dirty[w] != 0;
        __syncwarp();  // every lane has read the entries before way w's owner rewrites them
        if (evict && victim_stamp >= clock) {
          // came in during this call: drop its earlier eviction record, if any (lane 0 wrote
          // the records; the barrier makes them visible to the other lanes)
          __syncwarp();
          for (oe::i64 q = group_begin + lane; q < j; q += 32) {
            const oe::i64 earlier = order[q];
            if (ev_flag[earlier] == 1 && ev_keys[earlier] == victim_key) ev_flag[earlier] = 2;
          }
          __syncwarp();
        }
        if (lane == 0) {
          if (evict) ev_keys[p] = victim_key;
          ev_flag[p] = evict ? 1 : 3;
        }
      }
      if (lane == w) {
        if (hits) {
          s.freq[w] += 1;
        } else {
          s.keys[w] = key;
          s.freq[w] = 1;
        }
        s.stamp[w] = clock + p;
        s.dirty[w] = 1;
      }
      if (lane == 0) new_flag[p] = hits == 0u;
      T* row = rows + (base + w) * line_size;
      const T* src = lines + p * line_size;
      T* evicted = ev_lines + p * line_size;
      // a lane copies the old value of column c (of vector g) out before it writes the new one
      // into it; no other lane touches that column
      if (vector) {
        typedef typename oe::Vector16<T>::type V;
        const int groups = line_size / oe::Vector16<T>::LANES;
        V* row_v = oe::as_vectors<V>(row);
        const V* src_v = oe::as_vectors<const V>(src);
        V* evicted_v = evict ? oe::as_vectors<V>(evicted) : nullptr;
        for (int g = lane; g < groups; g += 32) {
          if (evict) evicted_v[g] = row_v[g];
          row_v[g] = src_v[g];
        }
      } else {
        for (int c = lane; c < line_size; c += 32) {
          if (evict) evicted[c] = row[c];
          row[c] = src[c];
        }
      }
    }
    if (lane < ways) {
      way_keys[base + lane] = s.keys[lane];
      way_stamp[base + lane] = s.stamp[lane];
      way_freq[base + lane] = s.freq[lane];
      way_dirty[base + lane] = s.dirty[lane];
    }
    __syncwarp();  // the entries are written back before the next group reloads them
  }
}

#ifdef ONE_EMBEDDING_INSTANTIATE
ONE_EMBEDDING_KERNEL(cache_find)
ONE_EMBEDDING_KERNEL(cache_insert)
#endif
