"""The request contract between the trainer and a rollout server: one request's SGLang
``sampling_params`` and the error a malformed request raises. The client sends it, the
embedded engine honours it; it lives here, below both, not in the engine's sampling math."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

GREEDY_EPS = 1e-6  # a temperature below this is greedy decoding


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
        return self.temperature < GREEDY_EPS or self.top_k == 1
