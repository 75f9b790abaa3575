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
#include <cstdlib>
#include <cstring>
#include <type_traits>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include "policy_loss_math.h"

namespace klear::cpu {

// GCC vectorises the clamps below only without trapping math; x86 builds additionally get
// AVX2+FMA and AVX-512 (512-bit vectors) copies of each row kernel, the best one picked at run
// time (the baseline build is SSE2 only). bf16 rows on CPUs with AVX-512 BF16 (Zen 4, Sapphire
// Rapids) use the hand-written kernels of namespace avx512 instead (half the cost per logit).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#define KLEAR_X86_DISPATCH 1
#define KLEAR_AVX2 __attribute__((target("avx2,fma")))
#define KLEAR_AVX512 __attribute__((target("arch=x86-64-v4")))
#define KLEAR_AVX512_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))
enum class Isa { kBase, kAvx2, kAvx512, kAvx512Bf16 };   // each level includes the previous
constexpr const char* kIsaNames[] = {"base", "avx2", "avx512", "avx512bf16"};
constexpr const char* kIsaVariable = "KLEAR_CPU_ISA";
// The best copy this CPU runs, capped by the environment variable KLEAR_CPU_ISA (one of
// kIsaNames) so that tests run every copy on one machine. An unknown value is ignored here; the
// extension rejects it when it is imported (csrc/binding.cpp).
inline Isa detect_isa() {
  Isa isa = Isa::kBase;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    isa = __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
  if (const char* cap = std::getenv(kIsaVariable))
    for (int i = 0; i < static_cast<int>(isa); ++i)
      if (std::strcmp(cap, kIsaNames[i]) == 0) isa = static_cast<Isa>(i);
  return isa;
}
inline Isa cpu_isa() {
  static const Isa isa = detect_isa();
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

// Elements per block of the row statistics (below).
constexpr int64_t kBlock = 2048;

// The running row statistics of both stats kernels (generic and AVX-512 BF16): m = max x so far,
// d = sum exp(x - m), s = sum exp(x - m)(x - m), the sums in fp64.
struct RunningStats {
  float m = -INFINITY;
  double d = 0.0, s = 0.0;

  // Move to a block maximum `top` if it is larger: rescale d and s from the old max to it.
  KLEAR_INLINE void raise_max(float top) {
    if (!(top > m)) return;  // also keeps m when top is NaN
    if (d > 0.0) {
      const double sc = std::exp(static_cast<double>(m) - top);
      s = sc * (s + d * (static_cast<double>(m) - top));
      d *= sc;
    }
    m = top;
  }

  // out = {m, d, s, x[target] or 0}, the layout the loss and the backward read.
  template <typename T>
  KLEAR_INLINE void store(const T* row, int64_t valid, int64_t target, float inv_temp,
                          float* out) const {
    out[0] = m;
    out[1] = static_cast<float>(d);
    out[2] = static_cast<float>(s);
    out[3] = (target >= 0 && target < valid) ? to_float(row[target]) * inv_temp : 0.0f;
  }
};

#if KLEAR_X86_DISPATCH
// bf16 rows on AVX-512: intrinsics (the generic bodies below stay for the other types and ISAs).
// 32 bf16 are loaded as 16 dwords: lane i holds elements 2i (low half) and 2i + 1 (high half),
// so `even` (shift left) and `odd` (mask) are fp32 vectors without any cross-lane shuffle; the
// sums do not care about the order, and the backward writes both halves back in place.
// GCC 12 flags the intrinsics' own _mm512_undefined_* as maybe-uninitialized (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {

constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;

KLEAR_AVX512 KLEAR_INLINE __m512 even(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
KLEAR_AVX512 KLEAR_INLINE __m512 odd(__m512i v) {
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  return _mm512_castsi512_ps(_mm512_and_si512(v, high_halves));
}
// The 32 bf16 at p, of which the first `left` are in the row (-inf fills the rest at a row's
// tail; masked-off lanes are neither read nor faulted on).
KLEAR_AVX512 KLEAR_INLINE __m512i load32(const bf16_t* p, int64_t left) {
  if (left >= 32) return _mm512_loadu_si512(p);
  const __mmask32 k = static_cast<__mmask32>((1ull << left) - 1);
  return _mm512_mask_loadu_epi16(_mm512_set1_epi16(static_cast<short>(0xFF80)), k, p);
}

// 2^y for y <= 0 already clamped (finite or NaN): y = n + f with n = round(y), f in [-1/2, 1/2];
// 2^f by a degree-5 polynomial with p(0) = 1 (relative error 9e-8 + rounding: <= 2 fp32 ulps,
// 0.7 on average), times 2^n with vscalefps (subnormal or 0 below 2^-126, no exponent bits).
struct Exp2 {
  __m512 p, n;   // 2^y = p 2^n
};
KLEAR_AVX512 KLEAR_INLINE Exp2 exp2_split(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.326472615e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671512991e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550733581e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402224243e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470037e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return {p, n};
}

// Sums of one vector of logits x: d += 2^y, s += 2^y y with y = (x inv_temp - m) log2 e clamped
// at -126 (as the generic kernel's -87.33: -inf logits add ~1e-38 to d and a finite term to s).
KLEAR_AVX512 KLEAR_INLINE void stats_step(__m512 x, __m512 inv_temp, __m512 m, __m512* d,
                                          __m512* s) {
  const __m512 z = _mm512_fmsub_ps(x, inv_temp, m);
  const __m512 y = _mm512_max_ps(_mm512_set1_ps(-126.0f),   // max(c, NaN) = NaN
                                  _mm512_mul_ps(z, _mm512_set1_ps(kLog2e)));
  const Exp2 r = exp2_split(y);
  const __m512 e = _mm512_scalef_ps(r.p, r.n);
  *d = _mm512_add_ps(*d, e);
  *s = _mm512_fmadd_ps(e, y, *s);
}

KLEAR_AVX512 KLEAR_INLINE double sum_lanes(__m512 v) {   // fixed order, in fp64
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m512d hi = _mm512_cvtps_pd(upper);
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

// row_stats_body for bf16: per block, the block max, at most one rescale, then the exp sums
// (each lane sums kBlock / 32 terms per accumulator in fp32, blocks add up in fp64).
KLEAR_AVX512 inline void row_stats_bf16(const bf16_t* row, int64_t valid, int64_t target,
                                        float inv_temp, float* out) {
  RunningStats st;
  const __m512 vt = _mm512_set1_ps(inv_temp);
  for (int64_t begin = 0; begin < valid; begin += kBlock) {
    const bf16_t* block = row + begin;
    const int64_t n = valid - begin < kBlock ? valid - begin : kBlock;
    __m512 top0 = _mm512_set1_ps(-INFINITY), top1 = top0;
    for (int64_t j = 0; j < n; j += 32) {
      const __m512i v = load32(block + j, n - j);
      top0 = _mm512_max_ps(top0, even(v));
      top1 = _mm512_max_ps(top1, odd(v));
    }
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(top0, top1)) * inv_temp;
    st.raise_max(top);
    if (st.m == -INFINITY) continue;  // nothing but -inf logits so far
    const __m512 vm = _mm512_set1_ps(st.m);
    __m512 d0 = _mm512_setzero_ps(), d1 = d0, s0 = d0, s1 = d0;
    for (int64_t j = 0; j < n; j += 32) {
      const __m512i v = load32(block + j, n - j);
      stats_step(even(v), vt, vm, &d0, &s0);
      stats_step(odd(v), vt, vm, &d1, &s1);
    }
    st.d += sum_lanes(_mm512_add_ps(d0, d1));
    st.s += sum_lanes(_mm512_add_ps(s0, s1)) * static_cast<double>(kLn2);
  }
  st.store(row, valid, target, inv_temp, out);
}

// Gradient of one vector (see row_backward_body): 2^y (a + b y) with y = x c + c0 = (x inv_temp -
// lse) log2 e clamped at -200 (b = b_nat ln 2), so -inf logits give exactly 0; NaN propagates.
KLEAR_AVX512 KLEAR_INLINE __m512 backward_step(__m512 x, __m512 c, __m512 c0, __m512 a,
                                               __m512 b) {
  const __m512 y = _mm512_max_ps(_mm512_set1_ps(-200.0f), _mm512_fmadd_ps(x, c, c0));
  const Exp2 r = exp2_split(y);
  return _mm512_scalef_ps(_mm512_mul_ps(r.p, _mm512_fmadd_ps(b, y, a)), r.n);
}

// The bf16 words of `even` and `odd` back in row order: vcvtne2ps2bf16 rounds to nearest even
// (NaN stays NaN; gradients below 2^-126 in magnitude flush to 0: the generic kernel zeroes every
// element whose probability is below 2^-126), vpermw interleaves its two halves.
KLEAR_AVX512_BF16 KLEAR_INLINE __m512i pack_bf16(__m512 even_f, __m512 odd_f) {
  const __m512i words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd_f, even_f));
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  return _mm512_permutexvar_epi16(order, words);
}

KLEAR_AVX512_BF16 inline void row_backward_bf16(const bf16_t* row, bf16_t* grad, int64_t vocab,
                                                int64_t valid, int64_t target, float inv_temp,
                                                float lse, float entropy, float g_logp,
                                                float g_ent) {
  const bool has_target = target >= 0 && target < valid;
  const float x_target = has_target ? to_float(row[target]) * inv_temp - lse : 0.0f;
  const __m512 c = _mm512_set1_ps(inv_temp * kLog2e), c0 = _mm512_set1_ps(-lse * kLog2e);
  const __m512 a = _mm512_set1_ps((-g_logp - g_ent * entropy) * inv_temp);
  const __m512 b = _mm512_set1_ps(-g_ent * inv_temp * kLn2);
  for (int64_t j = 0; j < valid; j += 32) {
    const __m512i v = load32(row + j, valid - j);
    const __m512i w = pack_bf16(backward_step(even(v), c, c0, a, b),
                                backward_step(odd(v), c, c0, a, b));
    if (valid - j >= 32) {
      _mm512_storeu_si512(grad + j, w);
    } else {
      _mm512_mask_storeu_epi16(grad + j, static_cast<__mmask32>((1ull << (valid - j)) - 1), w);
    }
  }
  if (vocab > valid)
    std::memset(static_cast<void*>(grad + valid), 0, (vocab - valid) * sizeof(bf16_t));
  if (has_target) {
    const float p = exp_nonpos(x_target);
    const float g = g_logp * (1.0f - p) - g_ent * p * (x_target + entropy);
    grad[target] = from_float<bf16_t>(g * inv_temp);
  }
}

}  // namespace avx512
#pragma GCC diagnostic pop
#endif

