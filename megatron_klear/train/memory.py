"""Per-GPU memory plan of a training run: model state, activations, logits and loss.

:func:`plan_memory` estimates the peak bytes each pipeline stage holds for a run's layout
(TP, PP, DP), sequence length and micro-batch, from the architecture alone (no GPU, no
weights). :func:`flags_to_fit` names the memory flags that would make a plan fit a GPU.
The formulas, their sources (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", adapted to Qwen3: GQA, QK-norm, SwiGLU, RMSNorm, no dropout)
and the CPU validation numbers are in docs/memory.md.

Activations are counted as the tensors autograd saves for backward, in elements per token
of one micro-batch and one layer, split by what tensor parallelism shards (``/t``) and
what only sequence parallelism shards (the hidden-size tensors of norms and residuals).
Two layer implementations differ in what they save:

* ``local`` (megatron-core's local spec; what runs on CPU): torch RMSNorm saves its input,
  the normalised input and (through the next linear) its output; unfused attention saves
  q, the GQA-expanded k and v, and the ``a x s`` softmax scores per token; SwiGLU saves the
  fc1 output, silu of the gate half and the product. Measured on CPU (tests/multiprocess/test_memory.py).
* ``transformer_engine`` (GPU): LayerNormLinear saves input and normalised input; flash
  attention saves q, k, v and its output (no ``s x s`` scores); TE's SwiGLU saves its
  input. Derived from what those kernels save; not measured here (no GPU).

Qwen3-MoE (:func:`moe_layer_terms`): a sparse layer holds the router (replicated) and
``num_experts / EP`` experts split over expert-TP, whose optimizer state the distributed
optimizer shards over the expert-data-parallel ranks; its MLP activations are those of the
``top-k`` routed copies of each token (plus the permuted inputs and fp32 router scores).
Layers are averaged over the model (exact when every layer is sparse, as in Qwen3-MoE
releases). An estimate from megatron-core's MoE layer; not measured on a GPU.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from megatron_klear.config import ConfigError, TrainConfig
from megatron_klear.models.pipeline_layout import PipelineLayout
from megatron_klear.models.qwen3 import padded_vocab_size

__all__ = ["Workload", "StagePlan", "MemoryPlan", "plan_memory", "flags_to_fit", "check_fits",
           "model_state_bytes_per_param", "layer_activation_elements", "GiB",
           "ColocatedPlan", "plan_colocated", "colocated_fixes", "check_colocated_fits",
           "model_params", "COLOCATE_RESIDUAL_GIB", "SYNC_BUCKETS", "HOST_PROCESS_GIB", "HostPlan",
           "plan_host", "check_host_fits", "lora_params_per_layer",
           "lora_activation_bytes_per_token", "teacher_stage_params"]

GiB = 2**30


@dataclass(frozen=True)
class Workload:
    """What a trainer feeds the model: sequence length, loss kind, tokens per micro-batch.

    ``fused_loss``: the loss keeps O(1) numbers per token and writes the logits' gradient in
    place (``vocab_parallel_policy_loss``/``vocab_parallel_logprobs``); False: fp32 copies
    of the vocab-parallel logits (``sft_objective.token_nll``). ``tokens``: the
    tokens of one micro-batch when it is a pack under a token budget (``--max-tokens-per-gpu``,
    sequences of at most ``seq_length``); None: ``seq_length x --micro-batch-size``.
    ``reference_on_host``: the KL reference's weights live in host memory and are swapped in
    for its forward (no device bytes; two host copies of the rank's weights). ``teacher``: the
    Qwen3Arch of a Megatron OPD teacher (train/frozen_policy.py): its shards live in host
    memory and come onto the device for its forward only, beside the trainer's state.
    """

    seq_length: int
    fused_loss: bool = True
    tokens: int | None = None
    reference_on_host: bool = False  # a KL reference: a host copy of the weights (reference.py)
    teacher: Any = None  # a Megatron OPD teacher's Qwen3Arch (train/frozen_policy.py)

    def microbatch_tokens(self, cfg: TrainConfig) -> int:
        """Tokens of one micro-batch (before context parallelism slices them)."""
        return self.tokens or self.seq_length * cfg.micro_batch_size


@dataclass(frozen=True)
class StagePlan:
    """Peak bytes of one pipeline stage's rank, by component."""

    stage: int
    layers: int
    in_flight: int  # micro-batches (per model chunk when interleaved) the schedule holds at once
    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward by the in-flight micro-batches
    logits_loss: int  # transient: logits and loss of one micro-batch (last stage)
    backward_working: int  # transient: gradients while one layer's backward runs
    teacher: int = 0  # a Megatron OPD teacher's weights, on the device for its forward only

    @property
    def total(self) -> int:
        """Peak bytes: state, plus the larger phase: training (saved activations and the
        larger transient; the logits are freed before the layers' backward starts) or the
        teacher's forward (its weights and one micro-batch's logits)."""
        return (self.params + self.grads + self.optimizer +
                max(self.activations + max(self.logits_loss, self.backward_working),
                    self.teacher + self.logits_loss))


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of every pipeline stage; :attr:`peak` is the stage that needs the most."""

    stages: tuple[StagePlan, ...]
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    data_parallel_size: int

    @property
    def peak(self) -> StagePlan:
        """The binding stage (largest total)."""
        return max(self.stages, key=lambda st: st.total)

    @property
    def total(self) -> int:
        """Peak bytes of the binding stage."""
        return self.peak.total

    def fits(self, gpu_memory_gb: float) -> bool:
        """True when every stage fits ``gpu_memory_gb`` GiB."""
        return self.total <= gpu_memory_gb * GiB

    def as_dict(self) -> dict:
        """A JSON-friendly summary: GiB per component of the binding stage, and per stage."""
        pk = self.peak
        gib = lambda n: round(n / GiB, 2)  # noqa: E731
        return {"seq_length": self.seq_length, "micro_batch_size": self.micro_batch_size,
                "num_microbatches": self.num_microbatches,
                "data_parallel_size": self.data_parallel_size,
                "binding_stage": pk.stage, "in_flight_microbatches": pk.in_flight,
                "gib": {k: gib(getattr(pk, k)) for k in
                        ("params", "grads", "optimizer", "activations", "logits_loss", "backward_working", "teacher", "total")},
                "stage_total_gib": [gib(st.total) for st in self.stages]}


def model_state_bytes_per_param(cfg: TrainConfig, dp: int) -> tuple[float, float, float]:
    """(param, grad, optimizer) bytes per parameter on one GPU.

    bf16: bf16 params, fp32 grads (megatron DDP's grad_reduce_in_fp32), fp32 master weights
    plus Adam m and v (12 bytes); fp32: no master copy (8 bytes). The distributed optimizer
    shards the optimizer bytes over the DP ranks; CPU offload moves them off the GPU.
    """
    param = 2.0 if cfg.bf16 else 4.0
    opt = 12.0 if cfg.bf16 else 8.0
    if cfg.use_distributed_optimizer:
        opt /= dp
    if cfg.optimizer_cpu_offload:
        opt = 0.0
    return param, 4.0, opt


def _layer_params(arch, t: int) -> int:
    h, d = arch.hidden_size, arch.head_dim
    qkv = h * (arch.num_attention_heads + 2 * arch.num_query_groups) * d
    proj = arch.num_attention_heads * d * h
    sparse = moe_layer_terms(arch)["sparse_fraction"]
    mlp = (1 - sparse) * 3 * h * arch.ffn_hidden_size  # experts: expert_params_per_layer
    router = sparse * arch.num_experts * h
    return int((qkv + proj + mlp) // t + router) + 2 * h + 2 * d  # norms are replicated


def moe_layer_terms(arch) -> dict[str, float]:
    """Per-layer MoE quantities averaged over the layers (all zero for a dense model):
    ``sparse_fraction`` of layers, ``expert_params`` (all experts of one layer) and the
    per-token MLP activation elements of a sparse layer (``local`` and TE)."""
    if not arch.is_moe:
        return {"sparse_fraction": 0.0, "expert_params": 0.0, "act_local": 0.0, "act_te": 0.0}
    h, f, k = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts_per_tok
    # k routed copies: permuted input (h) plus the SwiGLU tensors; 2 x E fp32 router scores
    return {"sparse_fraction": len(arch.moe_layers) / arch.num_layers,
            "expert_params": arch.num_experts * 3 * h * f,
            "act_local": k * (h + 5 * f) + 2 * arch.num_experts,
            "act_te": k * (h + 3 * f) + 2 * arch.num_experts}


def expert_params_per_layer(arch, cfg: TrainConfig) -> float:
    """This rank's expert parameters per layer (averaged): 1/EP of the experts, 1/ETP each."""
    terms = moe_layer_terms(arch)
    return terms["sparse_fraction"] * terms["expert_params"] / (
        cfg.expert_model_parallel_size * cfg.expert_tp)


def lora_params_per_layer(arch, cfg: TrainConfig) -> float:
    """This rank's LoRA adapter parameters per layer (0 without ``--lora-rank``): per targeted
    HF projection r x in (A) + out x r (B); column-parallel ones (q, k, v, gate, up) hold A
    whole and B / TP, row-parallel ones (o, down) A / TP and B whole. MLP targets count on
    dense layers only (experts take no adapters)."""
    r = getattr(cfg, "lora_rank", 0)
    if not r:
        return 0.0
    t = cfg.tensor_model_parallel_size
    h, ffn = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    dense = 1 - moe_layer_terms(arch)["sparse_fraction"]
    per = {"q_proj": (r * h + q * r / t, 1.0), "k_proj": (r * h + kv * r / t, 1.0),
           "v_proj": (r * h + kv * r / t, 1.0), "o_proj": (r * q / t + h * r, 1.0),
           "gate_proj": (r * h + ffn * r / t, dense), "up_proj": (r * h + ffn * r / t, dense),
           "down_proj": (r * ffn / t + h * r, dense)}
    return sum(n * share for target, (n, share) in per.items() if target in _lora_targets(cfg))


def _lora_targets(cfg: TrainConfig) -> tuple[str, ...]:
    from megatron_klear.config import LORA_TARGETS

    return tuple(cfg.lora_target_modules or LORA_TARGETS)


def lora_activation_bytes_per_token(arch, cfg: TrainConfig) -> float:
    """Bytes one layer's adapters save per token for backward (0 without LoRA).

    The adapters compute in fp32: with a bf16 base each adapted layer's input is cast to fp32
    (column-parallel: the hidden size, divided by TP under sequence parallelism; row-parallel:
    its TP shard), and every targeted projection keeps its r-wide ``A x`` (whole: gathered
    over the sequence under SP). Dropout adds its output and mask per input element.
    """
    r = getattr(cfg, "lora_rank", 0)
    if not r:
        return 0.0
    t = cfg.tensor_model_parallel_size
    sp = t if cfg.sequence_parallel else 1
    targets = _lora_targets(cfg)
    dense = 1 - moe_layer_terms(arch)["sparse_fraction"]
    h, ffn, q = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads * arch.head_dim
    inputs = {"qkv": (h / sp, 1.0, ("q_proj", "k_proj", "v_proj")),
              "o": (q / t, 1.0, ("o_proj",)), "fc1": (h / sp, dense, ("gate_proj", "up_proj")),
              "fc2": (ffn / t, dense, ("down_proj",))}
    per_input = (4.0 if cfg.bf16 else 0.0) + (5.0 if getattr(cfg, "lora_dropout", 0) else 0.0)
    total = 0.0
    for width, share, parts in inputs.values():
        hit = sum(p in targets for p in parts)
        if hit:
            total += share * (width * per_input + hit * r * 4.0)
    return total


def _lora_layers(cfg: TrainConfig, layers: int) -> tuple[int, int]:
    """(layers whose adapter tensors stay saved per micro-batch, layers re-run in backward):
    full recompute keeps none (uniform) or ``layers - n`` (block) and re-runs ``n``."""
    if cfg.recompute_granularity != "full":
        return layers, 0
    n = min(cfg.recompute_num_layers or 1, layers)
    return (layers - n if cfg.recompute_method == "block" else 0), n


def _stage_params(arch, t: int, pp: int, stage: int, layers: int) -> int:
    vocab = padded_vocab_size(arch.vocab_size, t) * arch.hidden_size // t
    n = layers * _layer_params(arch, t)
    if stage == 0:
        n += vocab
    if stage == pp - 1:
        n += arch.hidden_size + (vocab if not arch.tie_word_embeddings or pp > 1 else 0)
    return n


def layer_activation_elements(arch, cfg: TrainConfig, seq_length: int) -> tuple[float, float]:
    """Saved activation elements per token of one layer: (hidden-state part, TP-sharded part).

    The hidden-state part is divided by TP only under sequence parallelism; the other part
    is always divided by TP. The ``a x s`` softmax scores of local attention are included
    in the TP-sharded part in units of activation elements (their fp32 bytes converted).
    """
    h, d, F = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    a, g = arch.num_attention_heads, arch.num_query_groups
    e = _act_bytes(cfg)
    modules = set(cfg.recompute_modules or ["core_attn"]) \
        if cfg.recompute_granularity == "selective" else set()
    if cfg.transformer_impl == "local":
        hidden = 2 * 3 * h  # two norms: input, normalised input, output (saved by linear)
        # q-norm input and its normalised copy, the QKV buffer (k-norm's input is a view
        # of it), normalised k
        qk_norms = 2 * a * d + (a + 2 * g) * d + g * d
        core = 3 * a * d + a * seq_length * _score_bytes(e) / e  # q, k, v (GQA-expanded)
        mlp = 5 * F  # fc1 output (2F), silu(gate), product
    else:
        hidden = 2 * 2 * h  # LayerNormLinear: input and normalised input
        qk_norms = a * d + (a + 2 * g) * d  # q-norm input, the QKV buffer
        core = (a + 2 * g) * d + a * 4 / e  # flash: q, k, v and the fp32 log-sum-exp
        mlp = 3 * F  # swiglu input (2F) and output
    if "core_attn" in modules:  # checkpointed core attention keeps only its inputs q, k
        core = (a + g) * d
    moe = moe_layer_terms(arch)
    mlp = (1 - moe["sparse_fraction"]) * mlp + moe["sparse_fraction"] * (
        moe["act_local"] if cfg.transformer_impl == "local" else moe["act_te"])
    if "mlp" in modules:  # the MLP's input is the (kept) norm output
        mlp = 0
    if "layernorm" in modules:
        hidden = 2 * h
    return hidden, qk_norms + core + a * d + mlp  # + a*d: attention output, linear_proj input


def _act_bytes(cfg: TrainConfig) -> int:
    return 2 if cfg.bf16 else 4


def _score_bytes(e: int) -> int:
    """Bytes per softmax score saved by local attention: the fp32 softmax output, plus its
    cast back to bf16 that the probs @ V matmul saves."""
    return 4 if e == 4 else 4 + e


def _activation_bytes(arch, cfg: TrainConfig, w: Workload, layers: int, in_flight: int,
                      stage: int, pp: int) -> tuple[int, int]:
    """(saved activations of ``in_flight`` micro-batches, backward working set) of a stage.

    The working set is what one layer's backward allocates on top of the saved tensors:
    gradients about the size of the layer's per-token activations, or, with local
    attention, the fp32 ``s x s`` gradient chain of the unfused softmax (grad of the
    probabilities, of the scores, and the clone of the in-place mask's backward), whichever
    is larger. Full recompute adds the re-run group's activations.
    """
    t = cfg.tensor_model_parallel_size
    sp = t if cfg.sequence_parallel else 1
    e = _act_bytes(cfg)
    tokens = w.microbatch_tokens(cfg) / cfg.context_parallel_size  # CP: a slice
    scores = tokens * 4 * arch.num_attention_heads * w.seq_length / t \
        if cfg.transformer_impl == "local" else 0.0

    def layer_bytes(c: TrainConfig) -> float:
        hidden, sharded = layer_activation_elements(arch, c, w.seq_length)
        return tokens * e * (hidden / sp + sharded / t)

    stored = layer_bytes(cfg)  # selective recompute drops what it re-runs
    run = layer_bytes(replace(cfg, recompute_granularity=None))  # a layer in its backward
    working = max(run - scores * _score_bytes(e) / 4, 3 * scores)
    layer_input = tokens * e * arch.hidden_size / sp
    if cfg.recompute_granularity == "full":
        n = min(cfg.recompute_num_layers or 1, layers)
        if cfg.recompute_method == "block":  # n layers keep only their input, the rest all
            per_mb = (layers - n) * run + n * layer_input
            working += run
        else:  # uniform: the input of every group of n layers; backward re-runs one group
            per_mb = math.ceil(layers / n) * layer_input
            working += n * run
    else:
        per_mb = layers * stored
        if "core_attn" in (cfg.recompute_modules or ["core_attn"]) and \
                cfg.recompute_granularity == "selective":
            working += run - stored  # the re-run core attention
    if stage == pp - 1:  # final norm (its output is the output layer's input)
        per_mb += tokens * e * (3 if cfg.transformer_impl == "local" else 2) * \
            arch.hidden_size / sp
    else:  # the stage's output, kept by the schedule until its gradient arrives
        per_mb += layer_input
    return int(in_flight * per_mb), int(working)


def _logits_loss_bytes(arch, cfg: TrainConfig, w: Workload) -> int:
    """Logits of one micro-batch on the last stage, and what the loss adds to them.

    Fused loss: the logits (activation dtype), their gradient written in place. fp32 path
    (``token_nll``): next to the logits, an fp32 copy when they are bf16 and the masked copy
    when the vocab is padded; ``vocab_parallel_cross_entropy`` turns the last of these into
    the softmax in place and reuses it as the gradient, whose backward through the mask and
    the cast makes the same number of copies again.
    """
    t = cfg.tensor_model_parallel_size
    vpad = padded_vocab_size(arch.vocab_size, t)
    e = _act_bytes(cfg)
    per_entry = e
    if not w.fused_loss:
        per_entry += (4 if e != 4 else 0) + (4 if vpad != arch.vocab_size else 0)
    return int(w.microbatch_tokens(cfg) / cfg.context_parallel_size * vpad / t * per_entry)


def plan_memory(arch, cfg: TrainConfig, world_size: int, workload: Workload | None = None
                ) -> MemoryPlan:
    """Per-stage peak bytes of a run of ``cfg`` on ``world_size`` GPUs (see module doc).

    ``arch`` is a :class:`~megatron_klear.models.qwen3.Qwen3Arch`. Stage layers follow the
    pipeline layout (uneven first/last stages). 1F1B pipelining: stage ``i`` of ``pp``
    holds ``min(pp - i, num_microbatches)`` micro-batches of activations; interleaved
    (``v`` model chunks per stage), megatron's warm-up keeps ``2 (pp - i - 1) + (v - 1) pp
    + 1`` chunk-micro-batches of ``layers / v`` layers each (``in_flight`` counts those).
    Context parallelism divides every activation and the logits by the CP size.
    """

    w = workload or Workload(cfg.seq_length)
    t, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    dp = cfg.data_parallel_size(world_size)
    m = cfg.global_batch_size // (cfg.micro_batch_size * dp)
    p_b, g_b, o_b = model_state_bytes_per_param(cfg, dp)
    layout = PipelineLayout.from_config(arch.num_layers, cfg)
    v = layout.num_model_chunks
    expert_dp = world_size // (cfg.expert_model_parallel_size * cfg.expert_tp * pp)
    o_b_experts = model_state_bytes_per_param(cfg, expert_dp)[2]
    # LoRA: a frozen base (no grads, no optimizer state); the adapters, in the parameter
    # dtype, take the state bytes of any parameter (fp32 grads, master copy and Adam m, v)
    lora = bool(getattr(cfg, "lora_rank", 0))
    teacher = teacher_stage_params(w.teacher, cfg) if w.teacher is not None else None
    stages = []
    for i, layers in enumerate(layout.stage_layers):
        experts = int(layers * expert_params_per_layer(arch, cfg))
        n = _stage_params(arch, t, pp, i, layers) + experts
        adapters = int(layers * lora_params_per_layer(arch, cfg))
        in_flight = min(pp - i, m) if v == 1 else min(2 * (pp - i - 1) + (v - 1) * pp + 1,
                                                      m * v)
        saved, working = _activation_bytes(arch, cfg, w, layers // v, in_flight, i, pp)
        lora_layer = w.microbatch_tokens(cfg) / cfg.context_parallel_size * \
            lora_activation_bytes_per_token(arch, cfg)  # one layer, one micro-batch
        kept, rerun = _lora_layers(cfg, layers // v)
        saved += int(in_flight * kept * lora_layer)
        working += int(rerun * lora_layer)
        if lora:
            grads, optimizer = adapters * g_b, adapters * o_b
        else:
            grads, optimizer = n * g_b, (n - experts) * o_b + experts * o_b_experts
        stages.append(StagePlan(
            stage=i, layers=layers, in_flight=in_flight, params=int((n + adapters) * p_b),
            grads=int(grads), optimizer=int(optimizer),
            activations=saved,
            logits_loss=_logits_loss_bytes(arch, cfg, w) if i == pp - 1 else 0,
            backward_working=working,
            teacher=int(teacher[i] * p_b) if teacher else 0))
    return MemoryPlan(stages=tuple(stages), seq_length=w.seq_length,
                      micro_batch_size=cfg.micro_batch_size, num_microbatches=m,
                      data_parallel_size=dp)


def teacher_stage_params(arch, cfg: TrainConfig) -> list[int]:
    """Per pipeline stage, the parameters of one rank's shards of a frozen model of ``arch``
    built at ``cfg``'s layout (the Megatron OPD teacher, train/frozen_policy.py)."""
    t, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    layers = PipelineLayout.from_config(arch.num_layers, cfg).stage_layers
    return [_stage_params(arch, t, pp, i, n) + int(n * expert_params_per_layer(arch, cfg))
            for i, n in enumerate(layers)]


# Memory flags, each with the config change it stands for, in the anchors' order of preference.
_FEATURES: tuple[tuple[str, dict], ...] = (
    ("--use-distributed-optimizer", {"use_distributed_optimizer": True}),
    ("--sequence-parallel", {"sequence_parallel": True}),
    ("--transformer-impl transformer_engine", {"transformer_impl": "transformer_engine"}),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
     {"recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 1, "recompute_modules": None}),
    ("--optimizer-cpu-offload", {"optimizer_cpu_offload": True}),  # with the distributed optimizer
)


def flags_to_fit(arch, cfg: TrainConfig, world_size: int, workload: Workload | None = None,
                 gpu_memory_gb: float | None = None) -> list[str] | None:
    """The fewest memory flags (not yet set) whose plan fits, cheapest plan among equals.

    Returns [] when the plan already fits and None when no combination of the flags does
    (then only a larger TP/PP, a shorter sequence or a bigger GPU helps).
    """
    limit = cfg.gpu_memory_gb if gpu_memory_gb is None else gpu_memory_gb
    usable = [(f, ch) for f, ch in _FEATURES if _applies(cfg, ch)]
    for k in range(len(usable) + 1):
        fitting = []
        for combo in itertools.combinations(usable, k):
            changes = {key: v for _, ch in combo for key, v in ch.items()}
            if changes.get("optimizer_cpu_offload") and not (cfg.bf16 and (
                    cfg.use_distributed_optimizer or changes.get("use_distributed_optimizer"))):
                continue  # offload needs the distributed optimizer and --bf16 (config.py)
            plan = plan_memory(arch, replace(cfg, **changes), world_size, workload)
            if plan.fits(limit):
                fitting.append((plan.total, [f for f, _ in combo]))
        if fitting:
            return min(fitting)[1]
    return None


def _applies(cfg: TrainConfig, change: dict) -> bool:
    """A feature is worth suggesting when it is not on yet and can act on this layout."""
    if all(getattr(cfg, k) == v for k, v in change.items()):
        return False
    if change.get("sequence_parallel") and cfg.tensor_model_parallel_size < 2:
        return False
    return True


def check_fits(plan: MemoryPlan, arch, cfg: TrainConfig, world_size: int,
               workload: Workload) -> None:
    """Raise :class:`ConfigError` naming the flags that would fit when the plan does not."""
    if plan.fits(cfg.gpu_memory_gb):
        return
    need = f"{plan.total / GiB:.1f} GiB on pipeline stage {plan.peak.stage}"
    fix = flags_to_fit(arch, cfg, world_size, workload)
    hint = (f"add {' '.join(fix)}" if fix else
            "no memory flag is enough: raise --tensor-model-parallel-size or "
            "--pipeline-model-parallel-size, or shorten the sequences")
    raise ConfigError(f"memory plan: {need} does not fit --gpu-memory-gb "
                      f"{cfg.gpu_memory_gb:g}; {hint}")


# Colocated mode (--colocate): what stays on a GPU of the side whose memory is handed over
# (a process's CUDA context, NCCL buffers, allocator slack): an estimate, not measured on a
# GPU; the trainer releases everything it can with storage resizing (train/offload.py),
# SGLang with torch_memory_saver.
COLOCATE_RESIDUAL_GIB = 2.0
# staging buffers a trainer rank holds at once in a tensor-handle sync (rollout/tensor_sync.py:
# bucket k+2 is packed before bucket k's is dropped; each dropped one is IPC-collected)
SYNC_BUCKETS = 3


@dataclass(frozen=True)
class ColocatedPlan:
    """Per-GPU bytes of the phases of a colocated step (``--colocate``), with the numbers
    each phase is made of. ``training``: the trainer's plan with the engines released;
    ``sync``: the trainer's parameters, the engines' resumed weights and
    :data:`SYNC_BUCKETS` staging buckets; ``rollout``: SGLang's static pool
    (``--sglang-mem-fraction-static`` of the GPU:
    its weights, then its KV cache) with the trainer offloaded; ``save``: a checkpoint save
    or the run's end (HF export), the trainer's parameters, gradients and optimizer state
    back on the device beside the engines' weights, their KV cache released
    (train/colocate.py ``trainer_resident``, ``close``)."""

    gpu: int
    training: int
    sync: int
    rollout: int
    save: int
    engine_weights: int  # per GPU: bf16 weights / --sglang-tp-size
    kv_bytes_per_token: int  # per GPU
    kv_pool: int  # what the static pool leaves the KV cache
    sequence_tokens: int  # the longest rollout sequence (prompt + response)

    @property
    def kv_sequences(self) -> float:
        """Longest sequences the KV pool holds at once (at least one, or rollout cannot run)."""
        return self.kv_pool / max(self.kv_bytes_per_token * self.sequence_tokens, 1)

    def problems(self) -> list[str]:
        """What does not fit, phase by phase (empty: every phase fits)."""
        out = []
        for name in ("training", "sync", "rollout", "save"):
            if getattr(self, name) > self.gpu:
                out.append(f"the {name} phase needs {getattr(self, name) / GiB:.1f} GiB of "
                           f"{self.gpu / GiB:.0f}")
        if self.kv_sequences < 1:
            out.append(f"the engines' KV cache ({self.kv_pool / GiB:.1f} GiB per GPU after "
                       f"{self.engine_weights / GiB:.1f} GiB of weights) holds no "
                       f"{self.sequence_tokens}-token sequence")
        return out

    def as_dict(self) -> dict:
        """GiB per phase and component (the dry run's ``colocated`` report)."""
        gib = lambda n: round(n / GiB, 2)  # noqa: E731
        return {"training_gib": gib(self.training), "sync_gib": gib(self.sync),
                "rollout_gib": gib(self.rollout), "save_gib": gib(self.save), "engine_weights_gib": gib(self.engine_weights),
                "kv_pool_gib": gib(self.kv_pool), "kv_sequences": round(self.kv_sequences, 1),
                "residual_gib_per_side": COLOCATE_RESIDUAL_GIB, "fits": not self.problems()}


# Host memory of a trainer process beyond the pinned buffers the plan counts (interpreter,
# libraries, CUDA context, data): an estimate, not measured on a GPU.
HOST_PROCESS_GIB = 4.0


@dataclass(frozen=True)
class HostPlan:
    """Host bytes per node: ``pinned_per_rank`` -- the colocated trainer's offload arenas
    (parameters, gradients, optimizer state: train/offload.py pins exactly that) and the KL
    reference's two weight copies (train/reference.py), a Megatron OPD teacher's weights
    (train/frozen_policy.py) -- and each process's own
    (:data:`HOST_PROCESS_GIB`), times the ranks on a node."""

    ranks_per_node: int
    pinned_per_rank: int

    @property
    def pinned(self) -> int:
        """Pinned bytes per node."""
        return self.pinned_per_rank * self.ranks_per_node

    @property
    def total(self) -> int:
        """Host bytes per node, pinned and the processes' own."""
        return self.pinned + int(HOST_PROCESS_GIB * GiB) * self.ranks_per_node

    def as_dict(self) -> dict:
        """GiB per node (the dry run's ``host`` report)."""
        return {"ranks_per_node": self.ranks_per_node,
                "pinned_gib_per_rank": round(self.pinned_per_rank / GiB, 2),
                "pinned_gib_per_node": round(self.pinned / GiB, 2),
                "total_gib_per_node": round(self.total / GiB, 2),
                "process_gib_per_rank": HOST_PROCESS_GIB}


def plan_host(plan: MemoryPlan, workload: Workload, ranks_per_node: int, colocate: bool
              ) -> HostPlan:
    """The host memory per node of a run with the trainer plan ``plan`` (``colocate``: its
    state is offloaded between steps; a KL reference on the host: two copies of the rank's
    weights; a Megatron OPD teacher: its shards)."""
    pinned = 0
    if colocate:
        pinned += plan.peak.params + plan.peak.grads + plan.peak.optimizer
    if workload.reference_on_host:  # the reference's copy and the policy's stash
        pinned += 2 * max(st.params for st in plan.stages)
    pinned += max(st.teacher for st in plan.stages)
    return HostPlan(ranks_per_node, pinned)


def check_host_fits(host: HostPlan, cfg) -> None:
    """Raise :class:`ConfigError` when the node's host memory (``--host-memory-gb``) is
    smaller than the plan's."""
    if cfg.host_memory_gb is None or host.total <= cfg.host_memory_gb * GiB:
        return
    raise ConfigError(f"host memory plan: {host.total / GiB:.1f} GiB per node "
                      f"({host.pinned / GiB:.1f} pinned: {host.pinned_per_rank / GiB:.1f} per rank "
                      f"x {host.ranks_per_node} "
                      f"ranks) does not fit --host-memory-gb {cfg.host_memory_gb:g}; spread the "
                      "ranks over more nodes (fewer per node) or run on hosts with more memory")


def model_params(arch) -> int:
    """Parameters of the whole model (unsharded), experts included."""
    moe = moe_layer_terms(arch)
    return _stage_params(arch, 1, 1, 0, arch.num_layers) + int(
        arch.num_layers * moe["sparse_fraction"] * moe["expert_params"])


def plan_colocated(arch, cfg, trainer: MemoryPlan, sequence_tokens: int, *,
                   mem_fraction: float | None = None, engine_tp: int | None = None,
                   bucket_mb: int | None = None) -> ColocatedPlan:
    """The phases of a colocated step on one GPU of ``cfg`` (an RLConfig: ``--gpu-memory-gb``,
    ``--sglang-mem-fraction-static``, ``--sglang-tp-size``, ``--weight-sync-bucket-mb``;
    the keyword arguments override them), given the trainer's own plan. The engines serve
    bf16 weights; a KV token holds K and V of every layer, its KV heads split over the
    engine's TP (replicated when TP exceeds them, as SGLang does)."""
    frac = cfg.sglang_mem_fraction_static if mem_fraction is None else mem_fraction
    tp = cfg.sglang_tp_size if engine_tp is None else engine_tp
    bucket = (cfg.weight_sync_bucket_mb if bucket_mb is None else bucket_mb) * 2**20
    gpu, residual = int(cfg.gpu_memory_gb * GiB), int(COLOCATE_RESIDUAL_GIB * GiB)
    weights = model_params(arch) * 2 // tp
    kv_token = 2 * arch.num_layers * max(arch.num_query_groups // tp, 1) * arch.head_dim * 2
    pool = int(frac * gpu)
    return ColocatedPlan(
        gpu=gpu, training=trainer.total + residual,
        sync=trainer.peak.params + weights + SYNC_BUCKETS * bucket + residual,
        rollout=pool + residual,
        save=trainer.peak.params + trainer.peak.grads + trainer.peak.optimizer + weights + residual,
        engine_weights=weights, kv_bytes_per_token=kv_token,
        kv_pool=pool - weights, sequence_tokens=sequence_tokens)


def colocated_fixes(arch, cfg, world_size: int, workload: Workload, trainer: MemoryPlan
                    ) -> list[str]:
    """Flags that would make a colocated plan fit: memory flags for the trainer (with the
    engines' residual taken off the GPU), a larger ``--sglang-tp-size``, a ``--sglang-mem-
    fraction-static`` that leaves room for the offloaded trainer's residual and still holds
    a sequence's KV cache, a smaller ``--weight-sync-bucket-mb``."""
    plan = plan_colocated(arch, cfg, trainer, workload.seq_length)
    fixes: list[str] = []
    if plan.training > plan.gpu:
        trainer_fix = flags_to_fit(arch, cfg, world_size, workload,
                                   cfg.gpu_memory_gb - COLOCATE_RESIDUAL_GIB)
        fixes += trainer_fix if trainer_fix else [
            "(trainer: raise --tensor-model-parallel-size or --pipeline-model-parallel-size)"]
    if plan.rollout > plan.gpu or plan.kv_sequences < 1:
        fixes += _engine_fixes(arch, cfg, world_size, trainer, workload.seq_length)
    if plan.sync > plan.gpu:
        for mb in (256, 128, 64, 32):
            smaller = plan_colocated(arch, cfg, trainer, workload.seq_length, bucket_mb=mb)
            if smaller.sync <= plan.gpu:
                fixes.append(f"--weight-sync-bucket-mb {mb}")
                break
    return fixes


def _engine_fixes(arch, cfg, world_size: int, trainer: MemoryPlan, tokens: int) -> list[str]:
    """The smallest ``--sglang-tp-size`` (from the configured one up) whose rollout phase
    fits, with the configured ``--sglang-mem-fraction-static`` or the nearest that fits."""
    def fits(tp: int, frac: float) -> bool:
        p = plan_colocated(arch, cfg, trainer, tokens, engine_tp=tp, mem_fraction=frac)
        return p.rollout <= p.gpu and p.kv_sequences >= 1

    frac = cfg.sglang_mem_fraction_static
    for tp in (t for t in (1, 2, 4, 8) if t >= cfg.sglang_tp_size and world_size % t == 0):
        tp_flag = [f"--sglang-tp-size {tp}"] if tp != cfg.sglang_tp_size else []
        if fits(tp, frac):
            return tp_flag
        good = [f / 100 for f in range(5, 100) if fits(tp, f / 100)]
        if good:
            return tp_flag + [f"--sglang-mem-fraction-static "
                              f"{min(good, key=lambda f: abs(f - frac)):.2f}"]
    return ["(rollout: no engine TP up to 8 holds the weights and one sequence)"]


def check_colocated_fits(plan: ColocatedPlan, arch, cfg, world_size: int, workload: Workload,
                         trainer: MemoryPlan) -> None:
    """Raise :class:`ConfigError` naming each phase that does not fit and the flags that
    would make it fit."""
    problems = plan.problems()
    if not problems:
        return
    fixes = colocated_fixes(arch, cfg, world_size, workload, trainer)
    raise ConfigError(f"colocated memory plan (--colocate): {'; '.join(problems)} "
                      f"(--gpu-memory-gb {cfg.gpu_memory_gb:g}); "
                      + (f"add {' '.join(fixes)}" if fixes else "no flag is enough"))
