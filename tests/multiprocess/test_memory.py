"""The memory planner against measured peak memory of real CPU training steps.

How the peak is measured: ``torch.profiler.profile(profile_memory=True)`` makes c10's CPU
allocator report every allocation and free to the profiler, each "[memory]" event carrying
the allocator's running total of bytes allocated since profiling started ("Total
Allocated" in the Chrome trace; c10's ProfiledCPUMemoryReporter). Profiling starts before
the engine is built, so the maximum of that total over the run is the peak of live tensor
bytes of the whole run: parameters, DDP grad buffers, Adam state (created by the first
step, hence two steps), activations, logits and loss, and every temporary. Unlike RSS it
does not see the allocator's caching, the Python heap or shared libraries. The total is
process-wide and never forgets bytes allocated in an earlier profiling window and freed
between windows, so each window's peak is taken relative to its first event (measured
without that correction, a process's third run read 27 MiB too high).

The runs are tiny Qwen3 models through the real engine (megatron-core GPTModel, DDP,
optimizer, 1F1B schedule, the SFT loss) at sequence lengths where activations, including
the ``a x s`` attention scores of the local spec, are most of the peak, so a wrong
activation formula moves the estimate by more than the tolerance (see the negative control).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest

from megatron_klear.config import TrainConfig
from megatron_klear.models.qwen3 import qwen3_config_from_hf
from megatron_klear.models.tiny import tiny_qwen3_config
from megatron_klear.train.memory import GiB, flags_to_fit, layer_activation_elements, plan_memory
from megatron_klear.train.sft import SFTConfig
from megatron_klear.train.sft import memory_workload as sft_workload
from tests.dist import run_distributed
from tests.peak_memory import peak_allocated_bytes

TOLERANCE = 0.25
VOCAB = 500  # padded to 512: exercises the masked copy of the fp32 loss path
ARCH = qwen3_config_from_hf(tiny_qwen3_config(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096))
MICROBATCHES = 2  # per DP rank: stage 0 of PP2 holds two in flight


def _cfg(tp: int, pp: int, **features) -> SFTConfig:
    return SFTConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       micro_batch_size=1, global_batch_size=MICROBATCHES, **features)




def _measure(rank, world, layouts):
    """Per layout (tp, pp, cases), per case: (this rank's pipeline stage, peak bytes of
    building the engine + 2 steps). Each build sets its layout (initialize_parallel)."""
    import torch
    from megatron.core import parallel_state

    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.sft import sft_loss_fn

    out = []
    for tp, pp, cases in layouts:
        out.append([])
        for seq, features in cases:
            cfg = _cfg(tp, pp, seq_length=seq, **features)
            g = torch.Generator().manual_seed(seq)
            tok = torch.randint(0, VOCAB, (MICROBATCHES, seq + 1), generator=g)
            mbs = [dict(tokens=tok[i:i + 1, :-1], labels=tok[i:i + 1, 1:],
                        loss_mask=torch.ones(1, seq), position_ids=torch.arange(seq)[None])
                   for i in range(MICROBATCHES)]

            wired = []

            def run():
                engine = build_engine(cfg, ARCH)
                tconf = engine.transformer_config
                wired.append(all(getattr(tconf, k) == v for k, v in features.items()))
                for _ in range(2 if wired[0] else 0):
                    engine.train_step(mbs, sft_loss_fn(VOCAB, MICROBATCHES * seq))

            peak = peak_allocated_bytes(run)
            gc.collect()
            out[-1].append((parallel_state.get_pipeline_model_parallel_rank(),
                            peak if wired[0] else None))
        # build_engine keeps an existing parallel state: the next layout sets up its own
        parallel_state.destroy_model_parallel()
    return out


FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 1}
# (tp, pp, [(seq, features), ...]) per layout; each launch is one set of gloo processes
# that measures the layouts of its world size in turn. A features case whose flags the
# engine does not pass to megatron-core measures nothing.
LAUNCHES = [
    [(1, 1, [(256, {}), (1024, {}), (1024, FULL_RECOMPUTE)])],
    [(2, 1, [(512, {}), (512, {"sequence_parallel": True})]),
     (1, 2, [(512, {})])],
]


@pytest.fixture(scope="module")
def measured():
    rows = []
    for layouts in LAUNCHES:
        tp, pp, _ = layouts[0]
        per_rank = run_distributed(_measure, tp * pp, layouts, timeout=600)
        for j, (tp, pp, cases) in enumerate(layouts):
            for i, (seq, features) in enumerate(cases):
                peaks = {}
                for rank_rows in per_rank:
                    stage, peak = rank_rows[j][i]  # the max over the stage's TP/DP ranks
                    peaks[stage] = None if peak is None else max(peaks.get(stage, 0), peak)
                rows.append((_cfg(tp, pp, seq_length=seq, **features), peaks))
    return rows


def _ratios(rows, **override):
    out = []
    for cfg, peaks in rows:
        if None in peaks.values():
            continue
        world = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
        # the SFT trainer's workload: fused loss, no attention mask (one sequence per pack)
        workload = sft_workload(cfg)
        plan = plan_memory(ARCH, dataclasses.replace(cfg, **override), world, workload)
        for stage, peak in peaks.items():
            st = plan.stages[stage]
            out.append((cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                        cfg.seq_length, cfg.recompute_granularity, cfg.sequence_parallel,
                        stage, st.total / peak, (st.activations + st.backward_working) / peak))
    return out


def _plain(rows):
    return [r for r in rows if not r[0].recompute_granularity and not r[0].sequence_parallel]


def test_plan_within_25_percent_of_measured_cpu_peaks(measured):
    ratios = _ratios(_plain(measured))
    assert len(ratios) == 5  # TP1 x 2 lengths, TP2, PP2 x 2 stages
    for *case, ratio, act_share in ratios:
        assert abs(ratio - 1) <= TOLERANCE, (case, ratio)
        assert act_share > 0.5, (case, act_share)  # activations dominate the peak


def test_plan_with_recompute_and_sequence_parallel(measured):
    """Full recompute (TP1) and sequence parallelism (TP2) against their measured peaks;
    needs the engine to pass --recompute-* / --sequence-parallel to megatron-core."""
    features = [(cfg, peaks) for cfg, peaks in measured if (cfg, peaks) not in _plain(measured)]
    if any(None in peaks.values() for _, peaks in features):
        pytest.skip("the engine does not pass --recompute-*/--sequence-parallel to "
                    "megatron-core on this branch (issue 13, gpupath)")
    plain = {(c.tensor_model_parallel_size, c.seq_length): p for c, p in _plain(measured)}
    for *case, ratio, _ in _ratios(features):
        assert abs(ratio - 1) <= TOLERANCE, (case, ratio)
    for cfg, peaks in features:  # and the features do save memory
        assert peaks[0] < plain[(cfg.tensor_model_parallel_size, cfg.seq_length)][0]


def test_negative_control_wrong_activation_formula_fails(measured):
    """Planning the same runs with flash attention's formula (no s x s scores) misses the
    measured peak of the long sequence by more than the tolerance."""
    wrong = _ratios(_plain(measured), transformer_impl="transformer_engine")
    assert max(abs(r - 1) for *_, r, _ in wrong) > TOLERANCE


def test_8b_today_layout_does_not_fit():
    """Issue 13's arithmetic: Qwen3-8B, s=32768, TP4 PP2 mbs 1, flash attention, none of
    the memory features: stage 0 holds 2 micro-batches x 18 layers (~2 GB each) plus
    ~17 GiB of model state, ~96 GB; TP4 PP1 ~117 GB."""
    from megatron_klear.models.qwen3 import load_hf_config

    arch = qwen3_config_from_hf(load_hf_config("examples/klear_8b/hf_config"))
    cfg = TrainConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, bf16=True,
                      seq_length=32768, global_batch_size=64,
                      transformer_impl="transformer_engine")
    plan = plan_memory(arch, cfg, 32)
    assert plan.peak.stage == 0 and plan.peak.in_flight == 2
    assert 90e9 < plan.total < 100e9 and not plan.fits(80)
    single = plan_memory(arch, dataclasses.replace(cfg, pipeline_model_parallel_size=1), 4)
    assert 110e9 < single.total < 125e9
    fix = flags_to_fit(arch, cfg, 32)
    assert fix and plan_memory(arch, dataclasses.replace(cfg, **_apply(fix)), 32).fits(80)


def _apply(flags: list[str]) -> dict:
    from megatron_klear.train.memory import _FEATURES

    return {k: v for f, ch in _FEATURES if f in flags for k, v in ch.items()}


def test_activation_formula_by_hand():
    """Local spec, one layer of the tiny model, per token: 6h + 7ad + 3gd + 5F + a*s."""
    h, a, g, d, F, s = 128, 4, 2, 32, 384, 256
    hidden, sharded = layer_activation_elements(ARCH, _cfg(1, 1), s)
    assert hidden == 6 * h and sharded == 7 * a * d + 3 * g * d + 5 * F + a * s
    te = layer_activation_elements(ARCH, _cfg(1, 1, transformer_impl="transformer_engine"), s)
    assert te == (4 * h, 4 * a * d + 4 * g * d + 3 * F + a)  # + a: fp32 lse in fp32 elements


def test_model_state_and_features_shrink_the_plan():
    """8B at TP4: 18 bytes/param without the distributed optimizer, 6 + 12/DP with it."""
    from megatron_klear.models.qwen3 import load_hf_config

    arch = qwen3_config_from_hf(load_hf_config("examples/klear_8b/hf_config"))
    base = TrainConfig(tensor_model_parallel_size=4, bf16=True, seq_length=4096,
                       global_batch_size=8, transformer_impl="transformer_engine")
    p = plan_memory(arch, base, 8).peak
    assert p.optimizer == 6 * p.params and p.grads == 2 * p.params
    dist = plan_memory(arch, dataclasses.replace(base, use_distributed_optimizer=True), 8).peak
    assert dist.optimizer == p.optimizer // 2
    sp = plan_memory(arch, dataclasses.replace(base, sequence_parallel=True), 8).peak
    rc = plan_memory(arch, dataclasses.replace(base, recompute_granularity="full",
                                               recompute_method="uniform",
                                               recompute_num_layers=1), 8).peak
    assert sp.activations < p.activations and rc.activations < p.activations / 4
    assert p.total / GiB > 20  # sanity: 2B params per GPU x 18 bytes


def test_rl_token_budget_plans_its_tokens():
    """An RL micro-batch under --max-tokens-per-gpu 4S holds the activations and logits of
    four rows of S tokens (the attention scores of a pack are per sequence, at most S), not
    of one row; without the budget it is --micro-batch-size rows."""
    from megatron_klear.train.rl import RLConfig
    from megatron_klear.train.rl import memory_workload as rl_workload

    def plan(**flags):
        cfg = RLConfig(rollout_max_prompt_len=96, rollout_max_response_len=160,
                       global_batch_size=8, **flags)
        return plan_memory(ARCH, cfg, 1, rl_workload(cfg)).peak

    one, four_rows, budget = plan(), plan(micro_batch_size=4), plan(max_tokens_per_gpu=4 * 256)
    assert budget.activations == four_rows.activations > 3 * one.activations
    assert budget.logits_loss == four_rows.logits_loss == 4 * one.logits_loss
    assert budget.backward_working == four_rows.backward_working


def test_flags_to_fit_edges():
    """[] when the plan fits; None (and a message naming TP/PP) when no flag is enough;
    CPU offload is only suggested together with the distributed optimizer."""
    from megatron_klear.config import ConfigError
    from megatron_klear.models.qwen3 import load_hf_config
    from megatron_klear.train.memory import Workload, check_fits

    arch = qwen3_config_from_hf(load_hf_config("examples/qwen3_32b/hf_config"))
    small = TrainConfig(tensor_model_parallel_size=8, bf16=True, seq_length=1024,
                        global_batch_size=8, transformer_impl="transformer_engine")
    assert flags_to_fit(arch, small, 8) == []
    state_bound = dataclasses.replace(small, gpu_memory_gb=40)  # 32B/8 x 18 bytes = 69 GiB
    fix = flags_to_fit(arch, state_bound, 16)
    assert fix and "--optimizer-cpu-offload" in fix and "--use-distributed-optimizer" in fix
    hopeless = dataclasses.replace(small, tensor_model_parallel_size=1, gpu_memory_gb=20)
    assert flags_to_fit(arch, hopeless, 1) is None
    with pytest.raises(ConfigError, match="no memory flag is enough"):
        check_fits(plan_memory(arch, hopeless, 1), arch, hopeless, 1, Workload(1024))


def test_config_imports_nothing_from_models():
    """The dry run lives in train/dry_run.py: config.py <-> models/qwen3.py is no circle."""
    import ast
    import subprocess
    import sys

    code = ("import sys, megatron_klear.config; "
            "print([m for m in sys.modules if m.startswith('megatron_klear.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert ast.literal_eval(out) == ["megatron_klear.config"]


def test_megatron_opd_teacher_in_the_plan():
    """--opd-type megatron: the teacher's shards at the student's layout, in bf16, are on the
    device beside the trainer's state during its forward (a phase of their own, with one
    micro-batch's logits) and in the host plan. A teacher of the student's own architecture
    holds exactly the student's parameter bytes; Qwen3-32B at TP4 about 32.8e9 x 2 / 4."""
    from megatron_klear.models.qwen3 import load_hf_config
    from megatron_klear.train.memory import Workload, plan_host

    def load(name):
        return qwen3_config_from_hf(load_hf_config(f"examples/{name}/hf_config"))

    student = load("klear_8b")
    cfg = TrainConfig(tensor_model_parallel_size=4, bf16=True, seq_length=1024,
                      global_batch_size=8, transformer_impl="transformer_engine")
    alone = plan_memory(student, cfg, 8, Workload(1024))
    same = plan_memory(student, cfg, 8, Workload(1024, teacher=student)).peak
    assert same.teacher == alone.peak.params and same.teacher > 0
    big = plan_memory(student, cfg, 8, Workload(1024, teacher=load("qwen3_32b"))).peak
    assert 15e9 < big.teacher < 17.5e9
    assert big.total == big.params + big.grads + big.optimizer + max(
        big.activations + max(big.logits_loss, big.backward_working),
        big.teacher + big.logits_loss) > alone.total
    host = plan_host(plan_memory(student, cfg, 8, Workload(1024, teacher=load("qwen3_32b"))),
                     Workload(1024), 8, False)
    assert host.pinned_per_rank - plan_host(alone, Workload(1024), 8, False).pinned_per_rank \
        == big.teacher
