"""GPPO RL trainer (``klear-rl``): the Klear-Reasoner recipe on megatron-core.

One RL step: sample prompts -> n responses each through the rollout servers -> rewards ->
group advantages -> drop zero-advantage groups (refill) -> old log-probs with the Megatron
model -> one optimizer step per mini-batch on GPPO + alpha * SFT(fully correct responses),
token-level mean over the mini-batch -> weight sync to the rollout servers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from megatron.core import parallel_state

from megatron_klear.algo.kl import KL_ESTIMATORS, kl_per_token
from megatron_klear.algo.losses import LOSS_AGGREGATIONS, AggregationTotals, MicroCounts, \
    aggregate_rl_loss, erc_band
from megatron_klear.algo.rollout_correction import LEVELS, MODES, RolloutCorrection, \
    rollout_correction_weights
from megatron_klear.config import ConfigError, TrainConfig, opt
from megatron_klear.data.packing import balance, pack_bins, run_positions, thd_pack
from megatron_klear.data.prompts import parse_chat_template_kwargs
from megatron_klear.heap import freeze_startup_heap
from megatron_klear.models.qwen3 import Qwen3Arch, load_hf_config, qwen3_config_from_hf
from megatron_klear.ops import vocab_parallel_logprobs, vocab_parallel_policy_loss
from megatron_klear.ops.backend import loss_backend
from megatron_klear.rewards.remote import RemoteReward
from megatron_klear.rewards.shaping import OverlongShaping
from megatron_klear.train.async_rollout import RolloutSource
from megatron_klear.train.colocate import Colocation
from megatron_klear.train.context_parallel import THD_CP_UNSUPPORTED, sequence_multiple
from megatron_klear.train.engine import Engine, build_engine, cpu_threads, \
    restore_or_init
from megatron_klear.train.memory import Workload
from megatron_klear.train.metrics import MetricsLogger, wandb_settings
from megatron_klear.train.reference import ReferencePolicy
from megatron_klear.train.rl_data import PromptStream, RolloutBatch, broadcast_batch, \
    collect_batch


# --async-inflight -> the /pause_generation mode of every weight sync (SGLang's names)
INFLIGHT_PAUSE_MODES = {"pause_in_place": "in_place", "pause_retract": "retract",
                        "abort": "abort"}


@dataclass
class RLConfig(TrainConfig):
    """GPPO RL settings (plus every shared trainer flag). Defaults follow Klear-Reasoner."""

    trainer_name = "rl"  # recorded in its checkpoints (not a flag)

    prompt_data: str | None = opt(None, "RL prompts: JSONL or Parquet")
    prompt_key: str = opt("prompt", "prompt field")
    prompt_template: str | None = opt(None, "prompt rendering: chat (the tokenizer's chat "
                                      "template) or raw text; default chat when the tokenizer "
                                      "has a template, else raw", choices=("chat", "raw"))
    chat_template: str | None = opt(None, "Jinja chat template file replacing the tokenizer's")
    answer_key: str = opt("answer", "label field (answer for math, tests for code)")
    answer_format: str | None = opt(None, "label extraction, e.g. gsm8k ('#### N')")
    reward: str = opt("math", "reward name (math, code) or import path pkg.mod:fn")
    rollout_batch_size: int = opt(128, "prompts per RL step")
    mini_batch_size: int = opt(16, "prompts per optimizer step (16 math, 32 code)")
    n_samples_per_prompt: int = opt(8, "responses per prompt (group size)")
    rollout_max_response_len: int = opt(256, "max new tokens per response")
    rollout_max_prompt_len: int = opt(1024, "longest prompt in tokens: the --dry-run memory "
                                      "plan budgets for it (sequences are prompt + "
                                      "--rollout-max-response-len), and --truncate-prompt "
                                      "left|error enforces it in training (Klear: 4096, left)")
    rollout_temperature: float = opt(1.0, "sampling temperature")
    rollout_top_p: float = opt(1.0, "nucleus sampling")
    rollout_urls: list[str] | None = opt(None, "existing SGLang/embedded servers (else embedded)")
    rollout_num_servers: int | None = opt(None, "embedded servers to start when no "
                                          "--rollout-urls (default: one per core of this node, "
                                          "at most 4; each decodes on cores / servers threads)")
    loss_type: str = opt("gppo", "policy loss: gppo (CE-GPPO general beta), ppo (PPO-clip with "
                         "Clip-Higher bounds, DAPO), cispo (MiniMax-M1) or gspo (sequence-level "
                         "ratio; set --eps-clip-low/high ~3e-4/4e-4); docs/policy_loss.md",
                         choices=("gppo", "ppo", "cispo", "gspo"))
    eps_clip_low: float = opt(0.2, "lower clip epsilon")
    eps_clip_high: float = opt(0.28, "upper clip epsilon (Clip-Higher)")
    gppo_beta1: float = opt(1.0, "GPPO gradient weight of the low clip")
    gppo_beta2: float = opt(1.0, "GPPO gradient weight of the high clip")
    dual_clip: float | None = opt(None, "dual-clip bound c for negative advantages")
    sft_alpha: float = opt(0.1, "weight of the SFT loss on fully correct responses")
    advantage_std_norm: bool = opt(True, "divide group advantages by the group std")
    dynamic_sampling: bool = opt(True, "drop zero-advantage groups and refill the batch")
    max_sampling_rounds: int = opt(4, "rollout rounds allowed to refill a batch")
    entropy_ratio_clip: float | None = opt(None, "ERC delta (arXiv 2512.05591), e.g. 0.05: tokens "
                                           "whose entropy ratio current/old policy leaves "
                                           "(1-delta, 1+delta) pass no gradient; unset: off")
    rollout_correction: str = opt("none", "rollout/trainer mismatch correction: truncated IS "
                                  "(tis), masked IS (mis) or IcePop's two-sided mask (icepop); "
                                  "docs/policy_loss.md", choices=MODES)
    rollout_correction_level: str = opt("token", "ratio the correction uses: per token, per "
                                        "sequence (product) or geometric (mean log-ratio of the "
                                        "sequence)", choices=LEVELS)
    rollout_correction_cap: float | None = opt(None, "tis truncates at it, mis/icepop reject "
                                               "above it (default 2 for tis/mis, 5 for icepop)")
    rollout_correction_lower: float | None = opt(None, "mis/icepop reject ratios below it "
                                                 "(default: none for mis, 0.5 for icepop)")
    tis_cap: float | None = opt(None, "alias of --rollout-correction tis "
                                "--rollout-correction-level token --rollout-correction-cap C")
    async_rollout: bool = opt(False, "generate the next steps' batches while this step trains "
                              "(off-policy by up to --max-staleness weight updates; "
                              "docs/training.md)")
    max_staleness: int = opt(1, "with --async-rollout: batches generated ahead, i.e. the most "
                             "weight updates a trained batch's rollout weights may lag")
    async_inflight: str = opt("pause_in_place", "with --async-rollout: what a weight update does "
                              "to requests in flight: SGLang's /pause_generation in_place (keep "
                              "decoding with the new weights), retract (re-prefill the tokens so "
                              "far with the new weights), or abort (regenerate them)",
                              choices=tuple(INFLIGHT_PAUSE_MODES))
    weight_sync_bucket_mb: int = opt(512, "weight-sync bucket size (MiB)")
    weight_sync_format: str = opt("flattened_bucket", "one broadcast per bucket, or per tensor "
                                  "(faster over gloo on CPU: no packing copy)",
                                  choices=("flattened_bucket", "per_tensor"))
    weight_sync_master_addr: str | None = opt(None, "address the rollout servers dial to join "
                                              "the weight-update group (default: this node's "
                                              "address on the route to the first server)")
    probe_weights: bool = opt(True, "after each sync, compare server and trainer log-probs")
    eval_data: str | None = opt(None, "benchmark JSONL for periodic eval")
    eval_interval: int = opt(0, "evaluate every K steps (0: off)")
    eval_k: int = opt(4, "samples per eval problem")
    export_hf: str | None = opt(None, "write the final model in Hugging Face format here")
    # micro-batching of the rollout sequences
    max_tokens_per_gpu: int | None = opt(None, "token budget of one micro-batch: pack rollout "
                                         "sequences (THD, first-fit decreasing) under it; unset: "
                                         "--micro-batch-size x (--rollout-max-prompt-len + "
                                         "--rollout-max-response-len), what a padded "
                                         "micro-batch of the longest sequences holds")
    pack_sequences: bool = opt(True, "THD packs without padding (--no-pack-sequences: "
                               "micro-batches right-padded to the longest sequence)")
    share_prompts: bool | None = opt(None, "carry each prompt once per pack for its n samples "
                                     "(a tree mask, exact; docs/training.md); default: on with "
                                     "THD packs in the local spec and plain RoPE, off under "
                                     "Transformer Engine, whose THD attention cannot express it")
    chat_template_kwargs: str | None = opt(None, "JSON object of chat-template arguments for "
                                           "the prompts, e.g. '{\"enable_thinking\": false}'")
    # rewards scored elsewhere, and shaped (docs/rewards.md)
    reward_url: str | None = opt(None, "score rewards with this HTTP service instead of "
                                 "--reward: POST {prompts, responses, labels} -> {rewards}")
    reward_timeout: float = opt(60.0, "seconds per --reward-url request")
    reward_retries: int = opt(3, "--reward-url retries after a failed or timed-out request")
    overlong_buffer_len: int | None = opt(None, "DAPO overlong shaping: responses longer than "
                                          "--rollout-max-response-len minus this lose reward "
                                          "linearly, up to --overlong-penalty-factor")
    overlong_penalty_factor: float = opt(1.0, "DAPO overlong shaping: the penalty at "
                                         "--rollout-max-response-len tokens")
    # KL to a frozen reference policy (a loss term; docs/policy_loss.md)
    kl_coef: float = opt(0.0, "weight of the KL(policy || reference) loss term (0: off, no "
                         "reference forward)")
    kl_estimator: str = opt("low_var_kl", "per-token KL estimator", choices=KL_ESTIMATORS)
    ref_load: str | None = opt(None, "reference weights: a checkpoint dir or a Hugging Face "
                               "dir (default: --hf-checkpoint); e.g. the SFT checkpoint an RL "
                               "run started from")

    # Klear's released recipe (docs/recipe.md)
    loss_aggregation: str = opt("token-mean", "how per-token losses become the loss: token-mean "
                                "(the paper: mean over the mini-batch's tokens), "
                                "token-mean-micro (Klear's released code: token mean per "
                                "micro-batch x sequences / per-rank mini-batch size, "
                                "averaged over DP), seq-mean-token-sum, seq-mean-token-mean "
                                "(verl's sequence means); the SFT term likewise",
                                choices=LOSS_AGGREGATIONS)
    erc_low: float | None = opt(None, "ERC band lower bound of the entropy ratio (with "
                                "--erc-high; ERC's scripts: 0.95), instead of "
                                "--entropy-ratio-clip's symmetric 1 - delta")
    erc_high: float | None = opt(None, "ERC band upper bound of the entropy ratio (with "
                                 "--erc-low; ERC's scripts: 1.05)")
    rollout_gen_batch_size: int | None = opt(None, "over-generation: prompts generated per "
                                             "round (Klear: 256 for --rollout-batch-size 128);"
                                             " the step trains on the informative groups left,"
                                             " at most --rollout-batch-size, the last "
                                             "mini-batch possibly partial; unset or 0 (to "
                                             "turn a YAML's off): refill to whole mini-batches")
    max_gen_rounds: int | None = opt(None, "generation rounds per step (1: no refill, Klear's "
                                     "max_num_gen_batches=1); default --max-sampling-rounds")
    filter_groups_metric: str = opt("reward", "dynamic sampling drops the groups without "
                                    "spread in this: reward, or acc (reward == the reward's "
                                    "maximum: Klear's filter_groups_metric=acc)",
                                    choices=("reward", "acc"))
    overlong_filter: bool = opt(False, "drop the responses that did not end in EOS before the "
                                "group filter (no loss tokens, not in the group advantages)")
    truncate_prompt: str = opt("off", "rendered prompts longer than --rollout-max-prompt-len: "
                               "left keeps their last tokens (verl's truncation=left, Klear), "
                               "error stops the run naming the prompt, off lets them through",
                               choices=("off", "left", "error"))
    eval_temperature: float | None = opt(None, "--eval-data sampling temperature (Klear: 0.6); "
                                         "default --rollout-temperature")
    eval_top_p: float | None = opt(None, "--eval-data nucleus sampling (Klear: 0.95); default "
                                   "--rollout-top-p")
    colocate: bool = opt(False, "trainer and rollout engines share the GPUs: engines release "
                         "their memory while the trainer (offloaded to CPU otherwise) trains, "
                         "weights go over as tensor handles; docs/rollout.md")
    sglang_mem_fraction_static: float = opt(0.85, "SGLang's --mem-fraction-static of the rollout "
                                            "engines: the share of GPU memory for their weights "
                                            "and KV cache (the --dry-run plan budgets it)")
    sglang_tp_size: int = opt(1, "TP size of each rollout engine; with --colocate one engine runs "
                              "per this many GPUs (embedded servers on CPU: one per this many "
                              "ranks) and the --dry-run plan shards their weights by it")

    def validate_colocation(self) -> None:
        """``--colocate`` and ``--sglang-mem-fraction-static`` checks."""
        if not 0 < self.sglang_mem_fraction_static < 1:
            raise ConfigError(f"--sglang-mem-fraction-static must be in (0, 1), got "
                              f"{self.sglang_mem_fraction_static}")
        if self.sglang_tp_size < 1:
            raise ConfigError(f"--sglang-tp-size must be >= 1, got {self.sglang_tp_size}")
        if not self.colocate:
            return
        if self.rollout_num_servers is not None:
            raise ConfigError("--rollout-num-servers does not apply with --colocate: one engine "
                              "runs per --sglang-tp-size ranks; drop it")
        if self.async_rollout:
            raise ConfigError("--async-rollout cannot run with --colocate: colocated engines and "
                              "trainer take turns on the same GPUs, so nothing is generated "
                              "while the trainer trains; drop one of the two flags")
        if self.weight_sync_format != "flattened_bucket":
            raise ConfigError("--colocate passes weights as SGLang flattened buckets of tensor "
                              "handles; drop --weight-sync-format per_tensor")

    def validate(self) -> None:  # noqa: D102
        # sequences per optimizer step follow from the mini-batch of prompts
        self.global_batch_size = self.mini_batch_size * self.n_samples_per_prompt
        super().validate()
        parse_chat_template_kwargs(self.chat_template_kwargs)
        for name, flag in (("prompt_data", "--prompt-data"), ("hf_checkpoint", "--hf-checkpoint")):
            if not getattr(self, name):
                raise ConfigError(f"{flag} is required")
        if self.rollout_batch_size % self.mini_batch_size:
            raise ConfigError(f"--rollout-batch-size {self.rollout_batch_size} must be a multiple"
                              f" of --mini-batch-size {self.mini_batch_size}")
        if self.loss_type == "gspo" and self.context_parallel_size > 1:
            raise ConfigError("--loss-type gspo takes each response's mean log-ratio, which a "
                              "context-parallel rank holds only a slice of: drop "
                              "--context-parallel-size or use another --loss-type")
        if self.n_samples_per_prompt < 2:
            raise ConfigError("--n-samples-per-prompt must be >= 2 (group advantages)")
        if not 0 < self.eps_clip_low < 1 or self.eps_clip_high <= 0:
            raise ConfigError("--eps-clip-low must be in (0, 1) and --eps-clip-high > 0")
        if self.entropy_ratio_clip is not None and not self.entropy_ratio_clip > 0:
            raise ConfigError(f"--entropy-ratio-clip must be > 0 (ERC's delta, e.g. 0.05), got "
                              f"{self.entropy_ratio_clip}; omit the flag to disable ERC")
        try:
            erc_band(self.entropy_ratio_clip, self.erc_low, self.erc_high)
        except ValueError:
            raise ConfigError(f"ERC's band: give --entropy-ratio-clip DELTA, or both --erc-low "
                              f"and --erc-high with 0 <= low < high (e.g. 0.95 1.05), not both "
                              f"forms; got delta {self.entropy_ratio_clip}, low {self.erc_low},"
                              f" high {self.erc_high}") from None
        self.correction()
        self.validate_generation()
        self.overlong_shaping()
        if self.kl_coef < 0:
            raise ConfigError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if self.ref_load and not self.kl_coef:
            raise ConfigError("--ref-load is the reference of the KL term: set --kl-coef > 0 "
                              "or drop --ref-load")
        if self.reward_timeout <= 0 or self.reward_retries < 0:
            raise ConfigError("--reward-timeout must be > 0 and --reward-retries >= 0")
        if self.async_rollout and self.cpu_threads is None:
            self.cpu_threads = async_share(cpu_threads())
        if self.max_staleness < 1:
            raise ConfigError(f"--max-staleness must be >= 1 (batches generated ahead with "
                              f"--async-rollout), got {self.max_staleness}")
        if not self.async_rollout and (self.max_staleness != 1
                                       or self.async_inflight != "pause_in_place"):
            raise ConfigError("--max-staleness and --async-inflight apply to --async-rollout only; "
                              "add --async-rollout or drop them")
        if self.max_tokens_per_gpu is not None:
            if self.max_tokens_per_gpu < 2:
                raise ConfigError(f"--max-tokens-per-gpu must be >= 2, got "
                                  f"{self.max_tokens_per_gpu}")
            if not self.pack_sequences:
                raise ConfigError("--max-tokens-per-gpu packs sequences; drop "
                                  "--no-pack-sequences")
        if self.context_parallel_size > 1 and self.pack_sequences:
            raise ConfigError(f"--context-parallel-size {self.context_parallel_size}: "
                              f"{THD_CP_UNSUPPORTED}; add --no-pack-sequences (padded "
                              "micro-batches) or drop context parallelism")
        if self.share_prompts and (not self.pack_sequences
                                   or self.transformer_impl != "local"):
            raise ConfigError("--share-prompts needs THD packs in the local spec (Transformer "
                              "Engine's THD attention cannot express its tree mask): drop "
                              "--no-pack-sequences / use --transformer-impl local, or drop "
                              "--share-prompts")
        self.validate_colocation()

    def resolve_share_prompts(self, arch: Qwen3Arch) -> bool:
        """Settle ``--share-prompts`` for ``arch``: as given, or by default on wherever its
        tree mask is exact and runs (THD packs, the local spec, plain RoPE)."""
        if self.share_prompts and arch.rope_scaling:
            raise ConfigError(f"--share-prompts continues a prompt's RoPE positions in its "
                              f"samples' branches, which needs plain RoPE; {self.hf_checkpoint}"
                              "/config.json sets rope_scaling: drop --share-prompts")
        if self.share_prompts is None:
            self.share_prompts = (self.pack_sequences and self.transformer_impl == "local"
                                  and not arch.rope_scaling)
            if self.transformer_impl != "local" and torch.distributed.get_rank() == 0:
                print("notice: prompt sharing is off: Transformer Engine's THD attention cannot "
                      "express its tree mask (--transformer-impl local shares prompts)",
                      file=sys.stderr)
        return self.share_prompts

    def overlong_shaping(self) -> OverlongShaping | None:
        """DAPO's overlong reward shaping, or None without ``--overlong-buffer-len``."""
        if self.overlong_buffer_len is None:
            return None
        try:
            return OverlongShaping(self.rollout_max_response_len, self.overlong_buffer_len,
                                   self.overlong_penalty_factor)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def remote_reward(self) -> RemoteReward | None:
        """The ``--reward-url`` service, or None (rewards scored here by ``--reward``)."""
        if not self.reward_url:
            return None
        return RemoteReward(self.reward_url, self.reward_timeout, self.reward_retries)

    def validate_generation(self) -> None:
        """Over-generation flags (Klear's recipe, docs/recipe.md)."""
        if self.rollout_gen_batch_size == 0:  # a command line's "off" over a YAML's value
            self.rollout_gen_batch_size = None
        gen = self.rollout_gen_batch_size
        if gen is not None and (gen < self.rollout_batch_size or not self.dynamic_sampling):
            raise ConfigError(f"--rollout-gen-batch-size {gen} over-generates for dynamic "
                              f"sampling: it needs --dynamic-sampling and >= "
                              f"--rollout-batch-size {self.rollout_batch_size}")
        if self.max_gen_rounds is not None and self.max_gen_rounds < 1:
            raise ConfigError(f"--max-gen-rounds must be >= 1 (1: no refill), got "
                              f"{self.max_gen_rounds}")

    def correction(self) -> RolloutCorrection | None:
        """The rollout correction in effect (``--tis-cap`` C = tis / token / cap C), or None."""
        if self.tis_cap is not None:
            if self.rollout_correction != "none":
                raise ConfigError("--tis-cap C is an alias of --rollout-correction tis "
                                  "--rollout-correction-level token --rollout-correction-cap C;"
                                  " give one or the other")
            if not self.tis_cap > 0:
                raise ConfigError(f"--tis-cap must be > 0, got {self.tis_cap}")
            return RolloutCorrection("tis", "token", self.tis_cap)
        if self.rollout_correction == "none":
            if self.rollout_correction_cap is not None or self.rollout_correction_lower is not None:
                raise ConfigError("--rollout-correction-cap / --rollout-correction-lower need "
                                  "--rollout-correction tis, mis or icepop")
            return None
        try:
            return RolloutCorrection(self.rollout_correction, self.rollout_correction_level,
                                     self.rollout_correction_cap, self.rollout_correction_lower)
        except ValueError as e:
            raise ConfigError(str(e)) from None


