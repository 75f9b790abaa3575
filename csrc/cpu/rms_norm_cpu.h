// RMSNorm of fp32 rows, forward and backward, one pass per row each: the decode's Qwen3RMSNorm
// (decode_cpu.h) and the trainer's norms (megatron_klear/ops/rms_norm.py), where torch's CPU
// rms_norm is eight ops forward and its autograd about twenty backward (~8x this kernel's time
// at a micro-batch's size: benchmarks/bench_cpu_gemm.py).
//
//   y  = x r w,  r = 1 / sqrt(mean(x^2) + eps)
//   dx = r (dy w) - x r^3 mean(dy w x)
//   dw = sum over rows of dy x r
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/vocab_logprobs_cpu.h"

namespace klear::cpu {

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

KLEAR_INLINE float rms_inverse(const float* x, int64_t dim, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < dim; ++j) ss += x[j] * x[j];
  return 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
}

// out = x / sqrt(mean(x^2) + eps) * weight over one row of `dim` (Qwen3RMSNorm in fp32).
KLEAR_INLINE void rms_norm_row(const float* x, const float* weight, int64_t dim, float eps,
                               float* out) {
  const float r = rms_inverse(x, dim, eps);
#pragma omp simd
  for (int64_t j = 0; j < dim; ++j) out[j] = x[j] * r * weight[j];
}

// One row's dx (written) and dw (accumulated).
KLEAR_INLINE void rms_norm_backward_row(const float* dy, const float* x, const float* weight,
                                        int64_t dim, float eps, float* dx, float* dw) {
  const float r = rms_inverse(x, dim, eps);
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t j = 0; j < dim; ++j) dot += dy[j] * weight[j] * x[j];
  const float c = r * r * r * dot / static_cast<float>(dim);
#pragma omp simd
  for (int64_t j = 0; j < dim; ++j) {
    dx[j] = r * dy[j] * weight[j] - x[j] * c;
    dw[j] += dy[j] * x[j] * r;
  }
}

#if KLEAR_X86_DISPATCH
#define KLEAR_RMS_NORM_KERNELS(isa, attr)                                                         \
  attr void rms_norm_row_##isa(const float* x, const float* weight, int64_t dim, float eps,      \
                               float* out) {                                                      \
    rms_norm_row(x, weight, dim, eps, out);                                                       \
  }                                                                                               \
  attr void rms_norm_backward_row_##isa(const float* dy, const float* x, const float* weight,    \
                                        int64_t dim, float eps, float* dx, float* dw) {          \
    rms_norm_backward_row(dy, x, weight, dim, eps, dx, dw);                                       \
  }
KLEAR_RMS_NORM_KERNELS(avx2, KLEAR_AVX2)
KLEAR_RMS_NORM_KERNELS(avx512, KLEAR_AVX512)
#undef KLEAR_RMS_NORM_KERNELS
// The best copy of row kernel `name` for this CPU, called with `args`.
#define KLEAR_ISA_CALL(name, ...)                                   \
  do {                                                              \
    if (cpu_isa() >= Isa::kAvx512) name##_avx512(__VA_ARGS__);      \
    else if (cpu_isa() == Isa::kAvx2) name##_avx2(__VA_ARGS__);     \
    else name(__VA_ARGS__);                                         \
  } while (0)
#else
#define KLEAR_ISA_CALL(name, ...) name(__VA_ARGS__)
#endif

// out [rows, dim] contiguous; x rows `x_row` apart.
inline void rms_norm(const float* x, int64_t x_row, const float* weight, int64_t rows,
                     int64_t dim, float eps, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i)
    KLEAR_ISA_CALL(rms_norm_row, x + i * x_row, weight, dim, eps, out + i * dim);
}

// dx [rows, dim] contiguous and dw [dim] (overwritten) of contiguous dy and x [rows, dim].
inline void rms_norm_backward(const float* dy, const float* x, const float* weight, int64_t rows,
                              int64_t dim, float eps, float* dx, float* dw) {
  std::fill(dw, dw + dim, 0.0f);
#pragma omp parallel
  {
    std::vector<float> part(dim, 0.0f);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i)
      KLEAR_ISA_CALL(rms_norm_backward_row, dy + i * dim, x + i * dim, weight, dim, eps,
                     dx + i * dim, part.data());
#pragma omp critical
    for (int64_t j = 0; j < dim; ++j) dw[j] += part[j];
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

}  // namespace klear::cpu
