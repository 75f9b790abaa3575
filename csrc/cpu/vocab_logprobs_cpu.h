// CPU kernels of the fused vocab-parallel log-prob / policy loss (OpenMP over rows).
//
// Plain templates over the logits storage type T (float, bf16_t below, or any type convertible
// to and from float such as c10::Half); no torch headers. One row is one token; a row holds this
// rank's vocabulary shard, of which the first `valid` slots are real (the rest is padding and
// behaves as -inf). All accumulation is fp32, every row is reduced by one thread in a fixed
// order, so results are deterministic and independent of the thread count.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "policy_loss_math.h"

namespace klear::cpu {

// GCC vectorises the clamps below only without trapping math; x86 builds additionally get an
// AVX2+FMA copy of each row kernel, picked at run time (the baseline build is SSE2 only).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#define KLEAR_X86_DISPATCH 1
#define KLEAR_AVX2 __attribute__((target("avx2,fma")))
inline bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

// exp(x) for x <= 0 (arguments below -87 give 0): Cody-Waite reduction + Cephes polynomial,
// plain arithmetic so that `omp simd` loops vectorise (libm's expf does not without -ffast-math).
#if defined(__GNUC__)
#define KLEAR_INLINE inline __attribute__((always_inline))
#else
#define KLEAR_INLINE inline
#endif

KLEAR_INLINE float exp_nonpos(float x_in) {
  const float x = x_in < -87.0f ? -87.0f : (x_in > 0.0f ? 0.0f : x_in);
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  float r = x - k * 0.693359375f;
  r = r + k * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x_in < -87.0f ? 0.0f : y * scale;   // exactly 0 below -87 (and for -inf)
}

// bfloat16 storage (layout of c10::BFloat16 / __nv_bfloat16). Its conversions are written out
// here because plain bit operations vectorise; c10's do not.
struct bf16_t {
  uint16_t bits;
};

template <typename T>
KLEAR_INLINE float to_float(T x) {
  return static_cast<float>(x);
}
KLEAR_INLINE float to_float(bf16_t x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
KLEAR_INLINE T from_float(float x) {
  return static_cast<T>(x);
}
template <>
KLEAR_INLINE bf16_t from_float<bf16_t>(float x) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return {static_cast<uint16_t>(x != x ? 0x7FC0u : rounded)};
}

// Row statistics of the temperature-scaled shard x = logits * inv_temp:
// out = {m = max x, d = sum exp(x - m), s = sum exp(x - m)(x - m), x[target] or 0}.
template <typename T>
KLEAR_INLINE void row_stats_body(const T* row, int64_t valid, int64_t target, float inv_temp,
                                 float* out) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < valid; ++j) {
    const float x = to_float(row[j]) * inv_temp;
    m = x > m ? x : m;
  }
  float d = 0.0f, s = 0.0f;
#pragma omp simd reduction(+ : d, s)
  for (int64_t j = 0; j < valid; ++j) {
    const float z = to_float(row[j]) * inv_temp - m;
    const float zc = z < -87.0f ? -87.0f : z;   // keeps e * z finite for -inf logits
    const float e = exp_nonpos(z);   // 0 below -87: -inf logits add nothing
    d += e;
    s += e * zc;
  }
  out[0] = m;
  out[1] = d;
  out[2] = s;
  out[3] = (target >= 0 && target < valid) ? to_float(row[target]) * inv_temp : 0.0f;
}

