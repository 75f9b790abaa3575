"""Token sampling and stop rules of the embedded rollout server (pure torch, no HTTP).

Kept apart from the HTTP layer so the numerics can be read (and tested) on their own.

Logprob semantics (the same as SGLang's for temperature-scaled sampling): the logprob of a
token is ``log_softmax(logits / temperature)[token]`` of the full distribution, i.e. before
top-k / top-p filtering. Temperature 0 means greedy decoding and logprobs of the unscaled
distribution (temperature 1), as SGLang does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from megatron_klear.rollout.orchestration.request import GREEDY_EPS, SamplingParams


def token_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row (fp32); rows with T == 0 use T = 1."""
    t = torch.where(temperatures < GREEDY_EPS, torch.ones_like(temperatures), temperatures)
    return torch.log_softmax(logits.float() / t[:, None], dim=-1)


def filter_top_k_top_p(logprobs: torch.Tensor, top_k: int | torch.Tensor,
                       top_p: float | torch.Tensor) -> torch.Tensor:
    """Logprobs ``[..., V]`` with tokens outside top-k / the top-p nucleus set to -inf.

    ``top_k`` / ``top_p`` are numbers or per-row tensors (``top_k`` <= 0: off). Ties with the
    k-th value are kept; top-p drops a token when the probability mass strictly before it
    (in descending order) already reaches ``top_p``.
    """
    vocab = logprobs.shape[-1]
    k = torch.as_tensor(top_k).expand(logprobs.shape[:-1])
    p = torch.as_tensor(top_p, dtype=logprobs.dtype).expand(logprobs.shape[:-1])
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    kth = sorted_lp.gather(-1, (k.clamp(1, vocab) - 1)[..., None])
    cut = (k[..., None] > 0) & (logprobs < kth)
    probs = sorted_lp.exp()
    drop_sorted = (probs.cumsum(-1) - probs) >= p[..., None]
    cut = cut | torch.zeros_like(cut).scatter(-1, order, drop_sorted)
    return logprobs.masked_fill(cut, float("-inf"))


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser (a bijective avalanche mix) on uint32 arrays (numpy's
    uint32 products wrap mod 2**32, as the hash wants)."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One float64 draw in [0, 1) per row that depends only on (seed, position): a counter-
    based stream, so a seeded sample does not depend on its batch, row or server (the property
    of SGLang's ``multinomial_with_seed``, sglang/srt/layers/sampler.py).

    The hash runs on numpy uint32 arrays: a decode step calls this once, and ~60 torch ops on
    a few hundred elements cost ~0.5 ms of dispatch per step (14% of a small model's decode)."""
    seeds = seeds.long().numpy().astype(np.uint64)
    positions = positions.long().numpy().astype(np.uint64)
    low, high = (seeds & 0xFFFFFFFF).astype(np.uint32), (seeds >> 32).astype(np.uint32)
    key = _fmix32(_fmix32(low) ^ high)
    h1 = _fmix32(key ^ _fmix32((positions & 0xFFFFFFFF).astype(np.uint32)))
    h2 = _fmix32(h1 ^ np.uint32(0x9E3779B9))
    bits = (h1.astype(np.uint64) << 21) + (h2 >> 11).astype(np.uint64)  # 53 random bits
    return torch.from_numpy(bits.astype(np.float64) / 2.0**53)


@dataclass(frozen=True)
class RowSettings:
    """The sampling settings of a decode batch's rows as tensors, built once per batch: a
    decode step rebuilding them from the requests' params spent ~40 us of the ~1.7 ms a step
    of the tiny model takes. :meth:`select` keeps rows as the batch drops finished ones."""

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def of(cls, configs: list[SamplingParams]) -> "RowSettings":
        return cls(torch.tensor([float(c.temperature) for c in configs], dtype=torch.float32),
                   torch.tensor([c.greedy for c in configs], dtype=torch.bool),
                   torch.tensor([c.top_k for c in configs], dtype=torch.long),
                   torch.tensor([float(c.top_p) for c in configs], dtype=torch.float32))

    def select(self, index: torch.Tensor) -> "RowSettings":
        return RowSettings(*(t[index] for t in (self.temperature, self.greedy, self.top_k,
                                                self.top_p)))

    @functools.cached_property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    @functools.cached_property
    def filtered(self) -> bool:
        """Some row samples from a top-k or top-p filtered distribution."""
        return bool((self.top_k > 0).any() or (self.top_p < 1.0).any())


def sample_next(logprobs: torch.Tensor, rows: RowSettings | list[SamplingParams],
                uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, vectorised: argmax for greedy rows, else the inverse CDF of the
    row's top-k/top-p filtered distribution at that row's uniform draw ``uniforms[row]``
    (``rows``: the rows' settings, or their params)."""
    rows = rows if isinstance(rows, RowSettings) else RowSettings.of(rows)
    tokens = logprobs.argmax(-1)
    if rows.all_greedy:
        return tokens
    if rows.filtered:
        logprobs = filter_top_k_top_p(logprobs, rows.top_k, rows.top_p.to(logprobs.dtype))
    cdf = logprobs.double().exp().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1])[:, None]
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=logprobs.shape[-1] - 1)
    return torch.where(rows.greedy, tokens, drawn)


def find_stop_string(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in ``text``, or None."""
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None
