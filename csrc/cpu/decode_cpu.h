// The embedded rollout server's decode kernels (megatron_klear/rollout/engine/qwen3_decode.py), where
// a tiny model's step is per-op overhead in torch.
//
// rms_norm (rms_norm_cpu.h): Qwen3RMSNorm of each row (fp32).
//
// qk_norm_rope: Qwen3's per-head RMSNorm of the queries or keys followed by the rotary
// embedding (transformers' q_norm/k_norm and apply_rotary_pos_emb, non-interleaved halves), one
// pass per row and head instead of about twenty ops per layer.
//
// decode_attention: each row's one new query token against its KV cache, grouped-query, with an
// fp32 softmax over an additive padding mask, as transformers' eager attention computes it. In
// torch that is two batched matmuls of (rows x KV heads) tiny matrices plus mask, scale and
// softmax ops, all per-matrix and per-op overhead at decode sizes. Here each (row, KV head) is
// one pass over its keys, which the cache keeps transposed ([dim, positions]) so that both
// products run along contiguous memory without horizontal sums. Shares the exp and the run-time
// ISA choice of the loss kernels (vocab_logprobs_cpu.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/rms_norm_cpu.h"
#include "cpu/vocab_logprobs_cpu.h"

namespace klear::cpu {

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#endif

// Sizes and strides (in floats) of the query [rows, heads, dim], the transposed keys
// [rows, kv_heads, dim, capacity], the values [rows, kv_heads, capacity, dim] and the additive
// mask [rows, capacity], of which the first `keys` positions are attended; the last dimension
// of each has unit stride, and the key rows are contiguous (k_dim == capacity), so a block of
// positions may be read up to the capacity.
struct DecodeLayout {
  int64_t rows, heads, kv_heads, keys, dim;
  int64_t q_row, q_head;
  int64_t k_row, k_head, k_dim;
  int64_t v_row, v_head, v_key;
  int64_t bias_row;
};

// Columns per register block: the fixed-width inner loops below keep their accumulators in
// vector registers (one AVX-512 or two AVX2 registers).
constexpr int64_t kDecodeBlock = 16;

// acc[t] = sum_i w[i] * rows[i * stride + t] for t < width (at most kDecodeBlock): four
// independent accumulator sets, so the adds of consecutive rows do not wait on each other.
// `readable`: the rows hold kDecodeBlock readable floats (those past width are ignored).
KLEAR_INLINE void weighted_rows(const float* w, int64_t n, const float* rows, int64_t stride,
                                int64_t width, bool readable, float* acc) {
  float a[4][kDecodeBlock] = {};
  if (readable) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
      for (int64_t u = 0; u < 4; ++u) {
        const float wi = w[i + u];
        const float* row = rows + (i + u) * stride;
#pragma omp simd
        for (int64_t t = 0; t < kDecodeBlock; ++t) a[u][t] += wi * row[t];
      }
    for (; i < n; ++i) {
      const float wi = w[i];
      const float* row = rows + i * stride;
#pragma omp simd
      for (int64_t t = 0; t < kDecodeBlock; ++t) a[0][t] += wi * row[t];
    }
  } else {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t t = 0; t < width; ++t) a[0][t] += w[i] * rows[i * stride + t];
  }
  for (int64_t t = 0; t < width; ++t) acc[t] = (a[0][t] + a[1][t]) + (a[2][t] + a[3][t]);
}

// The `rep` query heads of one KV head of one row: s = (q . k) * scale + bias, p = softmax(s)
// (max-subtracted, normalised before the weighted sum, as transformers), out = p @ v.
// `scores` holds keys floats.
KLEAR_INLINE void decode_group_body(const float* q, int64_t q_head, const float* kt,
                                    int64_t k_dim, const float* v, int64_t v_key,
                                    const float* bias, int64_t keys, int64_t dim, int64_t rep,
                                    float scale, float* scores, float* out) {
  for (int64_t r = 0; r < rep; ++r) {
    const float* qr = q + r * q_head;
    for (int64_t l = 0; l < keys; l += kDecodeBlock) {   // q . k for a block of positions
      const int64_t width = keys - l < kDecodeBlock ? keys - l : kDecodeBlock;
      weighted_rows(qr, dim, kt + l, k_dim, width, l + kDecodeBlock <= k_dim, scores + l);
    }
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t l = 0; l < keys; ++l) {
      scores[l] = scores[l] * scale + bias[l];
      top = scores[l] > top ? scores[l] : top;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < keys; ++l) {
      scores[l] = exp_nonpos(scores[l] - top);
      sum += scores[l];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t l = 0; l < keys; ++l) scores[l] *= inv;
    float* o = out + r * dim;
    for (int64_t j = 0; j < dim; j += kDecodeBlock) {    // p @ v for a block of dimensions
      const int64_t width = dim - j < kDecodeBlock ? dim - j : kDecodeBlock;
      weighted_rows(scores, keys, v + j, v_key, width, width == kDecodeBlock, o + j);
    }
  }
}

