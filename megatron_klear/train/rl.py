"""GPPO RL trainer (``klear-rl``): the Klear-Reasoner recipe on megatron-core.

One RL step: sample prompts -> n responses each through the rollout servers -> rewards ->
group advantages -> drop zero-advantage groups (refill) -> old log-probs with the Megatron
model -> one optimizer step per mini-batch on GPPO + alpha * SFT(fully correct responses),
token-level mean over the mini-batch -> weight sync to the rollout servers.

This file is the loop; its parts live with their concepts: the flags in train/rl_config.py,
the rollouts in train/rl_data.py, the placement of the engines (separate or colocated) in
train/placement.py, micro-batches in data/microbatches.py, the loss in algo/rl_objective.py, and
the skeleton shared with SFT (engine, restore, log, saves, export) in train/loop.py.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Sequence

import torch
from megatron.core import parallel_state

from megatron_klear.algo.rl_objective import PolicyLossFlags, aggregation_totals, \
    annotate_aggregation, old_logprobs, policy_loss_fn, step_means
from megatron_klear.data.microbatches import rollout_microbatches, shape_routed_experts
from megatron_klear.data.prompts import parse_chat_template_kwargs
from megatron_klear.rollout.orchestration.teacher import TeacherClient
from megatron_klear.samples import RolloutBatch
from megatron_klear.train.async_rollout import RolloutSource
from megatron_klear.train.colocate import release_launched_engines
from megatron_klear.train.engine import Engine
from megatron_klear.train.frozen_policy import FrozenModel, source_hf_config
from megatron_klear.train.learning_signal import LearningSignalMonitor
from megatron_klear.train.loop import finish, model_arch, open_log, run_steps, start_run
from megatron_klear.train.memory import Workload
from megatron_klear.train.placement import build_placement, rollout_servers
from megatron_klear.train.reference import ReferencePolicy
from megatron_klear.train.rl_config import RLConfig
from megatron_klear.train.rl_data import DynamicSamplingFlags, PromptStream, broadcast_batch, \
    collect_batch


def train(cfg: RLConfig) -> list[dict]:
    """Run GPPO RL; returns this run's per-step metrics."""
    from megatron_klear.data.prompts import load_prompt_dataset, load_tokenizer
    from megatron_klear.rollout.orchestration.client import RolloutClient

    arch = model_arch(cfg)
    tokenizer = load_tokenizer(cfg.hf_checkpoint, cfg.prompt_template, cfg.chat_template,
                               parse_chat_template_kwargs(cfg.chat_template_kwargs))
    prompts = load_prompt_dataset(cfg.prompt_data, prompt_key=cfg.prompt_key,
                                  answer_key=cfg.answer_key, answer_format=cfg.answer_format,
                                  meta_keys=[cfg.opd_teacher_key] if cfg.opd_teacher_key else [])
    if cfg.rollout_engine_memory == "launched":  # released before the model is built
        release_launched_engines(cfg.rollout_urls)
    run = start_run(cfg, arch, "consumed_prompts")
    engine = run.engine
    reference = ReferencePolicy(engine, cfg.ref_load or cfg.hf_checkpoint) \
        if cfg.kl_coef else None
    teacher = FrozenModel(cfg, cfg.opd_teacher_load, "--opd-teacher-load") \
        if cfg.use_opd and cfg.opd_type == "megatron" else None
    stream = PromptStream(prompts, cfg.seed, run.position)
    params = cfg.sampling_params(stop_token_ids=[tokenizer.eos_token_id])
    log = open_log(cfg, "rl", run.step)
    signal = LearningSignalMonitor(cfg.max_skipped_steps,
                                   None if torch.distributed.get_rank() == 0 else lambda _: None)
    with rollout_servers(cfg) as servers, RolloutClient(servers.urls).keep_alive() as client:
        placement = build_placement(cfg, servers.urls, engine, client)
        placement.start(str(run.step))  # the servers start from the trainer's weights
        with contextlib.closing(rollout_source(cfg, client, tokenizer, stream, params,
                                               run.step)) as source:

            def take_step(step: int) -> dict:
                """Rollout, training, weight sync (and probe), periodic eval: step + 1;
                first stops a run whose last --max-skipped-steps steps trained nothing."""
                signal.check()
                metrics = rl_step(engine, cfg, source, tokenizer, step, reference,
                                  placement.before_train, teacher)
                signal.observe(step + 1, metrics)
                metrics.update(placement.sync_and_probe(
                    str(step + 1), cfg.probe_due(step + 1, first=step == run.step)))
                source.weights_updated(step + 1)
                if cfg.eval_data and cfg.eval_interval and (step + 1) % cfg.eval_interval == 0:
                    metrics.update(periodic_eval(cfg, client, tokenizer))
                return metrics

            history = run_steps(cfg, engine, log, run.step, take_step,
                                lambda m: {"consumed_prompts": m["data/consumed_prompts"]},
                                placement.trainer_resident)
        placement.close()
    finish(cfg, engine, log)
    return history


