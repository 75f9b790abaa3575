"""One typed config with Megatron-style CLI flags and YAML files, in sections.

Every dataclass field is a flag: ``tensor_model_parallel_size`` is
``--tensor-model-parallel-size``. A YAML file given with ``--config`` supplies defaults
(keys with dashes or underscores); flags on the command line override it. Unknown keys,
flags a trainer does not read, and inconsistent values fail with a :class:`ConfigError`
naming the flag.

The flags come in **sections** (:class:`Section` dataclasses mixed into the trainer
configs: checkpoints, parallelism, memory, batch, optimizer and schedule, logging; klear-rl
adds prompts, rollout, reward, policy loss, ...). A section checks its own flags in
``validate_section`` (flags alone, at parse time) and, optionally,
``check_inputs_section(model)``
(against the files on this machine and the model's config.json: ``preflight()`` in
train/dry_run.py runs it before the dry run and before a real run builds anything).
Validation never changes a value; values that follow from others are set afterwards, in one
place: ``derive()``, which ``preflight()`` calls once the model is known.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence, TypeVar

import yaml

__all__ = ["ConfigError", "OneLineParser", "Section", "TrainConfig", "parse_config", "flag",
           "to_dict", "LAYOUT_FIELDS", "add_layout_flags", "add_section_flags", "parallel_layout",
           "layout_from_args", "section_from_args", "with_peft_adapter_values",
           "PEFT_ADAPTER_CONFIG", "PEFT_ADAPTER_WEIGHTS"]

T = TypeVar("T", bound="TrainConfig")
S = TypeVar("S", bound="Section")

# megatron-core's selective-recompute modules that exist in a dense (non-MoE, non-MLA) model
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
# the HF (PEFT) module names LoRA can target (models/lora.py maps them to megatron's layers)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a PEFT LoRA folder's files (--lora-load; checkpoint/peft_io.py writes and reads them)
PEFT_ADAPTER_CONFIG, PEFT_ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class ConfigError(ValueError):
    """A bad configuration value; the message names the flag and the fix."""


def flag(name: str) -> str:
    """The CLI flag of a config field."""
    return "--" + name.replace("_", "-")


def opt(default: Any, help: str, choices: Sequence | None = None) -> Any:
    """A config field with its help text (and allowed values)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Section:
    """A group of flags with its own checks; the trainer configs mix sections together.

    A subclass sets ``title`` (its ``--help`` group) and may define ``validate_section()``
    (the flags alone) and ``check_inputs_section(model)`` (files and the model's config.json;
    ``model`` is a :class:`~megatron_klear.models.qwen3.Qwen3Arch`, or None when no
    config.json is on this machine). Each is looked up in the section's own class body, so
    every section's checks run once, whatever the mix.
    """

    title: ClassVar[str] = ""

    @classmethod
    def sections(cls) -> list[type["Section"]]:
        """The sections of this config, in flag order."""
        return [c for c in reversed(cls.__mro__)
                if isinstance(c, type) and issubclass(c, Section) and "title" in c.__dict__
                and c.__dict__["title"]]

    def part(self, section: type[S]) -> S:
        """``section`` of this config as an object of its own, holding its fields only: what
        the part of the trainer that reads those flags receives, instead of the whole
        config (the flat flags, YAML keys and messages stay as they are)."""
        return section(**{name: getattr(self, name) for name in section.section_fields()})

    @classmethod
    def section_fields(cls) -> tuple[str, ...]:
        """The fields (flags) declared by this section itself."""
        names = {f.name for f in dataclasses.fields(cls)}
        return tuple(n for n in cls.__dict__.get("__annotations__", {}) if n in names)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the flag of the first inconsistent value (each
        section's ``validate_section``, in flag order). Never changes a value."""
        for section in self.sections():
            check = section.__dict__.get("validate_section")
            if check is not None:
                check(self)

    def check_inputs(self, model: Any) -> None:
        """Each section's ``check_inputs(model)``: data files, reward, model-dependent flags."""
        for section in self.sections():
            check = section.__dict__.get("check_inputs_section")
            if check is not None:
                check(self, model)

    def derive(self, model: Any = None) -> None:
        """Set the values that follow from others (after :meth:`validate`); a no-op here."""


def _at_least(cfg: Any, names: Sequence[str], low: int) -> None:
    """Every field of ``names`` (None: unset, skipped) is >= ``low``."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < low:
            raise ConfigError(f"{flag(name)} must be >= {low}, got {value}")


@dataclass
class CheckpointFlags(Section):
    """The model to start from and the checkpoints to load and save."""

    title = "model and checkpoints"
    hf_checkpoint: str | None = opt(None, "Hugging Face Qwen3 dir: architecture, tokenizer, "
                                          "and initial weights unless --load has a checkpoint")
    load: str | None = opt(None, "checkpoint dir to resume or initialise from")
    save: str | None = opt(None, "checkpoint dir to save to")
    save_interval: int = opt(0, "save every K steps (0: only at the end)")
    keep_last: int = opt(2, "keep the last N checkpoints")
    # loading another stage's checkpoint (issue 28), as Megatron-LM's flags
    finetune: bool = opt(False, "take only the weights of --load's checkpoint: start at step 0 "
                                "with a fresh optimizer, LR schedule, data cursor and RNG "
                                "(implied for a checkpoint of another trainer or the converter)")
    no_load_optim: bool = opt(False, "resume without the checkpoint's optimizer and LR-schedule "
                                     "state")
    no_load_rng: bool = opt(False, "resume without the checkpoint's RNG states")
    export_hf: str | None = opt(None, "write the final model in Hugging Face format here")
    export_hf_interval: int = opt(0, "also export every K steps before the last, to "
                                     "<--export-hf>_step<N> (0: only the final model)")

    def validate_section(self) -> None:  # noqa: D102
        _at_least(self, ("keep_last",), 1)
        _at_least(self, ("save_interval", "export_hf_interval"), 0)
        if self.export_hf_interval and not self.export_hf:
            raise ConfigError("--export-hf-interval needs --export-hf DIR (the intermediate "
                              "models go to DIR_step<N>)")


@dataclass
class ParallelFlags(Section):
    """Tensor, pipeline, context and expert parallelism."""

    title = "parallelism"
    tensor_model_parallel_size: int = opt(1, "tensor-parallel size")
    pipeline_model_parallel_size: int = opt(1, "pipeline-parallel size")
    # larger-model layouts (issue 15): uneven and interleaved pipeline stages, context parallel
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "decoder layers of the first pipeline stage (uneven PP; the rest split evenly)")
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "decoder layers of the last pipeline stage (uneven PP; the rest split evenly)")
    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None, "layers per model chunk: interleaved 1F1B with (layers per stage / this) chunks")
    context_parallel_size: int = opt(1, "context-parallel size: each rank of the CP group "
                                        "holds 1/cp of every sequence (needs "
                                        "--transformer-impl transformer_engine)")
    # Qwen3-MoE expert parallelism (issue 15)
    expert_model_parallel_size: int = opt(1, "expert-parallel size (MoE; carved out of the "
                                             "data-parallel ranks)")
    expert_tensor_parallel_size: int | None = opt(None, "tensor-parallel size of the experts "
                                                        "(default: --tensor-model-parallel-size)")
    moe_token_dispatcher_type: str = opt("alltoall", "MoE token dispatcher",
                                         choices=("alltoall", "allgather"))
    moe_aux_loss_coeff: float | None = opt(None, "MoE load-balancing loss coefficient "
                                                 "(default: config.json router_aux_loss_coef; "
                                                 "0: off)")
    use_routing_replay: bool = opt(False, "MoE routing replay (klear-rl): the trainer's "
                                          "routers use the experts the rollout chose for each "
                                          "token (docs/moe.md)")

    def validate_section(self) -> None:
        """Sizes, context parallelism (TE attention, load-balanced chunks) and MoE flags."""
        _at_least(self, ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                         "context_parallel_size", "expert_model_parallel_size",
                         "expert_tensor_parallel_size"), 1)
        cp = self.context_parallel_size
        if cp > 1 and self.transformer_impl != "transformer_engine":
            raise ConfigError(f"--context-parallel-size {cp} needs --transformer-impl "
                              "transformer_engine (the local attention cannot attend across "
                              "CP ranks)")
        if cp > 1 and self.seq_length % (2 * cp):
            raise ConfigError(f"--context-parallel-size {cp} needs --seq-length "
                              f"{self.seq_length} to be a multiple of 2 x {cp} (load-balanced "
                              "chunks)")
        if self.moe_aux_loss_coeff is not None and self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.use_routing_replay:
            clash = [f for f, on in (("--sequence-parallel", self.sequence_parallel),
                                     ("--context-parallel-size", self.context_parallel_size > 1),
                                     ("--recompute-granularity", self.recompute_granularity),
                                     ("--num-layers-per-virtual-pipeline-stage",
                                      self.num_layers_per_virtual_pipeline_stage))
                     if on]
            if clash:
                raise ConfigError(f"--use-routing-replay does not yet split the replayed experts "
                                  f"as {clash[0]} splits tokens or recomputes layers: drop one "
                                  "of them")

    def check_inputs_section(self, model: Any) -> None:
        """MoE-only flags on a dense model (``model``: the checkpoint's config.json)."""
        if model is None or model.is_moe:
            return
        moe_only = [f for f, on in (("--use-routing-replay", self.use_routing_replay),
                                    ("--expert-model-parallel-size",
                                     self.expert_model_parallel_size > 1),
                                    ("--expert-tensor-parallel-size",
                                     self.expert_tensor_parallel_size is not None),
                                    ("--moe-aux-loss-coeff", self.moe_aux_loss_coeff is not None))
                    if on]
        if moe_only:
            raise ConfigError(f"{moe_only[0]} applies to MoE models, and {self.hf_checkpoint}"
                              "/config.json is a dense model: drop the flag")

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (``--expert-tensor-parallel-size``, else TP)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


@dataclass
class MemoryFlags(Section):
    """GPU-scale memory features (issue 13) and the layer implementation."""

    title = "memory and kernels"
    sequence_parallel: bool = opt(False, "sequence parallelism over the TP group (needs TP > 1)")
    recompute_granularity: str | None = opt(None, "activation recompute",
                                            choices=(None, "full", "selective"))
    recompute_method: str | None = opt(None, "full recompute: which layers",
                                       choices=(None, "uniform", "block"))
    recompute_num_layers: int | None = opt(None, "full recompute: layers per group (uniform) "
                                                 "or recomputed layers per stage (block)")
    recompute_modules: list[str] | None = opt(None, "selective recompute: modules, e.g. "
                                                    "core_attn")
    use_distributed_optimizer: bool = opt(False, "shard optimizer state over data-parallel ranks")
    overlap_grad_reduce: bool = opt(False, "overlap the DP grad reduce with backward")
    overlap_param_gather: bool = opt(False, "overlap the DP param all-gather with forward "
                                            "(needs --use-distributed-optimizer)")
    optimizer_cpu_offload: bool = opt(False, "keep optimizer state and master weights on CPU")
    transformer_impl: str = opt("local", "layer implementation: transformer_engine (GPU) or "
                                         "megatron-core's local spec",
                                choices=("transformer_engine", "local"))
    loss_backend: str = opt("auto", "fused loss backend; auto: cuda on GPU (error if the "
                                    "extension lacks CUDA), cpu kernel on CPU",
                            choices=("auto", "cuda", "cpu", "torch"))
    gpu_memory_gb: float = opt(80.0, "per-GPU memory the --dry-run memory plan must fit")
    host_memory_gb: float | None = opt(
        None, "host memory per node the --dry-run plan must fit: pinned offload buffers and "
        "KL reference copies, and each trainer process's own (unset: printed, not checked)")

    def validate_section(self) -> None:
        """Sequence parallel, recompute and distributed-optimizer flags that contradict."""
        _at_least(self, ("gpu_memory_gb",), 1)
        if self.host_memory_gb is not None:
            _at_least(self, ("host_memory_gb",), 1)
        if self.sequence_parallel and self.tensor_model_parallel_size < 2:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it "
                              "splits activations over the TP group)")
        if self.sequence_parallel and self.seq_length % self.tensor_model_parallel_size:
            raise ConfigError(f"--sequence-parallel needs --seq-length {self.seq_length} to be a "
                              f"multiple of --tensor-model-parallel-size "
                              f"{self.tensor_model_parallel_size}")
        self._validate_recompute()
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")
        if self.optimizer_cpu_offload and not self.use_distributed_optimizer:
            raise ConfigError("--optimizer-cpu-offload needs --use-distributed-optimizer")
        if self.optimizer_cpu_offload and not self.bf16:
            # megatron-core 0.16.1's DistributedOptimizer hands its fp32 parameter shards (views)
            # to the CPU-offloading optimizer, which torch refuses ("can't optimize a non-leaf
            # Tensor"); with bf16 parameters it gets the shards' fp32 copies
            raise ConfigError("--optimizer-cpu-offload needs --bf16 (megatron-core's offloading "
                              "optimizer cannot take fp32 parameters); add --bf16 or drop "
                              "--optimizer-cpu-offload")

    def _validate_recompute(self) -> None:
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            raise ConfigError("--recompute-granularity full needs --recompute-method "
                              "{uniform,block} and --recompute-num-layers N")
        if not full and (self.recompute_method is not None or
                         self.recompute_num_layers is not None):
            raise ConfigError("--recompute-method and --recompute-num-layers apply only to "
                              "--recompute-granularity full")
        _at_least(self, ("recompute_num_layers",), 1)
        if self.recompute_modules and self.recompute_granularity != "selective":
            raise ConfigError("--recompute-modules applies only to --recompute-granularity "
                              "selective")
        bad = sorted(set(self.recompute_modules or ()) - set(RECOMPUTE_MODULES))
        if bad:
            raise ConfigError(f"--recompute-modules {bad}: not a dense-model module; choose from "
                              f"{list(RECOMPUTE_MODULES)}")


@dataclass
class BatchFlags(Section):
    """Sequences per micro-batch and per optimizer step."""

    title = "batch"
    micro_batch_size: int = opt(1, "sequences per micro-batch")
    global_batch_size: int = opt(8, "sequences per optimizer step (across data-parallel ranks)")
    seq_length: int = opt(512, "sequence length (packing bin size)")

    # the flag(s) of step_sequences, for the messages
    step_sequences_flag: ClassVar[str] = "--global-batch-size"

    @property
    def step_sequences(self) -> int:
        """Sequences per optimizer step: ``--global-batch-size`` (klear-rl derives it)."""
        return self.global_batch_size

    def validate_section(self) -> None:  # noqa: D102
        _at_least(self, ("micro_batch_size", "global_batch_size", "seq_length"), 1)
        if self.step_sequences % self.micro_batch_size:
            raise ConfigError(f"{self.step_sequences_flag} = {self.step_sequences} must be a "
                              f"multiple of --micro-batch-size {self.micro_batch_size}")


@dataclass
class OptimizerFlags(Section):
    """AdamW, the learning-rate schedule, precision and the run's length."""

    title = "optimizer and schedule"
    lr: float = opt(1e-5, "peak learning rate")
    min_lr: float = opt(0.0, "minimum learning rate of the decay")
    lr_decay_style: str = opt("constant", "LR decay", choices=("constant", "cosine", "linear"))
    lr_warmup_iters: int = opt(0, "linear warmup steps")
    lr_decay_iters: int | None = opt(None, "decay steps (default: --train-iters)")
    train_iters: int = opt(10, "optimizer steps to run")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "gradient clipping by global norm (0: off)")
    bf16: bool = opt(False, "bf16 parameters and compute (GPU)")
    cpu_threads: int | None = opt(None, "torch CPU threads per rank (default: this node's "
                                  "cores / its ranks; torchrun's OMP_NUM_THREADS=1 would leave "
                                  "the other cores idle)")
    seed: int = opt(1234, "random seed")

    def validate_section(self) -> None:
        """Counts, the LR range, and warm-up against decay as megatron-core's
        OptimizerParamScheduler asserts it (warm-up < decay steps, whatever the style)."""
        _at_least(self, ("cpu_threads",), 1)
        _at_least(self, ("train_iters", "lr_warmup_iters", "lr_decay_iters"), 0)
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} must be between 0 and --lr {self.lr}")
        if self.lr_warmup_iters and self.lr_warmup_iters >= max(self.decay_iters, 1):
            given = ("--lr-decay-iters" if self.lr_decay_iters is not None
                     else "--train-iters (the default of --lr-decay-iters)")
            raise ConfigError(f"--lr-warmup-iters {self.lr_warmup_iters} must be smaller than the "
                              f"decay steps {self.decay_iters} of {given}: lower the warm-up or "
                              f"set --lr-decay-iters above {self.lr_warmup_iters}")

    @property
    def decay_iters(self) -> int:
        """Steps over which the LR decays."""
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters


