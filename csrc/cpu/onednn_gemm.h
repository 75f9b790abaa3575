// fp32 GEMM through oneDNN, the library torch's CPU build already links.
//
// torch sends fp32 matmuls to MKL's sgemm, which picks its code path by CPU vendor: on AMD
// CPUs it runs its AVX2 kernels even where the core has AVX-512, at about half of what oneDNN
// reaches on the same core (benchmarks/bench_cpu_gemm.py). ATen's own entry into oneDNN,
// at::native::mkldnn_matmul (aten/src/ATen/native/mkldnn/Matmul.cpp; exported, used there for
// bf16/fp16 GEMMs), takes any strides, so transposed operands cost no copy.
//
// The symbol is declared weak: a torch build without it (or with another signature) loads this
// extension all the same, and onednn_gemm_available() says false.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Config.h>

#include <vector>

namespace at::native {
// result = beta * result + alpha * (mat1 @ mat2)
__attribute__((weak)) void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2,
                                         const at::Tensor& result, float beta, float alpha);
}  // namespace at::native

namespace klear::cpu {

inline bool onednn_gemm_available() {
#if AT_MKLDNN_ENABLED()
  return &at::native::mkldnn_matmul != nullptr;
#else
  return false;
#endif
}

// oneDNN JIT-compiles and caches a kernel per GEMM shape (about 0.6 MB each, 1-15 ms to build
// inside a training step). A packed micro-batch changes its token count every step, so the
// token dimension -- a's rows (forward, input gradient) or the reduction (weight gradient) --
// runs in pieces of these sizes, the same kernels every step, and MKL takes the last rows.
#ifndef KLEAR_ONEDNN_PIECES
#define KLEAR_ONEDNN_PIECES 256, 64
#endif
constexpr int64_t kOnednnPieces[] = {KLEAR_ONEDNN_PIECES};

struct Span {
  int64_t begin, end;
  bool onednn;
};

// [0, n) in spans of kOnednnPieces (largest first) through oneDNN, the rest through MKL; one
// oneDNN span when the dimension does not vary (split false).
inline std::vector<Span> spans(int64_t n, bool split) {
  if (!split) return {{0, n, true}};
  std::vector<Span> out;
  int64_t at = 0;
  for (const int64_t piece : kOnednnPieces)
    for (; n - at >= piece; at += piece) out.push_back({at, at + piece, true});
  if (at < n) out.push_back({at, n, false});
  return out;
}

// Whether t [r, c] is dense row-major, or dense column-major (t = u.t() of a contiguous u):
// the layouts ATen's mkldnn_matmul takes without a copy.
inline bool row_major(const at::Tensor& t) { return t.stride(1) == 1 && t.stride(0) == t.size(1); }
inline bool col_major(const at::Tensor& t) { return t.stride(0) == 1 && t.stride(1) == t.size(0); }

// a [m, k] @ b [k, n] -> a new contiguous [m, n]: fp32 CPU matrices of any strides. A
// row-major a is split along its rows; a column-major a with a row-major b (a weight gradient:
// activations^T @ gradients) along the reduction; slices of either stay dense.
inline at::Tensor onednn_mm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(onednn_gemm_available(),
              "onednn_mm: this torch build has no oneDNN matmul (at::native::mkldnn_matmul)");
  for (const at::Tensor* t : {&a, &b})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->dim() == 2,
                "onednn_mm: fp32 CPU matrices only, got ", t->scalar_type(), " ", t->sizes(),
                " on ", t->device());
  TORCH_CHECK(a.size(1) == b.size(0), "onednn_mm: shapes ", a.sizes(), " and ", b.sizes(),
              " cannot be multiplied");
  auto out = at::empty({a.size(0), b.size(1)}, a.options());
  if (a.size(1) == 0) return out.zero_();
  const bool split_rows = row_major(a), split_reduction = !split_rows && col_major(a) &&
                                                           row_major(b);
  const std::vector<Span> reduction = spans(a.size(1), split_reduction);
  for (const Span& r : spans(a.size(0), split_rows)) {
    at::Tensor po = out.slice(0, r.begin, r.end);
    bool accumulate = false;
    for (const Span& k : reduction) {
      const at::Tensor pa = a.slice(0, r.begin, r.end).slice(1, k.begin, k.end);
      const at::Tensor pb = b.slice(0, k.begin, k.end);
      if (r.onednn && k.onednn)
        at::native::mkldnn_matmul(pa, pb, po, accumulate ? 1.f : 0.f, 1.f);
      else if (accumulate)
        po.addmm_(pa, pb);
      else
        at::mm_out(po, pa, pb);
      accumulate = true;
    }
  }
  return out;
}

}  // namespace klear::cpu
