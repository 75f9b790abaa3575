// Per-token policy-loss math shared by the CPU kernels and the CUDA kernels.
//
// Plain C++ (no torch, no CUDA headers): compiled by the host compiler for the CPU extension and
// by nvcc (__host__ __device__) for the CUDA kernels, so both backends run literally the same
// per-token code. The pure-torch specification is megatron_klear/ops/loss_math.py.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define KLEAR_HD __host__ __device__ __forceinline__
#else
#define KLEAR_HD inline
#endif

namespace klear {

// ERC's code clamps log r to [-20, 20] before exp (ops/loss_math.py ERC_MAX_LOG_RATIO).
constexpr float kErcMaxLogRatio = 20.0f;

enum LossType : int { kPPO = 0, kGPPO = 1, kCISPO = 2 };

struct TokenLossParams {
  int type;          // LossType
  float eps_low;     // clip below 1 - eps_low
  float eps_high;    // clip above 1 + eps_high
  float beta1;       // GPPO scale (value and gradient) of the low case
  float beta2;       // GPPO scale (value and gradient) of the high case
  float dual_clip;   // c > 1 caps the loss of A < 0 tokens at -c A; <= 0 disables it
  float erc_low;     // ERC keeps the gradient where erc_low < rho < erc_high (1 -/+ delta or
  float erc_high;    // free bounds, rounded from double); erc_high <= 0 disables ERC
};

struct TokenLoss {
  float loss;    // per-token loss value
  float dlogp;   // d loss / d logp
  float ratio;   // exp(logp - old_logp)
};

// ERC (arXiv 2512.05591): does the token keep its gradient? rho = (H + 1e-8) / (H_old + 1e-8).
KLEAR_HD bool entropy_ratio_kept(float entropy, float old_entropy, const TokenLossParams& p) {
  const float rho = (entropy + 1e-8f) / (old_entropy + 1e-8f);
  return rho > p.erc_low && rho < p.erc_high;
}

// The surrogate of one token (GPPO table of docs/ARCHITECTURE.md, before the dual clip): PPO
// zeroes the clipped gradients, CISPO is -sg(clip(r)) * A * logp.
KLEAR_HD TokenLoss token_surrogate(float logp, float r, float adv, const TokenLossParams& p) {
  if (p.type == kCISPO) {
    const float w = fminf(fmaxf(r, 1.0f - p.eps_low), 1.0f + p.eps_high);
    return {-w * adv * logp, -w * adv, r};
  }
  const bool low = adv < 0.0f && r < 1.0f - p.eps_low;
  const bool high = adv > 0.0f && r > 1.0f + p.eps_high;
  if (!(low || high)) return {-r * adv, -r * adv, r};
  const float bound = low ? 1.0f - p.eps_low : 1.0f + p.eps_high;
  if (p.type == kPPO) return {-bound * adv, 0.0f, r};
  const float beta = low ? p.beta1 : p.beta2;
  return {-beta * bound * adv, -beta * bound * adv, r};
}

// One token: the surrogate, the dual clip min(-c A, loss) for A < 0 (constant where it caps),
// then ERC's gradient mask m l + (1 - m) sg(l) (entropies only read when ERC is on). With ERC
// log r is clamped to [-20, 20] first; the clamp passes no gradient to r outside that range
// (CISPO's gradient does not go through r).
KLEAR_HD TokenLoss token_policy_loss(float logp, float old_logp, float adv, float entropy,
                                     float old_entropy, const TokenLossParams& p) {
  const bool erc = p.erc_high > 0.0f;
  float log_r = logp - old_logp;
  const bool clamped = erc && (log_r < -kErcMaxLogRatio || log_r > kErcMaxLogRatio);
  if (clamped) log_r = fminf(fmaxf(log_r, -kErcMaxLogRatio), kErcMaxLogRatio);
  TokenLoss t = token_surrogate(logp, expf(log_r), adv, p);
  if (clamped && p.type != kCISPO) t.dlogp = 0.0f;
  if (p.dual_clip > 0.0f && adv < 0.0f && t.loss > -p.dual_clip * adv) {
    t.loss = -p.dual_clip * adv;
    t.dlogp = 0.0f;
  }
  if (erc && !entropy_ratio_kept(entropy, old_entropy, p)) t.dlogp = 0.0f;
  return t;
}

}  // namespace klear