@dataclass
class LoggingFlags(Section):
    """Console, metrics files, Weights & Biases, and the dry run."""

    title = "logging"
    log_dir: str | None = opt(None, "metrics.jsonl and TensorBoard events (default: --save)")
    log_interval: int = opt(1, "print metrics every K steps")
    progress_bar: bool = opt(True, "console progress bar (--no-progress-bar: JSON lines)")
    dry_run: bool = opt(False, "validate the config against the launch (WORLD_SIZE), the data "
                               "files and the model (when --hf-checkpoint exists here), print "
                               "it and the per-GPU memory plan, and exit (non-zero when it "
                               "does not fit --gpu-memory-gb)")
    # Weights & Biases (optional: pip install wandb); the same metrics as TensorBoard
    wandb_project: str | None = opt(None, "log metrics to this W&B project (unset: no W&B)")
    wandb_run_name: str | None = opt(None, "W&B run name (default: W&B's generated name)")
    wandb_mode: str = opt("online", "W&B mode: offline writes the run under --wandb-dir for "
                          "a later `wandb sync`", choices=("online", "offline"))
    wandb_dir: str | None = opt(None, "W&B files (default: the log dir: --log-dir or --save)")

    def validate_section(self) -> None:
        """The log interval; W&B flags need a project, and the wandb package here."""
        import importlib.util

        _at_least(self, ("log_interval",), 0)
        given = [n for n in ("wandb_run_name", "wandb_dir") if getattr(self, n) is not None]
        if self.wandb_mode != "online":
            given.append("wandb_mode")
        if not self.wandb_project:
            if given:
                raise ConfigError(f"{flag(given[0])} needs --wandb-project NAME (W&B logging is "
                                  "off without a project)")
            return
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("--wandb-project needs the wandb package: pip install wandb "
                              "(or drop --wandb-project)")


