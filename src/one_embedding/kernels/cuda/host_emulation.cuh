// Host emulation of the CUDA built-ins the kernels of this folder use, so that a kernel family
// can be compiled with g++ and executed on a CPU (the tests do this on machines without a GPU).
// Never seen by NVRTC or nvcc.
//
// Include this, then one or more <family>.cu. Each thread of a block runs as a fiber (a ucontext
// coroutine) on the calling thread. Kernels are registered by name ("mlp_bias_act_forward<float>")
// through ONE_EMBEDDING_KERNEL and launched with oe_emulate_launch or oe_emulate_launch_stress,
// args laid out as cuLaunchKernel's kernelParams: one pointer to each argument's value.
//
// oe_emulate_launch, the default mode: deterministic and fast. Blocks run one after the other;
// the fibers of a block advance round-robin, each until it reaches a barrier (__syncthreads, a
// warp primitive) or an atomic. Fibers instead of OS threads make a launch cheap and
// deterministic on a loaded machine (a barrier costs a few context switches, not a wake-up of
// every thread), and yielding at each atomic interleaves threads between their atomics, so
// concurrent inserts really race for buckets. `__shared__` is `static`: one block at a time uses it.
//
// oe_emulate_launch_stress(..., seed), the stress mode (tests/cuda_emulation.py uses it when
// ONE_EMBEDDING_CUDA_EMULATION_SEED is set): adversarial, and deterministic per seed, to show
// what the default cannot (inter-block races, missing barriers, uninitialised shared memory,
// out-of-bounds indexing).
//  - Schedule: up to 8 blocks of the grid live at once (2048 threads at most), started in a
//    seeded random order, and the next fiber to resume is drawn by a seeded PRNG (splitmix64)
//    among the runnable fibers of every live block. Besides barriers and atomics, every
//    shared-memory access, every read of gridDim.x (each step of a grid-stride loop, through
//    oe::grid_threads / grid_warps) and every oe::racy_read of a global word yields with
//    probability 1/4, so threads interleave between
//    barriers and blocks interleave through global memory and atomics.
//  - Shared memory per block, 0xFF bytes (NaN as float or double) until written; every index
//    bounds-checked; a read of an unwritten element, or two threads touching one element with no
//    barrier between them (one writing), fail the launch whatever the schedule.
//  - Each pointer argument runs on a copy that ends at a guard page: an out-of-bounds access
//    fails the launch naming the argument, the element and the thread.
// host_emulation_checks.cuh has the details and the source rewrite that shared memory needs
// (without it `__shared__` is `static` and only the default mode runs). Fiber stacks end at a
// guard page too: an overflow faults instead of corrupting memory.
//
// Barriers (both modes): a warp primitive (__shfl_xor_sync, __shfl_sync, __ballot_sync,
// __syncwarp) completes when every lane of the warp waits in the same primitive; __syncthreads
// when every thread of the block waits in it. A thread that skips a barrier its warp or block
// reaches (divergence around a warp primitive or __syncthreads, a real bug on a GPU), or lanes
// that meet in different primitives, make the launch report failure.
#pragma once

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __global__
#ifndef ONE_EMBEDDING_EMULATION_REWRITTEN
#define __shared__ static
#endif

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace oe_emulation {
inline void scheduling_point();
}
// oe::racy_read (common.cuh) of a word other threads may be writing: the stress mode may switch
// threads there, as at a shared-memory access.
#define ONE_EMBEDDING_RACY_READ_HOOK oe_emulation::scheduling_point

// CUDA's vector types that the kernels use (vector_types.h declares them alike: plain structs
// aligned to their size): the 16-byte copies of the gathers (embedding.cu) and line copies
// (oe::copy_line: hashindex.cu, cache.cu).
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) double2 {
  double x, y;
};
struct alignas(8) ushort4 {
  unsigned short x, y, z, w;
};
struct alignas(4) ushort2 {
  unsigned short x, y;
};
namespace oe_emulation {
inline void check_vector_alignment(const void* address, size_t alignment);
}
#define ONE_EMBEDDING_VECTOR_HOOK oe_emulation::check_vector_alignment