FIELDS = ("loss_mask", "advantages", "positive", "rollout_logprobs")  # per-label loss inputs


def is_positive(batch: RolloutBatch, i: int) -> bool:
    """Sample ``i`` scored the reward's maximum (the SFT term's positives, whatever the scale:
    1 for the 0/1 and the +-1 rewards)."""
    return batch.is_kept(i) and batch.rewards[i] >= batch.max_score


def sample_fields(batch: RolloutBatch, i: int) -> tuple[list[int], dict[str, list[float]]]:
    """Sample ``i`` as one sequence (prompt + response) and its per-label loss inputs.

    labels[t] is token t+1; loss_mask marks the response tokens; advantages, ``positive``
    (fully correct response) and rollout log-probs are aligned with the labels.
    """
    p, resp = batch.prompt_ids[i], batch.response_ids[i]
    ctx, n = [0.0] * (len(p) - 1), len(resp)
    lp = list(batch.rollout_logprobs[i][:n])
    fields = {"loss_mask": ctx + [float(batch.is_kept(i))] * n,
              "advantages": ctx + [float(batch.advantages[i])] * n,
              "positive": ctx + [float(is_positive(batch, i))] * n,
              "rollout_logprobs": ctx + lp + [0.0] * (n - len(lp))}
    if batch.routed_experts and batch.routed_experts[i] is not None:
        fields["routed_experts"] = batch.routed_experts[i]  # [labels, layers, k]
    return p + resp, fields