// d/dx_j of (g_logp * logp + g_ent * H) for one row, times inv_temp (x = logits * inv_temp):
// g_logp (onehot_j - p_j) - g_ent p_j (log p_j + H), p_j = exp(x_j - lse). Safe in place
// (grad == row): the target logit is read before the row is overwritten.
template <typename T, bool kEntropy>
KLEAR_INLINE void row_backward_body(const T* row, T* grad, int64_t vocab, int64_t valid,
                                    int64_t target, float inv_temp, float lse, float entropy,
                                    float g_logp, float g_ent) {
  const bool has_target = target >= 0 && target < valid;
  const float x_target = has_target ? to_float(row[target]) * inv_temp - lse : 0.0f;
#pragma omp simd
  for (int64_t j = 0; j < valid; ++j) {
    const float z = to_float(row[j]) * inv_temp - lse;
    const float p = exp_nonpos(z);
    float g = -g_logp * p;
    if constexpr (kEntropy) g -= g_ent * (p > 0.0f ? p * (z + entropy) : 0.0f);  // 0 log 0 = 0
    grad[j] = from_float<T>(g * inv_temp);
  }
  for (int64_t j = valid; j < vocab; ++j) grad[j] = from_float<T>(0.0f);
  if (has_target) {
    const float p = exp_nonpos(x_target);
    float g = g_logp * (1.0f - p);
    if constexpr (kEntropy) g -= g_ent * p * (x_target + entropy);
    grad[target] = from_float<T>(g * inv_temp);
  }
}

// Row kernels: the same body compiled for the baseline ISA and (x86) for AVX2+FMA.
#if KLEAR_X86_DISPATCH
template <typename T>
KLEAR_AVX2 void row_stats_avx2(const T* row, int64_t valid, int64_t target, float inv_temp,
                               float* out) {
  row_stats_body(row, valid, target, inv_temp, out);
}
template <typename T, bool kEntropy>
KLEAR_AVX2 void row_backward_avx2(const T* row, T* grad, int64_t vocab, int64_t valid,
                                  int64_t target, float inv_temp, float lse, float entropy,
                                  float g_logp, float g_ent) {
  row_backward_body<T, kEntropy>(row, grad, vocab, valid, target, inv_temp, lse, entropy, g_logp,
                                 g_ent);
}
#endif

template <typename T>
void row_stats(const T* row, int64_t valid, int64_t target, float inv_temp, float* out) {
#if KLEAR_X86_DISPATCH
  if (cpu_has_avx2()) return row_stats_avx2(row, valid, target, inv_temp, out);
#endif
  row_stats_body(row, valid, target, inv_temp, out);
}

template <typename T, bool kEntropy>
void row_backward(const T* row, T* grad, int64_t vocab, int64_t valid, int64_t target,
                  float inv_temp, float lse, float entropy, float g_logp, float g_ent) {
#if KLEAR_X86_DISPATCH
  if (cpu_has_avx2())
    return row_backward_avx2<T, kEntropy>(row, grad, vocab, valid, target, inv_temp, lse,
                                          entropy, g_logp, g_ent);
#endif
  row_backward_body<T, kEntropy>(row, grad, vocab, valid, target, inv_temp, lse, entropy, g_logp,
                                 g_ent);
}

template <typename T>
void logprob_stats(const T* logits, int64_t rows, int64_t vocab, const int64_t* target_local,
                   int64_t valid, float inv_temp, float* stats) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i)
    row_stats(logits + i * vocab, valid, target_local[i], inv_temp, stats + 4 * i);
}

template <typename T>
void logprob_backward(const T* logits, T* grad, int64_t rows, int64_t vocab,
                      const int64_t* target_local, int64_t valid, float inv_temp,
                      const float* lse, const float* entropy, const float* g_logp,
                      const float* g_ent) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = logits + i * vocab;
    T* out = grad + i * vocab;
    if (g_ent != nullptr)
      row_backward<T, true>(row, out, vocab, valid, target_local[i], inv_temp, lse[i],
                            entropy[i], g_logp[i], g_ent[i]);
    else
      row_backward<T, false>(row, out, vocab, valid, target_local[i], inv_temp, lse[i], 0.0f,
                             g_logp[i], 0.0f);
  }
}

inline void token_policy_loss(const float* logp, const float* old_logp, const float* adv,
                              int64_t n, const TokenLossParams& params, float* loss, float* dlogp,
                              float* ratio) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const TokenLoss t = klear::token_policy_loss(logp[i], old_logp[i], adv[i], params);
    loss[i] = t.loss;
    dlogp[i] = t.dlogp;
    ratio[i] = t.ratio;
  }
}

}  // namespace klear::cpu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
