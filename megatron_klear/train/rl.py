"""GPPO RL trainer (``klear-rl``): the Klear-Reasoner recipe on megatron-core.

One RL step: sample prompts -> n responses each through the rollout servers -> rewards ->
group advantages -> drop zero-advantage groups (refill) -> old log-probs with the Megatron
model -> one optimizer step per mini-batch on GPPO + alpha * SFT(fully correct responses),
token-level mean over the mini-batch -> weight sync to the rollout servers.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from megatron.core import parallel_state

from megatron_klear.algo.losses import sft_loss
from megatron_klear.algo.rollout_correction import LEVELS, MODES, RolloutCorrection, \
    rollout_correction_weights
from megatron_klear.config import ConfigError, TrainConfig, opt
from megatron_klear.data.packing import balance, pack_bins, run_positions, thd_pack
from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
from megatron_klear.ops import vocab_parallel_logprobs, vocab_parallel_policy_loss
from megatron_klear.ops.backend import loss_backend
from megatron_klear.train.async_rollout import RolloutSource
from megatron_klear.train.engine import Engine, build_engine, \
    restore_or_init
from megatron_klear.train.memory import Workload
from megatron_klear.train.metrics import MetricsLogger
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
    rollout_max_prompt_len: int = opt(1024, "longest prompt in tokens that the --dry-run "
                                      "memory plan budgets for (sequences are prompt + "
                                      "--rollout-max-response-len); not enforced in training")
    rollout_temperature: float = opt(1.0, "sampling temperature")
    rollout_top_p: float = opt(1.0, "nucleus sampling")
    rollout_urls: list[str] | None = opt(None, "existing SGLang/embedded servers (else embedded)")
    rollout_num_servers: int = opt(1, "embedded servers to start when no --rollout-urls")
    loss_type: str = opt("gppo", "policy loss: gppo (CE-GPPO general beta), ppo (PPO-clip with "
                         "Clip-Higher bounds, DAPO) or cispo (MiniMax-M1); docs/policy_loss.md",
                         choices=("gppo", "ppo", "cispo"))
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
                                         "--micro-batch-size sequences per micro-batch")
    pack_sequences: bool = opt(True, "THD packs without padding (--no-pack-sequences: "
                               "micro-batches right-padded to the longest sequence)")
    share_prompts: bool = opt(False, "carry each prompt once per pack for its n samples (a "
                              "tree mask: --transformer-impl local only; docs/training.md)")

    def validate(self) -> None:  # noqa: D102
        # sequences per optimizer step follow from the mini-batch of prompts
        self.global_batch_size = self.mini_batch_size * self.n_samples_per_prompt
        super().validate()
        for name, flag in (("prompt_data", "--prompt-data"), ("hf_checkpoint", "--hf-checkpoint")):
            if not getattr(self, name):
                raise ConfigError(f"{flag} is required")
        if self.rollout_batch_size % self.mini_batch_size:
            raise ConfigError(f"--rollout-batch-size {self.rollout_batch_size} must be a multiple"
                              f" of --mini-batch-size {self.mini_batch_size}")
        if self.n_samples_per_prompt < 2:
            raise ConfigError("--n-samples-per-prompt must be >= 2 (group advantages)")
        if not 0 < self.eps_clip_low < 1 or self.eps_clip_high <= 0:
            raise ConfigError("--eps-clip-low must be in (0, 1) and --eps-clip-high > 0")
        if self.entropy_ratio_clip is not None and not self.entropy_ratio_clip > 0:
            raise ConfigError(f"--entropy-ratio-clip must be > 0 (ERC's delta, e.g. 0.05), got "
                              f"{self.entropy_ratio_clip}; omit the flag to disable ERC")
        self.correction()
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
        if self.share_prompts and (not self.pack_sequences
                                   or self.transformer_impl != "local"):
            raise ConfigError("--share-prompts needs THD packs in the local spec (Transformer "
                              "Engine's THD attention cannot express its tree mask): drop "
                              "--no-pack-sequences / use --transformer-impl local, or drop "
                              "--share-prompts")

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


def sample_fields(batch: RolloutBatch, i: int) -> tuple[list[int], dict[str, list[float]]]:
    """Sample ``i`` as one sequence (prompt + response) and its per-label loss inputs.

    labels[t] is token t+1; loss_mask marks the response tokens; advantages, ``positive``
    (fully correct response) and rollout log-probs are aligned with the labels.
    """
    p, resp = batch.prompt_ids[i], batch.response_ids[i]
    ctx, n = [0.0] * (len(p) - 1), len(resp)
    lp = list(batch.rollout_logprobs[i][:n])
    return p + resp, {"loss_mask": ctx + [1.0] * n,
                      "advantages": ctx + [float(batch.advantages[i])] * n,
                      "positive": ctx + [float(batch.rewards[i] >= 1.0)] * n,
                      "rollout_logprobs": ctx + lp + [0.0] * (n - len(lp))}


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
            for k, v in fields.items():
                d[k][r, :len(v)] = torch.tensor(v)
        d.update(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                 position_ids=torch.arange(seq_len).expand(len(chunk), seq_len))
        out.append(d)
    return out


def pack_microbatches(batch: RolloutBatch, rows: Sequence[int], cfg: "RLConfig",
                      pad_id: int) -> list[dict]:
    """THD micro-batches of ``rows`` without padding: ``--micro-batch-size`` sequences each,
    or, with ``--max-tokens-per-gpu``, first-fit-decreasing packs under that token budget
    (with ``--share-prompts``, of prompt units, each prompt carried once)."""
    units = prompt_units(batch, rows, cfg)
    budget = token_budget(cfg)
    if budget is not None:
        sizes = [unit_positions(batch, u, cfg.share_prompts) for u in units]
        if max(sizes) > budget:
            raise ConfigError(f"--max-tokens-per-gpu {cfg.max_tokens_per_gpu} is smaller than a "
                              f"rollout sequence of {max(sizes)} tokens; raise it to at "
                              "least the longest prompt + --rollout-max-response-len")
        groups = [[r for u in b for r in units[u]]
                  for b in pack_bins([n + 1 for n in sizes], budget, window=None)]
    else:
        rows = [r for u in units for r in u]
        groups = [rows[s:s + cfg.micro_batch_size]
                  for s in range(0, len(rows), cfg.micro_batch_size)]
    out = []
    for group in groups:
        seqs, fields = zip(*(sample_fields(batch, r) for r in group))
        out.append(thd_pack(seqs, {k: [f[k] for f in fields] for k in FIELDS}, pad_id=pad_id,
                            multiple=cfg.tensor_model_parallel_size,
                            prompt_lens=[len(batch.prompt_ids[r]) for r in group]
                            if cfg.share_prompts else None))
    return out


def token_budget(cfg: "RLConfig") -> int | None:
    """Next-token positions per micro-batch under ``--max-tokens-per-gpu`` (a multiple of the
    TP size), or None."""
    if not cfg.max_tokens_per_gpu:
        return None
    return cfg.max_tokens_per_gpu - cfg.max_tokens_per_gpu % cfg.tensor_model_parallel_size


def prompt_units(batch: RolloutBatch, rows: Sequence[int], cfg: "RLConfig") -> list[list[int]]:
    """``rows`` in the pieces that train together: with ``--share-prompts`` the runs of rows
    of one prompt (split where the run's pack would exceed the token budget), else each row
    alone."""
    if not cfg.share_prompts:
        return [[r] for r in rows]
    budget, units = token_budget(cfg), []
    for r in rows:
        if units and batch.prompt_ids[units[-1][0]] == batch.prompt_ids[r] and (
                budget is None or unit_positions(batch, units[-1] + [r], True) <= budget):
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
                  backend: str) -> None:
    """Set ``old_logprobs`` and ``entropy`` of a micro-batch from its logits (no gradient)."""
    lp, ent = vocab_parallel_logprobs(logits, batch["labels"],
                                      tp_group=parallel_state.get_tensor_model_parallel_group(),
                                      compute_entropy=True, temperature=temperature,
                                      vocab_size=vocab_size, backend=backend)
    batch["old_logprobs"], batch["entropy"] = lp.float(), ent.float()


def old_logprobs(engine: Engine, mbs: list[dict], vocab_size: int, temperature: float) -> None:
    """Fill ``old_logprobs`` and ``entropy`` of each micro-batch with the current policy."""
    if not mbs:
        return
    backend = loss_backend(engine.cfg.loss_backend)

    def fwd(logits, batch):
        fill_logprobs(logits, batch, vocab_size, temperature, backend)
        # on the logits' device: megatron's MoE schedule multiplies it by the CUDA loss scale
        return logits.new_zeros(()), {}

    engine.forward_only(mbs, fwd)


def sequence_ids(b: dict) -> torch.Tensor:
    """Each label's sequence in a micro-batch: THD ``segment_ids`` or the row of a padded one."""
    if "segment_ids" in b:
        return b["segment_ids"]
    rows = b["loss_mask"].shape[0]
    return torch.arange(rows, device=b["loss_mask"].device)[:, None].expand_as(b["loss_mask"])


def policy_loss_fn(cfg: RLConfig, vocab_size: int, n_tokens: float, n_positive: float):
    """GPPO (or PPO/CISPO) + alpha * SFT, each a token-level mean over the mini-batch, with the
    optional rollout correction (weights on the advantages) and ERC (old entropy per token)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    backend = loss_backend(cfg.loss_backend)
    correction = cfg.correction()
    erc = cfg.entropy_ratio_clip is not None

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
            temperature=cfg.rollout_temperature, normalizer=max(n_tokens, 1.0),
            compute_entropy=False, tp_group=tp_group, vocab_size=vocab_size, backend=backend,
            inplace_backward=True)  # logits are not read after backward
        sft = sft_loss(out.logprobs, mask * b["positive"], normalizer=max(n_positive, 1.0))
        loss = out.loss + cfg.sft_alpha * sft
        metrics.update({f"train/{k}": v.detach() * tokens for k, v in out.metrics.items()})
        mismatch = ((old - b["rollout_logprobs"]).abs() * mask).sum()
        metrics.update({"train/policy_loss": out.loss.detach(), "train/sft_loss": sft.detach(),
                        "train/loss": loss.detach(), "train/tokens": tokens,
                        "train/entropy": (b["entropy"] * mask).sum(),
                        "train/mismatch_abs_logprob": mismatch})
        return loss, metrics

    return loss_fn


def train_on_batch(engine: Engine, cfg: RLConfig, batch: RolloutBatch, pad_id: int) -> dict:
    """Old log-probs, then one optimizer step per mini-batch; returns averaged metrics."""
    vocab = engine.arch.vocab_size
    per_mini = cfg.mini_batch_size * batch.group_size
    minis = [list(range(s, min(s + per_mini, len(batch)))) for s in range(0, len(batch), per_mini)]
    mbs_per_mini = [rollout_microbatches(batch, rows, cfg, pad_id) for rows in minis]
    t0 = time.time()
    # the first mini-batch trains on the policy that sampled: its old log-probs come from its
    # own training forward (policy_loss_fn); the later ones need the pre-update policy
    old_logprobs(engine, [mb for mbs in mbs_per_mini[1:] for mb in mbs], vocab,
                 cfg.rollout_temperature)
    t_old = time.time() - t0
    totals: dict[str, float] = {}
    t0 = time.time()
    for rows, mbs in zip(minis, mbs_per_mini):
        n_tok = sum(len(batch.response_ids[i]) for i in rows)
        n_pos = sum(len(batch.response_ids[i]) for i in rows if batch.rewards[i] >= 1.0)
        m = engine.train_step(mbs, policy_loss_fn(cfg, vocab, n_tok, n_pos))
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + v
    t_train = time.time() - t0
    steps = len(minis)
    tokens = totals.pop("train/tokens", 0.0)
    out = {}
    for k, v in totals.items():  # token-weighted metrics -> means; per-step ones -> averages
        token_weighted = k.startswith("train/") and k not in (
            "train/policy_loss", "train/sft_loss", "train/loss")
        out[k] = v / max(tokens, 1.0) if token_weighted else v / steps
    n_train = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    out.update({"time/old_logprob_s": t_old, "time/train_s": t_train,
                "train/tokens_per_s": n_train / max(t_train, 1e-9), "train/optimizer_steps": steps})
    return out


@contextlib.contextmanager
def rollout_servers(cfg: RLConfig):
    """The rollout servers of the run: given URLs, or embedded servers started here (rank 0)."""
    from megatron_klear.rollout.launcher import connect, launch_embedded_servers

    if cfg.rollout_urls:
        yield connect(cfg.rollout_urls)
    elif torch.distributed.get_rank() == 0:
        with launch_embedded_servers(cfg.hf_checkpoint, cfg.rollout_num_servers,
                                     seed=cfg.seed) as servers:
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
    if cfg.share_prompts and arch.rope_scaling:
        raise ConfigError(f"--share-prompts continues a prompt's RoPE positions in its samples' "
                          f"branches, which needs plain RoPE; {cfg.hf_checkpoint}/config.json "
                          "sets rope_scaling: drop --share-prompts")
    tokenizer = load_tokenizer(cfg.hf_checkpoint, cfg.prompt_template, cfg.chat_template)
    prompts = load_prompt_dataset(cfg.prompt_data, prompt_key=cfg.prompt_key,
                                  answer_key=cfg.answer_key, answer_format=cfg.answer_format)
    engine = build_engine(cfg, arch)
    info = restore_or_init(engine)
    step, consumed = (info.iteration, info.extra["consumed_prompts"]) if info else (0, 0)
    stream = PromptStream(prompts, cfg.seed, consumed)
    params = SamplingParams(n=cfg.n_samples_per_prompt, max_new_tokens=cfg.rollout_max_response_len,
                            temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p,
                            stop_token_ids=[tokenizer.eos_token_id])
    log = MetricsLogger(cfg.log_dir or cfg.save, total_steps=cfg.train_iters, start_step=step,
                        desc="rl", progress=cfg.progress_bar, log_interval=cfg.log_interval)
    history: list[dict] = []
    with rollout_servers(cfg) as servers:
        client = RolloutClient(servers.urls)
        # synchronous runs have nothing in flight at a sync: abort + flush is the clean state
        sync = WeightSync(servers.urls, engine.model, arch,
                          bucket_bytes=cfg.weight_sync_bucket_mb * 2**20,
                          load_format=None if cfg.weight_sync_format == "per_tensor"
                          else cfg.weight_sync_format,
                          master_addr=cfg.weight_sync_master_addr, rollout_client=client,
                          pause_mode=INFLIGHT_PAUSE_MODES[cfg.async_inflight]
                          if cfg.async_rollout else "abort",
                          flush_cache=not cfg.async_rollout)
        sync.connect()
        sync.sync(weight_version=str(step))  # servers start from the trainer's weights
        with contextlib.closing(rollout_source(cfg, client, tokenizer, stream, params,
                                               step)) as source:
            while step < cfg.train_iters:
                metrics = rl_step(engine, cfg, source, tokenizer, step)
                step += 1
                metrics.update(sync_and_probe(engine, cfg, sync, str(step)))
                source.weights_updated(step)
                if cfg.eval_data and cfg.eval_interval and step % cfg.eval_interval == 0:
                    metrics.update(periodic_eval(cfg, client, tokenizer))
                log.log(step, metrics)
                history.append(metrics)
                if cfg.save and (step == cfg.train_iters or
                                 (cfg.save_interval and step % cfg.save_interval == 0)):
                    engine.save(step, {"consumed_prompts": metrics["data/consumed_prompts"]})
        sync.close()
    log.close()
    if cfg.export_hf:
        engine.export_hf(cfg.export_hf, cfg.hf_checkpoint)
    return history


def rollout_source(cfg: RLConfig, client: Any, tokenizer: Any, stream: PromptStream,
                   params: Any, step: int) -> RolloutSource:
    """The run's batches from ``stream``: collected when a step starts, or with
    ``--async-rollout`` up to ``--max-staleness`` steps ahead (train/async_rollout.py)."""
    collect = functools.partial(collect_batch, client, tokenizer, stream, cfg.rollout_batch_size,
                                params, cfg.reward, dynamic_sampling=cfg.dynamic_sampling,
                                max_rounds=cfg.max_sampling_rounds,
                                normalize_std=cfg.advantage_std_norm)
    return RolloutSource(collect, stream, ahead=cfg.max_staleness if cfg.async_rollout else 0,
                         last_step=cfg.train_iters, version=step)


def rl_step(engine: Engine, cfg: RLConfig, source: RolloutSource, tokenizer: Any,
            step: int) -> dict:
    """Take step ``step``'s batch on rank 0 (generated now or ahead), share it, train on it."""
    t0 = time.time()
    got = source.next(step) if torch.distributed.get_rank() == 0 else None
    batch, cursor, version = broadcast_batch(
        (got.batch, got.cursor, got.version) if got else None)
    metrics = dict(batch.stats)
    metrics["time/rollout_s"] = time.time() - t0  # async: only the wait for the batch
    metrics["rollout/staleness"] = float(step - version)  # weight updates since it began
    metrics["data/prompt_indices"] = sorted(set(batch.prompt_index))
    metrics["data/consumed_prompts"] = cursor  # the checkpoint resumes after this batch
    usable = batch.groups() // cfg.mini_batch_size * cfg.mini_batch_size
    if usable == 0:  # fewer informative groups than one mini-batch even after refilling
        metrics["train/skipped_step"] = 1.0
        return metrics
    batch = batch.select_groups(range(usable))
    metrics.update(train_on_batch(engine, cfg, batch, tokenizer.pad_token_id))
    return metrics


def sync_and_probe(engine: Engine, cfg: RLConfig, sync: Any, version: str) -> dict:
    """Push new weights to the servers and, optionally, check them with a log-prob probe."""
    from megatron_klear.rollout.weight_sync import trainer_sequence_logprobs

    engine.gather_params()  # the distributed optimizer may defer the all-gather
    metrics = dict(sync.sync(weight_version=version))
    if cfg.probe_weights:
        probe_ids = list(range(1, min(engine.arch.vocab_size, 33)))
        trainer_lp = trainer_sequence_logprobs(engine.model, engine.arch, probe_ids)
        asks = trainer_lp is not None and parallel_state.get_tensor_model_parallel_rank() == 0
        probe = (sync.probe(probe_ids, trainer_lp), float(trainer_lp.mean())) if asks else None
        held = [None] * torch.distributed.get_world_size()  # one rank asked: share its answer
        torch.distributed.all_gather_object(held, probe)
        diff, mean_lp = next(p for p in held if p is not None)
        metrics["weight_sync/probe_max_abs_diff"] = diff
        metrics["weight_sync/probe_logprob_mean"] = mean_lp  # moves when the weights move
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
                                temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p,
                                stop_token_ids=[tokenizer.eos_token_id])
        report = evaluate(client, tokenizer, [bench], k=cfg.eval_k, params=params,
                          progress=False)["eval"]
    report = broadcast_batch(report)
    return {f"eval/{k}": v for k, v in report.items()}


def memory_workload(cfg: RLConfig) -> Workload:
    """What the RL trainer feeds the model (the dry run's memory plan): THD packs of
    ``--micro-batch-size`` prompt + response rows, or of ``--max-tokens-per-gpu`` tokens,
    under the fused policy loss unless --loss-backend torch."""
    return Workload(cfg.rollout_max_prompt_len + cfg.rollout_max_response_len,
                    fused_loss=cfg.loss_backend != "torch",
                    tokens=cfg.max_tokens_per_gpu)


def main(argv: Sequence[str] | None = None) -> None:
    """``klear-rl``: parse flags, run RL, exit non-zero with a clear message on bad input."""
    from megatron_klear.cli import trainer_main

    trainer_main(RLConfig, train, argv, "klear-rl", workload=memory_workload)


if __name__ == "__main__":
    main()
