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

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from megatron.core import parallel_state

from megatron_klear.algo.kl import KL_ESTIMATORS, kl_per_token
from megatron_klear.algo.opd import opd_advantages, opd_stats, topk_reverse_kl
from megatron_klear.algo.rollout_correction import LEVELS, MODES, RolloutCorrection, \
    rollout_correction_weights
from megatron_klear.config import ConfigError, Section, opt
from megatron_klear.data.microbatches import is_positive
from megatron_klear.ops import PolicyLossSpec, vocab_parallel_gather_logits, \
    vocab_parallel_logprobs, vocab_parallel_policy_loss
from megatron_klear.ops.backend import loss_backend
from megatron_klear.ops.loss_math import LOSS_AGGREGATIONS, AggregationTotals, MicroCounts, \
    aggregate_rl_loss, erc_band
from megatron_klear.samples import RolloutBatch

# per-step metrics averaged over optimizer steps; every other train/ metric is a token sum
PER_STEP_METRICS = ("train/policy_loss", "train/sft_loss", "train/kl_loss", "train/opd_loss",
                    "train/loss")


@dataclass
class PolicyLossFlags(Section):
    """The policy loss, its aggregation, the SFT and KL terms, and rollout corrections."""

    title = "policy loss"
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
    # Klear's released recipe (docs/recipe.md)
    loss_aggregation: str = opt("token-mean", "how per-token losses become the loss: token-mean "
                                "(the paper: mean over the mini-batch's tokens), "
                                "token-mean-micro (Klear's released code: token mean per "
                                "micro-batch x sequences / per-rank mini-batch size, "
                                "averaged over DP), seq-mean-token-sum, seq-mean-token-mean "
                                "(verl's sequence means); the SFT term likewise",
                                choices=LOSS_AGGREGATIONS)
    entropy_ratio_clip: float | None = opt(None, "ERC delta (arXiv 2512.05591), e.g. 0.05: tokens "
                                           "whose entropy ratio current/old policy leaves "
                                           "(1-delta, 1+delta) pass no gradient; unset: off")
    erc_low: float | None = opt(None, "ERC band lower bound of the entropy ratio (with "
                                "--erc-high; ERC's scripts: 0.95), instead of "
                                "--entropy-ratio-clip's symmetric 1 - delta")
    erc_high: float | None = opt(None, "ERC band upper bound of the entropy ratio (with "
                                 "--erc-low; ERC's scripts: 1.05)")
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
    # KL to a frozen reference policy (a loss term; docs/policy_loss.md)
    kl_coef: float = opt(0.0, "weight of the KL(policy || reference) loss term (0: off, no "
                         "reference forward)")
    kl_estimator: str = opt("low_var_kl", "per-token KL estimator", choices=KL_ESTIMATORS)
    ref_load: str | None = opt(None, "reference weights: a checkpoint dir or a Hugging Face "
                               "dir (default: --hf-checkpoint); e.g. the SFT checkpoint an RL "
                               "run started from")

    def validate_section(self) -> None:  # noqa: D102
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
        if self.kl_coef < 0:
            raise ConfigError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if self.ref_load and not self.kl_coef:
            raise ConfigError("--ref-load is the reference of the KL term: set --kl-coef > 0 "
                              "or drop --ref-load")

    def check_inputs_section(self, model: Any) -> None:  # noqa: D102
        if self.ref_load and not Path(self.ref_load).is_dir():
            raise ConfigError(f"--ref-load {self.ref_load}: no such directory (a checkpoint "
                              "dir or a Hugging Face dir)")

    def spec(self) -> PolicyLossSpec:
        """The policy loss's hyper-parameters as the fused op takes them (built once a run)."""
        return PolicyLossSpec(self.loss_type, self.eps_clip_low, self.eps_clip_high,
                              self.gppo_beta1, self.gppo_beta2, self.dual_clip,
                              self.entropy_ratio_clip, self.erc_low, self.erc_high)

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