def pad_microbatches(batch: RolloutBatch, rows: Sequence[int], micro: int, pad_id: int,
                     seq_len: int) -> list[dict]:
    """Micro-batches of ``micro`` whole sequences right-padded to ``seq_len`` next-token
    positions (``--no-pack-sequences``: the padded reference layout)."""
    out = []
    for start in range(0, len(rows), micro):
        chunk = rows[start:start + micro]
        d = {k: torch.zeros(len(chunk), seq_len) for k in FIELDS}
        tokens = torch.full((len(chunk), seq_len + 1), pad_id, dtype=torch.long)
        for r, i in enumerate(chunk):
            seq, fields = sample_fields(batch, i)
            tokens[r, :len(seq)] = torch.tensor(seq)
            experts = fields.pop("routed_experts", None)
            if experts is not None:  # padding replays a real row: k distinct experts
                d.setdefault("routed_experts", experts.new_zeros(
                    (len(chunk), seq_len, *experts.shape[1:])))
                d["routed_experts"][r] = experts[-1]
                d["routed_experts"][r, :len(experts)] = experts
            for k, v in fields.items():
                d[k][r, :len(v)] = torch.tensor(v)
        d.update(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                 position_ids=torch.arange(seq_len).expand(len(chunk), seq_len))
        out.append(d)
    return out


