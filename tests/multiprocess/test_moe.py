"""Qwen3-MoE on megatron-core's MoE layer with expert parallelism (issue 15).

References are independent of the code under test: transformers' Qwen3MoeForCausalLM
logits, the tensors transformers saved, and transformers' own rule for which layers are
sparse. Tiny random models (4 experts, top-2, hidden 64, std 0.2, random norms). One
2-rank launch runs every layout (EP1 = TP1 on 2 data-parallel ranks, EP2, TP2, PP2,
TP2 x EP2 with ETP1), the conversion round trip and the EP2 -> EP1 resume.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_klear.checkpoint.hf_bridge import BridgeError, check_hf_names, hf_tensor_names
from megatron_klear.config import ConfigError, TrainConfig, parse_config
from megatron_klear.models import qwen3
from megatron_klear.models.tiny import save_tiny_hf_model, tiny_qwen3_moe_config
from tests.dist import run_distributed

TOL = 1e-4
# (tp, pp, ep, etp, dispatcher)
LAYOUTS = ((1, 1, 1, None, "alltoall"), (1, 1, 2, None, "alltoall"),
           (1, 1, 2, None, "allgather"), (2, 1, 1, None, "alltoall"),
           (1, 2, 1, None, "alltoall"), (2, 1, 2, 1, "alltoall"))


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _arch(hf: Path) -> qwen3.Qwen3Arch:
    return qwen3.qwen3_config_from_hf(qwen3.load_hf_config(hf))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {"main": save_tiny_hf_model(root / "main", moe=True, std=0.2, seed=0),
            # raw (not renormalised) top-k weights, every other layer sparse
            "step2": save_tiny_hf_model(root / "step2", moe=True, std=0.2, seed=1,
                                        norm_topk_prob=False, decoder_sparse_step=2,
                                        mlp_only_layers=[])}


# ---------------------------------------------------------------- two ranks
def _model_at(arch, tp, pp, ep, etp, dispatcher, ckpt):
    from megatron_klear.checkpoint import state
    from megatron_klear.distributed import initialize_parallel

    initialize_parallel(tp, pp, ep=ep, etp=etp)
    config = qwen3.transformer_config(
        arch, tp=tp, pp=pp, perform_initialization=False,
        **qwen3.moe_config_kwargs(arch, ep=ep, etp=etp, dispatcher=dispatcher))
    model = qwen3.build_gpt_model(arch, config).eval()
    state.load_checkpoint(ckpt, [model], load_rng=False)
    return model


def _diff(model, arch, ids, ref) -> float:
    """Max |logits - reference| over the ranks (the last PP stage holds the logits)."""
    import torch.distributed as dist

    from megatron_klear.checkpoint import convert

    logits = convert.megatron_logits(model, arch, ids)
    d = torch.zeros((), dtype=torch.float64)
    if logits is not None:
        d.fill_((logits - ref).abs().max().item())
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d)


def _bitwise(exported: dict, original: dict) -> list[str]:
    """HF names that differ (or are missing) between an export and the original."""
    return sorted(n for n in original | exported
                  if n not in exported or n not in original
                  or not torch.equal(exported[n], original[n]))


def _two_ranks(rank, world, hf_dirs, out: Path):
    from megatron_klear.checkpoint import convert, hf_bridge, state

    res = {}
    hf = hf_dirs["main"]
    arch, original = _arch(hf), _tensors(hf)
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = convert.hf_logits(hf, ids)
    ckpt = convert.convert_hf_to_megatron(hf, out / "mg", dtype="fp32")
    back = convert.convert_megatron_to_hf(ckpt, out / "back", hf_config_dir=hf)
    res["convert_round_trip"] = _bitwise(_tensors(back), original)
    for tp, pp, ep, etp, disp in LAYOUTS:
        model = _model_at(arch, tp, pp, ep, etp, disp, ckpt)
        key = (tp, pp, ep, etp, disp)
        res["logits", key] = _diff(model, arch, ids, ref)
        exported = hf_bridge.hf_state_dict_from_megatron([model], arch)
        stage = {n for n in original if n in exported}
        res["export", key] = (_bitwise(exported, {n: original[n] for n in stage}), len(stage))
        if key == (1, 1, 2, None, "alltoall"):
            state.save_checkpoint(out / "ep2", 1, [model], hf_config=arch.hf_config)
            res["ep2_saved_to_hf"] = _bitwise(_tensors(convert.convert_megatron_to_hf(
                out / "ep2", out / "ep2_hf", hf_config_dir=hf)), original)
            # Negative controls: swapping this rank's two local experts in layer 0, or
            # routing with the other top-k weighting, must break parity.
            experts = model.decoder.layers[0].mlp.experts.local_experts
            with torch.no_grad():
                a, b = experts[0].linear_fc1.weight, experts[1].linear_fc1.weight
                a_copy = a.clone()
                a.copy_(b)
                b.copy_(a_copy)
            res["swapped_experts"] = _diff(model, arch, ids, ref)
            flipped = dataclasses.replace(arch, norm_topk_prob=False)
            res["flipped_topk_norm"] = _diff(
                _model_at(flipped, 1, 1, 2, None, "alltoall", ckpt), arch, ids, ref)
    resumed = _model_at(arch, 1, 1, 1, None, "alltoall", out / "ep2")
    res["ep2_resumed_at_ep1"] = (_diff(resumed, arch, ids, ref), _bitwise(
        hf_bridge.hf_state_dict_from_megatron([resumed], arch), original))
    hf2 = hf_dirs["step2"]
    arch2 = _arch(hf2)
    ckpt2 = convert.convert_hf_to_megatron(hf2, out / "mg_step2", dtype="fp32")
    res["step2_ep2"] = _diff(_model_at(arch2, 1, 1, 2, None, "alltoall", ckpt2), arch2, ids,
                             convert.hf_logits(hf2, ids))
    return res


def _two_ranks_then_rl(rank, world, hf_dirs, out: Path, rl_argv: list[str]):
    """The layouts' checks, then klear-rl at EP2 in the same two ranks (one launch): its
    history under "rl". The layouts' parallel state is torn down first: build_engine keeps
    an existing one (it would run at the last layout, unseeded), so train() sets up its own
    layout and seed as in a fresh process."""
    from megatron.core import parallel_state

    from tests.multiprocess.test_rl import _rl_train

    res = _two_ranks(rank, world, hf_dirs, out)
    parallel_state.destroy_model_parallel()
    return {**res, "rl": _rl_train(rank, world, rl_argv)}


@pytest.fixture(scope="module")
def two(hf_dirs, tmp_path_factory):
    import json

    from tests.multiprocess.test_rl import _rl_args

    out = tmp_path_factory.mktemp("moe2")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {i}.",
                                           "answer": "never" if i % 2 else "x"}) + "\n"
                               for i in range(12)))
    rl_argv = _rl_args(hf_dirs["main"], prompts, out / "ck", 2,
                       "--expert-model-parallel-size", "2", "--max-sampling-rounds", "8")
    return run_distributed(_two_ranks_then_rl, 2, hf_dirs, out, rl_argv, timeout=800)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}pp{}ep{}etp{}-{}".format(*l))
def test_logits_match_transformers_qwen3_moe(two, layout):
    assert two[0]["logits", layout] < TOL


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}pp{}ep{}etp{}-{}".format(*l))
def test_live_export_gathers_every_expert_bitwise(two, hf_dirs, layout):
    for rank_result in two:
        differing, checked = rank_result["export", layout]
        assert differing == [] and checked > 0
        if layout[1] == 1:  # one stage holds every tensor; every rank received all experts
            assert checked == len(hf_tensor_names(_arch(hf_dirs["main"])))


def test_hf_megatron_hf_round_trip_is_bitwise(two):
    assert two[0]["convert_round_trip"] == []
    assert two[0]["ep2_saved_to_hf"] == []


def test_checkpoint_saved_at_ep2_resumes_at_ep1(two):
    diff, differing = two[0]["ep2_resumed_at_ep1"]
    assert diff < TOL and differing == []


def test_sparse_step_and_raw_topk_weights_match_at_ep2(two):
    assert two[0]["step2_ep2"] < TOL


def test_parity_catches_swapped_experts_and_wrong_topk_weighting(two):
    assert two[0]["swapped_experts"] > 100 * TOL
    assert two[0]["flipped_topk_norm"] > 100 * TOL


# ---------------------------------------------------------------- no launch
def test_hf_names_are_the_tensors_transformers_saves(hf_dirs):
    for hf in hf_dirs.values():
        assert sorted(hf_tensor_names(_arch(hf))) == sorted(_tensors(hf))


def test_sparse_layers_follow_transformers_rule():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = tiny_qwen3_moe_config(num_hidden_layers=6, decoder_sparse_step=2,
                                mlp_only_layers=[3], hidden_size=16, head_dim=4,
                                vocab_size=32)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    sparse = tuple(i for i, layer in enumerate(model.model.layers)
                   if hasattr(layer.mlp, "experts"))
    assert qwen3.qwen3_config_from_hf(cfg).moe_layers == sparse == (1, 5)


def test_bad_moe_configs_name_the_field_or_flag(hf_dirs):
    with pytest.raises(ConfigError, match="num_experts"):
        qwen3.qwen3_config_from_hf({k: v for k, v in tiny_qwen3_moe_config().items()
                                    if k != "num_experts"})
    with pytest.raises(ConfigError, match="num_experts_per_tok=5"):
        qwen3.qwen3_config_from_hf(tiny_qwen3_moe_config(num_experts_per_tok=5))
    with pytest.raises(ConfigError, match="num_experts=0: a qwen3_moe model needs"):
        qwen3.qwen3_config_from_hf(tiny_qwen3_moe_config(num_experts=0))
    arch = _arch(hf_dirs["main"])
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3"):
        qwen3.moe_config_kwargs(arch, ep=3)
    with pytest.raises(BridgeError, match="mlp.experts.3.up_proj.weight"):
        check_hf_names([n for n in hf_tensor_names(arch)
                        if n != "model.layers.0.mlp.experts.3.up_proj.weight"], arch)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size x"):
        parse_config(TrainConfig, ["--expert-model-parallel-size", "4"]).data_parallel_size(2)
    with pytest.raises(ConfigError, match="--moe-aux-loss-coeff"):
        parse_config(TrainConfig, ["--moe-aux-loss-coeff", "-1"])


def test_moe_flags_reach_megatron_config(hf_dirs):
    from megatron_klear.models.qwen3 import moe_features

    arch = _arch(hf_dirs["main"])
    cfg = parse_config(TrainConfig, ["--expert-model-parallel-size", "2",
                                     "--tensor-model-parallel-size", "2",
                                     "--moe-token-dispatcher-type", "allgather"])
    got = moe_features(arch, cfg)
    assert (got["expert_model_parallel_size"], got["expert_tensor_parallel_size"],
            got["moe_token_dispatcher_type"], got["moe_aux_loss_coeff"],
            got["moe_router_load_balancing_type"]) == (2, 2, "allgather", 0.001, "aux_loss")
    off = moe_features(arch, parse_config(TrainConfig, ["--moe-aux-loss-coeff", "0"]))
    assert off["moe_router_load_balancing_type"] == "none"
    assert got["moe_layer_freq"] == [1, 0, 1, 1] and not got["moe_router_pre_softmax"]


# ---------------------------------------------------------------- RL at EP2
def _safetensors_bytes(hf: Path) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(hf).values())


def test_rl_trains_at_ep2_against_embedded_server(two, hf_dirs):
    """klear-rl at EP2 (2 ranks: experts split, dense parts data-parallel) against the
    embedded server (transformers' Qwen3MoeForCausalLM, per-expert weight names); run in the
    launch of the layouts' checks (the ``two`` fixture)."""
    hist = two[0]["rl"]
    assert len(hist) == 2
    for m in hist:
        assert m["train/optimizer_steps"] == 2 and m["grad_norm"] > 0
        assert m["weight_sync/probe_max_abs_diff"] < TOL  # server == trainer after sync
        assert m["train/mismatch_abs_logprob"] < TOL  # rollout logprobs == trainer's
        # every expert of every EP rank sent exactly once (in fp32, like the checkpoint)
        assert m["weight_sync/bytes"] == _safetensors_bytes(hf_dirs["main"])
    assert abs(hist[0]["weight_sync/probe_logprob_mean"] -
               hist[1]["weight_sync/probe_logprob_mean"]) > 1e-5  # the weights moved


# ---------------------------------------------------------------- dry run / memory plan
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3_30b_a3b"


def _train_cfg(*extra: str) -> TrainConfig:
    """The example's parallel and memory flags (rl.yaml's RL-only keys left out)."""
    return parse_config(TrainConfig, [
        "--hf-checkpoint", str(EXAMPLE / "hf_config"), "--tensor-model-parallel-size", "4",
        "--sequence-parallel", "--expert-model-parallel-size", "8",
        "--expert-tensor-parallel-size", "1", "--bf16", "--global-batch-size", "128",
        "--seq-length", "10240", "--transformer-impl", "transformer_engine", *extra])


def test_memory_plan_counts_this_ranks_experts():
    """Qwen3-30B-A3B at TP4 EP8 ETP1 on 8 GPUs: per GPU 16 of 128 experts per layer, the
    attention split 4 ways, the router replicated (hand count from config.json)."""
    from megatron_klear.train.memory import plan_memory

    arch = _arch(EXAMPLE / "hf_config")
    h, layers = 2048, 48
    attn = (h * (32 + 2 * 4) * 128 + 32 * 128 * h) // 4
    experts = 16 * 3 * h * 768
    per_layer = attn + experts + 128 * h + 2 * h + 2 * 128
    vocab = 152064 * h // 4  # vocab padded to a multiple of 128 x TP
    want = layers * per_layer + 2 * vocab + h
    plan = plan_memory(arch, _train_cfg(), 8)
    assert plan.stages[0].params == 2 * want  # bf16
    # fp32 Adam state (12 B) of the experts is not sharded: expert-DP is 1 at EP8 on 8 GPUs
    dist_opt = plan_memory(arch, _train_cfg("--use-distributed-optimizer"), 8).stages[0]
    assert dist_opt.optimizer == pytest.approx(12 * layers * experts +
                                               6 * (want - layers * experts), rel=1e-6)


def test_dry_run_rejects_expert_layouts_that_do_not_split(monkeypatch, capsys):
    from megatron_klear.train.dry_run import dry_run

    monkeypatch.setenv("WORLD_SIZE", "12")  # EP3 fits 12 GPUs but not 128 experts
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3 does not divide "
                                          "num_experts=128"):
        dry_run(_train_cfg("--expert-model-parallel-size", "3", "--global-batch-size", "6"))
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="--expert-model-parallel-size x"):
        dry_run(_train_cfg("--expert-tensor-parallel-size", "4"))  # 8 x 4 > 8 GPUs
