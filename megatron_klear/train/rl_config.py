"""``klear-rl``'s settings: every GPPO RL flag (plus the shared trainer flags) and their checks.

The flags come in sections (config.py's :class:`~megatron_klear.config.Section`): prompts
(shared with klear-eval), rollout, dynamic sampling, async rollout, sampling, reward,
policy loss, micro-batches, weight sync, eval, colocation. Each checks its own flags;
:meth:`RLConfig.derive` sets the values that follow from others.
"""

from __future__ import annotations

import os
import sys
import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_klear.algo.rl_objective import PolicyLossFlags
from megatron_klear.config import ConfigError, Section, TrainConfig, opt
from megatron_klear.data.microbatches import MicroBatchLayout
from megatron_klear.data.prompt_flags import PromptFlags
from megatron_klear.rewards import check_reward
from megatron_klear.rewards.remote import RemoteReward
from megatron_klear.rewards.shaping import OverlongShaping
from megatron_klear.rollout.orchestration.request import SamplingParams
from megatron_klear.rollout.orchestration.tool_flags import ToolFlags, check_tools_chat_template
from megatron_klear.train.context_parallel import THD_CP_UNSUPPORTED
from megatron_klear.train.engine import cpu_threads
from megatron_klear.train.opd_flags import OPDFlags
from megatron_klear.train.rl_data import DynamicSamplingFlags