@dataclass
class LoraFlags(Section):
    """LoRA adapters on the base's linear layers (issue 41; models/lora.py, docs/lora.md)."""

    title = "LoRA"
    lora_rank: int = opt(0, "LoRA rank r (0: full fine-tuning); the base is frozen and only the "
                            "adapters train, save and get optimizer state")
    lora_alpha: float = opt(16.0, "LoRA alpha: the adapters' output is scaled by alpha / r (as "
                                  "PEFT)")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input (PEFT's lora_dropout)")
    lora_target_modules: list[str] | None = opt(
        None, "HF module names that get adapters (PEFT's target_modules), from q_proj k_proj "
              "v_proj o_proj gate_proj up_proj down_proj (default: all seven)")
    lora_load: str | None = opt(
        None, "PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) to "
              "start from, on the base of --load or --hf-checkpoint; its r, lora_alpha and "
              "target_modules are the run's unless --lora-rank / --lora-alpha / "
              "--lora-target-modules are given, which must then agree with them")

    def validate_section(self) -> None:
        """The LoRA flags: rank, alpha, dropout and targets (the names PEFT uses)."""
        if self.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be >= 0 (0: no LoRA), got {self.lora_rank}")
        lora_only = [n for n, on in (("lora_target_modules", self.lora_target_modules),
                                     ("lora_dropout", self.lora_dropout),
                                     ("lora_load", self.lora_load)) if on]
        if not self.lora_rank:
            if lora_only:
                raise ConfigError(f"{flag(lora_only[0])} needs --lora-rank R > 0")
            return
        if self.lora_alpha <= 0:
            raise ConfigError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        bad = sorted(set(self.lora_target_modules or ()) - set(LORA_TARGETS))
        if bad or self.lora_target_modules == []:
            raise ConfigError(f"--lora-target-modules {bad or '[]'}: choose from "
                              f"{list(LORA_TARGETS)}")

    def check_inputs_section(self, model: Any) -> None:
        """``--lora-load``'s weights file is here (its config was read when the flags parsed)."""
        weights = Path(self.lora_load or ".") / PEFT_ADAPTER_WEIGHTS
        if self.lora_load and not weights.is_file():
            raise ConfigError(f"--lora-load {self.lora_load}: {weights} not found; a PEFT LoRA "
                              f"folder holds {PEFT_ADAPTER_CONFIG} and {PEFT_ADAPTER_WEIGHTS}")


# LoraConfig fields that, when set, make PEFT compute what this project's LoRA does not
_PEFT_UNSUPPORTED = ("use_dora", "use_rslora", "bias", "lora_bias", "rank_pattern",
                     "alpha_pattern", "modules_to_save", "layers_to_transform",
                     "exclude_modules", "fan_in_fan_out", "use_qalora", "layer_replication",
                     "target_parameters", "trainable_token_indices", "alora_invocation_tokens")


def with_peft_adapter_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (the flags given, by field name) with ``lora_rank``, ``lora_alpha`` and
    ``lora_target_modules`` taken from ``--lora-load``'s adapter_config.json where not given.

    A given flag that differs from the adapter's value, an adapter PEFT builds differently
    from this project's LoRA (DoRA, rsLoRA, biases, per-layer ranks, ...) or a missing or
    unreadable config raise :class:`ConfigError` naming the file, the field and the flag, at
    parse time (the dry run too), before any model is built."""
    folder = values.get("lora_load")
    if not folder:
        return values
    path = Path(folder) / PEFT_ADAPTER_CONFIG
    try:
        peft = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--lora-load {folder}: cannot read {path} ({exc}); a PEFT LoRA "
                          f"folder holds {PEFT_ADAPTER_CONFIG} and {PEFT_ADAPTER_WEIGHTS}") \
            from None
    if not isinstance(peft, dict) or peft.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"--lora-load {path}: not a PEFT LoRA config (peft_type must be LORA)")
    for key in _PEFT_UNSUPPORTED:
        if peft.get(key) not in (None, False, "none", {}, []):
            raise ConfigError(f"--lora-load {path}: {key} {peft[key]!r} is not supported (plain "
                              "LoRA only); merge the adapter into the base or retrain it")
    targets, rank, alpha = peft.get("target_modules"), peft.get("r"), peft.get("lora_alpha")
    if isinstance(targets, str) or not targets or set(targets) - set(LORA_TARGETS):
        raise ConfigError(f"--lora-load {path}: target_modules {targets!r} must be a list of "
                          f"module names from {list(LORA_TARGETS)}")
    for key, value in (("r", rank), ("lora_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"--lora-load {path}: {key} {value!r} must be a positive number")
    adapter = {"lora_rank": ("r", rank), "lora_alpha": ("lora_alpha", float(alpha)),
               "lora_target_modules": ("target_modules", sorted(targets))}
    out = dict(values)
    for name, (key, saved) in adapter.items():
        given = values.get(name)
        if given is None:
            out[name] = saved
        elif (sorted(given) if name == "lora_target_modules" else given) != saved:
            raise ConfigError(f"{flag(name)} {given} but --lora-load {path} has {key} {saved}: "
                              f"drop {flag(name)} or pass the adapter's value")
    return out


@dataclass
class TrainConfig(LoraFlags, LoggingFlags, OptimizerFlags, BatchFlags, MemoryFlags,
                  ParallelFlags, CheckpointFlags):
    """Settings shared by every trainer (model, parallelism, optimizer, schedule, I/O)."""

    # which trainer this config drives; recorded in its checkpoints ("sft", "rl")
    trainer_name: ClassVar[str | None] = None
    # flags of the shared sections this trainer does not read: refused when given, with why
    unread_flags: ClassVar[dict[str, str]] = {}

    def data_parallel_size(self, world_size: int) -> int:
        """DP size for a world size; raises when TP x PP x CP does not divide it."""
        pp = self.pipeline_model_parallel_size
        mp = self.tensor_model_parallel_size * pp * self.context_parallel_size
        if world_size % mp:
            raise ConfigError(f"--tensor-model-parallel-size x --pipeline-model-parallel-size x "
                              f"--context-parallel-size = {mp} does not divide the number of "
                              f"processes ({world_size})")
        dp = world_size // mp
        expert_mp = self.expert_model_parallel_size * self.expert_tp * \
            self.pipeline_model_parallel_size
        if world_size % expert_mp:
            raise ConfigError(f"--expert-model-parallel-size x --expert-tensor-parallel-size x "
                              f"--pipeline-model-parallel-size = {expert_mp} does not divide the "
                              f"number of processes ({world_size})")
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(f"{self.step_sequences_flag} = {self.global_batch_size} must be a "
                              f"multiple of --micro-batch-size x data-parallel size "
                              f"({self.micro_batch_size} x {dp})")
        microbatches = self.global_batch_size // (self.micro_batch_size * dp)
        if self.num_layers_per_virtual_pipeline_stage and microbatches < pp:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage needs at least "
                              f"--pipeline-model-parallel-size {pp} micro-batches per step, got "
                              f"{microbatches} ({self.step_sequences_flag} / (--micro-batch-size x "
                              f"data-parallel size {dp}))")
        return dp


def _base_type(tp: Any) -> Any:
    """int for ``int | None`` and the like."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _add_flag(parser: Any, f: dataclasses.Field, hint: Any,
              default: Any = argparse.SUPPRESS, aliases: Sequence[str] = (),
              hidden: bool = False) -> None:
    """Add the flag of config field ``f`` (type hint ``hint``) to ``parser`` (or a group)."""
    tp = _base_type(hint)
    kw: dict[str, Any] = {"dest": f.name, "default": default,
                          "help": argparse.SUPPRESS if hidden else f.metadata.get("help", "")}
    if tp is bool:  # --foo / --no-foo; a field named no_foo is a plain switch (--no-foo)
        parser.add_argument(flag(f.name), *aliases, action="store_true"
                            if f.name.startswith("no_") else argparse.BooleanOptionalAction, **kw)
        return
    if typing.get_origin(tp) is list:
        kw.update(nargs="+", type=typing.get_args(tp)[0])
    else:
        kw["type"] = tp
    if f.metadata.get("choices"):
        kw["choices"] = f.metadata["choices"]
    parser.add_argument(flag(f.name), *aliases, **kw)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (not the usage of 100+ flags), exit 2."""

    def error(self, message: str) -> typing.NoReturn:  # noqa: D102
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _build_parser(cls: type[TrainConfig], prog: str | None) -> argparse.ArgumentParser:
    """The flags of ``cls``, one ``--help`` group per section."""
    parser = OneLineParser(prog=prog, description=cls.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML file of defaults (flags override it)")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for section in cls.sections():
        group = parser.add_argument_group(section.title)
        for name in section.section_fields():
            _add_flag(group, fields[name], hints[name], hidden=name in cls.unread_flags)
    return parser


def _load_yaml(path: str, cls: type[TrainConfig]) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError(f"--config {where}: not valid YAML "
                          f"({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise ConfigError(f"--config {path}: unknown key {key!r} (no flag {flag(name)})")
        out[name] = value
    return out


def _typed(cls: type[TrainConfig], values: dict) -> dict:
    """``values`` checked against the fields' types and choices (YAML values are untyped)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in values.items():
        tp = _base_type(hints[name])
        if value is not None and tp in (int, float, str, bool) and not isinstance(value, tp):
            if tp is float and isinstance(value, int) and not isinstance(value, bool):
                values[name] = float(value)
            else:
                raise ConfigError(f"{flag(name)}: expected {tp.__name__}, got {value!r}")
        choices = fields[name].metadata.get("choices")
        if choices and values[name] not in choices:
            raise ConfigError(f"{flag(name)}: {values[name]!r} is not one of {list(choices)}")
    return values


