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
from typing import Any, Sequence

import torch
from megatron.core import parallel_state

from megatron_klear.algo.kl import kl_per_token
from megatron_klear.algo.losses import AggregationTotals, MicroCounts, \
    aggregate_rl_loss, erc_band
from megatron_klear.algo.rollout_correction import rollout_correction_weights
from megatron_klear.config import ConfigError
from megatron_klear.data.packing import balance, pack_bins, run_positions, thd_pack
from megatron_klear.data.prompts import parse_chat_template_kwargs
from megatron_klear.heap import freeze_startup_heap
from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
from megatron_klear.ops import vocab_parallel_logprobs, vocab_parallel_policy_loss
from megatron_klear.ops.backend import loss_backend
from megatron_klear.train.async_rollout import RolloutSource
from megatron_klear.train.colocate import Colocation
from megatron_klear.train.context_parallel import sequence_multiple
from megatron_klear.train.engine import Engine, build_engine, restore_or_init
from megatron_klear.train.memory import Workload
from megatron_klear.train.metrics import MetricsLogger, wandb_settings
from megatron_klear.train.reference import ReferencePolicy
from megatron_klear.train.rl_config import INFLIGHT_PAUSE_MODES, RLConfig, async_share
from megatron_klear.train.rl_data import PromptStream, RolloutBatch, broadcast_batch, \
    collect_batch


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
    from megatron_klear.rollout.client import RolloutClient
    from megatron_klear.rollout.weight_sync import WeightSync

    arch = qwen3_config_from_hf(load_hf_config(cfg.hf_checkpoint))
    tokenizer = load_tokenizer(cfg.hf_checkpoint, cfg.prompt_template, cfg.chat_template,
                               parse_chat_template_kwargs(cfg.chat_template_kwargs))
    prompts = load_prompt_dataset(cfg.prompt_data, prompt_key=cfg.prompt_key,
                                  answer_key=cfg.answer_key, answer_format=cfg.answer_format)
    engine = build_engine(cfg, arch)
    cfg.derive(arch)  # the --share-prompts default for this model
    info = restore_or_init(engine)
    reference = ReferencePolicy(engine, cfg.ref_load or cfg.hf_checkpoint) \
        if cfg.kl_coef else None
    step, consumed = (info.iteration, info.extra["consumed_prompts"]) if info else (0, 0)
    stream = PromptStream(prompts, cfg.seed, consumed)
    params = cfg.sampling_params(stop_token_ids=[tokenizer.eos_token_id])
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

    report = None
    if torch.distributed.get_rank() == 0:
        bench = Benchmark(name="eval", path=cfg.eval_data, reward=cfg.reward,
                          prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                          answer_format=cfg.answer_format)
        params = cfg.eval_sampling_params(stop_token_ids=[tokenizer.eos_token_id])
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
    from megatron_klear.train.main import trainer_main

    trainer_main(RLConfig, train, argv, "klear-rl", workload=memory_workload)


if __name__ == "__main__":
    main()
