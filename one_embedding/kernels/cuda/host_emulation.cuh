// Host emulation of the CUDA built-ins the kernels of this folder use, so that a kernel family
// can be compiled with g++ and executed on a CPU (the tests do this on machines without a GPU).
// Never seen by NVRTC or nvcc.
//
// Include this, then one or more <family>.cu. Each block runs as blockDim.x * blockDim.y fibers
// (ucontext coroutines) on the calling thread, one block after the other, so `__shared__` (made
// `static`) is shared by the threads of one block as on a GPU. A fiber runs until it reaches a
// barrier (__syncthreads, a warp primitive) or an atomic, then the next fiber runs: every thread
// of a block advances round-robin. Fibers instead of OS threads make a launch cheap and
// deterministic on a loaded machine (a barrier costs a few context switches, not a wake-up of
// every thread), and yielding at each atomic interleaves threads between their atomics, so
// concurrent inserts really race for buckets.
//
// Barriers: a warp primitive (__shfl_xor_sync, __shfl_sync, __ballot_sync, __syncwarp) completes
// when every lane of the warp waits in the same primitive; __syncthreads when every thread of the
// block waits in it. A thread that skips a barrier its warp or block reaches (divergence around a
// warp primitive or __syncthreads, a real bug on a GPU), or lanes that meet in different
// primitives, make the launch report failure at once.
//
// Kernels are registered by name ("mlp_bias_act_forward<float>") through ONE_EMBEDDING_KERNEL and
// launched with oe_emulate_launch(name, grid, block, args), args laid out as cuLaunchKernel's
// kernelParams: one pointer to each argument's value.
#pragma once

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>

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
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
// Not static: the scheduler rewrites threadIdx before it resumes a fiber, and external linkage
// keeps the compiler from caching it in a kernel across a barrier (an opaque call).
dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace oe_emulation {

enum class State { runnable, at_warp_barrier, at_block_barrier, done };

struct Fiber {
  ucontext_t context;
  State state = State::runnable;
  const char* waiting_in = "";
  dim3 thread;
};

struct Warp {
  int first = 0;   // linear thread index of lane 0
  int lanes = 0;   // lanes in this warp (the last warp of a block may be partial)
  unsigned char slots[32][8];
  bool votes[32];
};

constexpr size_t STACK_BYTES = 256 * 1024;

static std::vector<Fiber> fibers;
static std::vector<std::unique_ptr<char[]>> stacks;
static std::vector<Warp> warps;
static ucontext_t scheduler;
static int current = 0;
static std::function<void(void**)>* running_kernel = nullptr;
static void** running_args = nullptr;
static bool failed = false;
static std::string failure;

inline void fail(const std::string& what) {
  if (!failed) failure = what;
  failed = true;
}

inline int lane() { return current % 32; }
inline Warp& warp() { return warps[current / 32]; }

// Back to the scheduler; returns when this fiber is resumed.
inline void yield() { swapcontext(&fibers[current].context, &scheduler); }

inline void wait(State state, const char* what) {
  fibers[current].state = state;
  fibers[current].waiting_in = what;
  yield();
}

inline void warp_barrier(const char* what) { wait(State::at_warp_barrier, what); }

static void fiber_main() {
  (*running_kernel)(running_args);
  fibers[current].state = State::done;
  // returning resumes uc_link, the scheduler
}

// Releases the barriers every waiter has reached. Returns false (after fail()) when no fiber can
// move: threads diverged around a barrier.
inline bool release_barriers() {
  bool released = false;
  for (Warp& w : warps) {
    int waiting = 0;
    const char* what = nullptr;
    bool same = true;
    for (int t = w.first; t < w.first + w.lanes; ++t) {
      if (fibers[t].state != State::at_warp_barrier) continue;
      if (what && strcmp(what, fibers[t].waiting_in) != 0) same = false;
      what = fibers[t].waiting_in;
      ++waiting;
    }
    if (waiting == w.lanes) {
      if (!same) {
        fail(std::string("lanes of a warp met in different warp primitives (") + what + ")");
        return false;
      }
      for (int t = w.first; t < w.first + w.lanes; ++t) fibers[t].state = State::runnable;
      released = true;
    }
  }
  if (released) return true;
  int at_block = 0, done = 0;
  for (const Fiber& f : fibers) {
    at_block += f.state == State::at_block_barrier;
    done += f.state == State::done;
  }
  if (at_block == (int)fibers.size()) {
    for (Fiber& f : fibers) f.state = State::runnable;
    return true;
  }
  for (const Fiber& f : fibers) {
    if (f.state == State::at_warp_barrier || f.state == State::at_block_barrier) {
      fail(std::string("threads diverged: not every thread reached ") + f.waiting_in);
      return false;
    }
  }
  (void)done;
  return true;
}

// Runs one block to completion; false on failure.
inline bool run_block(int threads) {
  if (fibers.size() != (size_t)threads) {
    fibers.assign(threads, Fiber());
    while (stacks.size() < (size_t)threads) stacks.emplace_back(new char[STACK_BYTES]);
  }
  warps.clear();
  for (int first = 0; first < threads; first += 32) {
    Warp w;
    w.first = first;
    w.lanes = threads - first < 32 ? threads - first : 32;
    warps.push_back(w);
  }
  for (int t = 0; t < threads; ++t) {
    Fiber& f = fibers[t];
    f.state = State::runnable;
    f.thread = dim3{(unsigned)t % blockDim.x, (unsigned)t / blockDim.x, 0};
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stacks[t].get();
    f.context.uc_stack.ss_size = STACK_BYTES;
    f.context.uc_link = &scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  for (;;) {
    bool ran = false;
    for (int t = 0; t < threads; ++t) {
      if (fibers[t].state != State::runnable) continue;
      current = t;
      threadIdx = fibers[t].thread;
      swapcontext(&scheduler, &fibers[t].context);
      if (failed) return false;
      ran = true;
    }
    if (ran) continue;
    bool all_done = true;
    for (const Fiber& f : fibers) all_done = all_done && f.state == State::done;
    if (all_done) return true;
    if (!release_barriers()) return false;
  }
}

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

// Runs kernel `name` over the grid; returns 0, or 1 with the reason in `error` (size error_size).
extern "C" int oe_emulate_launch(const char* name, unsigned grid_x, unsigned grid_y,
                                 unsigned block_x, unsigned block_y, void** args, char* error,
                                 int error_size) {
  using namespace oe_emulation;
  auto found = registry().find(name);
  if (found == registry().end()) {
    snprintf(error, error_size, "no kernel named %s", name);
    return 1;
  }
  if (grid_x == 0 || grid_y == 0 || block_x == 0 || block_y == 0 || block_x * block_y > 1024) {
    // a real launch fails on these too
    snprintf(error, error_size, "invalid launch shape grid (%u, %u) block (%u, %u)", grid_x, grid_y,
             block_x, block_y);
    return 1;
  }
  failed = false;
  failure.clear();
  running_kernel = &found->second;
  running_args = args;
  gridDim = dim3{grid_x, grid_y, 1};
  blockDim = dim3{block_x, block_y, 1};
  const int threads = (int)(block_x * block_y);
  for (unsigned by = 0; by < grid_y; ++by) {
    for (unsigned bx = 0; bx < grid_x; ++bx) {
      blockIdx = dim3{bx, by, 0};
      if (!run_block(threads)) {
        snprintf(error, error_size, "%s (block %u,%u)", failure.c_str(), bx, by);
        return 1;
      }
    }
  }
  return 0;
}