// Row statistics of the temperature-scaled shard x = logits * inv_temp:
// out = {m = max x, d = sum exp(x - m), s = sum exp(x - m)(x - m), x[target] or 0}.
// One pass over blocks of kBlock elements: the block's max, at most one rescale of the running
// sums, then its exp sums (the block is re-read from L1). Sums are blocked for accuracy: each
// SIMD lane sums kBlock / lanes terms in fp32, blocks add up in fp64.
template <typename T>
KLEAR_INLINE void row_stats_body(const T* row, int64_t valid, int64_t target, float inv_temp,
                                 float* out) {
  RunningStats st;
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
    st.raise_max(top);
    if (st.m == -INFINITY) continue;  // nothing but -inf logits so far
    float bd = 0.0f, bs = 0.0f;
#pragma omp simd reduction(+ : bd, bs)
    for (int64_t j = 0; j < n; ++j) {
      const float z = to_float(block[j]) * inv_temp - st.m;
      const float e = exp_nonpos<false>(z);     // ~1e-38 for -inf logits
      bd += e;
      bs += e * (z < -87.33f ? -87.33f : z);    // keeps 0 * z finite for -inf logits
    }
    st.d += bd;
    st.s += bs;
  }
  st.store(row, valid, target, inv_temp, out);
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
  if constexpr (std::is_same_v<T, bf16_t>)
    if (cpu_isa() == Isa::kAvx512Bf16)
      return avx512::row_stats_bf16(row, valid, target, inv_temp, out);
  if (cpu_isa() >= Isa::kAvx512) return row_stats_avx512(row, valid, target, inv_temp, out);
  if (cpu_isa() == Isa::kAvx2) return row_stats_avx2(row, valid, target, inv_temp, out);
#endif
  row_stats_body(row, valid, target, inv_temp, out);
}

template <typename T>
void row_backward(const T* row, T* grad, int64_t vocab, int64_t valid, int64_t target,
                  float inv_temp, float lse, float entropy, float g_logp, float g_ent) {
#if KLEAR_X86_DISPATCH
  if constexpr (std::is_same_v<T, bf16_t>)
    if (cpu_isa() == Isa::kAvx512Bf16)
      return avx512::row_backward_bf16(row, grad, vocab, valid, target, inv_temp, lse, entropy,
                                       g_logp, g_ent);
  if (cpu_isa() >= Isa::kAvx512)
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