def token_advantages(b: dict, correction: RolloutCorrection | None = None,
                     opd_kl_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Each label's advantage in micro-batch ``b`` (which holds its ``old_logprobs``) and the
    token-summed ``train/`` metrics it adds: the group advantage; with ``opd_kl_coef`` and the
    batch's ``teacher_logprobs``, minus lambda x (student - teacher log-prob), the student's
    being the old log-prob, or the rollout engine's under ``correction`` (algo/opd.py); then
    times the rollout correction's weights."""
    adv, mask, old = b["advantages"], b["loss_mask"], b["old_logprobs"]
    metrics = {}
    if opd_kl_coef and "teacher_logprobs" in b:
        student = b["rollout_logprobs"] if correction is not None else old
        adv, opd = opd_advantages(adv, student, b["teacher_logprobs"], mask, opd_kl_coef)
        metrics.update({f"train/{k}": v for k, v in opd.items()})
    if correction is not None:  # rollout engine vs trainer mismatch
        weights, corr = rollout_correction_weights(old, b["rollout_logprobs"], mask,
                                                   sequence_ids(b), correction)
        adv = adv * weights
        metrics.update({f"train/rollout_correction_{k}": v * mask.sum()
                        for k, v in corr.items()})
    return adv, metrics


def policy_loss_fn(loss: PolicyLossFlags, vocab_size: int, n_tokens: float, n_positive: float,
                   totals: AggregationTotals | None = None, *, temperature: float = 1.0,
                   backend: str = "auto", opd_kl_coef: float = 0.0,
                   opd_top_k: int = 0) -> Callable:
    """GPPO (or PPO/CISPO) + alpha * SFT aggregated as ``--loss-aggregation`` says (default: each
    a token-level mean over the mini-batch, whose counts ``n_tokens`` / ``n_positive`` are),
    with the optional rollout correction (weights on the advantages) and ERC (old entropy per
    token). ``totals``: the mini-batch's counts (:func:`aggregation_totals`), needed by the
    other aggregations. ``loss``: the policy-loss section; ``temperature``: the rollout's
    sampling temperature (``--rollout-temperature``); ``backend``: ``--loss-backend``;
    ``opd_kl_coef``: on-policy distillation's lambda (``--opd-kl-coef``, algo/opd.py): with
    the micro-batch's ``teacher_logprobs``, each token's advantage loses lambda x (student -
    teacher log-prob), the student's being the old log-prob, or the rollout engine's under a
    rollout correction; ``opd_top_k`` > 0 (``--opd-top-k``): instead, the advantage stays the
    task's and the loss adds lambda x the reverse KL over the teacher's top-k ids
    (``teacher_topk_ids`` / ``teacher_topk_logprobs``, algo/opd.py), aggregated as the policy
    term."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    backend = loss_backend(backend)
    correction = loss.correction()
    spec = loss.spec()
    erc = spec.band is not None
    if totals is None:
        if loss.loss_aggregation != "token-mean":
            raise ValueError(f"--loss-aggregation {loss.loss_aggregation} needs the mini-batch's "
                             "totals (aggregation_totals)")
        totals = AggregationTotals(n_tokens, n_positive, 0.0, 0.0,
                                   parallel_state.get_data_parallel_world_size())

    def loss_fn(logits, b):
        mask = b["loss_mask"]
        if "old_logprobs" not in b:  # first mini-batch: the policy has not moved, old = current
            fill_logprobs(logits, b, vocab_size, temperature, backend)
        old = b["old_logprobs"]
        tokens = mask.sum()
        adv, metrics = token_advantages(b, correction, 0.0 if opd_top_k else opd_kl_coef)
        out = vocab_parallel_policy_loss(
            logits, b["labels"], old, adv, mask, spec, old_entropy=b["entropy"] if erc else None,
            sequence_ids=sequence_ids(b), temperature=temperature, reduction="none",
            tp_group=tp_group, backend=backend, vocab_size=vocab_size,
            inplace_backward=True)  # logits are not read after backward
        seq_len = b["seq_tokens"] if "seq_tokens" in b else seq_tokens(b)
        total, pg, sft = aggregate_rl_loss(
            loss.loss_aggregation, out.loss, -out.logprobs, mask, b["positive"], loss.sft_alpha,
            totals, seq_tokens=seq_len, micro=micro_counts(b))

        def as_policy_term(per_token: torch.Tensor) -> torch.Tensor:
            """A per-token loss term aggregated as the policy term (its mask and counts)."""
            return aggregate_rl_loss(loss.loss_aggregation, per_token,
                                     torch.zeros_like(per_token), mask, b["positive"], 0.0,
                                     totals, seq_tokens=seq_len, micro=micro_counts(b))[1]

        if opd_top_k and "teacher_topk_ids" in b:  # on-policy distillation's top-k KL
            picked = vocab_parallel_gather_logits(logits, b["teacher_topk_ids"], tp_group,
                                                  vocab_size)
            topk_kl = topk_reverse_kl(picked / temperature, b["teacher_topk_logprobs"])
            opd_loss = as_policy_term(topk_kl)
            total = total + opd_kl_coef * opd_loss
            metrics.update({f"train/{k}": v for k, v in opd_stats(
                topk_kl, adv, b["teacher_logprobs"], mask, opd_kl_coef).items()})
            metrics["train/opd_loss"] = opd_loss.detach()
        if loss.kl_coef:  # aggregated as the policy term
            kl = kl_per_token(out.logprobs, b["ref_logprobs"], loss.kl_estimator)
            kl_loss = as_policy_term(kl)
            total = total + loss.kl_coef * kl_loss
            metrics.update({"train/kl_loss": kl_loss.detach(),
                            "train/kl": (kl.detach() * mask).sum()})
        metrics.update({f"train/{k}": v.detach() * tokens for k, v in out.metrics.items()})
        mismatch = ((old - b["rollout_logprobs"]).abs() * mask).sum()
        metrics.update({"train/policy_loss": pg.detach(), "train/sft_loss": sft.detach(),
                        "train/loss": total.detach(), "train/tokens": tokens,
                        "train/entropy": (b["entropy"] * mask).sum(),
                        "train/mismatch_abs_logprob": mismatch})
        return total, metrics

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