// gridDim.x is read once per step of a grid-stride loop: in the stress mode that read may yield.
struct oe_grid_dim {
  struct X {
    unsigned value = 1;
    operator unsigned() const {
      oe_emulation::scheduling_point();
      return value;
    }
  } x;
  unsigned y = 1, z = 1;
};

// Not static: the scheduler rewrites threadIdx and blockIdx before it resumes a fiber, and
// external linkage keeps the compiler from caching them in a kernel across a barrier (an opaque
// call).
dim3 threadIdx, blockIdx, blockDim;
oe_grid_dim gridDim;

namespace oe_emulation {

typedef unsigned long long u64;

enum class State { runnable, at_warp_barrier, at_block_barrier, done };

struct Block;

struct Fiber {
  ucontext_t context;
  State state = State::runnable;
  const char* waiting_in = "";
  dim3 thread;
  int linear = 0;  // threadIdx.y * blockDim.x + threadIdx.x
  Block* block = nullptr;
};

struct Warp {
  int first = 0;   // linear thread index of lane 0
  int lanes = 0;   // lanes in this warp (the last warp of a block may be partial)
  unsigned syncs = 0;  // completed __syncwarp: orders the lanes' shared-memory accesses
  unsigned char slots[32][8];
  bool votes[32];
};

struct Arena;

// One block of the grid: its fibers, warps and barrier count.
struct Block {
  dim3 index;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int runnable = 0;
  unsigned barriers = 0;  // completed __syncthreads
  size_t slot = 0;  // place among the live blocks (stress mode)
  Arena* arena = nullptr;  // its shared memory (stress mode); lives as long as the process
};

constexpr size_t STACK_BYTES = 256 * 1024;

// A fiber stack with a PROT_NONE page below it: an overflow faults instead of corrupting memory.
struct Stack {
  char* guard;  // the mapping starts with the guard page
  char* base;   // the usable stack
};

static std::vector<Stack> stacks;
static size_t page_bytes = 0;

inline size_t page() {
  if (page_bytes == 0) page_bytes = (size_t)sysconf(_SC_PAGESIZE);
  return page_bytes;
}

inline char* stack(size_t i) {
  while (stacks.size() <= i) {
    void* m = mmap(nullptr, STACK_BYTES + page(), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    mprotect(m, page(), PROT_NONE);
    stacks.push_back(Stack{(char*)m, (char*)m + page()});
  }
  return stacks[i].base;
}

static ucontext_t scheduler;
static Fiber* running = nullptr;
static std::function<void(void**)>* running_kernel = nullptr;
static void** running_args = nullptr;
static bool failed = false;
static std::string failure;
static bool stress = false;
static u64 random_state = 0;

inline u64 splitmix64(u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline u64 next_random() {
  random_state += 0x9E3779B97F4A7C15ull;
  return splitmix64(random_state);
}

inline void fail(const std::string& what) {
  if (!failed) failure = what;
  failed = true;
}

inline std::string describe_thread(const Fiber& f) {
  char text[96];
  snprintf(text, sizeof text, "thread (%u,%u) of block (%u,%u)", f.thread.x, f.thread.y,
           f.block->index.x, f.block->index.y);
  return text;
}

inline int lane() { return running->linear % 32; }
inline Warp& warp() { return running->block->warps[running->linear / 32]; }

// Back to the scheduler; returns when this fiber is resumed.
inline void yield() { swapcontext(&running->context, &scheduler); }

// Fails the launch from inside a fiber; the fiber is never resumed.
[[noreturn]] inline void abort_fiber(const std::string& what) {
  fail(what);
  running->state = State::done;
  setcontext(&scheduler);
  __builtin_unreachable();
}

// oe::as_vectors (vector.cuh) of an address that is not a multiple of the vector's
// size: a GPU faults ("misaligned address"); here the launch fails naming the thread. The
// default mode sees the arrays' own addresses. The stress mode's guarded copies keep only the
// element alignment, but a copy ends at a page boundary, so an argument of whole vectors (every
// vectorised argument: whole rows of whole vectors) still starts on a vector boundary there.
inline void check_vector_alignment(const void* address, size_t alignment) {
  if ((size_t)address % alignment != 0) {
    char text[96];
    snprintf(text, sizeof text, "%p as %zu-byte vectors", address, alignment);
    abort_fiber("misaligned vector access: " + describe_thread(*running) + " views " + text);
  }
}

inline void scheduling_point() {
  if (stress && running != nullptr && next_random() % 4 == 0) yield();
}

inline void wait(State state, const char* what) {
  running->state = state;
  running->waiting_in = what;
  yield();
}

inline void warp_barrier(const char* what) { wait(State::at_warp_barrier, what); }

static void fiber_main() {
  (*running_kernel)(running_args);
  running->state = State::done;
  // returning resumes uc_link, the scheduler
}

}  // namespace oe_emulation

#include "host_emulation_checks.cuh"

namespace oe_emulation {

// --- scheduling

inline void init_block(Block& b, dim3 index, int threads, size_t first_stack) {
  b.index = index;
  b.fibers.assign((size_t)threads, Fiber());
  b.warps.clear();
  for (int first = 0; first < threads; first += 32) {
    Warp w;
    w.first = first;
    w.lanes = threads - first < 32 ? threads - first : 32;
    b.warps.push_back(w);
  }
  b.runnable = threads;
  b.barriers = 0;
  for (int t = 0; t < threads; ++t) {
    Fiber& f = b.fibers[(size_t)t];
    f.linear = t;
    f.block = &b;
    f.thread = dim3{(unsigned)t % blockDim.x, (unsigned)t / blockDim.x, 0};
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stack(first_stack + (size_t)t);
    f.context.uc_stack.ss_size = STACK_BYTES;
    f.context.uc_link = &scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  if (stress) reset_arena(b);
}

inline void resume(Fiber& f) {
  running = &f;
  threadIdx = f.thread;
  blockIdx = f.block->index;
  swapcontext(&scheduler, &f.context);
  running = nullptr;
}

// Releases every warp whose lanes all wait in a warp primitive. Returns false (after fail())
// when lanes met in different primitives; `released` tells whether any warp moved on.
inline bool release_warps(Block& b, bool& released, std::vector<Fiber*>* runnable) {
  released = false;
  for (Warp& w : b.warps) {
    int waiting = 0;
    const char* what = nullptr;
    bool same = true;
    for (int t = w.first; t < w.first + w.lanes; ++t) {
      const Fiber& f = b.fibers[(size_t)t];
      if (f.state != State::at_warp_barrier) continue;
      if (what && strcmp(what, f.waiting_in) != 0) same = false;
      what = f.waiting_in;
      ++waiting;
    }
    if (waiting != w.lanes) continue;
    if (!same) {
      fail(std::string("lanes of a warp met in different warp primitives (") + what + ") in block (" +
           std::to_string(b.index.x) + "," + std::to_string(b.index.y) + ")");
      return false;
    }
    if (strcmp(what, "__syncwarp") == 0) ++w.syncs;
    for (int t = w.first; t < w.first + w.lanes; ++t) {
      b.fibers[(size_t)t].state = State::runnable;
      if (runnable) runnable->push_back(&b.fibers[(size_t)t]);
    }
    b.runnable += w.lanes;
    released = true;
  }
  return true;
}

// Releases __syncthreads when every thread of the block waits in it.
inline bool release_block(Block& b, std::vector<Fiber*>* runnable) {
  for (const Fiber& f : b.fibers) {
    if (f.state != State::at_block_barrier) return false;
  }
  for (Fiber& f : b.fibers) {
    f.state = State::runnable;
    if (runnable) runnable->push_back(&f);
  }
  b.runnable = (int)b.fibers.size();
  ++b.barriers;
  return true;
}

// A block where no thread can run and some still wait: they diverged around a barrier.
inline void diverged(const Block& b) {
  for (const Fiber& f : b.fibers) {
    if (f.state == State::at_warp_barrier || f.state == State::at_block_barrier) {
      fail(std::string("threads diverged: not every thread reached ") + f.waiting_in +
           " in block (" + std::to_string(b.index.x) + "," + std::to_string(b.index.y) + ")");
      return;
    }
  }
  fail("no thread can run");
}

inline bool all_done(const Block& b) {
  for (const Fiber& f : b.fibers) {
    if (f.state != State::done) return false;
  }
  return true;
}

// Default mode: one block to completion, its fibers round-robin; false on failure.
inline bool run_block(Block& b) {
  const int threads = (int)b.fibers.size();
  for (;;) {
    bool ran = false;
    for (int t = 0; t < threads; ++t) {
      if (b.fibers[(size_t)t].state != State::runnable) continue;
      resume(b.fibers[(size_t)t]);
      if (failed) return false;
      ran = true;
    }
    if (ran) continue;
    if (all_done(b)) return true;
    bool released = false;
    if (!release_warps(b, released, nullptr)) return false;
    if (released || release_block(b, nullptr)) continue;
    diverged(b);
    return false;
  }
}

static Block default_block;

inline bool run_grid(unsigned grid_x, unsigned grid_y, int threads) {
  for (unsigned by = 0; by < grid_y; ++by) {
    for (unsigned bx = 0; bx < grid_x; ++bx) {
      init_block(default_block, dim3{bx, by, 0}, threads, 0);
      if (!run_block(default_block)) {
        if (failure.find("block (") == std::string::npos) {
          failure += " (block " + std::to_string(bx) + "," + std::to_string(by) + ")";
        }
        return false;
      }
    }
  }
  return true;
}

constexpr int MAX_LIVE_BLOCKS = 8;
constexpr int MAX_LIVE_THREADS = 2048;
static std::vector<std::unique_ptr<Block>> live_blocks;

// Stress mode: blocks start in a seeded order, up to a window of them live at once, and the next
// fiber to run is drawn at random among the runnable fibers of every live block.
inline bool run_grid_stress(unsigned grid_x, unsigned grid_y, int threads) {
  const long long n_blocks = (long long)grid_x * grid_y;
  std::vector<long long> order((size_t)n_blocks);
  for (long long i = 0; i < n_blocks; ++i) order[(size_t)i] = i;
  for (long long i = n_blocks - 1; i > 0; --i) {
    std::swap(order[(size_t)i], order[(size_t)(next_random() % (u64)(i + 1))]);
  }
  const long long window = std::min<long long>(
      n_blocks, std::max(1, std::min(MAX_LIVE_BLOCKS, MAX_LIVE_THREADS / threads)));
  while ((long long)live_blocks.size() < window) {
    live_blocks.emplace_back(new Block());
    live_blocks.back()->slot = live_blocks.size() - 1;
  }
  std::vector<Fiber*> runnable;
  long long next = 0;
  const auto start = [&](size_t slot) {
    Block& b = *live_blocks[slot];
    const long long id = order[(size_t)next++];
    init_block(b, dim3{(unsigned)(id % grid_x), (unsigned)(id / grid_x), 0}, threads,
               slot * (size_t)threads);
    for (Fiber& f : b.fibers) runnable.push_back(&f);
  };
  for (size_t slot = 0; slot < (size_t)window; ++slot) start(slot);
  while (!runnable.empty()) {
    const size_t pick = (size_t)(next_random() % runnable.size());
    Fiber& f = *runnable[pick];
    resume(f);
    if (failed) return false;
    if (f.state == State::runnable) continue;
    runnable[pick] = runnable.back();
    runnable.pop_back();
    Block& b = *f.block;
    --b.runnable;
    if (f.state == State::at_warp_barrier) {
      bool released = false;
      if (!release_warps(b, released, &runnable)) return false;
    } else if (f.state == State::at_block_barrier) {
      release_block(b, &runnable);
    }
    if (b.runnable > 0) continue;
    if (!all_done(b)) {
      diverged(b);
      return false;
    }
    if (next < n_blocks) start(b.slot);  // the finished block's place goes to the next one
  }
  return true;
}

// --- registry

template <typename... P, size_t... I>
void call(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<typename std::decay<P>::type*>(args[I])...);
}

inline std::map<std::string, std::function<void(void**)>>& registry() {
  static std::map<std::string, std::function<void(void**)>> kernels;
  return kernels;
}

template <typename... P>
struct Registrar {
  Registrar(const char* name, void (*kernel)(P...)) {
    registry()[name] = [kernel](void** args) { call(kernel, args, std::index_sequence_for<P...>{}); };
  }
};

// Looks the kernel up and checks the launch shape; false with `error` filled.
inline bool prepare(const char* name, unsigned grid_x, unsigned grid_y, unsigned block_x,
                    unsigned block_y, char* error, int error_size) {
  auto found = registry().find(name);
  if (found == registry().end()) {
    snprintf(error, (size_t)error_size, "no kernel named %s", name);
    return false;
  }
  if (grid_x == 0 || grid_y == 0 || block_x == 0 || block_y == 0 || block_x * block_y > 1024) {
    // a real launch fails on these too
    snprintf(error, (size_t)error_size, "invalid launch shape grid (%u, %u) block (%u, %u)",
             grid_x, grid_y, block_x, block_y);
    return false;
  }
  failed = false;
  failure.clear();
  running_kernel = &found->second;
  gridDim.x.value = grid_x;
  gridDim.y = grid_y;
  blockDim = dim3{block_x, block_y, 1};
  return true;
}

}  // namespace oe_emulation

inline void __syncthreads() {
  oe_emulation::wait(oe_emulation::State::at_block_barrier, "__syncthreads");
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) oe_emulation::fail("__syncwarp with a partial mask");
  oe_emulation::warp_barrier("__syncwarp");
}

// A value exchange: every lane publishes, the warp meets, every lane reads, the warp meets again
// (so that no lane overwrites its slot before the others have read it).
template <typename T>
T oe_exchange(T value, int source, const char* what) {
  static_assert(sizeof(T) <= 8, "one slot holds 8 bytes");
  oe_emulation::Warp& w = oe_emulation::warp();
  memcpy(w.slots[oe_emulation::lane()], &value, sizeof(T));
  oe_emulation::warp_barrier(what);
  T result;
  memcpy(&result, w.slots[source], sizeof(T));
  oe_emulation::warp_barrier(what);
  return result;
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  if (mask != 0xffffffffu) oe_emulation::fail("__shfl_xor_sync with a partial mask");
  return oe_exchange(value, (oe_emulation::lane() ^ lane_mask) & 31, "__shfl_xor_sync");
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int source_lane) {
  if (mask != 0xffffffffu) oe_emulation::fail("__shfl_sync with a partial mask");
  return oe_exchange(value, source_lane & 31, "__shfl_sync");
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  if (mask != 0xffffffffu) oe_emulation::fail("__ballot_sync with a partial mask");
  oe_emulation::Warp& w = oe_emulation::warp();
  w.votes[oe_emulation::lane()] = predicate != 0;
  oe_emulation::warp_barrier("__ballot_sync");
  unsigned bits = 0;
  for (int k = 0; k < w.lanes; ++k) bits |= (unsigned)w.votes[k] << k;
  oe_emulation::warp_barrier("__ballot_sync");
  return bits;
}

// Atomics: the fiber yields first, so other threads run between two atomics of one thread.
inline unsigned long long atomicCAS(unsigned long long* address, unsigned long long compare,
                                    unsigned long long value) {
  oe_emulation::yield();
  const unsigned long long old = *address;
  if (old == compare) *address = value;
  return old;
}

inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  oe_emulation::yield();
  const unsigned long long old = *address;
  *address = old + value;
  return old;
}

