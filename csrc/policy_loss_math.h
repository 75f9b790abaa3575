// Per-token policy-loss math shared by the CPU kernels and the CUDA kernels.
//
// Plain C++ (no torch, no CUDA headers): compiled by the host compiler for the CPU extension and
// by nvcc (__host__ __device__) for the CUDA kernels, so both backends run literally the same
// per-token code. The pure-torch specification is megatron_klear/algo/losses.py.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define KLEAR_HD __host__ __device__ __forceinline__
#else
#define KLEAR_HD inline
#endif

namespace klear {

enum LossType : int { kPPO = 0, kGPPO = 1, kCISPO = 2 };

struct TokenLossParams {
  int type;          // LossType
  float eps_low;     // clip below 1 - eps_low
  float eps_high;    // clip above 1 + eps_high
  float beta1;       // GPPO gradient scale of the low case
  float beta2;       // GPPO gradient scale of the high case
  float dual_clip;   // c > 1 enables the dual clip; <= 0 disables it
};

struct TokenLoss {
  float loss;    // per-token loss value
  float dlogp;   // d loss / d logp
  float ratio;   // exp(logp - old_logp)
};

// One token of the GPPO table (docs/ARCHITECTURE.md); PPO zeroes the clipped gradients,
// CISPO is -sg(clip(r)) * A * logp.
KLEAR_HD TokenLoss token_policy_loss(float logp, float old_logp, float adv,
                                     const TokenLossParams& p) {
  const float r = expf(logp - old_logp);
  if (p.type == kCISPO) {
    const float w = fminf(fmaxf(r, 1.0f - p.eps_low), 1.0f + p.eps_high);
    return {-w * adv * logp, -w * adv, r};
  }
  if (p.dual_clip > 0.0f && adv < 0.0f && r > p.dual_clip) return {-p.dual_clip * adv, 0.0f, r};
  const bool low = adv < 0.0f && r < 1.0f - p.eps_low;
  const bool high = adv > 0.0f && r > 1.0f + p.eps_high;
  if (!(low || high)) return {-r * adv, -r * adv, r};
  const float bound = low ? 1.0f - p.eps_low : 1.0f + p.eps_high;
  if (p.type == kPPO) return {-bound * adv, 0.0f, r};
  const float beta = low ? p.beta1 : p.beta2;
  return {-beta * bound * adv, -beta * bound * adv, r};
}

}  // namespace klear
