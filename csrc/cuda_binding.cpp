// CUDA implementations of the `klear::` ops (schemas in binding.cpp): thin wrappers that call
// the plain C launchers of cuda/vocab_logprobs.cu on the current stream. Compiles to nothing
// unless setup.py found CUDA torch + nvcc and defined KLEAR_WITH_CUDA.
#ifdef KLEAR_WITH_CUDA

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/vocab_logprobs_cuda.h"
#include "op_checks.h"

namespace {

int klear_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kKlearFloat32;
    case at::kBFloat16: return kKlearBFloat16;
    case at::kHalf: return kKlearFloat16;
    default: TORCH_CHECK(false, "klear: logits must be float32, bfloat16 or float16, got ",
                         t.scalar_type());
  }
  return -1;
}

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "klear: ", what, " failed: ", cudaGetErrorString(err));
}

at::Tensor stats_cuda(const at::Tensor& logits, const at::Tensor& target_local, int64_t valid,
                      double inv_temp) {
  klear::check_rows(logits, target_local, valid);
  const c10::cuda::CUDAGuard guard(logits.device());
  auto stats = at::empty({logits.size(0), 4}, logits.options().dtype(at::kFloat));
  check(klear_logprob_stats_cuda(klear_dtype(logits), logits.const_data_ptr(), logits.size(0),
                                 logits.size(1), target_local.const_data_ptr<int64_t>(), valid,
                                 static_cast<float>(inv_temp), stats.mutable_data_ptr<float>(),
                                 c10::cuda::getCurrentCUDAStream()),
        "logprob_stats");
  return stats;
}

at::Tensor backward_cuda(const at::Tensor& logits, const at::Tensor& target_local,
                         const at::Tensor& lse, const at::Tensor& entropy,
                         const at::Tensor& grad_logp,
                         const std::optional<at::Tensor>& grad_entropy, int64_t valid,
                         double inv_temp, bool inplace) {
  klear::check_rows(logits, target_local, valid);
  const c10::cuda::CUDAGuard guard(logits.device());
  const klear::RowVectors v =
      klear::row_vectors(logits, lse, entropy, grad_logp, grad_entropy);
  auto grad = inplace ? logits : at::empty_like(logits);
  check(klear_logprob_backward_cuda(klear_dtype(logits), logits.const_data_ptr(),
                                    grad.mutable_data_ptr(), logits.size(0), logits.size(1),
                                    target_local.const_data_ptr<int64_t>(), valid,
                                    static_cast<float>(inv_temp), v.lse.const_data_ptr<float>(),
                                    v.entropy.const_data_ptr<float>(),
                                    v.grad_logp.const_data_ptr<float>(), v.grad_entropy_ptr(),
                                    c10::cuda::getCurrentCUDAStream()),
        "logprob_backward");
  return grad;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_loss_cuda(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& adv,
    const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& old_entropy,
    int64_t loss_type, double eps_low, double eps_high, double beta1, double beta2,
    double dual_clip, double erc_low, double erc_high) {
  const klear::TokenInputs ent =
      klear::check_tokens(logp, old_logp, adv, entropy, old_entropy, erc_high);
  const auto &lp = logp, &old = old_logp, &a = adv;
  const c10::cuda::CUDAGuard guard(lp.device());
  auto loss = at::empty_like(lp), dlogp = at::empty_like(lp), ratio = at::empty_like(lp);
  const klear::TokenLossParams p =
      klear::token_params(loss_type, eps_low, eps_high, beta1, beta2, dual_clip, erc_low,
                          erc_high);
  check(klear_token_policy_loss_cuda(lp.const_data_ptr<float>(), old.const_data_ptr<float>(),
                                     a.const_data_ptr<float>(), ent.entropy,
                                     ent.old_entropy, lp.numel(), p,
                                     loss.mutable_data_ptr<float>(),
                                     dlogp.mutable_data_ptr<float>(),
                                     ratio.mutable_data_ptr<float>(),
                                     c10::cuda::getCurrentCUDAStream()),
        "token_policy_loss");
  return {loss, dlogp, ratio};
}

}  // namespace

TORCH_LIBRARY_IMPL(klear, CUDA, m) {
  m.impl("logprob_stats", &stats_cuda);
  m.impl("logprob_backward", &klear::backward_out_of_place<&backward_cuda>);
  m.impl("logprob_backward_", &klear::backward_inplace<&backward_cuda>);
  m.impl("token_policy_loss", &token_loss_cuda);
}

#endif  // KLEAR_WITH_CUDA
