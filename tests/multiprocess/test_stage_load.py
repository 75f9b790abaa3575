"""Loading another stage's checkpoint (issue 28): SFT -> RL, converter -> SFT, RL -> SFT,
--finetune / --no-load-optim / --no-load-rng, and a model that does not match.

One process runs every stage in turn (tiny model, 1-2 steps each); the checks read the
metrics the trainers return, the checkpoints' meta and the models' parameters.
"""

import contextlib
import io
import json

import pytest
import torch

from tests.dist import run_distributed


def _sft_args(hf, data, save, iters, *extra):
    return ["--hf-checkpoint", str(hf), "--data-path", str(data), "--save", str(save),
            "--train-iters", str(iters), "--seq-length", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "2e-3", "--seed", "5", "--no-progress-bar",
            *extra]


def _rl_args(hf, data, save, iters, *extra):
    return ["--hf-checkpoint", str(hf), "--prompt-data", str(data), "--save", str(save),
            "--reward", "tests.reward_plugins:parity_reward", "--rollout-batch-size", "2",
            "--mini-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size", "4",
            "--rollout-max-response-len", "6", "--max-sampling-rounds", "8", "--lr", "1e-3",
            "--train-iters", str(iters), "--seed", "3", "--no-progress-bar", *extra]


def _run(train, cfg_cls, argv):
    """Run a trainer in this process; (its per-step metrics, what it wrote to stderr)."""
    from megatron_klear.train.main import load_config

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        hist = train(load_config(cfg_cls, argv))
    return hist, err.getvalue()


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model[0].module.named_parameters()}


def _restore(cfg_cls, argv):
    """Build an engine for ``argv`` and restore it; (engine, info, stderr)."""
    from megatron_klear.config import parse_config
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.engine import build_engine, restore_or_init

    cfg = parse_config(cfg_cls, argv)
    cfg.derive()  # preflight's, without the model
    engine = build_engine(cfg, qwen3_config_from_hf(load_hf_config(cfg.hf_checkpoint)))
    torch.manual_seed(99)  # an RNG state that differs from every checkpoint's
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        info = restore_or_init(engine)
    return engine, info, err.getvalue()


def _stages(rank, world, root, hf, other_hf, sft_data, prompts):
    from megatron_klear.checkpoint.convert import convert_hf_to_megatron
    from megatron_klear.checkpoint.state import CheckpointError, read_meta
    from megatron_klear.train import rl, sft

    out = {}
    convert_hf_to_megatron(hf, root / "conv")
    out["base"], _ = _run(sft.train, sft.SFTConfig, _sft_args(hf, sft_data, root / "sft", 2))
    out["from_conv"], out["from_conv_log"] = _run(
        sft.train, sft.SFTConfig, _sft_args(hf, sft_data, root / "sft_conv", 1,
                                            "--load", str(root / "conv")))
    out["finetune"], out["finetune_log"] = _run(
        sft.train, sft.SFTConfig, _sft_args(hf, sft_data, root / "ft", 1,
                                            "--load", str(root / "sft"), "--finetune"))
    out["rl"], out["rl_log"] = _run(rl.train, rl.RLConfig, _rl_args(
        hf, prompts, root / "rl", 1, "--load", str(root / "sft")))
    out["meta"] = {name: read_meta(root / name / f"iter_{it:07d}")["trainer"]
                   for name, it in (("conv", 0), ("sft", 2), ("rl", 1))}

    # weights, optimizer, schedule and RNG of each way of loading root/sft
    sft_argv = _sft_args(hf, sft_data, root / "unused", 3, "--load", str(root / "sft"))
    resumed, info, _ = _restore(sft.SFTConfig, sft_argv)
    saved = _params(resumed)
    rng = torch.load(root / "sft" / "iter_0000002" / "rng" / "rank_00000.pt",
                     weights_only=False)["torch"]
    out["resume"] = dict(iteration=info.iteration, opt=info.optimizer_restored,
                         sched=resumed.scheduler.num_steps,
                         rng=torch.equal(torch.get_rng_state(), rng))
    for flags in (["--no-load-optim"], ["--no-load-rng"]):
        engine, info, _ = _restore(sft.SFTConfig, sft_argv + flags)
        same = all(torch.equal(v, saved[k]) for k, v in _params(engine).items())
        out[flags[0]] = dict(iteration=info.iteration, opt=info.optimizer_restored,
                             sched=engine.scheduler.num_steps, same_weights=same,
                             rng=torch.equal(torch.get_rng_state(), rng))
    engine, info, _ = _restore(rl.RLConfig, _rl_args(hf, prompts, root / "unused", 1,
                                                     "--load", str(root / "sft")))
    out["rl_restore"] = dict(info=info, sched=engine.scheduler.num_steps,
                             same_weights=all(torch.equal(v, saved[k])
                                              for k, v in _params(engine).items()))
    engine, info, out["rl_to_sft_log"] = _restore(sft.SFTConfig, _sft_args(
        hf, sft_data, root / "unused", 1, "--load", str(root / "rl")))
    out["rl_to_sft"] = dict(info=info, sched=engine.scheduler.num_steps)
    try:
        _restore(sft.SFTConfig, _sft_args(other_hf, sft_data, root / "unused", 1,
                                          "--load", str(root / "sft")))
        out["mismatch"] = None
    except CheckpointError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    from megatron_klear.data.synthetic import write_arithmetic_data
    from megatron_klear.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("stages")
    hf = save_tiny_hf_model(root / "hf", seed=0)
    other = save_tiny_hf_model(root / "hf3", seed=0, num_hidden_layers=3, vocab_size=200)
    data = write_arithmetic_data(root / "data", n_sft=40, n_rl=4, n_eval=2)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                               for i in range(6)))
    return run_distributed(_stages, 1, root, hf, other, data["sft"], prompts, timeout=400)[0]


