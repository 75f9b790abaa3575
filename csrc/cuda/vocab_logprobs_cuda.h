// Plain C launchers of the CUDA kernels of the fused vocab-parallel log-prob / policy loss.
// No torch headers: vocab_logprobs.cu compiles with bare nvcc (CI: sm_80, sm_90); the torch
// binding (cuda_binding.cpp) calls these with raw pointers on the current stream.
// Shapes: logits and grad are contiguous [rows, vocab]; stats is [rows, 4] fp32
// {max, sum exp, sum exp * (x - max), target logit}; per-row vectors are fp32.
#pragma once

#include <cstdint>

#ifdef KLEAR_CUDA_EMULATION
#include "emu/cuda_emu.h"
#else
#include <cuda_runtime.h>
#endif

#include "policy_loss_math.h"

enum KlearDType : int { kKlearFloat32 = 0, kKlearBFloat16 = 1, kKlearFloat16 = 2 };

extern "C" {

cudaError_t klear_logprob_stats_cuda(int dtype, const void* logits, int64_t rows, int64_t vocab,
                                     const int64_t* target_local, int64_t valid, float inv_temp,
                                     float* stats, cudaStream_t stream);

// grad may equal logits (in-place backward). grad_entropy may be null (no entropy term).
cudaError_t klear_logprob_backward_cuda(int dtype, const void* logits, void* grad, int64_t rows,
                                        int64_t vocab, const int64_t* target_local, int64_t valid,
                                        float inv_temp, const float* lse, const float* entropy,
                                        const float* grad_logp, const float* grad_entropy,
                                        cudaStream_t stream);

// entropy / old_entropy (ERC's per-token entropies) may be null when ERC is off.
cudaError_t klear_token_policy_loss_cuda(const float* logp, const float* old_logp,
                                         const float* adv, const float* entropy,
                                         const float* old_entropy, int64_t n,
                                         klear::TokenLossParams params, float* loss, float* dlogp,
                                         float* ratio, cudaStream_t stream);
}
