// Host C++ stand-ins for the CUDA features the kernels of csrc/cuda/*.cu use, so that the SAME
// .cu source compiles with g++ (`-x c++ -DKLEAR_CUDA_EMULATION`) and runs on a CPU (the
// emulated-CUDA test tier: tests/cuda_emu.py builds it, tests/multiprocess/test_cuda_emu.py runs it).
//
// Launch model: the blocks of a grid run one after another on each of a few OS threads; the
// threads of a block are cooperative fibers on one OS thread (own stack each, switched by a few
// lines of assembly on x86-64, ucontext elsewhere). __syncthreads() is a block barrier and
// __shfl_*_sync a warp barrier around a per-warp exchange slot, so every fiber of a block (of a
// warp) must reach them, as on the GPU. __shared__ is a thread_local static: one copy per OS
// thread, i.e. per running block.
//
// What it cannot see: timing and occupancy; the real memory model (fibers run one at a time, so
// a missing __syncthreads between a shared-memory write and another thread's read is only caught
// when the schedule happens to expose it; no reordering, no caching); warp scheduling and
// independent thread progress; divergence rules for *_sync masks (the mask is ignored);
// hardware exp2/ex2.approx rounding (host libm is used); bank conflicts and alignment faults
// other than those the kernels check themselves.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// ------------------------------------------------------------------ qualifiers and types
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static thread_local

using cudaError_t = int;
using cudaStream_t = void*;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bf16 / fp16 storage with CUDA's round-to-nearest-even conversions.
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 x) { return __uint_as_float(unsigned(x.bits) << 16); }
inline __nv_bfloat16 __float2bfloat16(float x) {
  const unsigned u = __float_as_uint(x);
  if (x != x) return {0x7FC0u};
  return {static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}
inline float __half2float(__half x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}
inline __half __float2half(float x) {
  const _Float16 h = static_cast<_Float16>(x);  // IEEE round to nearest even
  __half out;
  std::memcpy(&out.bits, &h, 2);
  return out;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 x) { return x.bits; }
inline unsigned short __half_as_ushort(__half x) { return x.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
inline __half __ushort_as_half(unsigned short u) { return {u}; }

namespace klear_emu {

// ------------------------------------------------------------------ fibers
#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores its sp in *from, continues on
// `to` (a stack saved by this function, or a fresh one prepared by start()).
extern "C" void klear_emu_switch(void** from, void* to);
asm(R"(
.text
.globl klear_emu_switch
.hidden klear_emu_switch
.type klear_emu_switch,@function
klear_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size klear_emu_switch, .-klear_emu_switch
)");
#endif

constexpr size_t kStackBytes = 64 * 1024;

struct Fiber {
  // Not zero-filled: a launch's worker threads are new, and only the pages used get touched.
  std::unique_ptr<unsigned char[]> stack{new unsigned char[kStackBytes]};
  uint3 tid{0, 0, 0};
  bool done = false;
  unsigned waiting = 0;        // generation of the barrier it waits on (0: runnable)
  const unsigned* gen = nullptr;
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
};

struct Barrier {
  unsigned expected = 0, arrived = 0, gen = 1;
};

// Per OS thread: the block being run and its fibers.
struct Block {
  uint3 block_idx{0, 0, 0};
  dim3 grid, block;
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  int current = -1;
  int live = 0;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<uint64_t> slots;  // warp exchange slots [warps][32]
#if defined(__x86_64__)
  void* sched_sp = nullptr;
#else
  ucontext_t sched_ctx;
#endif
};

inline Block& here() {
  static thread_local Block b;
  return b;
}

inline void to_scheduler() {
  Block& b = here();
  Fiber& f = b.fibers[b.current];
#if defined(__x86_64__)
  klear_emu_switch(&f.sp, b.sched_sp);
#else
  swapcontext(&f.ctx, &b.sched_ctx);
#endif
}

inline void fiber_main() {
  Block& b = here();
  (*b.body)();
  Fiber& f = b.fibers[b.current];
  f.done = true;
  --b.live;
  const unsigned warp = (f.tid.x + f.tid.y * b.block.x) / 32;
  // A finished thread no longer counts at barriers (as exited threads on the GPU).
  --b.block_barrier.expected;
  --b.warp_barriers[warp].expected;
  to_scheduler();
  std::abort();  // never resumed
}

#if !defined(__x86_64__)
inline void fiber_trampoline() { fiber_main(); }
#endif

inline void start(Fiber& f) {
#if defined(__x86_64__)
  auto top = reinterpret_cast<uintptr_t>(f.stack.get() + kStackBytes) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                          // fake return address of fiber_main
  *--sp = reinterpret_cast<void*>(&fiber_main);             // `ret` target
  for (int r = 0; r < 6; ++r) *--sp = nullptr;              // rbp rbx r12 r13 r14 r15
  f.sp = sp;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack.get();
  f.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, &fiber_trampoline, 0);
#endif
}

// Arrive at `bar` and wait until every live fiber it counts has arrived.
inline void barrier_wait(Barrier& bar) {
  Block& b = here();
  Fiber& f = b.fibers[b.current];
  if (++bar.arrived >= bar.expected) {
    bar.arrived = 0;
    ++bar.gen;
    return;
  }
  f.waiting = bar.gen;
  f.gen = &bar.gen;
  to_scheduler();
}

// Run one block: round-robin over the fibers until all are done.
inline void run_block(const dim3& grid, const dim3& block, uint3 block_idx,
                      const std::function<void()>& body) {
  Block& b = here();
  const int n = static_cast<int>(block.x * block.y * block.z);
  if (static_cast<int>(b.fibers.size()) < n) b.fibers.resize(n);
  const int warps = (n + 31) / 32;
  b.grid = grid;
  b.block = block;
  b.block_idx = block_idx;
  b.body = &body;
  b.live = n;
  b.block_barrier = {static_cast<unsigned>(n), 0, 1};
  b.warp_barriers.assign(warps, Barrier{});
  b.slots.assign(static_cast<size_t>(warps) * 32, 0);
  for (int w = 0; w < warps; ++w)
    b.warp_barriers[w].expected = static_cast<unsigned>(std::min(32, n - 32 * w));
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.tid = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
    f.done = false;
    f.waiting = 0;
    start(f);
  }
  while (b.live > 0) {
    for (int i = 0; i < n; ++i) {
      Fiber& f = b.fibers[i];
      if (f.done || (f.waiting != 0 && *f.gen == f.waiting)) continue;
      f.waiting = 0;
      b.current = i;
#if defined(__x86_64__)
      klear_emu_switch(&b.sched_sp, f.sp);
#else
      swapcontext(&b.sched_ctx, &f.ctx);
#endif
    }
  }
  b.current = -1;
}

// Blocks of grid.x restricted to [window_begin, window_end) (tests of >2^31-element offsets run
// a few rows of a huge grid whose other rows do not exist in memory); default: all.
inline int64_t& window_begin() {
  static int64_t v = 0;
  return v;
}
inline int64_t& window_end() {
  static int64_t v = INT64_MAX;
  return v;
}

inline int os_threads() {
  const char* env = std::getenv("KLEAR_EMU_THREADS");
  const int n = env ? std::atoi(env) : static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(n, 8));
}