def async_share(cores: int) -> int:
    """The cores each side gets by default under ``--async-rollout``, where the trainer and
    the embedded servers run at the same time: half (synchronous runs take turns, so each
    side gets them all)."""
    return max(1, cores // 2)


# --async-inflight -> the /pause_generation mode of every weight sync (SGLang's names)
INFLIGHT_PAUSE_MODES = {"pause_in_place": "in_place", "pause_retract": "retract",
                        "abort": "abort"}


@dataclass
class RolloutFlags(Section):
    """The prompts of a step, their samples, and the servers that generate them."""

    title = "rollout"
    prompt_data: str | None = opt(None, "RL prompts: JSONL or Parquet")
    rollout_batch_size: int = opt(128, "prompts per RL step")
    mini_batch_size: int = opt(16, "prompts per optimizer step (16 math, 32 code)")
    n_samples_per_prompt: int = opt(8, "responses per prompt (group size)")
    rollout_max_prompt_len: int = opt(1024, "longest prompt in tokens: the --dry-run memory "
                                      "plan budgets for it (sequences are prompt + "
                                      "--rollout-max-response-len), and --truncate-prompt "
                                      "left|error enforces it in training (Klear: 4096, left)")
    truncate_prompt: str = opt("off", "rendered prompts longer than --rollout-max-prompt-len: "
                               "left keeps their last tokens (verl's truncation=left, Klear), "
                               "error stops the run naming the prompt, off lets them through",
                               choices=("off", "left", "error"))
    rollout_urls: list[str] | None = opt(None, "existing SGLang/embedded servers (else embedded)")
    rollout_num_servers: int | None = opt(None, "embedded servers to start when no "
                                          "--rollout-urls (default: one per core of this node, "
                                          "at most 4; each decodes on cores / servers threads)")
    deterministic_rollout: bool = opt(False, "embedded servers decode batch-invariantly: each "
                                      "sequence alone, so its tokens and log-probs do not depend "
                                      "on the batch or server that served it (slower; "
                                      "docs/rollout.md)")
    true_on_policy_mode: bool = opt(False, "embedded servers round their forward as the "
                                    "trainer's (fp32): the weight-sync probe reads exactly 0 at "
                                    "TP=1 (docs/rollout.md)")

    def validate_section(self) -> None:  # noqa: D102
        for name, flag in (("prompt_data", "--prompt-data"), ("hf_checkpoint", "--hf-checkpoint")):
            if not getattr(self, name):
                raise ConfigError(f"{flag} is required")
        for name in ("rollout_batch_size", "mini_batch_size", "rollout_max_prompt_len",
                     "rollout_num_servers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name, server_flag in (("deterministic_rollout", "--enable-batch-invariant"),
                                  ("true_on_policy_mode", "--rl-on-policy-target megatron")):
            if getattr(self, name) and self.rollout_urls:
                raise ConfigError(f"--{name.replace('_', '-')} sets up the embedded servers this "
                                  "run starts, not --rollout-urls: drop --rollout-urls, or start "
                                  f"embedded servers there with {server_flag}")
        if self.rollout_batch_size % self.mini_batch_size:
            raise ConfigError(f"--rollout-batch-size {self.rollout_batch_size} must be a multiple"
                              f" of --mini-batch-size {self.mini_batch_size}")
        if self.n_samples_per_prompt < 2:
            raise ConfigError("--n-samples-per-prompt must be >= 2 (group advantages)")

    def check_inputs_section(self, model: Any) -> None:  # noqa: D102
        self.check_prompts("--prompt-data", self.prompt_data)

    step_sequences_flag = "--mini-batch-size x --n-samples-per-prompt"

    @property
    def step_sequences(self) -> int:
        """Sequences per optimizer step: a mini-batch of prompts x their samples."""
        return self.mini_batch_size * self.n_samples_per_prompt


@dataclass
class SamplingFlags(Section):
    """The rollout's sampling (one :class:`~megatron_klear.rollout.orchestration.request.SamplingParams`
    contract with klear-eval's --temperature / --top-p / --max-new-tokens)."""

    title = "sampling"
    rollout_max_response_len: int = opt(256, "max new tokens per response")
    rollout_temperature: float = opt(1.0, "sampling temperature")
    rollout_top_p: float = opt(1.0, "nucleus sampling")

    def validate_section(self) -> None:  # noqa: D102
        self.sampling_params().check_flags({"max_new_tokens": "--rollout-max-response-len",
                                            "temperature": "--rollout-temperature",
                                            "top_p": "--rollout-top-p"})
        if self.rollout_max_response_len < 1:
            raise ConfigError(f"--rollout-max-response-len must be >= 1, got "
                              f"{self.rollout_max_response_len}")

    def sampling_params(self, **request: Any) -> SamplingParams:
        """The rollout's sampling params (``request``: stop tokens, seed, ...)."""
        return SamplingParams(n=self.n_samples_per_prompt,
                              max_new_tokens=self.rollout_max_response_len,
                              temperature=self.rollout_temperature, top_p=self.rollout_top_p,
                              return_routed_experts=self.use_routing_replay, **request)


@dataclass
class RolloutStageFlags(Section):
    """The rollout pipeline's stages (rollout/orchestration/pipeline.py), replaceable by name or import path."""

    title = "rollout stages"
    rollout_stages: list[str] | None = opt(None, "rollout pipeline stages, KIND=NAME or "
                                           "KIND=pkg.mod:fn: generate=, score=, advantages= "
                                           "replace the built-in stage, each filter= adds one "
                                           "before the zero-advantage group filter "
                                           "(docs/rollout.md)")

    def validate_section(self) -> None:
        """Each entry well formed, its stage registered or importable."""
        from megatron_klear.rollout.orchestration.pipeline import build_pipeline

        try:
            build_pipeline(self.rollout_stages)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class AsyncRolloutFlags(Section):
    """Generating ahead while the trainer trains."""

    title = "async rollout"
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

    def validate_section(self) -> None:  # noqa: D102
        if self.max_staleness < 1:
            raise ConfigError(f"--max-staleness must be >= 1 (batches generated ahead with "
                              f"--async-rollout), got {self.max_staleness}")
        if not self.async_rollout and (self.max_staleness != 1
                                       or self.async_inflight != "pause_in_place"):
            raise ConfigError("--max-staleness and --async-inflight apply to --async-rollout only; "
                              "add --async-rollout or drop them")


@dataclass
class RewardFlags(Section):
    """How responses are scored: a reward function here or an HTTP service, and shaping."""

    title = "reward"
    reward: str = opt("math", "reward name (math, code) or import path pkg.mod:fn")
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

    def validate_section(self) -> None:  # noqa: D102
        if self.reward_timeout <= 0 or self.reward_retries < 0:
            raise ConfigError("--reward-timeout must be > 0 and --reward-retries >= 0")
        self.overlong_shaping()

    def check_inputs_section(self, model: Any) -> None:
        """The reward resolves: a registered name, or an import path that imports."""
        check_reward(self.reward)

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


@dataclass
class MicroBatchFlags(Section):
    """How rollout sequences become micro-batches: padding, THD packs, shared prompts."""

    title = "micro-batches"
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

    def validate_section(self) -> None:  # noqa: D102
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

    def check_inputs_section(self, model: Any) -> None:  # noqa: D102
        if self.share_prompts and model is not None and model.rope_scaling:
            raise ConfigError(f"--share-prompts continues a prompt's RoPE positions in its "
                              f"samples' branches, which needs plain RoPE; {self.hf_checkpoint}"
                              "/config.json sets rope_scaling: drop --share-prompts")


@dataclass
class WeightSyncFlags(Section):
    """Pushing the trainer's weights to the rollout servers, and checking them."""

    title = "weight sync"
    weight_sync_bucket_mb: int = opt(512, "weight-sync bucket size (MiB)")
    weight_sync_format: str = opt("flattened_bucket", "one broadcast per bucket, or per tensor "
                                  "(faster over gloo on CPU: no packing copy)",
                                  choices=("flattened_bucket", "per_tensor"))
    weight_sync_master_addr: str | None = opt(None, "address the rollout servers dial to join "
                                              "the weight-update group (default: this node's "
                                              "address on the route to the first server)")
    probe_weights: bool = opt(True, "after a sync, compare server and trainer log-probs of a "
                              "fixed sequence (weight_sync/probe_max_abs_diff), on the steps "
                              "--probe-interval names")
    probe_interval: int = opt(10, "probe after the first sync of the run (or of a resume) and "
                              "after every K-th step's; 1: every step. Per step it costs a "
                              "forward on each side, ~5-10%% of a tiny CPU model's step "
                              "(docs/training.md)")

    def validate_section(self) -> None:  # noqa: D102
        if self.weight_sync_bucket_mb < 1:
            raise ConfigError(f"--weight-sync-bucket-mb must be >= 1, got "
                              f"{self.weight_sync_bucket_mb}")
        if self.probe_interval < 1:
            raise ConfigError(f"--probe-interval must be >= 1 (1: probe every step), got "
                              f"{self.probe_interval}")

    def probe_due(self, step: int, first: bool) -> bool:
        """Whether the sync after ``step`` (1-based) is probed: ``first`` (the first sync
        after this process's first step, which a resume's reload also reaches) or every
        --probe-interval steps."""
        return self.probe_weights and (first or step % self.probe_interval == 0)


@dataclass
class EvalFlags(Section):
    """Periodic evaluation on a benchmark during training."""

    title = "eval"
    eval_data: str | None = opt(None, "benchmark JSONL for periodic eval")
    eval_interval: int = opt(0, "evaluate every K steps (0: off)")
    eval_k: int = opt(4, "samples per eval problem")
    eval_temperature: float | None = opt(None, "--eval-data sampling temperature (Klear: 0.6); "
                                         "default --rollout-temperature")
    eval_top_p: float | None = opt(None, "--eval-data nucleus sampling (Klear: 0.95); default "
                                   "--rollout-top-p")

    def validate_section(self) -> None:  # noqa: D102
        if self.eval_interval < 0 or self.eval_k < 1:
            raise ConfigError("--eval-interval must be >= 0 and --eval-k >= 1")
        self.eval_sampling_params().check_flags({"temperature": "--eval-temperature",
                                                 "top_p": "--eval-top-p"})

    def check_inputs_section(self, model: Any) -> None:  # noqa: D102
        if self.eval_data:
            self.check_prompts("--eval-data", self.eval_data)

    def eval_sampling_params(self, **request: Any) -> SamplingParams:
        """Sampling of ``--eval-data``: the rollout's, with the eval temperature / top-p."""
        return SamplingParams(max_new_tokens=self.rollout_max_response_len,
                              temperature=self.rollout_temperature
                              if self.eval_temperature is None else self.eval_temperature,
                              top_p=self.rollout_top_p if self.eval_top_p is None
                              else self.eval_top_p, **request)


@dataclass
class ColocationFlags(Section):
    """Trainer and rollout engines on the same GPUs (docs/rollout.md)."""

    title = "colocation"
    colocate: bool = opt(False, "trainer and rollout engines share the GPUs: engines release "
                         "their memory while the trainer (offloaded to CPU otherwise) trains, "
                         "weights go over as tensor handles; docs/rollout.md")
    sglang_mem_fraction_static: float = opt(0.85, "SGLang's --mem-fraction-static of the rollout "
                                            "engines: the share of GPU memory for their weights "
                                            "and KV cache (the --dry-run plan budgets it)")
    rollout_engine_memory: str | None = opt(
        None, "with --colocate --rollout-urls: the engines' memory as they are handed over -- "
        "launched (as python -m sglang.launch_server leaves them, holding weights and KV cache: "
        "the trainer releases them before it builds its model) or released (a launch script "
        "released kv_cache and weights); required there, checked against engines that report "
        "it; docs/rollout.md", choices=("launched", "released"))
    sglang_tp_size: int = opt(1, "TP size of each rollout engine; with --colocate one engine runs "
                              "per this many GPUs (embedded servers on CPU: one per this many "
                              "ranks) and the --dry-run plan shards their weights by it")

    def validate_section(self) -> None:
        """``--colocate`` and ``--sglang-mem-fraction-static`` checks."""
        if not 0 < self.sglang_mem_fraction_static < 1:
            raise ConfigError(f"--sglang-mem-fraction-static must be in (0, 1), got "
                              f"{self.sglang_mem_fraction_static}")
        if self.sglang_tp_size < 1:
            raise ConfigError(f"--sglang-tp-size must be >= 1, got {self.sglang_tp_size}")
        if not self.colocate or not self.rollout_urls:
            if self.rollout_engine_memory is not None:
                raise ConfigError("--rollout-engine-memory applies only with --colocate and "
                                  "--rollout-urls (engines this run did not start); drop it")
            if not self.colocate:
                return
        elif self.rollout_engine_memory is None:
            raise ConfigError("--colocate --rollout-urls needs --rollout-engine-memory: launched "
                              "(engines as python -m sglang.launch_server starts them; the "
                              "trainer releases them) or released (kv_cache and weights "
                              "released, as run_rl_colocate.sh did before issue 51); a wrong "
                              "guess ends SGLang's scheduler at the first release or resume")
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
        if self.pipeline_model_parallel_size > 1:  # rollout/transport/tensor_sync.py's rule, up front
            raise ConfigError("--colocate with --pipeline-model-parallel-size > 1: every engine "
                              "needs every stage's weights on its own GPU; use "
                              "--pipeline-model-parallel-size 1")


@dataclass
class RLConfig(OPDFlags, ToolFlags, ColocationFlags, EvalFlags, WeightSyncFlags, MicroBatchFlags,
               PolicyLossFlags, RewardFlags, AsyncRolloutFlags, DynamicSamplingFlags,
               RolloutStageFlags, SamplingFlags, RolloutFlags, PromptFlags, TrainConfig):
    """GPPO RL settings (plus every shared trainer flag). Defaults follow Klear-Reasoner."""

    trainer_name = "rl"  # recorded in its checkpoints (not a flag)
    unread_flags = {
        "global_batch_size": "klear-rl trains --mini-batch-size x --n-samples-per-prompt "
                             "sequences per optimizer step",
        "seq_length": "klear-rl's sequences are --rollout-max-prompt-len + "
                      "--rollout-max-response-len tokens (THD packs of --max-tokens-per-gpu)"}

    def validate(self) -> None:
        """Each section's own checks, then the rules that tie sections together."""
        super().validate()
        if self.loss_type == "gspo" and self.context_parallel_size > 1:
            raise ConfigError("--loss-type gspo takes each response's mean log-ratio, which a "
                              "context-parallel rank holds only a slice of: drop "
                              "--context-parallel-size or use another --loss-type")

    def micro_batch_layout(self) -> MicroBatchLayout:
        """The flags of several sections that shape RL micro-batches (data/microbatches.py):
        packing, the token budget, the rollout lengths and the parallel split."""
        return MicroBatchLayout(**{f.name: getattr(self, f.name)
                                   for f in dataclasses.fields(MicroBatchLayout)})

    def check_inputs(self, model: Any) -> None:
        """Each section's checks, then, with ``--tools`` and the model on this machine, that
        its chat template (or ``--chat-template``) renders tool turns: the dry run refuses
        what the real run would."""
        super().check_inputs(model)
        if self.tools and model is not None:
            from megatron_klear.data.prompts import load_tokenizer, parse_chat_template_kwargs

            tokenizer = load_tokenizer(self.hf_checkpoint, self.prompt_template,
                                       self.chat_template,
                                       parse_chat_template_kwargs(self.chat_template_kwargs))
            check_tools_chat_template(tokenizer,
                                      self.multi_turn_config(self.rollout_max_response_len))

    def derive(self, model: Any = None) -> None:
        """The values that follow from others, after validation: sequences per optimizer
        step, a YAML's over-generation turned off by 0, each side's cores under
        ``--async-rollout``, and (with ``model``, the checkpoint's architecture) the
        ``--share-prompts`` default."""
        self.global_batch_size = self.step_sequences
        if self.rollout_gen_batch_size == 0:  # a command line's "off" over a YAML's value
            self.rollout_gen_batch_size = None
        if self.async_rollout and self.cpu_threads is None:
            self.cpu_threads = async_share(cpu_threads())
        if model is not None and self.share_prompts is None:
            self.share_prompts = (self.pack_sequences and self.transformer_impl == "local"
                                  and not model.rope_scaling)
            if self.transformer_impl != "local" and os.environ.get("RANK", "0") == "0":
                print("notice: prompt sharing is off: Transformer Engine's THD attention cannot "
                      "express its tree mask (--transformer-impl local shares prompts)",
                      file=sys.stderr)