inline int atomicAdd(int* address, int value) {
  oe_emulation::yield();
  const int old = *address;
  *address = old + value;
  return old;
}

inline long long atomicMin(long long* address, long long value) {
  oe_emulation::yield();
  const long long old = *address;
  if (value < old) *address = value;
  return old;
}

inline void __threadfence() {}

inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }

inline unsigned __float_as_uint(float x) {
  unsigned u;
  memcpy(&u, &x, 4);
  return u;
}

inline float __uint_as_float(unsigned u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

inline long long __double_as_longlong(double x) {
  long long u;
  memcpy(&u, &x, 8);
  return u;
}

inline double __longlong_as_double(long long u) {
  double x;
  memcpy(&x, &u, 8);
  return x;
}

inline long long min(long long a, long long b) { return a < b ? a : b; }

#define ONE_EMBEDDING_KERNEL(name)                                                     \
  static oe_emulation::Registrar name##_float_registrar(#name "<float>", &name<float>); \
  static oe_emulation::Registrar name##_double_registrar(#name "<double>", &name<double>);

// The entry points are the library's only visible symbols (tests/cuda_emulation.py builds with
// -fvisibility=hidden, so two builds loaded into one process keep their state apart).
#define OE_EMULATION_EXPORT extern "C" __attribute__((visibility("default")))

// Runs kernel `name` over the grid in the default mode; returns 0, or 1 with the reason in
// `error` (size error_size).
OE_EMULATION_EXPORT int oe_emulate_launch(const char* name, unsigned grid_x, unsigned grid_y,
                                          unsigned block_x, unsigned block_y, void** args,
                                          char* error, int error_size) {
  using namespace oe_emulation;
  if (!prepare(name, grid_x, grid_y, block_x, block_y, error, error_size)) return 1;
  stress = false;
  running_args = args;
  if (!run_grid(grid_x, grid_y, (int)(block_x * block_y))) {
    snprintf(error, (size_t)error_size, "%s", failure.c_str());
    return 1;
  }
  return 0;
}

// Runs kernel `name` in the stress mode with schedule `seed`. arg_bytes[i] is the byte size of
// array argument i, or -1 for a scalar; arg_itemsize[i] its element size; arg_names[i] its name
// for messages. Array arguments are run on guarded copies and copied back on success.
OE_EMULATION_EXPORT int oe_emulate_launch_stress(const char* name, unsigned grid_x,
                                                 unsigned grid_y, unsigned block_x, unsigned block_y,
                                                 void** args, int n_args,
                                                 const long long* arg_bytes,
                                                 const int* arg_itemsize,
                                                 const char* const* arg_names,
                                                 unsigned long long seed, char* error,
                                                 int error_size) {
  using namespace oe_emulation;
#ifndef ONE_EMBEDDING_EMULATION_REWRITTEN
  (void)grid_x, (void)grid_y, (void)block_x, (void)block_y, (void)args, (void)n_args;
  (void)arg_bytes, (void)arg_itemsize, (void)arg_names, (void)seed;
  snprintf(error, (size_t)error_size,
           "%s: the stress mode needs the sources with __shared__ rewritten (build the library "
           "with tests/cuda_emulation.build)", name);
  return 1;
#else
  if (!prepare(name, grid_x, grid_y, block_x, block_y, error, error_size)) return 1;
  stress = true;
  random_state = seed;
  std::vector<void*> values, new_args;
  bool ok = guard_arguments(args, n_args, arg_bytes, arg_itemsize, arg_names, values, new_args);
  if (ok) {
    running_args = new_args.data();
    fault = Fault();
    // faults on a fiber stack's guard page need a stack of their own to be handled on
    static char alternate[64 * 1024];
    stack_t own{}, before{};
    own.ss_sp = alternate;
    own.ss_size = sizeof alternate;
    sigaltstack(&own, &before);
    struct sigaction handler {};
    handler.sa_sigaction = on_fault;
    handler.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&handler.sa_mask);
    sigaction(SIGSEGV, &handler, &previous_segv);
    sigaction(SIGBUS, &handler, &previous_bus);
    ok = run_grid_stress(grid_x, grid_y, (int)(block_x * block_y));
    sigaction(SIGSEGV, &previous_segv, nullptr);
    sigaction(SIGBUS, &previous_bus, nullptr);
    sigaltstack(&before, nullptr);
    if (fault.pending) failure = describe_fault(*fault.fiber);
    if (ok) ok = check_canaries();
  }
  release_regions(ok);
  stress = false;
  if (!ok) {
    snprintf(error, (size_t)error_size, "%s", failure.c_str());
    return 1;
  }
  return 0;
#endif
}