def rollout_source(cfg: RLConfig, client: Any, tokenizer: Any, stream: PromptStream,
                   params: Any, step: int) -> RolloutSource:
    """The run's batches from ``stream``: collected when a step starts, or with
    ``--async-rollout`` up to ``--max-staleness`` steps ahead (train/async_rollout.py); a
    served OPD teacher scores them there (a Megatron one in :func:`train_on_batch`)."""
    teacher = None
    if cfg.use_opd and cfg.opd_type == "sglang" and torch.distributed.get_rank() == 0:
        key = cfg.opd_teacher_key  # several teachers: each prompt's by its record's field
        teacher = TeacherClient(cfg.teachers(), None if key is None else
                                lambda index: str(stream.prompts[index].meta[key]),
                                top_k=cfg.opd_top_k)
    collect = functools.partial(collect_batch, client, tokenizer, stream, cfg.rollout_batch_size,
                                params, cfg.reward, cfg.part(DynamicSamplingFlags),
                                prompt_limit=(cfg.rollout_max_prompt_len, cfg.truncate_prompt),
                                remote=cfg.remote_reward(), overlong=cfg.overlong_shaping(),
                                stages=cfg.rollout_stages, multi_turn=cfg.multi_turn_config(
                                    cfg.rollout_max_response_len), teacher=teacher,
                                opd=cfg.use_opd)
    return RolloutSource(collect, stream, ahead=cfg.max_staleness if cfg.async_rollout else 0,
                         last_step=cfg.train_iters, version=step)


def rl_step(engine: Engine, cfg: RLConfig, source: RolloutSource, tokenizer: Any,
            step: int, reference: ReferencePolicy | None = None,
            before_train: Callable[[], dict] | None = None,
            teacher: FrozenModel | None = None) -> dict:
    """Take step ``step``'s batch on rank 0 (generated now or ahead), share it, train on it;
    ``before_train()`` (the placement's: colocated, the hand-over of the GPUs) runs before
    training and returns metrics; ``teacher``: the Megatron OPD teacher."""
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
    metrics.update(train_on_batch(engine, cfg, batch, tokenizer.pad_token_id, reference,
                                  teacher))
    return metrics


def train_on_batch(engine: Engine, cfg: RLConfig, batch: RolloutBatch, pad_id: int,
                   reference: ReferencePolicy | None = None,
                   teacher: FrozenModel | None = None) -> dict:
    """Old (and reference, and a Megatron teacher's) log-probs, then one optimizer step per
    mini-batch; returns averaged metrics."""
    vocab = engine.arch.vocab_size
    per_mini = cfg.mini_batch_size * batch.group_size
    minis = [list(range(s, min(s + per_mini, len(batch)))) for s in range(0, len(batch), per_mini)]
    t0 = time.time()
    layout = cfg.micro_batch_layout()
    mbs_per_mini = [rollout_microbatches(batch, rows, layout, pad_id) for rows in minis]
    for mbs in mbs_per_mini:
        annotate_aggregation(mbs)
    t_pack = time.time() - t0
    every_mb = [mb for mbs in mbs_per_mini for mb in mbs]
    t0 = time.time()
    if reference is not None:
        with reference.swapped_in():
            old_logprobs(engine, every_mb, vocab, cfg.rollout_temperature, key="ref_logprobs",
                         entropy_key=None)
    t_ref = time.time() - t0
    t_teacher = teacher_logprobs(teacher, every_mb, cfg.opd_teacher_temperature) \
        if teacher is not None else 0.0
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
        m = engine.train_step(mbs, policy_loss_fn(
            cfg.part(PolicyLossFlags), vocab, counts.tokens, counts.positive_tokens, counts,
            temperature=cfg.rollout_temperature, backend=cfg.loss_backend,
            opd_kl_coef=cfg.opd_kl_coef if cfg.use_opd else 0.0,
            opd_top_k=cfg.opd_top_k if cfg.use_opd else 0))
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + v
    t_train = time.time() - t0
    steps = len(minis)
    out = step_means(totals, steps)
    if cfg.use_opd:  # the teacher's share of the advantage, |teacher term| / |whole|
        by_teacher = out.pop("train/opd_teacher_adv_abs")
        by_task = out.pop("train/opd_task_adv_abs")
        out["train/opd_teacher_share"] = by_teacher / max(by_teacher + by_task, 1e-12)
    n_train = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    if reference is not None:
        out["time/ref_logprob_s"] = t_ref
    if teacher is not None:
        out["time/teacher_s"] = t_teacher
    out.update({"time/pack_s": t_pack, "time/old_logprob_s": t_old, "time/train_s": t_train,
                "train/tokens_per_s": n_train / max(t_train, 1e-9), "train/optimizer_steps": steps})
    return out


