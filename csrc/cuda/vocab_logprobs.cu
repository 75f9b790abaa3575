// CUDA kernels of the fused vocab-parallel log-prob / policy loss (no torch headers).
//
// stats:    one block per row; each thread keeps an online (max, sum exp, sum exp*(x-max)) over a
//           strided slice of the row, in log2 units (exp2 of logits pre-scaled by
//           log2(e)/temperature), then a fixed-order warp-shuffle + shared-memory tree merges
//           them (deterministic, no atomics). Reads the logits once.
//           Aligned rows: two 16-byte loads in flight per iteration, one max per pair of
//           vectors and at most one rescale of the running sums. Other rows: one element per
//           iteration (the fallback).
// backward: a 2-D grid (x: row, y: vocab chunk) recomputes p = exp(x - lse) and writes the gradient
//           (optionally in place). Reads and writes the logits once. Aligned rows: every thread
//           loads all its 16-byte vectors into registers before its first store (legal in place:
//           each element is read and written by the same thread). Other rows: scalar fallback.
// token:    the per-token policy loss of policy_loss_math.h, elementwise.
// In-row indices are 32-bit (launchers reject rows of 2^31 elements or more); row offsets are
// 64-bit, so tensors beyond 2^31 (and 2^32) elements are addressed correctly.
//
// The same source is compiled as host C++ by the emulated-CUDA test tier (KLEAR_CUDA_EMULATION,
// csrc/emu/cuda_emu.h; tests/cuda_emu.py). KLEAR_MUTATION=k builds plant bug k there (mutation
// test: tests/multiprocess/test_cuda_emu.py); a real build with it set fails to compile.
#ifdef KLEAR_CUDA_EMULATION
#include "emu/cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define KLEAR_LAUNCH(kernel, grid, block, stream, ...) \
  kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

#include <climits>

#include "cuda/vocab_logprobs_cuda.h"

#ifndef KLEAR_MUTATION
#define KLEAR_MUTATION 0
#endif
#if KLEAR_MUTATION && !defined(KLEAR_CUDA_EMULATION)
#error "KLEAR_MUTATION plants bugs: only for the emulated test builds"
#endif
// `code`, or planted bug number k in a KLEAR_MUTATION=k build.
#define KLEAR_PLANTED(k, bug, code) (KLEAR_MUTATION == (k) ? (bug) : (code))

namespace {

constexpr int kStatsThreads = 512;
constexpr int kBackwardThreads = 256;
constexpr int kBackwardItems = 8;      // scalar fallback: elements per thread per chunk
constexpr int kBackwardVectors = 4;    // vector path: 16-byte vectors per thread per chunk
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kMinZ = -1024.0f;      // exp2 underflows to 0 far above: keeps 0 * z finite

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half(x);
}

__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 x) {
  return __bfloat16_as_ushort(x);
}
__device__ __forceinline__ unsigned short bits_of(__half x) { return __half_as_ushort(x); }
template <typename T> __device__ __forceinline__ T from_bits(unsigned short u);
template <> __device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(unsigned short u) {
  return __ushort_as_bfloat16(u);
}
template <> __device__ __forceinline__ __half from_bits<__half>(unsigned short u) {
  return __ushort_as_half(u);
}

// 16-byte vectors of T (a uint4): element k as float; floats packed back into a vector.
template <typename T> struct Vec {  // bf16 / fp16
  static constexpr int kN = 8;
  __device__ __forceinline__ static float get(const uint4& v, int k) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    return to_float(from_bits<T>(static_cast<unsigned short>(w[k / 2] >> (16 * (k % 2)))));
  }
  __device__ __forceinline__ static uint4 pack(const float* f) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<unsigned>(bits_of(from_float<T>(f[2 * i]))) |
             (static_cast<unsigned>(bits_of(from_float<T>(f[2 * i + 1]))) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};
template <> struct Vec<float> {
  static constexpr int kN = 4;
  __device__ __forceinline__ static float get(const uint4& v, int k) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    return __uint_as_float(w[k]);
  }
  __device__ __forceinline__ static uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

// ------------------------------------------------------------------ stats

struct Online {  // in log2 units: running max m, d = sum 2^(y - m), s = sum 2^(y - m)(y - m)
  float m, d, s;
};

// Move the running sums to a new max m > a.m.
__device__ __forceinline__ Online rescale(Online a, float m) {
  if (a.d > 0.0f) {
    const float sc = exp2f(a.m - m);
    a.s = KLEAR_PLANTED(4, a.s + a.d * (a.m - m), sc * (a.s + a.d * (a.m - m)));
    a.d = KLEAR_PLANTED(1, a.d, a.d * sc);
  }
  a.m = m;
  return a;
}