inline void launch(const dim3& grid, const dim3& block, const std::function<void()>& body) {
  const int64_t x0 = std::max<int64_t>(0, window_begin());
  const int64_t x1 = std::min<int64_t>(grid.x, window_end());
  const int64_t per_x = static_cast<int64_t>(grid.y) * grid.z;
  const int64_t total = std::max<int64_t>(0, x1 - x0) * per_x;
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t k = next++; k < total; k = next++) {
      const uint3 idx{static_cast<unsigned>(x0 + k / per_x), static_cast<unsigned>(k % grid.y),
                      static_cast<unsigned>((k / grid.y) % grid.z)};
      run_block(grid, block, idx, body);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::min<int64_t>(os_threads(), total); ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

// ------------------------------------------------------------------ builtins
inline void syncthreads() { barrier_wait(here().block_barrier); }

template <typename V, typename F>
V warp_exchange(V v, F src_of) {
  static_assert(sizeof(V) <= 8, "emulated shuffles move up to 8 bytes");
  Block& b = here();
  const Fiber& f = b.fibers[b.current];
  const unsigned linear = f.tid.x + f.tid.y * b.block.x + f.tid.z * b.block.x * b.block.y;
  const unsigned warp = linear / 32, lane = linear % 32;
  uint64_t* slot = b.slots.data() + 32 * warp;
  std::memcpy(&slot[lane], &v, sizeof(V));
  barrier_wait(b.warp_barriers[warp]);  // every lane has published its value
  const unsigned src = src_of(lane);
  V out;
  std::memcpy(&out, &slot[src < 32 ? src : lane], sizeof(V));
  barrier_wait(b.warp_barriers[warp]);  // every lane has read before the slots are reused
  return out;
}

}  // namespace klear_emu

#define threadIdx (::klear_emu::here().fibers[::klear_emu::here().current].tid)
#define blockIdx (::klear_emu::here().block_idx)
#define blockDim (::klear_emu::here().block)
#define gridDim (::klear_emu::here().grid)
#define __syncthreads() ::klear_emu::syncthreads()

template <typename V>
inline V __shfl_down_sync(unsigned /*mask*/, V v, unsigned delta, int width = 32) {
  return klear_emu::warp_exchange(v, [&](unsigned lane) {
    return (lane % width) + delta < static_cast<unsigned>(width) ? lane + delta : lane;
  });
}
template <typename V>
inline V __shfl_xor_sync(unsigned /*mask*/, V v, int lane_mask, int width = 32) {
  return klear_emu::warp_exchange(v, [&](unsigned lane) {
    const unsigned src = lane ^ static_cast<unsigned>(lane_mask);
    return src / width == lane / width ? src : lane;
  });
}

// kernel<<<grid, block, 0, stream>>>(args...) of the .cu becomes KLEAR_LAUNCH(...).
#define KLEAR_LAUNCH(kernel, grid, block, stream, ...) \
  ::klear_emu::launch((grid), (block), [&] { kernel(__VA_ARGS__); })

// Test hook (ctypes): run only blocks with blockIdx.x in [begin, end) of the next launches.
extern "C" void klear_emu_set_row_window(int64_t begin, int64_t end) {
  klear_emu::window_begin() = begin;
  klear_emu::window_end() = end;
}