def pack_microbatches(batch: RolloutBatch, rows: Sequence[int], cfg: "RLConfig",
                      pad_id: int) -> list[dict]:
    """THD micro-batches of ``rows`` without padding: first-fit-decreasing packs under the
    token budget (:func:`token_budget`; with ``--share-prompts``, of prompt units, each prompt
    carried once)."""
    units = prompt_units(batch, rows, cfg)
    budget = token_budget(cfg)
    sizes = [unit_positions(batch, u, cfg.share_prompts) for u in units]
    if max(sizes) > budget:
        if cfg.max_tokens_per_gpu:
            raise ConfigError(f"--max-tokens-per-gpu {cfg.max_tokens_per_gpu} is smaller than a "
                              f"rollout sequence of {max(sizes)} tokens; raise it to at "
                              "least the longest prompt + --rollout-max-response-len")
        budget = max(sizes)  # the default budget: a prompt over --rollout-max-prompt-len
    groups = [[r for u in b for r in units[u]]
              for b in pack_bins([n + 1 for n in sizes], budget, window=None)]
    out = []
    for group in groups:
        seqs, fields = zip(*(sample_fields(batch, r) for r in group))
        out.append(thd_pack(seqs, {k: [f[k] for f in fields] for k in fields[0]}, pad_id=pad_id,
                            multiple=cfg.tensor_model_parallel_size,
                            prompt_lens=[len(batch.prompt_ids[r]) for r in group]
                            if cfg.share_prompts else None))
    return out


