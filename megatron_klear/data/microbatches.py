"""The trainers' micro-batches: a step's samples as the tensors one forward/backward reads.

RL (:func:`rollout_microbatches`): a mini-batch's rows go to the data-parallel ranks balanced
by tokens (:func:`dp_rows`), then into THD packs under a token budget (:func:`token_budget`;
with ``--share-prompts`` in prompt units, each prompt carried once) or, with
``--no-pack-sequences``, into right-padded rows (:func:`pad_microbatches`). Each label carries
its loss inputs (:data:`FIELDS`). SFT (:func:`sft_microbatches`): whole packed bins per rank.
The packing itself (bins, THD layout) is :mod:`megatron_klear.data.packing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from megatron.core import parallel_state

from megatron_klear.config import ConfigError
from megatron_klear.data.packing import balance, build_packed_batch, pack_bins, \
    run_positions, thd_pack
from megatron_klear.data.sft import SFTSample
from megatron_klear.samples import RolloutBatch

FIELDS = ("loss_mask", "advantages", "positive", "rollout_logprobs")  # per-label loss inputs


@dataclass(frozen=True)
class MicroBatchLayout:
    """What shapes RL micro-batches, gathered from several config sections in one place
    (``RLConfig.micro_batch_layout()``, train/rl_config.py)."""

    pack_sequences: bool
    share_prompts: bool | None
    micro_batch_size: int
    max_tokens_per_gpu: int | None
    rollout_max_prompt_len: int
    rollout_max_response_len: int
    tensor_model_parallel_size: int
    context_parallel_size: int
    sequence_parallel: bool


def is_positive(batch: RolloutBatch, i: int) -> bool:
    """Sample ``i`` scored the reward's maximum (the SFT term's positives, whatever the scale:
    1 for the 0/1 and the +-1 rewards)."""
    return batch.is_kept(i) and batch.rewards[i] >= batch.max_score


def sample_fields(batch: RolloutBatch, i: int) -> tuple[list[int], dict[str, list[float]]]:
    """Sample ``i`` as one sequence (prompt + response) and its per-label loss inputs.

    labels[t] is token t+1; loss_mask marks the trained response tokens (all of them, or
    those of the sample's ``response_mask``: a multi-turn sample's own turns); advantages,
    ``positive`` (fully correct response) and rollout log-probs are aligned with the labels.
    """
    p, resp = batch.prompt_ids[i], batch.response_ids[i]
    ctx, n = [0.0] * (len(p) - 1), len(resp)
    lp = list(batch.rollout_logprobs[i][:n])
    kept, own = float(batch.is_kept(i)), batch.response_mask(i)
    fields = {"loss_mask": ctx + ([kept] * n if own is None else [kept * m for m in own]),
              "advantages": ctx + [float(batch.advantages[i])] * n,
              "positive": ctx + [float(is_positive(batch, i))] * n,
              "rollout_logprobs": ctx + lp + [0.0] * (n - len(lp))}
    if batch.teacher_logprobs:  # on-policy distillation: aligned as the rollout log-probs
        fields["teacher_logprobs"] = ctx + list(batch.teacher_logprobs[i][:n])
    if batch.teacher_topk_ids:  # --opd-top-k: [labels, k], the prompt's labels zero rows
        ids = torch.tensor(batch.teacher_topk_ids[i][:n], dtype=torch.long)
        lps = torch.tensor(batch.teacher_topk_logprobs[i][:n], dtype=torch.float32)
        fields["teacher_topk_ids"] = torch.cat([ids.new_zeros(len(ctx), ids.shape[1]), ids])
        fields["teacher_topk_logprobs"] = torch.cat([lps.new_zeros(len(ctx), lps.shape[1]),
                                                     lps])
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
        d = {k: torch.zeros(len(chunk), seq_len)
             for k in FIELDS + (("teacher_logprobs",) if batch.teacher_logprobs else ())}
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
                if torch.is_tensor(v):  # [labels, k] (--opd-top-k), padding zero rows
                    d.setdefault(k, v.new_zeros((len(chunk), seq_len, *v.shape[1:])))
                    d[k][r, :len(v)] = v
                    continue
                d[k][r, :len(v)] = torch.tensor(v)
        d.update(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                 position_ids=torch.arange(seq_len).expand(len(chunk), seq_len))
        out.append(d)
    return out


def pack_microbatches(batch: RolloutBatch, rows: Sequence[int], cfg: MicroBatchLayout,
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


def token_budget(cfg: MicroBatchLayout) -> int:
    """Next-token positions per THD micro-batch (a multiple of the TP size): under
    ``--max-tokens-per-gpu``, or by default those of ``--micro-batch-size`` sequences of the
    longest prompt and response, so the default pack needs no more memory than a padded
    micro-batch would at worst, and fills it."""
    tokens = cfg.max_tokens_per_gpu or cfg.micro_batch_size * (
        cfg.rollout_max_prompt_len + cfg.rollout_max_response_len)
    return tokens - tokens % cfg.tensor_model_parallel_size


def prompt_units(batch: RolloutBatch, rows: Sequence[int], cfg: MicroBatchLayout
                 ) -> list[list[int]]:
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


def sequence_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What a padded micro-batch's length must divide by: 2 x CP (megatron's load-balanced CP
    chunks, train/context_parallel.py) and, with sequence parallelism, TP (megatron scatters
    the sequence over the TP ranks). Each CP rank holds length / CP tokens, which SP splits
    again over TP."""
    multiple = 2 * cp if cp > 1 else 1
    return math.lcm(multiple, cp * tp) if sequence_parallel else multiple


def rollout_microbatches(batch: RolloutBatch, rows: Sequence[int], cfg: MicroBatchLayout,
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


def sft_microbatches(samples: Sequence[SFTSample], bins: Sequence[list[int]], micro_batch_size: int,
                     multiple: int) -> tuple[list[dict], float]:
    """This DP rank's SFT micro-batches of a global batch of packed ``bins`` of ``samples``
    (``micro_batch_size`` bins per THD pack, padded to a multiple of ``multiple``: the TP size),
    and the global batch's loss-token count."""
    pairs = {i: (samples[i].input_ids, samples[i].loss_mask) for b in bins for i in b}
    total = float(sum(sum(samples[i].loss_mask[1:]) for b in bins for i in b))
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    per = len(bins) // dp
    mine = bins[rank * per:(rank + 1) * per]
    step = micro_batch_size
    mbs = [build_packed_batch(pairs, [i for b in mine[j:j + step] for i in b], multiple=multiple)
           for j in range(0, len(mine), step)]
    return mbs, total
