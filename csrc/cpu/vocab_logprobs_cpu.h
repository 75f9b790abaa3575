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

// GCC vectorises the clamps below only without trapping math; x86 builds additionally get
// AVX2+FMA and AVX-512 (512-bit vectors) copies of each row kernel, the best one picked at run
// time (the baseline build is SSE2 only).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#define KLEAR_X86_DISPATCH 1
#define KLEAR_AVX2 __attribute__((target("avx2,fma")))
#define KLEAR_AVX512 \
  __attribute__((target("arch=x86-64-v4")))
enum class Isa { kBase, kAvx2, kAvx512 };
inline Isa cpu_isa() {
  static const Isa isa = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512vl") &&
                                 __builtin_cpu_supports("avx512dq")
                             ? Isa::kAvx512
                         : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                             ? Isa::kAvx2
                             : Isa::kBase;
  return isa;
}
#endif

#if defined(__GNUC__)
#define KLEAR_INLINE inline __attribute__((always_inline))
#else
#define KLEAR_INLINE inline
#endif

// exp(z) for z <= 0: 2^(z log2 e) split into 2^round * 2^frac, Cephes' exp2f polynomial for
// 2^frac on [-1/2, 1/2] (~1e-7 relative), the power of two through the exponent bits. Below
// -87.33 (-inf included) it returns exactly 0 if kExactZero, else ~1e-38 (one select less: the
// row sums do not see the difference). Plain arithmetic, so `omp simd` loops vectorise it
// (libm's expf does not vectorise without -ffast-math).
template <bool kExactZero = true>
KLEAR_INLINE float exp_nonpos(float z) {
  const float y = (z < -87.33f ? -87.33f : z) * 1.44269504088896341f;   // in [-126, 0]
  const float n = (y + 12582912.0f) - 12582912.0f;                       // round(y)
  const float f = y - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return kExactZero && z < -87.33f ? 0.0f : p * scale;
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
// One pass over blocks of kBlock elements: the block's max, at most one rescale of the running
// sums, then its exp sums (the block is re-read from L1). Sums are blocked for accuracy: each
// SIMD lane sums kBlock / lanes terms in fp32, blocks add up in fp64.
constexpr int64_t kBlock = 2048;

template <typename T>
KLEAR_INLINE void row_stats_body(const T* row, int64_t valid, int64_t target, float inv_temp,
                                 float* out) {
  float m = -INFINITY;
  double d = 0.0, s = 0.0;
  for (int64_t begin = 0; begin < valid; begin += kBlock) {
    const T* block = row + begin;
    const int64_t n = valid - begin < kBlock ? valid - begin : kBlock;
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < n; ++j) {
      const float x = to_float(block[j]);
      top = x > top ? x : top;
    }
    top *= inv_temp;   // inv_temp > 0: the max of the scaled block
    if (top > m) {
      if (d > 0.0) {
        const double sc = std::exp(static_cast<double>(m) - top);
        s = sc * (s + d * (static_cast<double>(m) - top));
        d *= sc;
      }
      m = top;
    }
    if (m == -INFINITY) continue;  // nothing but -inf logits so far
    float bd = 0.0f, bs = 0.0f;
#pragma omp simd reduction(+ : bd, bs)
    for (int64_t j = 0; j < n; ++j) {
      const float z = to_float(block[j]) * inv_temp - m;
      const float e = exp_nonpos<false>(z);     // ~1e-38 for -inf logits
      bd += e;
      bs += e * (z < -87.33f ? -87.33f : z);    // keeps 0 * z finite for -inf logits
    }
    d += bd;
    s += bs;
  }
  out[0] = m;
  out[1] = static_cast<float>(d);
  out[2] = static_cast<float>(s);
  out[3] = (target >= 0 && target < valid) ? to_float(row[target]) * inv_temp : 0.0f;
}