def parse_config(cls: type[T], argv: Sequence[str] | None = None, prog: str | None = None) -> T:
    """Parse flags (and an optional ``--config`` YAML) into a validated ``cls`` instance. Its
    derived values are not set yet: ``preflight()`` (train/dry_run.py) checks the config
    against the launch, the model and the files, then calls ``derive()``."""
    parser = _build_parser(cls, prog)
    args = vars(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))
    config = args.pop("config", None)
    values = _load_yaml(config, cls) if config else {}
    values.update(args)
    if issubclass(cls, LoraFlags):
        values = with_peft_adapter_values(values)
    for name, why in cls.unread_flags.items():
        if name in values:
            raise ConfigError(f"{flag(name)} is not read by {prog or cls.__name__}: {why}; "
                              f"drop it" + (f" (from --config {config})" if name not in args
                                            else ""))
    cfg = cls(**_typed(cls, values))
    cfg.validate()
    return cfg


def to_dict(cfg: TrainConfig) -> dict:
    """The config as a plain dict (saved with checkpoints and metrics)."""
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------- sections in other CLIs
def add_section_flags(parser: argparse.ArgumentParser, section: type[Section],
                      only: Sequence[str] | None = None,
                      aliases: dict[str, Sequence[str]] | None = None,
                      unset: bool = False) -> None:
    """Add a section's flags (``only`` these fields, when given) to another CLI's parser:
    same names, types, defaults and help as the trainers', so a flag means one thing
    everywhere (klear-eval takes the prompt section; the tools the layout flags). With
    ``unset`` a flag not given is absent from the parsed namespace (as the trainers' parser
    leaves it), so :func:`section_from_args` can tell it from one given at its default."""
    group = parser.add_argument_group(f"{section.title} (as the trainers take them)")
    hints = typing.get_type_hints(section)
    for f in dataclasses.fields(section):  # its own flags and those of the sections it extends
        if only is None or f.name in only:
            _add_flag(group, f, hints[f.name],
                      default=argparse.SUPPRESS if unset else f.default,
                      aliases=(aliases or {}).get(f.name, ()))


