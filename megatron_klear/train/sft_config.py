"""``klear-sft``'s settings: every long-CoT SFT flag (plus the shared trainer flags) and their checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_klear.config import ConfigError, Section, TrainConfig, opt
from megatron_klear.data.prompt_flags import FIRST_RECORDS, TemplateFlags, check_data_file
from megatron_klear.data.sft import MULTI_TURN, check_sft_records
from megatron_klear.train.context_parallel import THD_CP_UNSUPPORTED


@dataclass
class SFTDataFlags(Section):
    """The SFT records and how they become bins."""

    title = "SFT data"
    data_path: str | None = opt(None, "SFT data: JSONL or Parquet of prompt/response or messages")
    prompt_key: str = opt("prompt", "prompt field of a record")
    response_key: str = opt("response", "response field of a record")
    messages_key: str = opt("messages", "chat messages field of a record (used when present)")
    overflow: str = opt("truncate", "sequences longer than --seq-length",
                        choices=("truncate", "drop"))
    sft_multi_turn: str = opt("whole", "multi-turn records: 'whole' trains each assistant turn "
                              "as the whole conversation renders it (earlier reasoning dropped "
                              "as the template drops it); 'per-turn' makes each assistant turn "
                              "its own sample, rendered as at generation time",
                              choices=MULTI_TURN)
    pack: bool = opt(True, "pack several samples per bin (--no-pack: one sample per bin)")
    max_tokens_per_gpu: int | None = opt(None, "token budget of one micro-batch: bins of at most "
                                         "this many tokens, one bin per micro-batch (unset: bins "
                                         "of --seq-length, --micro-batch-size bins per pack)")

    def validate_section(self) -> None:  # noqa: D102
        if not self.data_path:
            raise ConfigError("--data-path is required (JSONL or Parquet SFT data)")
        if not self.hf_checkpoint:
            raise ConfigError("--hf-checkpoint is required (architecture and tokenizer)")
        if self.context_parallel_size > 1:
            raise ConfigError(f"--context-parallel-size {self.context_parallel_size}: SFT feeds "
                              f"THD packs (--no-pack too: one sample per pack), and "
                              f"{THD_CP_UNSUPPORTED}; use tensor/pipeline parallelism "
                              "(with --sequence-parallel) for long samples")
        if self.max_tokens_per_gpu is not None:
            if self.max_tokens_per_gpu < self.seq_length:
                raise ConfigError(f"--max-tokens-per-gpu {self.max_tokens_per_gpu} must be >= "
                                  f"--seq-length {self.seq_length} (the longest sample)")
            if self.micro_batch_size != 1:
                raise ConfigError("--max-tokens-per-gpu makes each micro-batch one bin: set "
                                  "--micro-batch-size 1")

    def check_inputs_section(self, model: Any) -> None:
        """``--data-path`` exists and its first records hold conversations (FILE:LINE)."""
        check_data_file("--data-path", self.data_path)
        check_sft_records(self.data_path, FIRST_RECORDS, prompt_key=self.prompt_key,
                          response_key=self.response_key, messages_key=self.messages_key)

    @property
    def bin_size(self) -> int:
        """Next-token positions per bin."""
        return self.max_tokens_per_gpu or self.seq_length


@dataclass
class SFTConfig(SFTDataFlags, TemplateFlags, TrainConfig):
    """SFT settings (plus every shared trainer flag)."""

    trainer_name = "sft"  # recorded in its checkpoints (not a flag)
    unread_flags = {"use_routing_replay": "routing replay trains on the experts a rollout "
                                          "chose (klear-rl)"}