def test_converter_checkpoint_starts_sft_at_step_zero_from_its_weights(stages):
    got, base = stages["from_conv"], stages["base"]
    assert len(got) == 1 and got[0]["consumed_bins"] == 4  # step 1 of 1, fresh data cursor
    assert got[0]["loss"] == base[0]["loss"]  # the converter's weights are the HF weights
    lines = [ln for ln in stages["from_conv_log"].splitlines() if ln.startswith("[load]")]
    assert len(lines) == 1 and "converter" in lines[0] and "step 0" in lines[0], lines
    assert stages["meta"] == {"conv": "convert", "sft": "sft", "rl": "rl"}


def test_rl_starts_from_the_sft_checkpoint_at_step_zero(stages):
    hist, log = stages["rl"], stages["rl_log"]
    assert len(hist) == 1  # train_iters 1 from step 0 (the SFT checkpoint is at step 2)
    assert hist[0]["data/consumed_prompts"] <= 2 * 8  # a fresh prompt cursor
    lines = [ln for ln in log.splitlines() if ln.startswith("[load]")]
    assert len(lines) == 1 and "klear-sft" in lines[0] and "fresh optimizer" in lines[0], lines
    r = stages["rl_restore"]
    assert r["info"] is None and r["sched"] == 0 and r["same_weights"]


def test_rl_checkpoint_gives_sft_its_weights_only(stages):
    r = stages["rl_to_sft"]
    assert r["info"] is None and r["sched"] == 0
    assert "written by klear-rl" in stages["rl_to_sft_log"]


def test_finetune_resets_the_step_of_an_own_checkpoint(stages):
    got, base = stages["finetune"], stages["base"]
    assert len(got) == 1 and got[0]["consumed_bins"] == 4  # step 0, first batch again
    assert got[0]["loss"] < base[0]["loss"]  # on the trained weights, not the HF ones
    assert "--finetune" in stages["finetune_log"]


def test_resume_and_the_no_load_flags(stages):
    assert stages["resume"] == dict(iteration=2, opt=True, sched=2, rng=True)
    assert stages["--no-load-optim"] == dict(iteration=2, opt=False, sched=0, same_weights=True,
                                             rng=True)
    assert stages["--no-load-rng"] == dict(iteration=2, opt=True, sched=2, same_weights=True,
                                           rng=False)


def test_a_different_model_is_refused_by_name(stages):
    msg = stages["mismatch"]
    assert msg is not None and "num_hidden_layers 2 (checkpoint) vs 3 (model)" in msg, msg
    assert "vocab_size" in msg and "hidden_size" not in msg.replace("num_hidden", ""), msg