// Add N values y (log2 units; -inf = masked) with one max and at most one rescale.
template <int N>
__device__ __forceinline__ Online push(Online a, const float (&y)[N]) {
  float top = y[0];
#pragma unroll
  for (int k = 1; k < N; ++k) top = fmaxf(top, y[k]);
  if (top > a.m) a = rescale(a, top);
  if (a.m == -INFINITY) return a;  // nothing but masked logits so far
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float z = y[k] - a.m;
    const float e = exp2f(z);
    a.d += e;
    a.s += e * fmaxf(z, kMinZ);
  }
  return a;
}

__device__ __forceinline__ Online merge(Online a, Online b) {
  if (a.d == 0.0f) return b;
  if (b.d == 0.0f) return a;
  const float m = fmaxf(a.m, b.m);
  const Online ra = rescale(a, m), rb = rescale(b, m);
  return {m, ra.d + rb.d, ra.s + rb.s};
}

__device__ __forceinline__ Online warp_merge(Online v) {
  for (int off = 16; off > 0; off >>= 1) {
    Online o{__shfl_down_sync(0xffffffffu, v.m, off), __shfl_down_sync(0xffffffffu, v.d, off),
             __shfl_down_sync(0xffffffffu, v.s, off)};
    v = merge(v, o);
  }
  return v;
}

// Merge the block's per-thread accumulators (fixed order) and write the row's stats in natural
// units: {max x, sum exp(x - max), sum exp(x - max)(x - max), x[target] or 0}.
template <typename T>
__device__ __forceinline__ void finish_stats(Online acc, const T* x, int64_t t, int valid,
                                             float inv_temp, float* out) {
  acc = warp_merge(acc);
  __shared__ Online partial[kStatsThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (warp != 0) return;
  acc = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : Online{-INFINITY, 0.0f, 0.0f};
  acc = warp_merge(acc);
  if (lane == 0) {
    out[0] = acc.m * kLn2;
    out[1] = acc.d;
    out[2] = acc.s * kLn2;
    out[3] = (KLEAR_PLANTED(3, true, t >= 0) && t < valid) ? to_float(x[t]) * inv_temp : 0.0f;
  }
}

// Fallback: one element per iteration, any alignment.
template <typename T>
__global__ void __launch_bounds__(kStatsThreads)
stats_kernel(const T* __restrict__ logits, int64_t vocab, const int64_t* __restrict__ target_local,
             int valid, float inv_temp, float* __restrict__ stats) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  const float scale = inv_temp * kLog2e;
  Online acc{-INFINITY, 0.0f, 0.0f};
  for (int j = threadIdx.x; j < valid; j += blockDim.x) {
    const float y[1] = {to_float(x[j]) * scale};
    acc = push(acc, y);
  }
  finish_stats(acc, x, target_local[row], valid, inv_temp, stats + 4 * row);
}

// Rows 16-byte aligned: vectors of Vec<T>::kN elements, two loads in flight per iteration.
template <typename T>
__global__ void __launch_bounds__(kStatsThreads)
stats_vec_kernel(const T* __restrict__ logits, int64_t vocab,
                 const int64_t* __restrict__ target_local, int valid, float inv_temp,
                 float* __restrict__ stats) {
  constexpr int N = Vec<T>::kN;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const float scale = inv_temp * kLog2e;
  const int vectors = valid / N, step = blockDim.x;
  Online acc{-INFINITY, 0.0f, 0.0f};
  int i = threadIdx.x;
  for (; i + step < vectors; i += 2 * step) {
    const uint4 a = xv[i], b = xv[i + step];
    float y[2 * N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      y[k] = Vec<T>::get(a, k) * scale;
      y[N + k] = Vec<T>::get(b, k) * scale;
    }
    acc = push(acc, y);
  }
  if (i < vectors) {
    const uint4 a = xv[i];
    float y[N];
#pragma unroll
    for (int k = 0; k < N; ++k) y[k] = Vec<T>::get(a, k) * scale;
    acc = push(acc, y);
  }
  const int tail = vectors * N + threadIdx.x;  // the last valid % N elements
  if (tail < valid) {
    const float y[1] = {to_float(x[tail]) * scale};
    acc = push(acc, y);
  }
  finish_stats(acc, x, target_local[row], valid, inv_temp, stats + 4 * row);
}

// ------------------------------------------------------------------ backward

struct RowGrad {  // per-row constants of the backward, in log2 units where it saves work
  float scale;    // log2(e) / temperature
  float lse2;     // lse * log2(e)
  float inv_temp, h, gl, ge;
  int t;          // target column in this shard, or -1
};

__device__ __forceinline__ RowGrad row_grad(int64_t row, const int64_t* target_local, int valid,
                                            float inv_temp, const float* lse,
                                            const float* entropy, const float* grad_logp,
                                            const float* grad_entropy) {
  const int64_t t = target_local[row];
  return {inv_temp * kLog2e, lse[row] * kLog2e, inv_temp,
          grad_entropy ? entropy[row] : 0.0f, grad_logp[row],
          grad_entropy ? grad_entropy[row] : 0.0f,
          (t >= 0 && t < valid) ? static_cast<int>(t) : -1};
}

