// Argument checks and conversions shared by the CPU (binding.cpp) and CUDA (cuda_binding.cpp)
// implementations of the `klear::` ops.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>

#include "policy_loss_math.h"

namespace klear {

inline void check_rows(const at::Tensor& logits, const at::Tensor& target_local, int64_t valid) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(),
              "klear: logits must be a contiguous [tokens, vocab_shard] tensor");
  TORCH_CHECK(logits.size(0) <= INT32_MAX && logits.size(1) <= INT32_MAX,
              "klear: logits must have fewer than 2^31 rows and 2^31 columns (32-bit in-row "
              "indices), got ", logits.sizes());
  TORCH_CHECK(target_local.scalar_type() == at::kLong && target_local.is_contiguous() &&
                  target_local.numel() == logits.size(0) &&
                  target_local.device() == logits.device(),
              "klear: target_local must be a contiguous int64 tensor with one id per row, on "
              "the logits' device");
  TORCH_CHECK(valid >= 0 && valid <= logits.size(1),
              "klear: valid vocab slots must be in [0, vocab_shard]");
}

// Per-row inputs of the backward, checked (float32, one value per logits row, on the logits'
// device) and made contiguous.
struct RowVectors {
  at::Tensor lse, entropy, grad_logp;
  std::optional<at::Tensor> grad_entropy;
  const float* grad_entropy_ptr() const {
    return grad_entropy ? grad_entropy->const_data_ptr<float>() : nullptr;
  }
};

inline RowVectors row_vectors(const at::Tensor& logits, const at::Tensor& lse,
                              const at::Tensor& entropy, const at::Tensor& grad_logp,
                              const std::optional<at::Tensor>& grad_entropy) {
  const std::pair<const char*, const at::Tensor*> inputs[] = {
      {"lse", &lse}, {"entropy", &entropy}, {"grad_logp", &grad_logp},
      {"grad_entropy", grad_entropy ? &*grad_entropy : &lse}};
  for (const auto& [name, t] : inputs)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == logits.size(0) &&
                    t->device() == logits.device(),
                "klear: ", name, " must be a float32 tensor with one value per logits row (",
                logits.size(0), ") on ", logits.device(), "; got ", t->scalar_type(), " ",
                t->sizes(), " on ", t->device());
  RowVectors out{lse.contiguous(), entropy.contiguous(), grad_logp.contiguous(), std::nullopt};
  if (grad_entropy) out.grad_entropy = grad_entropy->contiguous();
  return out;
}

// Per-token inputs of token_policy_loss: logp, old_logp, adv and (ERC) the two entropies, all
// contiguous float32 of one size on one device. The entropies are required iff ERC is on.
struct TokenInputs {
  const float* entropy;
  const float* old_entropy;
};

inline TokenInputs check_tokens(const at::Tensor& logp, const at::Tensor& old_logp,
                                const at::Tensor& adv, const std::optional<at::Tensor>& entropy,
                                const std::optional<at::Tensor>& old_entropy,
                                double erc_high) {
  for (const at::Tensor* t : {&logp, &old_logp, &adv})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == logp.numel() && t->device() == logp.device(),
                "klear: token_policy_loss takes three contiguous float32 tensors of one size");
  const bool erc = erc_high > 0.0;
  TORCH_CHECK(entropy.has_value() == erc && old_entropy.has_value() == erc,
              "klear: token_policy_loss needs entropy and old_entropy exactly when "
              "erc_high > 0 (got erc_high=", erc_high, ")");
  if (!erc) return {nullptr, nullptr};
  for (const auto* t : {&*entropy, &*old_entropy})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == logp.numel() && t->device() == logp.device(),
                "klear: entropy and old_entropy must be contiguous float32 tensors shaped like "
                "logp, on its device; got ", t->scalar_type(), " ", t->sizes(), " on ",
                t->device());
  return {entropy->const_data_ptr<float>(), old_entropy->const_data_ptr<float>()};
}

// ERC's band (erc_low, erc_high) of the entropy ratio (erc_high > 0 enables it: 1 -/+ delta or
// two free bounds, computed by the caller in double) is rounded to float, as torch compares
// fp32 ratios with Python-float bounds.
inline TokenLossParams token_params(int64_t loss_type, double eps_low, double eps_high,
                                    double beta1, double beta2, double dual_clip,
                                    double erc_low, double erc_high) {
  TORCH_CHECK(loss_type >= kPPO && loss_type <= kCISPO, "klear: unknown loss_type ", loss_type);
  const bool erc = erc_high > 0.0;
  return {static_cast<int>(loss_type), static_cast<float>(eps_low), static_cast<float>(eps_high),
          static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(dual_clip),
          erc ? static_cast<float>(erc_low) : 0.0f, erc ? static_cast<float>(erc_high) : -1.0f};
}

// The backward op comes in two schemas, `logprob_backward` (new gradient tensor) and
// `logprob_backward_` (gradient written into the logits, declared as mutating them); both wrap
// one device implementation `Impl(..., inplace)`.
using BackwardImpl = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, const at::Tensor&,
                                    const std::optional<at::Tensor>&, int64_t, double, bool);

template <BackwardImpl Impl>
at::Tensor backward_out_of_place(const at::Tensor& logits, const at::Tensor& target_local,
                                 const at::Tensor& lse, const at::Tensor& entropy,
                                 const at::Tensor& grad_logp,
                                 const std::optional<at::Tensor>& grad_entropy, int64_t valid,
                                 double inv_temp) {
  return Impl(logits, target_local, lse, entropy, grad_logp, grad_entropy, valid, inv_temp, false);
}

template <BackwardImpl Impl>
at::Tensor& backward_inplace(at::Tensor& logits, const at::Tensor& target_local,
                             const at::Tensor& lse, const at::Tensor& entropy,
                             const at::Tensor& grad_logp,
                             const std::optional<at::Tensor>& grad_entropy, int64_t valid,
                             double inv_temp) {
  Impl(logits, target_local, lse, entropy, grad_logp, grad_entropy, valid, inv_temp, true);
  return logits;
}

// The decode and norm kernels take fp32 CPU tensors whose last dimension has unit stride.
inline void check_cpu_rows(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), op,
                ": fp32 CPU tensors only, got ", t->scalar_type(), " on ", t->device());
    TORCH_CHECK(t->dim() > 0 && t->stride(-1) == 1, op, ": unit stride in the last dimension");
  }
}

}  // namespace klear
