// Torch binding of the fused vocab-parallel log-prob / policy-loss kernels: module
// megatron_klear._C registers the `klear::` ops and their CPU implementations. The CUDA
// implementations are registered by cuda_binding.cpp (built only with CUDA torch). Autograd is
// provided on the Python side (megatron_klear/ops/vocab_parallel.py) around these ops.
#include <iterator>
#include <string>
#include <vector>

#include <ATen/Dispatch.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "cpu/decode_cpu.h"
#include "cpu/onednn_gemm.h"
#include "cpu/vocab_logprobs_cpu.h"
#include "op_checks.h"

namespace {

// CPU kernel storage type of a torch scalar type (bf16 gets vectorisable conversions; fp16
// goes through c10::Half's scalar conversions: correct, not fast).
template <typename S> struct Storage { using type = S; };
template <> struct Storage<c10::BFloat16> { using type = klear::cpu::bf16_t; };

template <typename S> using storage_t = typename Storage<S>::type;
static_assert(sizeof(klear::cpu::bf16_t) == sizeof(c10::BFloat16));

at::Tensor stats_cpu(const at::Tensor& logits, const at::Tensor& target_local, int64_t valid,
                     double inv_temp) {
  klear::check_rows(logits, target_local, valid);
  auto stats = at::empty({logits.size(0), 4}, logits.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "klear_stats",
                                  [&] {
    using S = storage_t<scalar_t>;
    klear::cpu::logprob_stats(reinterpret_cast<const S*>(logits.const_data_ptr()),
                              logits.size(0), logits.size(1),
                              target_local.const_data_ptr<int64_t>(), valid,
                              static_cast<float>(inv_temp), stats.mutable_data_ptr<float>());
  });
  return stats;
}

at::Tensor backward_cpu(const at::Tensor& logits, const at::Tensor& target_local,
                        const at::Tensor& lse, const at::Tensor& entropy,
                        const at::Tensor& grad_logp, const std::optional<at::Tensor>& grad_entropy,
                        int64_t valid, double inv_temp, bool inplace) {
  klear::check_rows(logits, target_local, valid);
  const klear::RowVectors v =
      klear::row_vectors(logits, lse, entropy, grad_logp, grad_entropy);
  auto grad = inplace ? logits : at::empty_like(logits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "klear_bwd",
                                  [&] {
    using S = storage_t<scalar_t>;
    klear::cpu::logprob_backward(reinterpret_cast<const S*>(logits.const_data_ptr()),
                                 reinterpret_cast<S*>(grad.mutable_data_ptr()), logits.size(0),
                                 logits.size(1), target_local.const_data_ptr<int64_t>(), valid,
                                 static_cast<float>(inv_temp), v.lse.const_data_ptr<float>(),
                                 v.entropy.const_data_ptr<float>(),
                                 v.grad_logp.const_data_ptr<float>(), v.grad_entropy_ptr());
  });
  return grad;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_loss_cpu(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& adv,
    const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& old_entropy,
    int64_t loss_type, double eps_low, double eps_high, double beta1, double beta2,
    double dual_clip, double erc_low, double erc_high) {
  const klear::TokenInputs ent =
      klear::check_tokens(logp, old_logp, adv, entropy, old_entropy, erc_high);
  const auto &lp = logp, &old = old_logp, &a = adv;
  auto loss = at::empty_like(lp), dlogp = at::empty_like(lp), ratio = at::empty_like(lp);
  const klear::TokenLossParams p =
      klear::token_params(loss_type, eps_low, eps_high, beta1, beta2, dual_clip, erc_low,
                          erc_high);
  klear::cpu::token_policy_loss(lp.const_data_ptr<float>(), old.const_data_ptr<float>(),
                                a.const_data_ptr<float>(), ent.entropy, ent.old_entropy,
                                lp.numel(), p,
                                loss.mutable_data_ptr<float>(), dlogp.mutable_data_ptr<float>(),
                                ratio.mutable_data_ptr<float>());
  return {loss, dlogp, ratio};
}

// q [rows, heads, dim]; the cache's k_t [rows, kv_heads, dim, capacity] (keys transposed), v
// [rows, kv_heads, capacity, dim] and additive mask bias [rows, capacity], of which the first
// `keys` positions are attended: fp32 CPU tensors, unit stride in the last dimension.
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_t, const at::Tensor& v,
                                const at::Tensor& bias, int64_t keys, double scale) {
  klear::check_cpu_rows("decode_attention", {&q, &k_t, &v, &bias});
  TORCH_CHECK(q.dim() == 3 && k_t.dim() == 4 && v.dim() == 4 && bias.dim() == 2,
              "decode_attention: q [rows, heads, dim], k_t [rows, kv_heads, dim, capacity], "
              "v [rows, kv_heads, capacity, dim], bias [rows, capacity]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv = k_t.size(1), capacity = k_t.size(3);
  TORCH_CHECK(k_t.size(0) == rows && k_t.size(2) == dim && k_t.stride(2) == capacity &&
                  v.size(0) == rows && v.size(1) == kv && v.size(2) == capacity &&
                  v.size(3) == dim && bias.size(0) == rows && bias.size(1) == capacity &&
                  kv > 0 && heads % kv == 0 && keys > 0 && keys <= capacity,
              "decode_attention: shapes q ", q.sizes(), " k_t ", k_t.sizes(), " v ", v.sizes(),
              " bias ", bias.sizes(), " keys ", keys, " do not match");
  auto out = at::empty({rows, heads * dim}, q.options());
  const klear::cpu::DecodeLayout layout{rows, heads, kv, keys, dim,
                                        q.stride(0), q.stride(1),
                                        k_t.stride(0), k_t.stride(1), k_t.stride(2),
                                        v.stride(0), v.stride(1), v.stride(2),
                                        bias.stride(0)};
  klear::cpu::decode_attention(q.const_data_ptr<float>(), k_t.const_data_ptr<float>(),
                               v.const_data_ptr<float>(), bias.const_data_ptr<float>(), layout,
                               static_cast<float>(scale), out.mutable_data_ptr<float>());
  return out;
}

// x [rows, heads, dim] (unit stride in dim), weight [dim], cos/sin [rows, dim]: fp32 CPU, dim
// even. Returns rope(rmsnorm(x) * weight), contiguous [rows, heads, dim].
at::Tensor qk_norm_rope_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                            const at::Tensor& sin, double eps) {
  klear::check_cpu_rows("qk_norm_rope", {&x, &weight, &cos, &sin});
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 1 && cos.dim() == 2 && sin.sizes() == cos.sizes() &&
                  sin.strides() == cos.strides(),
              "qk_norm_rope: x [rows, heads, dim], weight [dim], cos/sin [rows, dim]");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(weight.size(0) == dim && cos.size(0) == rows && cos.size(1) == dim && dim % 2 == 0,
              "qk_norm_rope: shapes x ", x.sizes(), " weight ", weight.sizes(), " cos ",
              cos.sizes(), " do not match (dim must be even)");
  auto out = at::empty({rows, heads, dim}, x.options());
  klear::cpu::qk_norm_rope(x.const_data_ptr<float>(), x.stride(0), x.stride(1),
                           weight.const_data_ptr<float>(), cos.const_data_ptr<float>(),
                           sin.const_data_ptr<float>(), cos.stride(0), rows, heads, dim,
                           static_cast<float>(eps), out.mutable_data_ptr<float>());
  return out;
}