// d/dx_j of (gl * logp + ge * H) times 1/temperature: gl (onehot_j - p_j) - ge p_j (log p_j + H).
__device__ __forceinline__ float grad_at(const RowGrad& r, float x, int j, int valid) {
  if (j >= valid) return 0.0f;  // padding
  const float z2 = x * r.scale - r.lse2;
  const float p = exp2f(z2);
  const float plogp = p > 0.0f ? p * (z2 * kLn2 + r.h) : 0.0f;  // 0 log 0 = 0 for -inf logits
  return (r.gl * ((j == r.t ? 1.0f : 0.0f) - p) - r.ge * plogp) * r.inv_temp;
}

// First column of this block's vocab chunk.
__device__ __forceinline__ int chunk_begin(int per_block) {
  return KLEAR_PLANTED(2, 0, static_cast<int>(blockIdx.y) * per_block);
}

// Fallback: scalar loads, any alignment. No __restrict__: grad may alias logits.
template <typename T>
__global__ void __launch_bounds__(kBackwardThreads)
backward_kernel(const T* logits, T* grad, int64_t vocab, const int64_t* __restrict__ target_local,
                int valid, float inv_temp, const float* __restrict__ lse,
                const float* __restrict__ entropy, const float* __restrict__ grad_logp,
                const float* __restrict__ grad_entropy) {
  const int64_t row = blockIdx.x;
  const RowGrad r = row_grad(row, target_local, valid, inv_temp, lse, entropy, grad_logp,
                             grad_entropy);
  const int base = chunk_begin(blockDim.x * kBackwardItems);
  const T* x = logits + row * vocab;
  T* g = grad + row * vocab;
#pragma unroll
  for (int k = 0; k < kBackwardItems; ++k) {
    const int j = base + k * blockDim.x + threadIdx.x;
    if (j >= vocab) break;
    g[j] = from_float<T>(grad_at(r, to_float(x[j]), j, valid));
  }
}

// Rows 16-byte aligned: all of a thread's vectors are loaded before its first store.
template <typename T>
__global__ void __launch_bounds__(kBackwardThreads)
backward_vec_kernel(const T* logits, T* grad, int64_t vocab,
                    const int64_t* __restrict__ target_local, int valid, float inv_temp,
                    const float* __restrict__ lse, const float* __restrict__ entropy,
                    const float* __restrict__ grad_logp, const float* __restrict__ grad_entropy) {
  constexpr int N = Vec<T>::kN;
  const int64_t row = blockIdx.x;
  const RowGrad r = row_grad(row, target_local, valid, inv_temp, lse, entropy, grad_logp,
                             grad_entropy);
  const uint4* xv = reinterpret_cast<const uint4*>(logits + row * vocab);
  uint4* gv = reinterpret_cast<uint4*>(grad + row * vocab);
  const int vectors = static_cast<int>(vocab / N);
  const int base = chunk_begin(blockDim.x * kBackwardVectors) + threadIdx.x;
  uint4 v[kBackwardVectors];
#pragma unroll
  for (int k = 0; k < kBackwardVectors; ++k) {
    const int i = base + k * blockDim.x;
    if (i < vectors) v[k] = xv[i];
  }
#pragma unroll
  for (int k = 0; k < kBackwardVectors; ++k) {
    const int i = base + k * blockDim.x;
    if (i >= vectors) break;
    float out[N];
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = grad_at(r, Vec<T>::get(v[k], e), i * N + e, valid);
    gv[i] = Vec<T>::pack(out);
  }
}

// ------------------------------------------------------------------ token loss

// entropy / old_entropy may be null when ERC is off (params.erc_high <= 0).
__global__ void token_kernel(const float* __restrict__ logp, const float* __restrict__ old_logp,
                             const float* __restrict__ adv, const float* __restrict__ entropy,
                             const float* __restrict__ old_entropy, int64_t n,
                             klear::TokenLossParams params, float* __restrict__ loss,
                             float* __restrict__ dlogp, float* __restrict__ ratio) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const klear::TokenLoss t = klear::token_policy_loss(
      logp[i], old_logp[i], adv[i], entropy ? entropy[i] : 0.0f,
      old_entropy ? old_entropy[i] : 0.0f, params);
  loss[i] = t.loss;
  dlogp[i] = t.dlogp;
  ratio[i] = t.ratio;
}

// ------------------------------------------------------------------ launchers

// Rows can use 16-byte vectors: every pointer 16-byte aligned and the row length a whole
// number of vectors (so that every row starts aligned).
template <typename T>
bool vector_rows(const void* a, const void* b, int64_t vocab) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return aligned(a) && aligned(b) && vocab % Vec<T>::kN == 0;
}