def async_share(cores: int) -> int:
    """The cores each side gets by default under ``--async-rollout``, where the trainer and
    the embedded servers run at the same time: half (synchronous runs take turns, so each
    side gets them all)."""
    return max(1, cores // 2)


def token_budget(cfg: "RLConfig") -> int:
    """Next-token positions per THD micro-batch (a multiple of the TP size): under
    ``--max-tokens-per-gpu``, or by default those of ``--micro-batch-size`` sequences of the
    longest prompt and response, so the default pack needs no more memory than a padded
    micro-batch would at worst, and fills it."""
    tokens = cfg.max_tokens_per_gpu or cfg.micro_batch_size * (
        cfg.rollout_max_prompt_len + cfg.rollout_max_response_len)
    return tokens - tokens % cfg.tensor_model_parallel_size


def prompt_units(batch: RolloutBatch, rows: Sequence[int], cfg: "RLConfig") -> list[list[int]]:
    """``rows`` in the pieces that train together: with ``--share-prompts`` the runs of rows
    of one prompt (split where the run's pack would exceed the token budget), else each row
    alone."""
    if not cfg.share_prompts:
        return [[r] for r in rows]
    budget, units = token_budget(cfg), []
    for r in rows:
        if units and batch.prompt_ids[units[-1][0]] == batch.prompt_ids[r] and (
                unit_positions(batch, units[-1] + [r], True) <= budget):
            units[-1].append(r)
        else:
            units.append([r])
    return units


def unit_positions(batch: RolloutBatch, rows: Sequence[int], share: bool) -> int:
    """Next-token positions of ``rows`` (a prompt unit: one prompt) in one pack, the prompt
    shared or not."""
    lengths = row_lengths(batch, rows)
    if share:
        return run_positions(len(batch.prompt_ids[rows[0]]), lengths)
    return sum(n - 1 for n in lengths)


def rollout_microbatches(batch: RolloutBatch, rows: Sequence[int], cfg: "RLConfig",
                         pad_id: int) -> list[dict]:
    """This DP rank's micro-batches of the mini-batch ``rows``, packed or padded."""
    if cfg.pack_sequences:
        units = prompt_units(batch, rows, cfg)
        mine = dp_rows(units, [unit_positions(batch, u, cfg.share_prompts) for u in units])
        return pack_microbatches(batch, [r for u in mine for r in u], cfg, pad_id)
    mine = dp_rows(rows, row_lengths(batch, rows))
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)) - 1
    multiple = sequence_multiple(cfg.context_parallel_size, cfg.tensor_model_parallel_size,
                                 cfg.sequence_parallel)  # CP chunks, SP's split over TP
    seq_len = -(-seq_len // multiple) * multiple
    return pad_microbatches(batch, mine, cfg.micro_batch_size, pad_id, seq_len)


def dp_rows(rows: Sequence, lengths: Sequence[int]) -> list:
    """This data-parallel rank's share of ``rows`` (or of prompt units; ``lengths`` their
    token counts), balanced by tokens so the ranks reach the gradient all-reduce together
    (:func:`balance`: longest first onto the rank with the fewest tokens, as slime's balanced
    split). The loss stays exact however rows are split: every rank divides by the
    mini-batch's token count. Returned in batch order."""
    owner = balance(lengths, parallel_state.get_data_parallel_world_size())
    r = parallel_state.get_data_parallel_rank()
    return [row for row, o in zip(rows, owner) if o == r]


def row_lengths(batch: RolloutBatch, rows: Sequence[int]) -> list[int]:
    """Tokens (prompt + response) of each of ``rows``."""
    return [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]


def fill_logprobs(logits: torch.Tensor, batch: dict, vocab_size: int, temperature: float,
                  backend: str, key: str = "old_logprobs", entropy_key: str | None = "entropy"
                  ) -> None:
    """Set ``batch[key]`` (log-probs of the labels) and ``batch[entropy_key]`` of a
    micro-batch from its logits (no gradient)."""
    lp, ent = vocab_parallel_logprobs(logits, batch["labels"],
                                      tp_group=parallel_state.get_tensor_model_parallel_group(),
                                      compute_entropy=entropy_key is not None,
                                      temperature=temperature, vocab_size=vocab_size,
                                      backend=backend)
    batch[key] = lp.float()
    if entropy_key is not None:
        batch[entropy_key] = ent.float()


def old_logprobs(engine: Engine, mbs: list[dict], vocab_size: int, temperature: float,
                 **keys: str | None) -> None:
    """Fill ``old_logprobs`` and ``entropy`` of each micro-batch with the model's current
    weights (other keys through ``keys``, as :func:`fill_logprobs`)."""
    if not mbs:
        return
    backend = loss_backend(engine.cfg.loss_backend)

    def fwd(logits, batch):
        fill_logprobs(logits, batch, vocab_size, temperature, backend, **keys)
        # on the logits' device: megatron's MoE schedule multiplies it by the CUDA loss scale
        return logits.new_zeros(()), {}

    engine.forward_only(mbs, fwd)


def sequence_ids(b: dict) -> torch.Tensor:
    """Each label's sequence in a micro-batch: THD ``segment_ids`` or the row of a padded one."""
    if "segment_ids" in b:
        return b["segment_ids"]
    rows = b["loss_mask"].shape[0]
    return torch.arange(rows, device=b["loss_mask"].device)[:, None].expand_as(b["loss_mask"])


def micro_counts(b: dict) -> MicroCounts:
    """A whole micro-batch's response tokens, positive tokens and responses (int64)."""
    if "micro_counts" in b:   # counted before any context-parallel slicing
        return MicroCounts(*b["micro_counts"].unbind())
    mask = b["loss_mask"] > 0
    seqs = sequence_ids(b)[mask].unique().numel()
    return MicroCounts(mask.sum(), (mask & (b["positive"] > 0)).sum(),
                       torch.tensor(seqs, device=mask.device))


def seq_tokens(b: dict) -> torch.Tensor:
    """Each label's response length (its sequence's masked tokens), shaped like the labels."""
    ids, mask = sequence_ids(b), b["loss_mask"] > 0
    shifted = ids - ids.min()   # THD marks padding -1
    counts = torch.zeros(int(shifted.max()) + 1, dtype=torch.float32, device=mask.device)
    counts.index_add_(0, shifted[mask], torch.ones(int(mask.sum()), device=mask.device))
    return counts[shifted]


def annotate_aggregation(mbs: list[dict]) -> None:
    """Store each micro-batch's counts and per-token response lengths before the engine
    slices it for context parallelism (the aggregations need whole-micro-batch numbers)."""
    for b in mbs:
        b["micro_counts"] = torch.stack(list(micro_counts(b)))
        b["seq_tokens"] = seq_tokens(b)


def aggregation_totals(batch: RolloutBatch, rows: Sequence[int],
                       mini_sequences: int | None = None) -> AggregationTotals:
    """The mini-batch ``rows``' counts that ``--loss-aggregation`` divides by: tokens of the
    trained responses; sequences = ``mini_sequences``, the configured mini-batch size in
    responses (verl divides a partial last mini-batch by it too), default the trained rows."""
    kept = [i for i in rows if batch.is_kept(i)]
    pos = [i for i in kept if is_positive(batch, i)]
    return AggregationTotals(float(sum(len(batch.response_ids[i]) for i in kept)),
                             float(sum(len(batch.response_ids[i]) for i in pos)),
                             float(mini_sequences or len(kept)), float(len(pos)),
                             parallel_state.get_data_parallel_world_size())


def policy_loss_fn(cfg: RLConfig, vocab_size: int, n_tokens: float, n_positive: float,
                   totals: AggregationTotals | None = None):
    """GPPO (or PPO/CISPO) + alpha * SFT aggregated as ``--loss-aggregation`` says (default: each
    a token-level mean over the mini-batch, whose counts ``n_tokens`` / ``n_positive`` are),
    with the optional rollout correction (weights on the advantages) and ERC (old entropy per
    token). ``totals``: the mini-batch's counts (:func:`aggregation_totals`), needed by the
    other aggregations."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    backend = loss_backend(cfg.loss_backend)
    correction = cfg.correction()
    erc = erc_band(cfg.entropy_ratio_clip, cfg.erc_low, cfg.erc_high) is not None
    if totals is None:
        if cfg.loss_aggregation != "token-mean":
            raise ValueError(f"--loss-aggregation {cfg.loss_aggregation} needs the mini-batch's "
                             "totals (aggregation_totals)")
        totals = AggregationTotals(n_tokens, n_positive, 0.0, 0.0,
                                   parallel_state.get_data_parallel_world_size())

    def loss_fn(logits, b):
        mask = b["loss_mask"]
        if "old_logprobs" not in b:  # first mini-batch: the policy has not moved, old = current
            fill_logprobs(logits, b, vocab_size, cfg.rollout_temperature, backend)
        old = b["old_logprobs"]
        adv = b["advantages"]
        tokens = mask.sum()
        metrics = {}
        if correction is not None:  # rollout engine vs trainer mismatch
            weights, corr = rollout_correction_weights(old, b["rollout_logprobs"], mask,
                                                       sequence_ids(b), correction)
            adv = adv * weights
            metrics.update({f"train/rollout_correction_{k}": v * tokens for k, v in corr.items()})
        out = vocab_parallel_policy_loss(
            logits, b["labels"], old, adv, mask, loss_type=cfg.loss_type,
            eps_low=cfg.eps_clip_low, eps_high=cfg.eps_clip_high, beta1=cfg.gppo_beta1,
            beta2=cfg.gppo_beta2, dual_clip=cfg.dual_clip,
            entropy_ratio_clip=cfg.entropy_ratio_clip, old_entropy=b["entropy"] if erc else None,
            temperature=cfg.rollout_temperature, compute_entropy=False, tp_group=tp_group,
            vocab_size=vocab_size, backend=backend,
            inplace_backward=True,  # logits are not read after backward
            erc_low=cfg.erc_low, erc_high=cfg.erc_high, reduction="none",
            sequence_ids=sequence_ids(b))
        seq_len = b["seq_tokens"] if "seq_tokens" in b else seq_tokens(b)
        loss, pg, sft = aggregate_rl_loss(
            cfg.loss_aggregation, out.loss, -out.logprobs, mask, b["positive"], cfg.sft_alpha,
            totals, seq_tokens=seq_len, micro=micro_counts(b))
        if cfg.kl_coef:  # aggregated as the policy term
            kl = kl_per_token(out.logprobs, b["ref_logprobs"], cfg.kl_estimator)
            _, kl_loss, _ = aggregate_rl_loss(cfg.loss_aggregation, kl, torch.zeros_like(kl),
                                              mask, b["positive"], 0.0, totals,
                                              seq_tokens=seq_len, micro=micro_counts(b))
            loss = loss + cfg.kl_coef * kl_loss
            metrics.update({"train/kl_loss": kl_loss.detach(),
                            "train/kl": (kl.detach() * mask).sum()})
        metrics.update({f"train/{k}": v.detach() * tokens for k, v in out.metrics.items()})
        mismatch = ((old - b["rollout_logprobs"]).abs() * mask).sum()
        metrics.update({"train/policy_loss": pg.detach(), "train/sft_loss": sft.detach(),
                        "train/loss": loss.detach(), "train/tokens": tokens,
                        "train/entropy": (b["entropy"] * mask).sum(),
                        "train/mismatch_abs_logprob": mismatch})
        return loss, metrics

    return loss_fn


def train_on_batch(engine: Engine, cfg: RLConfig, batch: RolloutBatch, pad_id: int,
                   reference: ReferencePolicy | None = None) -> dict:
    """Old (and reference) log-probs, then one optimizer step per mini-batch; returns
    averaged metrics."""
    vocab = engine.arch.vocab_size
    per_mini = cfg.mini_batch_size * batch.group_size
    minis = [list(range(s, min(s + per_mini, len(batch)))) for s in range(0, len(batch), per_mini)]
    mbs_per_mini = [rollout_microbatches(batch, rows, cfg, pad_id) for rows in minis]
    for mbs in mbs_per_mini:
        annotate_aggregation(mbs)
    t0 = time.time()
    if reference is not None:
        with reference.swapped_in():
            old_logprobs(engine, [mb for mbs in mbs_per_mini for mb in mbs], vocab,
                         cfg.rollout_temperature, key="ref_logprobs", entropy_key=None)
    t_ref = time.time() - t0
    t0 = time.time()
    # the first mini-batch trains on the policy that sampled: its old log-probs come from its
    # own training forward (policy_loss_fn); the later ones need the pre-update policy
    old_logprobs(engine, [mb for mbs in mbs_per_mini[1:] for mb in mbs], vocab,
                 cfg.rollout_temperature)
    t_old = time.time() - t0
    totals: dict[str, float] = {}
    t0 = time.time()
    for rows, mbs in zip(minis, mbs_per_mini):
        counts = aggregation_totals(batch, rows, per_mini)
        m = engine.train_step(mbs, policy_loss_fn(cfg, vocab, counts.tokens,
                                                  counts.positive_tokens, counts))
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + v
    t_train = time.time() - t0
    steps = len(minis)
    tokens = totals.pop("train/tokens", 0.0)
    out = {}
    for k, v in totals.items():  # token-weighted metrics -> means; per-step ones -> averages
        token_weighted = k.startswith("train/") and k not in (
            "train/policy_loss", "train/sft_loss", "train/kl_loss", "train/loss")
        out[k] = v / max(tokens, 1.0) if token_weighted else v / steps
    n_train = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    if reference is not None:
        out["time/ref_logprob_s"] = t_ref
    out.update({"time/old_logprob_s": t_old, "time/train_s": t_train,
                "train/tokens_per_s": n_train / max(t_train, 1e-9), "train/optimizer_steps": steps})
    return out


@contextlib.contextmanager
def rollout_servers(cfg: RLConfig):
    """The rollout servers of the run: given URLs, or embedded servers started here (rank 0;
    with ``--colocate`` one per ``--sglang-tp-size`` ranks)."""
    from megatron_klear.rollout.launcher import connect, embedded_server_layout, \
        launch_embedded_servers

    if cfg.rollout_urls:
        yield connect(cfg.rollout_urls)
    elif torch.distributed.get_rank() == 0:
        count, threads = embedded_server_layout(
            max(torch.distributed.get_world_size() // cfg.sglang_tp_size, 1)
            if cfg.colocate else cfg.rollout_num_servers,  # colocated: one per engine TP group
            async_share(len(os.sched_getaffinity(0))) if cfg.async_rollout else None)
        with launch_embedded_servers(cfg.hf_checkpoint, count, seed=cfg.seed,
                                     num_threads=threads) as servers:
            broadcast_batch(servers.urls)
            yield servers
    else:
        yield connect(broadcast_batch(None))


def train(cfg: RLConfig) -> list[dict]:
    """Run GPPO RL; returns this run's per-step metrics."""
    from megatron_klear.data.prompts import load_prompt_dataset, load_tokenizer
    from megatron_klear.rollout.client import RolloutClient, SamplingParams
    from megatron_klear.rollout.weight_sync import WeightSync

    arch = qwen3_config_from_hf(load_hf_config(cfg.hf_checkpoint))
    tokenizer = load_tokenizer(cfg.hf_checkpoint, cfg.prompt_template, cfg.chat_template,
                               parse_chat_template_kwargs(cfg.chat_template_kwargs))
    prompts = load_prompt_dataset(cfg.prompt_data, prompt_key=cfg.prompt_key,
                                  answer_key=cfg.answer_key, answer_format=cfg.answer_format)
    engine = build_engine(cfg, arch)
    cfg.resolve_share_prompts(arch)
    info = restore_or_init(engine)
    reference = ReferencePolicy(engine, cfg.ref_load or cfg.hf_checkpoint) \
        if cfg.kl_coef else None
    step, consumed = (info.iteration, info.extra["consumed_prompts"]) if info else (0, 0)
    stream = PromptStream(prompts, cfg.seed, consumed)
    if cfg.use_routing_replay and not arch.is_moe:
        raise ConfigError(f"--use-routing-replay replays MoE routing, and "
                          f"{cfg.hf_checkpoint}/config.json is a dense model: drop the flag")
    params = SamplingParams(n=cfg.n_samples_per_prompt, max_new_tokens=cfg.rollout_max_response_len,
                            temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p,
                            stop_token_ids=[tokenizer.eos_token_id],
                            return_routed_experts=cfg.use_routing_replay)
    log = MetricsLogger(cfg.log_dir or cfg.save, total_steps=cfg.train_iters, start_step=step,
                        desc="rl", progress=cfg.progress_bar, log_interval=cfg.log_interval,
                        wandb=wandb_settings(cfg))
    history: list[dict] = []
    with rollout_servers(cfg) as servers:
        client = RolloutClient(servers.urls)
        if cfg.colocate:
            sync = colocated_sync(cfg, servers.urls, engine, arch, client)
            colo = Colocation(engine, client if torch.distributed.get_rank() == 0 else None)
        else:
            # synchronous runs have nothing in flight at a sync: abort + flush is the clean state
            sync = WeightSync(servers.urls, engine.model, arch,
                              bucket_bytes=cfg.weight_sync_bucket_mb * 2**20,
                              load_format=None if cfg.weight_sync_format == "per_tensor"
                              else cfg.weight_sync_format,
                              master_addr=cfg.weight_sync_master_addr, rollout_client=client,
                              pause_mode=INFLIGHT_PAUSE_MODES[cfg.async_inflight]
                              if cfg.async_rollout else "abort",
                              flush_cache=not cfg.async_rollout)
            colo = None
        sync.connect()
        if colo is not None:  # servers start from the trainer's weights; the trainer leaves
            colo.release_engines()
            colo.sync_and_probe(sync, str(step), probe=False)
        else:
            sync.sync(weight_version=str(step))  # servers start from the trainer's weights
        with contextlib.closing(rollout_source(cfg, client, tokenizer, stream, params,
                                               step)) as source:
            freeze_startup_heap()  # model, data and clients stay; full collections skip them
            while step < cfg.train_iters:
                metrics = rl_step(engine, cfg, source, tokenizer, step, reference,
                                  colo.before_train if colo is not None else None)
                step += 1
                metrics.update(colo.sync_and_probe(sync, str(step), cfg.probe_weights)
                               if colo is not None else
                               sync_and_probe(engine, cfg, sync, str(step)))
                source.weights_updated(step)
                if cfg.eval_data and cfg.eval_interval and step % cfg.eval_interval == 0:
                    metrics.update(periodic_eval(cfg, client, tokenizer))
                log.log(step, metrics)
                history.append(metrics)
                if cfg.save and (step == cfg.train_iters or
                                 (cfg.save_interval and step % cfg.save_interval == 0)):
                    with colo.trainer_resident() if colo else contextlib.nullcontext():
                        engine.save(step, {"consumed_prompts": metrics["data/consumed_prompts"]})
        sync.close()
        if colo is not None:
            colo.close()
    log.close()
    if cfg.export_hf:
        engine.export_hf(cfg.export_hf, cfg.hf_checkpoint)
    return history


def colocated_sync(cfg: RLConfig, urls: list[str], engine: Engine, arch: Any,
                   client: Any) -> Any:
    """The weight sync of ``--colocate``: tensor handles to the engines on this node."""
    from megatron_klear.rollout.tensor_sync import TensorWeightSync

    return TensorWeightSync(urls, engine.model, arch, rollout_client=client,
                            bucket_bytes=cfg.weight_sync_bucket_mb * 2**20)


def rollout_source(cfg: RLConfig, client: Any, tokenizer: Any, stream: PromptStream,
                   params: Any, step: int) -> RolloutSource:
    """The run's batches from ``stream``: collected when a step starts, or with
    ``--async-rollout`` up to ``--max-staleness`` steps ahead (train/async_rollout.py)."""
    collect = functools.partial(collect_batch, client, tokenizer, stream, cfg.rollout_batch_size,
                                params, cfg.reward, dynamic_sampling=cfg.dynamic_sampling,
                                max_rounds=cfg.max_gen_rounds or cfg.max_sampling_rounds,
                                normalize_std=cfg.advantage_std_norm,
                                gen_batch_size=cfg.rollout_gen_batch_size,
                                filter_metric=cfg.filter_groups_metric,
                                overlong_filter=cfg.overlong_filter,
                                prompt_limit=(cfg.rollout_max_prompt_len, cfg.truncate_prompt),
                                remote=cfg.remote_reward(), overlong=cfg.overlong_shaping())
    return RolloutSource(collect, stream, ahead=cfg.max_staleness if cfg.async_rollout else 0,
                         last_step=cfg.train_iters, version=step)


def rl_step(engine: Engine, cfg: RLConfig, source: RolloutSource, tokenizer: Any,
            step: int, reference: ReferencePolicy | None = None,
            before_train: Any = None) -> dict:
    """Take step ``step``'s batch on rank 0 (generated now or ahead), share it, train on it;
    ``before_train()`` (colocated mode: the hand-over of the GPUs) runs before training and
    returns metrics."""
    t0 = time.time()
    got = source.next(step) if torch.distributed.get_rank() == 0 else None
    batch, cursor, version = broadcast_batch(
        (got.batch, got.cursor, got.version) if got else None)
    metrics = dict(batch.stats)
    metrics["time/rollout_s"] = time.time() - t0  # async: only the wait for the batch
    metrics["rollout/staleness"] = float(step - version)  # weight updates since it began
    metrics["data/prompt_indices"] = sorted(set(batch.prompt_index))
    metrics["data/consumed_prompts"] = cursor  # the checkpoint resumes after this batch
    usable = trainable_groups(cfg, batch.groups(), parallel_state.get_data_parallel_world_size())
    if usable == 0:  # fewer informative groups than one mini-batch even after refilling
        metrics["train/skipped_step"] = 1.0
        return metrics
    batch = batch.select_groups(range(usable))
    shape_routed_experts(batch, engine.arch.num_layers, engine.arch.num_experts_per_tok)
    if before_train is not None:
        metrics.update(before_train())
    metrics.update(train_on_batch(engine, cfg, batch, tokenizer.pad_token_id, reference))
    return metrics


def shape_routed_experts(batch: RolloutBatch, num_layers: int, top_k: int) -> None:
    """The rollout's flat expert ids as [prompt + response - 1, layers, k] per sample (one row
    per label: the expert ids of the token it follows), checked against the sequence."""
    for i, flat in enumerate(batch.routed_experts):
        if flat is None:
            continue
        positions = len(batch.prompt_ids[i]) + len(batch.response_ids[i]) - 1
        if flat.numel() != positions * num_layers * top_k:
            raise ValueError(f"sample {i}: the rollout's routed_experts hold {flat.numel()} "
                             f"ids, not {positions} tokens x {num_layers} layers x {top_k}; "
                             "the server must answer return_routed_experts for the whole "
                             "sequence (routed_experts_start_len 0)")
        batch.routed_experts[i] = flat.view(positions, num_layers, top_k)


def trainable_groups(cfg: RLConfig, groups: int, dp: int) -> int:
    """How many of a step's ``groups`` informative groups train: whole mini-batches, or with
    over-generation (Klear) all of them up to --rollout-batch-size, rounded down so that the
    responses split evenly over the ``dp`` data-parallel ranks (the official code rounds its
    trajectories to the world size; the last mini-batch may be partial)."""
    if cfg.rollout_gen_batch_size is None:
        return groups // cfg.mini_batch_size * cfg.mini_batch_size
    usable = min(groups, cfg.rollout_batch_size)
    while usable and usable * cfg.n_samples_per_prompt % dp:
        usable -= 1
    return usable


def sync_and_probe(engine: Engine, cfg: RLConfig, sync: Any, version: str) -> dict:
    """Push new weights to the servers and, optionally, check them with a log-prob probe."""
    from megatron_klear.rollout.weight_sync import probe_asker, probe_ids, probe_metrics, \
        trainer_sequence_logprobs

    engine.gather_params()  # the distributed optimizer may defer the all-gather
    metrics = dict(sync.sync(weight_version=version))
    if cfg.probe_weights:
        ids = probe_ids(engine.arch)
        pending = sync.request_probe(ids) if probe_asker() else None  # servers work meanwhile
        trainer_lp = trainer_sequence_logprobs(engine.model, engine.arch, ids)
        metrics.update(probe_metrics(sync, ids, trainer_lp, pending))
    return metrics


def periodic_eval(cfg: RLConfig, client: Any, tokenizer: Any) -> dict:
    """avg@k / pass@k of the current policy on ``--eval-data`` (rank 0 evaluates)."""
    from megatron_klear.eval.evaluate import Benchmark, evaluate
    from megatron_klear.rollout.client import SamplingParams

    report = None
    if torch.distributed.get_rank() == 0:
        bench = Benchmark(name="eval", path=cfg.eval_data, reward=cfg.reward,
                          prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                          answer_format=cfg.answer_format)
        params = SamplingParams(max_new_tokens=cfg.rollout_max_response_len,
                                temperature=cfg.rollout_temperature
                                if cfg.eval_temperature is None else cfg.eval_temperature,
                                top_p=cfg.rollout_top_p if cfg.eval_top_p is None
                                else cfg.eval_top_p,
                                stop_token_ids=[tokenizer.eos_token_id])
        report = evaluate(client, tokenizer, [bench], k=cfg.eval_k, params=params,
                          progress=False)["eval"]
    report = broadcast_batch(report)
    return {f"eval/{k}": v for k, v in report.items()}


def memory_workload(cfg: RLConfig) -> Workload:
    """What the RL trainer feeds the model (the dry run's memory plan): THD packs of
    ``--max-tokens-per-gpu`` tokens, by default ``--micro-batch-size`` prompt + response rows,
    under the fused policy loss unless --loss-backend torch; with --kl-coef, the
    reference's weights in host memory."""
    return Workload(cfg.rollout_max_prompt_len + cfg.rollout_max_response_len,
                    fused_loss=cfg.loss_backend != "torch",
                    tokens=cfg.max_tokens_per_gpu, reference_on_host=cfg.kl_coef > 0)


def main(argv: Sequence[str] | None = None) -> None:
    """``klear-rl``: parse flags, run RL, exit non-zero with a clear message on bad input."""
    from megatron_klear.cli import trainer_main

    trainer_main(RLConfig, train, argv, "klear-rl", workload=memory_workload)


if __name__ == "__main__":
    main()
