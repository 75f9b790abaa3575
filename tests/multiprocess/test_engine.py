"""Engine parity: TP=2, PP=2 and DP=2 reproduce TP=1 losses and optimizer steps (gloo, CPU).

The TP=1 run saves its initial weights with megatron dist_checkpointing; the other
layouts load them, so every layout starts from the same weights.
"""

import torch
import pytest

from tests.dist import run_distributed

STEPS = 5
VOCAB = 103  # not a multiple of 128: exercises vocab padding


def _make_batches(dp_rank: int, dp: int):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (8, 17), generator=g)
    mask = (torch.rand(8, 16, generator=g) > 0.3).float()  # uneven token counts
    per = 8 // dp
    rows = range(dp_rank * per, (dp_rank + 1) * per)
    batches = []
    for i in range(0, per, 2):
        r = list(rows)[i:i + 2]
        batches.append(dict(tokens=tokens[r, :-1], labels=tokens[r, 1:], loss_mask=mask[r],
                            position_ids=torch.arange(16).expand(2, 16)))
    return batches, mask.sum()


def _train(rank, world, tp, pp, ckpt_dir, save):
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.sft_objective import token_nll

    arch = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB))
    cfg = TrainConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, lr=3e-3,
                      global_batch_size=8, micro_batch_size=2, train_iters=STEPS, seed=11)
    eng = build_engine(cfg, arch)
    module = eng.model[0].module
    if save:
        dist_checkpointing.save(module.sharded_state_dict(), ckpt_dir)
    else:
        module.load_state_dict(dist_checkpointing.load(module.sharded_state_dict(), ckpt_dir))
    batches, total = _make_batches(parallel_state.get_data_parallel_rank(),
                                   parallel_state.get_data_parallel_world_size())

    def loss_fn(logits, b):
        nll = (token_nll(logits, b["labels"], VOCAB) * b["loss_mask"]).sum() / total
        return nll, {"loss": nll.detach()}

    return [eng.train_step(batches, loss_fn) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("init"))
    return ckpt, run_distributed(_train, 1, 1, 1, ckpt, True)[0]


def test_same_seed_is_bitwise_reproducible(reference, tmp_path):
    again = run_distributed(_train, 1, 1, 1, str(tmp_path), True)[0]
    assert [m["loss"] for m in again] == [m["loss"] for m in reference[1]]
    assert [m["grad_norm"] for m in again] == [m["grad_norm"] for m in reference[1]]


LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}  # (tp, pp) on two ranks


def _train_each_layout(rank, world, ckpt_dir):
    """_train at every layout of LAYOUTS in turn, in the same ranks (one launch for all).
    Nothing is torn down in between: each build_engine must set up its own layout's
    parallel state over the last one's (the layout check below fails if it kept it)."""
    from megatron.core import parallel_state

    out = {}
    for name, (tp, pp) in LAYOUTS.items():
        steps = _train(rank, world, tp, pp, ckpt_dir, False)
        ran = (parallel_state.get_tensor_model_parallel_world_size(),
               parallel_state.get_pipeline_model_parallel_world_size())
        out[name] = dict(steps=steps, layout=ran)
    return out


@pytest.fixture(scope="module")
def layouts(reference):
    return run_distributed(_train_each_layout, 2, reference[0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_match_tp1(reference, layouts, layout):
    ckpt, ref = reference
    assert all(per_rank[layout]["layout"] == LAYOUTS[layout] for per_rank in layouts)
    results = [per_rank[layout]["steps"] for per_rank in layouts]
    assert ref[-1]["loss"] < ref[0]["loss"]  # the reference actually trains
    for metrics in results:  # every rank reports the same (broadcast) metrics
        for step, (got, want) in enumerate(zip(metrics, ref)):
            assert abs(got["loss"] - want["loss"]) < 1e-5, (step, got, want)
            assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-5 * max(1, want["grad_norm"])


def test_one_process_keeps_its_rendezvous_out_of_the_environment():
    """A process outside torchrun rendezvouses on a private free port that its children do not
    inherit. In the CI run of 2026-12-03 torch.distributed had been initialised in pytest's
    own process (test_readme_usage_runs_as_written calls convert_megatron_to_hf in-process, as
    a library user may), which left MASTER_PORT in os.environ with its TCPStore still
    listening, and every later one-process trainer started by pytest died with EADDRINUSE."""
    import os
    import subprocess
    import sys

    code = ("import os, subprocess, sys\n"
            "from megatron_klear.distributed import initialize_parallel\n"
            "initialize_parallel(1, 1)\n"
            "print('leaked' if 'MASTER_PORT' in os.environ else 'clean')\n"
            "child = 'from megatron_klear.distributed import initialize_parallel; "
            "initialize_parallel(1, 1); print(\"child ok\")'\n"
            "print(subprocess.run([sys.executable, '-c', child], capture_output=True, "
            "text=True).stdout.strip())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR",
                                                             "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["clean", "child", "ok"], out.stdout + out.stderr[-2000:]