def section_from_args(section: type[Section], args: argparse.Namespace) -> Any:
    """A validated ``section`` built from another CLI's flags added by
    :func:`add_section_flags` (raises :class:`ConfigError` naming the flag). Flags left
    unset take the field defaults; LoRA's take ``--lora-load``'s adapter values first."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(section)
              if hasattr(args, f.name)}
    if issubclass(section, LoraFlags):
        values = with_peft_adapter_values(values)
    instance = section(**values)
    instance.validate()
    return instance


# ---------------------------------------------------------------- the tools' layout flags
# The parallel layout of a model, as the trainers take it: the tools (converters,
# compare_logits, klear-eval) add exactly these TrainConfig flags, so one layout given to a
# trainer is accepted everywhere (issue 28).
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "num_layers_per_virtual_pipeline_stage", "expert_model_parallel_size",
                 "expert_tensor_parallel_size")
_LAYOUT_ALIASES = {"tensor_model_parallel_size": ("--tp",),
                   "pipeline_model_parallel_size": ("--pp",)}


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """Add TrainConfig's layout flags (:data:`LAYOUT_FIELDS`: names, types, defaults and help
    as the trainers have them) to a tool's parser, with ``--tp`` / ``--pp`` as short forms."""
    add_section_flags(parser, ParallelFlags, only=LAYOUT_FIELDS, aliases=_LAYOUT_ALIASES)


def parallel_layout(**values: Any) -> TrainConfig:
    """A validated TrainConfig that holds the layout ``values`` (:data:`LAYOUT_FIELDS`; every
    other field at its default): what :class:`~megatron_klear.models.pipeline_layout.
    PipelineLayout` and the engine's model builder read."""
    unknown = sorted(set(values) - set(LAYOUT_FIELDS))
    if unknown:
        raise TypeError(f"not layout fields: {unknown}")
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg


def layout_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :func:`parallel_layout` of a tool's flags parsed with :func:`add_layout_flags`."""
    return parallel_layout(**{name: getattr(args, name) for name in LAYOUT_FIELDS})
