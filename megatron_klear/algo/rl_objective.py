"""The RL trainer's objective on a micro-batch: old log-probs, counts, and the loss function.

:func:`policy_loss_fn` is what the engine's training step calls per micro-batch: GPPO (or
PPO / CISPO / GSPO, :mod:`megatron_klear.ops.loss_math`) on the fused vocab-parallel op
(:mod:`megatron_klear.ops`), plus alpha x SFT on the positives, the optional KL term, the
rollout correction and ERC, aggregated as ``--loss-aggregation`` says over the counts of the
whole mini-batch (:func:`aggregation_totals`) and of each whole micro-batch
(:func:`annotate_aggregation`, taken before context-parallel slicing). :func:`old_logprobs`
fills the behaviour policy's (or the reference's) log-probs with a forward-only pass.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
from megatron.core import parallel_state

from megatron_klear.algo.kl import kl_per_token
from megatron_klear.ops.loss_math import AggregationTotals, MicroCounts, aggregate_rl_loss, \
    erc_band
from megatron_klear.algo.rollout_correction import RolloutCorrection, \
    rollout_correction_weights
from megatron_klear.data.microbatches import is_positive
from megatron_klear.ops import vocab_parallel_logprobs, vocab_parallel_policy_loss
from megatron_klear.ops.backend import loss_backend
from megatron_klear.samples import RolloutBatch

# per-step metrics averaged over optimizer steps; every other train/ metric is a token sum
PER_STEP_METRICS = ("train/policy_loss", "train/sft_loss", "train/kl_loss", "train/loss")


class PolicyLossConfig(Protocol):
    """The flags :func:`policy_loss_fn` reads (train/rl_config.py's ``RLConfig``)."""

    loss_backend: str
    loss_type: str
    loss_aggregation: str
    rollout_temperature: float
    eps_clip_low: float
    eps_clip_high: float
    gppo_beta1: float
    gppo_beta2: float
    dual_clip: float | None
    entropy_ratio_clip: float | None
    erc_low: float | None
    erc_high: float | None
    sft_alpha: float
    kl_coef: float
    kl_estimator: str

    def correction(self) -> RolloutCorrection | None: ...


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


def old_logprobs(engine: Any, mbs: list[dict], vocab_size: int, temperature: float,
                 **keys: str | None) -> None:
    """Fill ``old_logprobs`` and ``entropy`` of each micro-batch with the model's current
    weights (other keys through ``keys``, as :func:`fill_logprobs`). ``engine``: the trainer's
    (train/engine.py), whose ``forward_only`` runs megatron's forward-only schedule."""
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
    """The mini-batch ``rows``' counts that ``--loss-aggregation`` divides by: trained tokens
    of the kept responses (a multi-turn sample's own turns); sequences = ``mini_sequences``,
    the configured mini-batch size in responses (verl divides a partial last mini-batch by it
    too), default the trained rows."""
    kept = [i for i in rows if batch.is_kept(i)]
    pos = [i for i in kept if is_positive(batch, i)]

    def trained(i: int) -> int:
        own = batch.response_mask(i)
        return len(batch.response_ids[i]) if own is None else sum(own)

    return AggregationTotals(float(sum(trained(i) for i in kept)),
                             float(sum(trained(i) for i in pos)),
                             float(mini_sequences or len(kept)), float(len(pos)),
                             parallel_state.get_data_parallel_world_size())


def policy_loss_fn(cfg: PolicyLossConfig, vocab_size: int, n_tokens: float, n_positive: float,
                   totals: AggregationTotals | None = None) -> Callable:
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


def step_means(summed: dict[str, float], steps: int) -> dict[str, float]:
    """Metrics of a step's optimizer steps, summed over them, as one step's: token-weighted
    ``train/`` sums over the trained tokens (``train/tokens``, popped), the per-step ones
    (:data:`PER_STEP_METRICS`, and every non-``train/`` one) averaged over ``steps``."""
    tokens = summed.pop("train/tokens", 0.0)
    out = {}
    for k, v in summed.items():
        token_weighted = k.startswith("train/") and k not in PER_STEP_METRICS
        out[k] = v / max(tokens, 1.0) if token_weighted else v / steps
    return out