#if KLEAR_X86_DISPATCH
#define KLEAR_DECODE_KERNEL(isa, attr)                                                            \
  attr void decode_group_##isa(const float* q, int64_t q_head, const float* kt, int64_t k_dim,   \
                               const float* v, int64_t v_key, const float* bias, int64_t keys,    \
                               int64_t dim, int64_t rep, float scale, float* scores,              \
                               float* out) {                                                      \
    decode_group_body(q, q_head, kt, k_dim, v, v_key, bias, keys, dim, rep, scale, scores, out);  \
  }
KLEAR_DECODE_KERNEL(avx2, KLEAR_AVX2)
KLEAR_DECODE_KERNEL(avx512, KLEAR_AVX512)
#undef KLEAR_DECODE_KERNEL
#endif

inline void decode_group(const float* q, int64_t q_head, const float* kt, int64_t k_dim,
                         const float* v, int64_t v_key, const float* bias, int64_t keys,
                         int64_t dim, int64_t rep, float scale, float* scores, float* out) {
#if KLEAR_X86_DISPATCH
  if (cpu_isa() >= Isa::kAvx512)
    return decode_group_avx512(q, q_head, kt, k_dim, v, v_key, bias, keys, dim, rep, scale,
                               scores, out);
  if (cpu_isa() == Isa::kAvx2)
    return decode_group_avx2(q, q_head, kt, k_dim, v, v_key, bias, keys, dim, rep, scale,
                             scores, out);
#endif
  decode_group_body(q, q_head, kt, k_dim, v, v_key, bias, keys, dim, rep, scale, scores, out);
}

// out [rows, heads * dim], contiguous.
inline void decode_attention(const float* q, const float* kt, const float* v, const float* bias,
                             const DecodeLayout& s, float scale, float* out) {
  const int64_t rep = s.heads / s.kv_heads;
#pragma omp parallel
  {
    std::vector<float> scores(s.keys);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < s.rows * s.kv_heads; ++i) {
      const int64_t b = i / s.kv_heads, g = i % s.kv_heads;
      decode_group(q + b * s.q_row + g * rep * s.q_head, s.q_head,
                   kt + b * s.k_row + g * s.k_head, s.k_dim, v + b * s.v_row + g * s.v_head,
                   s.v_key, bias + b * s.bias_row, s.keys, s.dim, rep, scale, scores.data(),
                   out + (b * s.heads + g * rep) * s.dim);
    }
  }
}

// out[row, head] = rope(rmsnorm(x[row, head]) * weight) with the row's cos/sin [dim]:
// n = x / sqrt(mean(x^2) + eps) * weight; out[j] = n[j] cos[j] - n[j + h] sin[j] (j < h),
// n[j] cos[j] + n[j - h] sin[j] (j >= h), h = dim / 2. x rows `x_row` apart, heads `x_head`
// apart; out contiguous [rows, heads, dim].
KLEAR_INLINE void norm_rope_head(const float* x, const float* weight, const float* cos,
                                 const float* sin, int64_t dim, float eps, float* n,
                                 float* out) {
  rms_norm_row(x, weight, dim, eps, n);
  const int64_t h = dim / 2;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) out[j] = n[j] * cos[j] - n[j + h] * sin[j];
#pragma omp simd
  for (int64_t j = h; j < dim; ++j) out[j] = n[j] * cos[j] + n[j - h] * sin[j];
}

#if KLEAR_X86_DISPATCH
#define KLEAR_NORM_ROPE_KERNEL(isa, attr)                                                         \
  attr void norm_rope_head_##isa(const float* x, const float* weight, const float* cos,          \
                                 const float* sin, int64_t dim, float eps, float* n,             \
                                 float* out) {                                                    \
    norm_rope_head(x, weight, cos, sin, dim, eps, n, out);                                        \
  }
KLEAR_NORM_ROPE_KERNEL(avx2, KLEAR_AVX2)
KLEAR_NORM_ROPE_KERNEL(avx512, KLEAR_AVX512)
#undef KLEAR_NORM_ROPE_KERNEL
#endif

inline void qk_norm_rope(const float* x, int64_t x_row, int64_t x_head, const float* weight,
                         const float* cos, const float* sin, int64_t trig_row, int64_t rows,
                         int64_t heads, int64_t dim, float eps, float* out) {
#pragma omp parallel
  {
    std::vector<float> n(dim);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * heads; ++i) {
      const int64_t row = i / heads, head = i % heads;
      const float* xi = x + row * x_row + head * x_head;
      const float *c = cos + row * trig_row, *s = sin + row * trig_row;
      KLEAR_ISA_CALL(norm_rope_head, xi, weight, c, s, dim, eps, n.data(), out + i * dim);
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

}  // namespace klear::cpu
