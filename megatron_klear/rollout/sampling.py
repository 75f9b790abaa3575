"""Token sampling and stop rules of the embedded rollout server (pure torch, no HTTP).

Kept apart from the HTTP layer so the numerics can be read (and tested) on their own.

Logprob semantics (the same as SGLang's for temperature-scaled sampling): the logprob of a
token is ``log_softmax(logits / temperature)[token]`` of the full distribution, i.e. before
top-k / top-p filtering. Temperature 0 means greedy decoding and logprobs of the unscaled
distribution (temperature 1), as SGLang does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_GREEDY_EPS = 1e-6


class RequestError(ValueError):
    """A malformed /generate request; the message names the field (answered with HTTP 400)."""


@dataclass
class SamplingConfig:
    """The SGLang ``sampling_params`` the embedded server honours, validated."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @classmethod
    def from_request(cls, params: Any) -> "SamplingConfig":
        """Parse and validate ``sampling_params`` (a dict) or raise :class:`RequestError`."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be a JSON object")
        known = set(cls.__dataclass_fields__)
        cfg = cls(**{k: v for k, v in params.items() if k in known and v is not None})
        if isinstance(cfg.stop, str):
            cfg.stop = [cfg.stop]
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
             "sampling_params.max_new_tokens must be an integer >= 0"),
            (isinstance(self.temperature, (int, float)) and self.temperature >= 0,
             "sampling_params.temperature must be a number >= 0"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
             "sampling_params.top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             "sampling_params.top_k must be -1 (off) or an integer >= 1"),
            (isinstance(self.n, int) and self.n >= 1, "sampling_params.n must be an integer >= 1"),
            (self.sampling_seed is None or isinstance(self.sampling_seed, int),
             "sampling_params.sampling_seed must be an integer"),
            (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "sampling_params.stop must be a string or a list of non-empty strings"),
            (isinstance(self.stop_token_ids, list)
             and all(isinstance(t, int) for t in self.stop_token_ids),
             "sampling_params.stop_token_ids must be a list of integers"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or top_k 1): argmax decoding."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1


def token_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row (fp32); rows with T == 0 use T = 1."""
    t = torch.where(temperatures < _GREEDY_EPS, torch.ones_like(temperatures), temperatures)
    return torch.log_softmax(logits.float() / t[:, None], dim=-1)


def filter_top_k_top_p(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row of logprobs with tokens outside top-k / the top-p nucleus set to -inf."""
    out = logprobs.clone()
    if top_k > 0 and top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        sorted_lp, order = torch.sort(out, descending=True)
        probs = sorted_lp.exp()
        # drop a token when the mass strictly before it already reaches top_p
        drop = (probs.cumsum(0) - probs) >= top_p
        out[order[drop]] = float("-inf")
    return out


def sample_next(logprobs: torch.Tensor, configs: list[SamplingConfig],
                generators: list[torch.Generator]) -> torch.Tensor:
    """Sample one token per row (argmax for greedy rows) with that row's generator."""
    tokens = torch.empty(logprobs.shape[0], dtype=torch.long)
    for row, cfg in enumerate(configs):
        if cfg.greedy:
            tokens[row] = int(torch.argmax(logprobs[row]))
            continue
        filtered = filter_top_k_top_p(logprobs[row], cfg.top_k, cfg.top_p)
        tokens[row] = int(torch.multinomial(filtered.exp(), 1, generator=generators[row]))
    return tokens


def find_stop_string(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in ``text``, or None."""
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None
