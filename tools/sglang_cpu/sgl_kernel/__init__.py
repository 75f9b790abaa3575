"""Stand-in for SGLang's compiled kernel package ``sgl_kernel`` on a CPU without AMX.

Stands in for the ``sgl-kernel`` wheel (sgl-kernel/python/sgl_kernel/ in the SGLang repo),
whose CPU build ships ``torch.ops.sgl_kernel.*`` (csrc/cpu/). On a CPU without AMX, with
``--attention-backend torch_native``, SGLang 0.5.23 reaches only one of its functions:
``assign_req_to_token_pool_cpu`` (sglang/srt/mem_cache/allocation.py). It is written here in
torch with the semantics of SGLang's triton kernel ``assign_req_to_token_pool`` in that file.
Every other name resolves to a function that raises NotImplementedError when called, so an
unexpected code path fails loudly instead of computing something else.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+klear-cpu-standin"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i:o_i + n_i]``
    with ``o_i`` the sum of the lengths of requests before i (in place)."""
    del pool_len  # the row length of req_to_token; implicit in torch indexing
    offset = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(),
                               end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not provided by the CPU stand-in "
                                  "(tools/sglang_cpu/sgl_kernel); only "
                                  "assign_req_to_token_pool_cpu is implemented")

    missing.__name__ = name
    return missing