// x [rows, dim] (unit stride in dim), weight [dim]: fp32 CPU. Returns x / sqrt(mean(x^2) + eps)
// * weight, contiguous.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  klear::check_cpu_rows("rms_norm", {&x, &weight});
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: x [rows, dim] and weight [dim], got ", x.sizes(), " and ",
              weight.sizes());
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  klear::cpu::rms_norm(x.const_data_ptr<float>(), x.stride(0), weight.const_data_ptr<float>(),
                       x.size(0), x.size(1), static_cast<float>(eps),
                       out.mutable_data_ptr<float>());
  return out;
}

// dy and x [rows, dim], weight [dim]: fp32 CPU. Returns (dx, dweight) of rms_norm_cpu.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& dy, const at::Tensor& x,
                                                         const at::Tensor& weight, double eps) {
  klear::check_cpu_rows("rms_norm_backward", {&dy, &x, &weight});
  TORCH_CHECK(x.dim() == 2 && dy.sizes() == x.sizes() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1),
              "rms_norm_backward: dy and x [rows, dim], weight [dim], got ", dy.sizes(), ", ",
              x.sizes(), " and ", weight.sizes());
  const at::Tensor dyc = dy.contiguous(), xc = x.contiguous();
  auto dx = at::empty_like(xc), dw = at::empty_like(weight);
  klear::cpu::rms_norm_backward(dyc.const_data_ptr<float>(), xc.const_data_ptr<float>(),
                                weight.const_data_ptr<float>(), x.size(0), x.size(1),
                                static_cast<float>(eps), dx.mutable_data_ptr<float>(),
                                dw.mutable_data_ptr<float>());
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY(klear, m) {
  m.def("logprob_stats(Tensor logits, Tensor target_local, int valid, float inv_temp) -> Tensor");
  m.def("logprob_backward(Tensor logits, Tensor target_local, Tensor lse, Tensor entropy, "
        "Tensor grad_logp, Tensor? grad_entropy, int valid, float inv_temp) -> Tensor");
  m.def("logprob_backward_(Tensor(a!) logits, Tensor target_local, Tensor lse, Tensor entropy, "
        "Tensor grad_logp, Tensor? grad_entropy, int valid, float inv_temp) -> Tensor(a!)");
  m.def("token_policy_loss(Tensor logp, Tensor old_logp, Tensor adv, Tensor? entropy, "
        "Tensor? old_entropy, int loss_type, float eps_low, float eps_high, float beta1, "
        "float beta2, float dual_clip, float erc_low, float erc_high) -> (Tensor, Tensor, Tensor)");
  m.def("decode_attention(Tensor q, Tensor k_t, Tensor v, Tensor bias, int keys, float scale) "
        "-> Tensor");
  m.def("qk_norm_rope(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("onednn_mm(Tensor a, Tensor b) -> Tensor");
}

TORCH_LIBRARY_IMPL(klear, CPU, m) {
  m.impl("logprob_stats", &stats_cpu);
  m.impl("logprob_backward", &klear::backward_out_of_place<&backward_cpu>);
  m.impl("logprob_backward_", &klear::backward_inplace<&backward_cpu>);
  m.impl("token_policy_loss", &token_loss_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
  m.impl("qk_norm_rope", &qk_norm_rope_cpu);
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("onednn_mm", &klear::cpu::onednn_mm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-klear fused kernels; ops are registered under torch.ops.klear";
  m.attr("with_cuda") =
#ifdef KLEAR_WITH_CUDA
      true;
#else
      false;
#endif
  // Whether torch's oneDNN fp32 matmul is there for klear::onednn_mm (see cpu/onednn_gemm.h).
  m.attr("onednn_gemm") = klear::cpu::onednn_gemm_available();
  // The CPU kernel copy this process runs (KLEAR_CPU_ISA caps it; megatron_klear/ops checks the
  // variable against cpu_isa_names).
#if KLEAR_X86_DISPATCH
  m.attr("cpu_isa_names") = std::vector<std::string>(std::begin(klear::cpu::kIsaNames),
                                                      std::end(klear::cpu::kIsaNames));
  m.def("cpu_isa", [] {
    return std::string(klear::cpu::kIsaNames[static_cast<int>(klear::cpu::cpu_isa())]);
  });
#else
  m.attr("cpu_isa_names") = std::vector<std::string>{"base"};
  m.def("cpu_isa", [] { return std::string("base"); });
#endif
}
