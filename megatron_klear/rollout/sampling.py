"""Token sampling and stop rules of the embedded rollout server (pure torch, no HTTP).

Kept apart from the HTTP layer so the numerics can be read (and tested) on their own.

Logprob semantics (the same as SGLang's for temperature-scaled sampling): the logprob of a
token is ``log_softmax(logits / temperature)[token]`` of the full distribution, i.e. before
top-k / top-p filtering. Temperature 0 means greedy decoding and logprobs of the unscaled
distribution (temperature 1), as SGLang does.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

_GREEDY_EPS = 1e-6


class RequestError(ValueError):
    """A malformed /generate request; the message names the field (answered with HTTP 400)."""


@dataclass
class SamplingParams:
    """The sampling contract: one request's SGLang ``sampling_params``, as the rollout client
    sends it and the embedded server honours it. Defaults are SGLang's
    (sglang/srt/sampling/sampling_params.py); the CLIs map their flags onto these fields
    (:meth:`check_flags`)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None  # the prompt's seed; sample j uses sample_seed(seed, j)
    # not a sampling param: the request's return_routed_experts (MoE routing replay)
    return_routed_experts: bool = False

    REQUEST_FIELDS: ClassVar[tuple[str, ...]] = ("return_routed_experts",)

    def to_sglang(self) -> dict:
        """The ``sampling_params`` JSON object (unset seeds and empty stop lists omitted)."""
        return {k: v for k, v in asdict(self).items()
                if v is not None and v != [] and k not in self.REQUEST_FIELDS}

    @classmethod
    def from_request(cls, params: Any) -> "SamplingParams":
        """Parse and validate ``sampling_params`` (a dict) or raise :class:`RequestError`."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be a JSON object")
        known = set(cls.__dataclass_fields__) - set(cls.REQUEST_FIELDS)
        cfg = cls(**{k: v for k, v in params.items() if k in known and v is not None})
        if isinstance(cfg.stop, str):
            cfg.stop = [cfg.stop]
        for name, rule in cfg.problems():
            raise RequestError(f"sampling_params.{name} {rule}")
        return cfg

    def problems(self) -> list[tuple[str, str]]:
        """(field, the rule it breaks) for each invalid field, in field order."""
        checks = [
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
             "must be an integer >= 0"),
            ("temperature", isinstance(self.temperature, (int, float)) and self.temperature >= 0,
             "must be a number >= 0"),
            ("top_p", isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
             "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             "must be -1 (off) or an integer >= 1"),
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("sampling_seed", self.sampling_seed is None or isinstance(self.sampling_seed, int),
             "must be an integer"),
            ("stop", isinstance(self.stop, list) and all(isinstance(s, str) and s
                                                         for s in self.stop),
             "must be a string or a list of non-empty strings"),
            ("stop_token_ids", isinstance(self.stop_token_ids, list)
             and all(isinstance(t, int) for t in self.stop_token_ids),
             "must be a list of integers"),
        ]
        return [(name, rule) for name, ok, rule in checks if not ok]

    def check_flags(self, flags: dict[str, str]) -> None:
        """Raise :class:`~megatron_klear.config.ConfigError` naming the CLI flag (``flags``:
        field -> flag) of the first invalid field: one contract, each CLI's flag names."""
        from megatron_klear.config import ConfigError

        for name, rule in self.problems():
            raise ConfigError(f"{flags.get(name, name)} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or top_k 1): argmax decoding."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def token_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row (fp32); rows with T == 0 use T = 1."""
    t = torch.where(temperatures < _GREEDY_EPS, torch.ones_like(temperatures), temperatures)
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
