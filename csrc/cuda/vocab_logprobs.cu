// CUDA kernels of the fused vocab-parallel log-prob / policy loss (no torch headers).
//
// stats:    one block per row; each thread keeps an online (max, sum exp, sum exp*(x-max)) over a
//           strided slice of the row, then a fixed-order warp-shuffle + shared-memory tree merges
//           them (deterministic, no atomics). Reads the logits once.
// backward: a 2-D grid (x: row, y: vocab chunk) recomputes p = exp(x - lse) and writes the gradient
//           (optionally in place). Reads and writes the logits once.
// token:    the per-token policy loss of policy_loss_math.h, elementwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/vocab_logprobs_cuda.h"

namespace {

constexpr int kStatsThreads = 512;
constexpr int kBackwardThreads = 256;
constexpr int kBackwardItems = 8;  // elements per thread per chunk

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

struct Online {  // running max m, d = sum exp(x - m), s = sum exp(x - m)(x - m)
  float m, d, s;
};

__device__ __forceinline__ Online merge(Online a, Online b) {
  if (a.d == 0.0f) return b;
  if (b.d == 0.0f) return a;
  const float m = fmaxf(a.m, b.m);
  const float ea = expf(a.m - m), eb = expf(b.m - m);
  return {m, a.d * ea + b.d * eb, ea * (a.s + a.d * (a.m - m)) + eb * (b.s + b.d * (b.m - m))};
}

__device__ __forceinline__ Online push(Online a, float x) {
  if (x == -INFINITY) return a;  // masked logit: adds nothing (and -inf - -inf would be NaN)
  if (x > a.m) {  // rescale the running sums to the new max (rare after the first elements)
    if (a.d > 0.0f) {
      const float sc = expf(a.m - x);
      a.s = sc * (a.s + a.d * (a.m - x));
      a.d *= sc;
    }
    a.m = x;
  }
  const float z = x - a.m;
  const float e = expf(z);
  a.d += e;
  a.s += e * z;
  return a;
}

__device__ __forceinline__ Online warp_merge(Online v) {
  for (int off = 16; off > 0; off >>= 1) {
    Online o{__shfl_down_sync(0xffffffffu, v.m, off), __shfl_down_sync(0xffffffffu, v.d, off),
             __shfl_down_sync(0xffffffffu, v.s, off)};
    v = merge(v, o);
  }
  return v;
}

template <typename T>
__global__ void stats_kernel(const T* __restrict__ logits, int64_t vocab,
                             const int64_t* __restrict__ target_local, int64_t valid,
                             float inv_temp, float* __restrict__ stats) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  Online acc{-INFINITY, 0.0f, 0.0f};
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x)
    acc = push(acc, to_float(x[j]) * inv_temp);
  acc = warp_merge(acc);
  __shared__ Online partial[kStatsThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < blockDim.x / 32 ? partial[lane] : Online{-INFINITY, 0.0f, 0.0f};
    acc = warp_merge(acc);
    if (lane == 0) {
      const int64_t t = target_local[row];
      float* out = stats + 4 * row;
      out[0] = acc.m;
      out[1] = acc.d;
      out[2] = acc.s;
      out[3] = (t >= 0 && t < valid) ? to_float(x[t]) * inv_temp : 0.0f;
    }
  }
}

template <typename T>
__global__ void backward_kernel(const T* logits, T* grad, int64_t vocab,
                                const int64_t* __restrict__ target_local, int64_t valid,
                                float inv_temp, const float* __restrict__ lse,
                                const float* __restrict__ entropy,
                                const float* __restrict__ grad_logp,
                                const float* __restrict__ grad_entropy) {
  const int64_t row = blockIdx.x;
  const int64_t t = target_local[row];
  const float l = lse[row], gl = grad_logp[row];
  const float ge = grad_entropy ? grad_entropy[row] : 0.0f;
  const float h = grad_entropy ? entropy[row] : 0.0f;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * blockDim.x * kBackwardItems;
  const T* x = logits + row * vocab;
  T* g = grad + row * vocab;
#pragma unroll
  for (int k = 0; k < kBackwardItems; ++k) {
    const int64_t j = base + k * blockDim.x + threadIdx.x;
    if (j >= vocab) break;
    float out = 0.0f;
    if (j < valid) {
      const float z = to_float(x[j]) * inv_temp - l;
      const float p = expf(z);
      const float plogp = p > 0.0f ? p * (z + h) : 0.0f;  // 0 log 0 = 0 for -inf logits
      out = gl * ((j == t ? 1.0f : 0.0f) - p) - ge * plogp;
    }
    g[j] = from_float<T>(out * inv_temp);
  }
}

__global__ void token_kernel(const float* __restrict__ logp, const float* __restrict__ old_logp,
                             const float* __restrict__ adv, int64_t n,
                             klear::TokenLossParams params, float* __restrict__ loss,
                             float* __restrict__ dlogp, float* __restrict__ ratio) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const klear::TokenLoss t = klear::token_policy_loss(logp[i], old_logp[i], adv[i], params);
  loss[i] = t.loss;
  dlogp[i] = t.dlogp;
  ratio[i] = t.ratio;
}

template <typename T>
cudaError_t launch_stats(const void* logits, int64_t rows, int64_t vocab, const int64_t* target,
                         int64_t valid, float inv_temp, float* stats, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  stats_kernel<T><<<static_cast<unsigned>(rows), kStatsThreads, 0, stream>>>(
      static_cast<const T*>(logits), vocab, target, valid, inv_temp, stats);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward(const void* logits, void* grad, int64_t rows, int64_t vocab,
                            const int64_t* target, int64_t valid, float inv_temp,
                            const float* lse, const float* entropy, const float* grad_logp,
                            const float* grad_entropy, cudaStream_t stream) {
  if (rows == 0 || vocab == 0) return cudaSuccess;
  const int64_t per_block = static_cast<int64_t>(kBackwardThreads) * kBackwardItems;
  // rows on x (up to 2^31 - 1 tokens), vocab chunks on y (<= 65535: 16.7M columns per shard)
  const dim3 grid(static_cast<unsigned>(rows),
                  static_cast<unsigned>((vocab + per_block - 1) / per_block));
  backward_kernel<T><<<grid, kBackwardThreads, 0, stream>>>(
      static_cast<const T*>(logits), static_cast<T*>(grad), vocab, target, valid, inv_temp, lse,
      entropy, grad_logp, grad_entropy);
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
                                         const float* adv, int64_t n,
                                         klear::TokenLossParams params, float* loss, float* dlogp,
                                         float* ratio, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int threads = 256;
  token_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(
      logp, old_logp, adv, n, params, loss, dlogp, ratio);
  return cudaGetLastError();
}
}