def teacher_logprobs(teacher: FrozenModel, mbs: list[dict], temperature: float) -> float:
    """Fill each micro-batch's ``teacher_logprobs`` (the log-prob of each label at
    ``temperature``) with the Megatron teacher, on the device for this forward only; the
    seconds taken. The loss turns them into advantages as a served teacher's
    (algo/rl_objective.py ``token_advantages``). The student's replayed MoE routes stay out
    of it: the teacher routes its own tokens."""
    t0 = time.time()
    routes = [mb.pop("routed_experts", None) for mb in mbs]
    try:
        with teacher.resident() as engine:
            old_logprobs(engine, mbs, engine.arch.vocab_size, temperature,
                         key="teacher_logprobs", entropy_key=None)
    finally:
        for mb, r in zip(mbs, routes):
            if r is not None:
                mb["routed_experts"] = r
    return time.time() - t0


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


def periodic_eval(cfg: RLConfig, client: Any, tokenizer: Any) -> dict:
    """avg@k / pass@k of the current policy on ``--eval-data`` (rank 0 evaluates); with
    ``--tools``, of tool-using trajectories, as klear-eval's (its tool metrics too)."""
    from megatron_klear.eval.evaluate import Benchmark, evaluate

    report = None
    if torch.distributed.get_rank() == 0:
        bench = Benchmark(name="eval", path=cfg.eval_data, reward=cfg.reward,
                          prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                          answer_format=cfg.answer_format)
        params = cfg.eval_sampling_params(stop_token_ids=[tokenizer.eos_token_id])
        report = evaluate(client, tokenizer, [bench], k=cfg.eval_k, params=params,
                          progress=False,
                          multi_turn=cfg.multi_turn_config(params.max_new_tokens))["eval"]
    report = broadcast_batch(report)
    return {f"eval/{k}": v for k, v in report.items()}


def memory_workload(cfg: RLConfig) -> Workload:
    """What the RL trainer feeds the model (the dry run's memory plan): THD packs of
    ``--max-tokens-per-gpu`` tokens, by default ``--micro-batch-size`` prompt + response rows,
    under the fused policy loss unless --loss-backend torch; with --kl-coef, the
    reference's weights in host memory; with --opd-type megatron, the teacher's model."""
    from megatron_klear.models.qwen3 import qwen3_config_from_hf

    teacher = qwen3_config_from_hf(source_hf_config(cfg.opd_teacher_load, "--opd-teacher-load")) \
        if cfg.use_opd and cfg.opd_type == "megatron" else None
    return Workload(cfg.rollout_max_prompt_len + cfg.rollout_max_response_len,
                    fused_loss=cfg.loss_backend != "torch",
                    tokens=cfg.max_tokens_per_gpu, reference_on_host=cfg.kl_coef > 0,
                    teacher=teacher)


def main(argv: Sequence[str] | None = None) -> None:
    """``klear-rl``: parse flags, run RL, exit non-zero with a clear message on bad input."""
    from megatron_klear.train.main import trainer_main

    trainer_main(RLConfig, train, argv, "klear-rl", workload=memory_workload)


if __name__ == "__main__":
    main()