// d/dx_j of (g_logp * logp + g_ent * H) for one row, times inv_temp (x = logits * inv_temp):
// g_logp (onehot_j - p_j) - g_ent p_j (log p_j + H), p_j = exp(x_j - lse), written as
// p_j (a + b z_j) with z_j = log p_j clamped at -87.33 (0 log 0 = 0 for -inf logits).
// Safe in place (grad == row): the target logit is read before the row is overwritten.
template <typename T>
KLEAR_INLINE void row_backward_body(const T* row, T* grad, int64_t vocab, int64_t valid,
                                    int64_t target, float inv_temp, float lse, float entropy,
                                    float g_logp, float g_ent) {
  const bool has_target = target >= 0 && target < valid;
  const float x_target = has_target ? to_float(row[target]) * inv_temp - lse : 0.0f;
  const float a = (-g_logp - g_ent * entropy) * inv_temp, b = -g_ent * inv_temp;
#pragma omp simd
  for (int64_t j = 0; j < valid; ++j) {
    const float z = to_float(row[j]) * inv_temp - lse;
    const float zc = z < -87.33f ? -87.33f : z;
    grad[j] = from_float<T>(exp_nonpos(z) * (a + b * zc));
  }
  for (int64_t j = valid; j < vocab; ++j) grad[j] = from_float<T>(0.0f);
  if (has_target) {
    const float p = exp_nonpos(x_target);
    const float g = g_logp * (1.0f - p) - g_ent * p * (x_target + entropy);
    grad[target] = from_float<T>(g * inv_temp);
  }
}

// Row kernels: the same body compiled for the baseline ISA and (x86) for AVX2+FMA and AVX-512.
#if KLEAR_X86_DISPATCH
#define KLEAR_ROW_KERNELS(isa, attr)                                                              \
  template <typename T>                                                                           \
  attr void row_stats_##isa(const T* row, int64_t valid, int64_t target, float inv_temp,          \
                            float* out) {                                                         \
    row_stats_body(row, valid, target, inv_temp, out);                                            \
  }                                                                                               \
  template <typename T>                                                                           \
  attr void row_backward_##isa(const T* row, T* grad, int64_t vocab, int64_t valid,               \
                               int64_t target, float inv_temp, float lse, float entropy,          \
                               float g_logp, float g_ent) {                                       \
    row_backward_body(row, grad, vocab, valid, target, inv_temp, lse, entropy, g_logp, g_ent);    \
  }
KLEAR_ROW_KERNELS(avx2, KLEAR_AVX2)
KLEAR_ROW_KERNELS(avx512, KLEAR_AVX512)
#undef KLEAR_ROW_KERNELS
#endif

template <typename T>
void row_stats(const T* row, int64_t valid, int64_t target, float inv_temp, float* out) {
#if KLEAR_X86_DISPATCH
  if (cpu_isa() == Isa::kAvx512) return row_stats_avx512(row, valid, target, inv_temp, out);
  if (cpu_isa() == Isa::kAvx2) return row_stats_avx2(row, valid, target, inv_temp, out);
#endif
  row_stats_body(row, valid, target, inv_temp, out);
}

template <typename T>
void row_backward(const T* row, T* grad, int64_t vocab, int64_t valid, int64_t target,
                  float inv_temp, float lse, float entropy, float g_logp, float g_ent) {
#if KLEAR_X86_DISPATCH
  if (cpu_isa() == Isa::kAvx512)
    return row_backward_avx512(row, grad, vocab, valid, target, inv_temp, lse, entropy, g_logp,
                               g_ent);
  if (cpu_isa() == Isa::kAvx2)
    return row_backward_avx2(row, grad, vocab, valid, target, inv_temp, lse, entropy, g_logp,
                             g_ent);
#endif
  row_backward_body(row, grad, vocab, valid, target, inv_temp, lse, entropy, g_logp, g_ent);
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
  for (int64_t i = 0; i < rows; ++i)   // no entropy gradient: g_ent = 0 (entropy unused)
    row_backward(logits + i * vocab, grad + i * vocab, vocab, valid, target_local[i], inv_temp,
                 lse[i], g_ent ? entropy[i] : 0.0f, g_logp[i], g_ent ? g_ent[i] : 0.0f);
}

// entropy / old_entropy may be null when ERC is off (params.erc_high <= 0).
inline void token_policy_loss(const float* logp, const float* old_logp, const float* adv,
                              const float* entropy, const float* old_entropy, int64_t n,
                              const TokenLossParams& params, float* loss, float* dlogp,
                              float* ratio) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const TokenLoss t = klear::token_policy_loss(logp[i], old_logp[i], adv[i],
                                                 entropy ? entropy[i] : 0.0f,
                                                 old_entropy ? old_entropy[i] : 0.0f, params);
    loss[i] = t.loss;
    dlogp[i] = t.dlogp;
    ratio[i] = t.ratio;
  }
}

}  // namespace klear::cpu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
