// Host emulation of the CUDA built-ins the kernels of this folder use, so that a kernel family
// can be compiled with g++ and executed on a CPU (tests/test_cuda_sources.py does this on machines
// without a GPU). Never seen by NVRTC or nvcc.
//
// Include this, then a <family>.cu. Each block runs as blockDim.x * blockDim.y std::threads, one
// block after the other, so `__shared__` (made `static`) is shared by the threads of one block as
// on a GPU. __syncthreads is a block barrier; __shfl_xor_sync and __ballot_sync exchange values
// through a per-warp slot array between two warp barriers. A thread that skips a barrier its
// warp or block reaches (divergence around a warp primitive or __syncthreads, a real bug on a GPU)
// makes the waiters time out and the launch report failure instead of hanging.
//
// Kernels are registered by name ("mlp_bias_act_forward<float>") through ONE_EMBEDDING_KERNEL and
// launched with oe_emulate_launch(name, grid, block, args), args laid out as cuLaunchKernel's
// kernelParams: one pointer to each argument's value.
#pragma once

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

namespace oe_emulation {

static bool failed = false;
static std::mutex failed_mutex;
static std::string failure;

inline void fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(failed_mutex);
  if (!failed) failure = what;
  failed = true;
}

class Barrier {
 public:
  explicit Barrier(int parties) : parties_(parties) {}
  void wait(const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    const unsigned long generation = generation_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(10), [&] { return generation_ != generation; })) {
      fail(std::string("threads diverged: not every thread reached ") + what);
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int parties_;
  int arrived_ = 0;
  unsigned long generation_ = 0;
};

struct Warp {
  explicit Warp(int lanes) : barrier(lanes) {}
  Barrier barrier;
  unsigned char slots[32][8];
  bool votes[32];
};

static thread_local Barrier* block_barrier = nullptr;
static thread_local Warp* warp = nullptr;
static thread_local int lane = 0;

using Launcher = std::function<void(void**)>;

inline std::map<std::string, Launcher>& registry() {
  static std::map<std::string, Launcher> kernels;
  return kernels;
}

template <typename... P, size_t... I>
void call(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<typename std::decay<P>::type*>(args[I])...);
}

template <typename... P>
struct Registrar {
  Registrar(const char* name, void (*kernel)(P...)) {
    registry()[name] = [kernel](void** args) { call(kernel, args, std::index_sequence_for<P...>{}); };
  }
};

}  // namespace oe_emulation

inline void __syncthreads() { oe_emulation::block_barrier->wait("__syncthreads"); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "one slot holds 8 bytes");
  if (mask != 0xffffffffu) oe_emulation::fail("__shfl_xor_sync with a partial mask");
  oe_emulation::Warp* w = oe_emulation::warp;
  const int lane = oe_emulation::lane;
  memcpy(w->slots[lane], &value, sizeof(T));
  w->barrier.wait("__shfl_xor_sync");
  T result;
  memcpy(&result, w->slots[lane ^ lane_mask], sizeof(T));
  w->barrier.wait("__shfl_xor_sync");
  return result;
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  if (mask != 0xffffffffu) oe_emulation::fail("__ballot_sync with a partial mask");
  oe_emulation::Warp* w = oe_emulation::warp;
  w->votes[oe_emulation::lane] = predicate != 0;
  w->barrier.wait("__ballot_sync");
  unsigned bits = 0;
  for (int k = 0; k < 32; ++k) bits |= (unsigned)w->votes[k] << k;
  w->barrier.wait("__ballot_sync");
  return bits;
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
  failed = false;
  failure.clear();
  gridDim = dim3{grid_x, grid_y, 1};
  blockDim = dim3{block_x, block_y, 1};
  const int threads = (int)(block_x * block_y);
  for (unsigned by = 0; by < grid_y; ++by) {
    for (unsigned bx = 0; bx < grid_x; ++bx) {
      Barrier block(threads);
      std::vector<std::unique_ptr<Warp>> warps;
      for (int first = 0; first < threads; first += 32)
        warps.emplace_back(new Warp(threads - first < 32 ? threads - first : 32));
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          threadIdx = dim3{(unsigned)t % block_x, (unsigned)t / block_x, 0};
          blockIdx = dim3{bx, by, 0};
          block_barrier = &block;
          warp = warps[t / 32].get();
          lane = t % 32;
          found->second(args);
        });
      }
      for (auto& thread : pool) thread.join();
      if (failed) {
        snprintf(error, error_size, "%s (block %u,%u)", failure.c_str(), bx, by);
        return 1;
      }
    }
  }
  return 0;
}