bool bad_shape(int64_t rows, int64_t vocab, int64_t valid) {
  return rows < 0 || rows > INT_MAX || vocab < 0 || vocab > INT_MAX || valid < 0 ||
         valid > vocab;
}

template <typename T>
cudaError_t launch_stats(const void* logits, int64_t rows, int64_t vocab, const int64_t* target,
                         int64_t valid, float inv_temp, float* stats, cudaStream_t stream) {
  if (bad_shape(rows, vocab, valid)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const T* x = static_cast<const T*>(logits);
  const int v = static_cast<int>(valid);
  if (vector_rows<T>(logits, logits, vocab))
    KLEAR_LAUNCH(stats_vec_kernel<T>, dim3(static_cast<unsigned>(rows)), dim3(kStatsThreads),
                 stream, x, vocab, target, v, inv_temp, stats);
  else
    KLEAR_LAUNCH(stats_kernel<T>, dim3(static_cast<unsigned>(rows)), dim3(kStatsThreads), stream,
                 x, vocab, target, v, inv_temp, stats);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward(const void* logits, void* grad, int64_t rows, int64_t vocab,
                            const int64_t* target, int64_t valid, float inv_temp,
                            const float* lse, const float* entropy, const float* grad_logp,
                            const float* grad_entropy, cudaStream_t stream) {
  if (bad_shape(rows, vocab, valid)) return cudaErrorInvalidValue;
  if (rows == 0 || vocab == 0) return cudaSuccess;
  const bool vec = vector_rows<T>(logits, grad, vocab);
  const int64_t per_block = static_cast<int64_t>(kBackwardThreads) *
                            (vec ? kBackwardVectors * Vec<T>::kN : kBackwardItems);
  // rows on x (up to 2^31 - 1 tokens), vocab chunks on y (<= 65535 chunks)
  const int64_t chunks = (vocab + per_block - 1) / per_block;
  if (chunks > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
  const T* x = static_cast<const T*>(logits);
  T* g = static_cast<T*>(grad);
  const int v = static_cast<int>(valid);
  if (vec)
    KLEAR_LAUNCH(backward_vec_kernel<T>, grid, dim3(kBackwardThreads), stream, x, g, vocab,
                 target, v, inv_temp, lse, entropy, grad_logp, grad_entropy);
  else
    KLEAR_LAUNCH(backward_kernel<T>, grid, dim3(kBackwardThreads), stream, x, g, vocab, target, v,
                 inv_temp, lse, entropy, grad_logp, grad_entropy);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

cudaError_t klear_logprob_stats_cuda(int dtype, const void* logits, int64_t rows, int64_t vocab,
                                     const int64_t* target_local, int64_t valid, float inv_temp,
                                     float* stats, cudaStream_t stream) {
  switch (dtype) {
    case kKlearFloat32:
      return launch_stats<float>(logits, rows, vocab, target_local, valid, inv_temp, stats, stream);
    case kKlearBFloat16:
      return launch_stats<__nv_bfloat16>(logits, rows, vocab, target_local, valid, inv_temp,
                                         stats, stream);
    case kKlearFloat16:
      return launch_stats<__half>(logits, rows, vocab, target_local, valid, inv_temp, stats,
                                  stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t klear_logprob_backward_cuda(int dtype, const void* logits, void* grad, int64_t rows,
                                        int64_t vocab, const int64_t* target_local, int64_t valid,
                                        float inv_temp, const float* lse, const float* entropy,
                                        const float* grad_logp, const float* grad_entropy,
                                        cudaStream_t stream) {
  switch (dtype) {
    case kKlearFloat32:
      return launch_backward<float>(logits, grad, rows, vocab, target_local, valid, inv_temp, lse,
                                    entropy, grad_logp, grad_entropy, stream);
    case kKlearBFloat16:
      return launch_backward<__nv_bfloat16>(logits, grad, rows, vocab, target_local, valid,
                                            inv_temp, lse, entropy, grad_logp, grad_entropy,
                                            stream);
    case kKlearFloat16:
      return launch_backward<__half>(logits, grad, rows, vocab, target_local, valid, inv_temp,
                                     lse, entropy, grad_logp, grad_entropy, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t klear_token_policy_loss_cuda(const float* logp, const float* old_logp,
                                         const float* adv, const float* entropy,
                                         const float* old_entropy, int64_t n,
                                         klear::TokenLossParams params, float* loss, float* dlogp,
                                         float* ratio, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int threads = 256;
  KLEAR_LAUNCH(token_kernel, dim3(static_cast<unsigned>((n + threads - 1) / threads)),
               dim3(threads), stream, logp, old_logp, adv, entropy, old_entropy, n, params, loss,
               dlogp, ratio);
  return cudaGetLastError();
}
}
