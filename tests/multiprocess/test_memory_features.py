"""Issue 13's memory flags at tiny size on gloo: each one is exact against the run without it.

* TP2 + ``--sequence-parallel`` vs TP2: losses and every rank's grads bitwise equal;
* ``--recompute-granularity`` full (uniform, block) and selective ``core_attn`` vs none, at TP2
  and through ``Engine.train_step`` (the CPU emulation must hold while megatron re-runs the
  forward inside backward);
* ``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` vs megatron's
  plain Adam at DP2: losses and parameters over several steps; right after a step the
  parameters are stale until :meth:`Engine.gather_params` (which save/export/weight sync call);
* the distributed optimizer's state resumes exactly in fresh processes (what a run killed with
  SIGKILL does: nothing survives but the checkpoint) and reshards from TP2 to PP2.

Every layout starts from the same weights: the engines are built right after reseeding.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed

VOCAB = 103  # not a multiple of 128: exercises vocab padding
SEQ = 16

RECOMPUTE = {
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=1),
    "selective_core_attn": dict(recompute_granularity="selective",
                                recompute_modules=["core_attn"]),
}
DIST_OPT = dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                overlap_param_gather=True)


# ------------------------------------------------------------------ flags and their errors
def test_megatron_flag_names_parse():
    from megatron_klear.config import TrainConfig, parse_config

    cfg = parse_config(TrainConfig, [
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--recompute-granularity", "full", "--recompute-method", "block",
        "--recompute-num-layers", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", "--optimizer-cpu-offload", "--bf16", "--transformer-impl",
        "local",
        "--loss-backend", "torch"])
    assert cfg.sequence_parallel and cfg.recompute_method == "block"
    assert cfg.recompute_num_layers == 2 and cfg.overlap_param_gather
    assert cfg.optimizer_cpu_offload and cfg.loss_backend == "torch"
    sel = parse_config(TrainConfig, ["--recompute-granularity", "selective",
                                     "--recompute-modules", "core_attn"])
    assert sel.recompute_modules == ["core_attn"]


@pytest.mark.parametrize("argv,flag", [
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size"),
    (["--recompute-granularity", "full"], "--recompute-method"),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"], "apply only to"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"],
     "--recompute-modules"),
    (["--recompute-modules", "core_attn"], "--recompute-modules applies only"),
    (["--overlap-param-gather"], "--use-distributed-optimizer"),
    (["--optimizer-cpu-offload"], "--use-distributed-optimizer"),
    (["--optimizer-cpu-offload", "--use-distributed-optimizer"], "needs --bf16"),
])
def test_inconsistent_flags_name_the_flag(argv, flag):
    from megatron_klear.config import ConfigError, TrainConfig, parse_config

    with pytest.raises(ConfigError, match=flag):
        parse_config(TrainConfig, argv)


def test_transformer_engine_is_explicit_and_its_absence_names_the_flag():
    from megatron_klear.config import ConfigError
    from megatron_klear.models import qwen3
    from megatron_klear.models.norms import RMSNorm
    from megatron_klear.models.tiny import tiny_qwen3_config

    assert not qwen3.HAVE_TE  # the CPU CI machine; on GPU tests/gpu/ runs the TE spec
    with pytest.raises(ConfigError, match="--transformer-impl transformer_engine"):
        qwen3.layer_spec("transformer_engine")
    spec = qwen3.layer_spec()  # the default is the local spec, whatever is installed
    assert spec.submodules.input_layernorm.module is RMSNorm
    arch = qwen3.qwen3_config_from_hf(tiny_qwen3_config())
    tconf = qwen3.transformer_config(arch, recompute_granularity="selective",
                                     recompute_modules=["mlp"])
    with pytest.raises(ConfigError, match="--recompute-modules"):
        qwen3.check_memory_features(tconf, "local")


def test_loss_backend_never_falls_back_silently():
    from megatron_klear.config import ConfigError
    from megatron_klear.ops.backend import loss_backend

    assert loss_backend("auto") == "cpu" and loss_backend("torch") == "torch"
    with pytest.raises(ConfigError, match="--loss-backend cuda"):
        loss_backend("cuda")


def _by_value(obj):
    """Tensors as numpy arrays, for the result queue: torch would pass them through shared
    memory files, which vanish when a finished rank exits before the parent reads them."""
    if torch.is_tensor(obj):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: _by_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_by_value(v) for v in obj)
    return obj


def _as_tensors(obj):
    if hasattr(obj, "__array__") and not isinstance(obj, (list, tuple, dict, float, int)):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _as_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_as_tensors(v) for v in obj)
    return obj


def _launch(fn, *args) -> list:
    """``fn`` on 2 gloo ranks, its results with tensors restored."""
    return _as_tensors(run_distributed(fn, 2, *args))


def _engine(tp: int = 1, pp: int = 1, **flags):
    """A freshly seeded engine (same initial weights for every flag set at one layout)."""
    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_engine

    cfg = TrainConfig(**{**dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                lr=3e-3, global_batch_size=4, micro_batch_size=1,
                                seq_length=SEQ, seed=11), **flags})
    cfg.validate()
    initialize_parallel(tp, pp, cfg.seed)
    return build_engine(cfg, qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB)))


def _batches(step: int):
    """This DP rank's micro-batches of step ``step`` and the loss function (global mean)."""
    from megatron.core import parallel_state

    from megatron_klear.train.sft_objective import token_nll

    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    mask = (torch.rand(4, SEQ, generator=g) > 0.3).float()
    total = float(mask.sum())
    dp, rank = (parallel_state.get_data_parallel_world_size(),
                parallel_state.get_data_parallel_rank())
    rows = range(rank * 4 // dp, (rank + 1) * 4 // dp)
    mbs = [dict(tokens=tokens[r:r + 1, :-1], labels=tokens[r:r + 1, 1:], loss_mask=mask[r:r + 1],
                position_ids=torch.arange(SEQ)[None]) for r in rows]

    def loss_fn(logits, b):
        loss = (token_nll(logits, b["labels"], VOCAB) * b["loss_mask"]).sum() / total
        return loss, {"loss": loss.detach()}

    return mbs, loss_fn


def _params(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.model[0].module.named_parameters()}


def _grads(eng) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient after one forward/backward of step 0."""
    for chunk in eng.model:
        chunk.zero_grad_buffer()
    eng.forward_backward(*_batches(0))
    return {n: p.main_grad.clone() for n, p in eng.model[0].module.named_parameters()}


def _train(eng, steps: range) -> list[float]:
    return [eng.train_step(*_batches(s))["loss"] for s in steps]


def _sft_loss_paths() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-token NLL and logits grad of the fused SFT loss and of megatron's cross entropy
    over masked fp32 logits (the SFT loss before issue 13), on this TP rank's vocab shard."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_klear.train.sft_objective import token_nll

    rank = parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(2, 8, 256, generator=g) * 3  # TP2 pads VOCAB to 256
    labels = torch.randint(0, VOCAB, (2, 8), generator=g)
    weights = torch.rand(2, 8, generator=g)
    ids = torch.arange(rank * 128, (rank + 1) * 128)
    paths = {"fused": lambda x: token_nll(x, labels, VOCAB),
             "megatron": lambda x: tensor_parallel.vocab_parallel_cross_entropy(
                 x.float().masked_fill(ids >= VOCAB, float("-inf")), labels)}
    out = {}
    for name, nll_of in paths.items():
        leaf = full[..., rank * 128:(rank + 1) * 128].clone().requires_grad_()
        nll = nll_of(leaf * 1.0)  # a non-leaf buffer like the model's output (in-place backward)
        (nll * weights).sum().backward()
        out[name] = (nll.detach(), leaf.grad)
    return out


# ------------------------------------- launch 1 (2 ranks), TP2 part: the flags, a TP2 save
def _tp2_flags(rank, world, ckpt):
    from megatron_klear.distributed import initialize_parallel

    initialize_parallel(2, 1)
    results = {"sft_loss": _sft_loss_paths()}
    for name, flags in {"none": {}, "sequence_parallel": dict(sequence_parallel=True),
                        **RECOMPUTE}.items():
        eng = _engine(tp=2, **flags)
        results[name] = {"grads": _grads(eng), "losses": _train(eng, range(3))}
    # the distributed optimizer's reference for the TP2 -> PP2 reshard (launch 2)
    eng = _engine(tp=2, save=ckpt, **DIST_OPT)
    _train(eng, range(2))
    eng.save(2, {})
    results["dist_opt_tp2"] = {"losses": _train(eng, range(2, 4))}
    return _by_value(results)


# ------------------------------------- launch 2 (2 fresh ranks), PP2 part: the reshard
def _pp2_resume(rank, world, ckpt):
    from megatron_klear.train.engine import restore_or_init

    eng = _engine(pp=2, load=ckpt, **DIST_OPT)
    info = restore_or_init(eng)
    return {"iteration": info.iteration, "losses": _train(eng, range(2, 4))}


# ------------------------------------- launch 1, DP2 part: the optimizers, a DP2 save
def _dp2_optimizers(rank, world, ckpt, hf):
    # no clipping: the sharded grad norm sums its squares in another order (~1e-7 apart),
    # which would move the clip factor; everything else is elementwise the same math
    plain = _engine(clip_grad=0.0)
    plain_losses = _train(plain, range(4))
    dist = _engine(save=ckpt, clip_grad=0.0, **DIST_OPT)
    losses = _train(dist, range(2))
    dist.save(2, {})
    losses += _train(dist, range(2, 4))
    stale = _params(dist)
    dist.gather_params()
    return _by_value({
        "plain": (plain_losses, _params(plain)), "dist": (losses, _params(dist)),
        "stale_equal": all(torch.equal(stale[n], p) for n, p in _params(dist).items()),
        "bf16_keeps_hf_weights": [_bf16_step_keeps_loaded_weights(hf, d) for d in (False, True)]})


def _bf16_step_keeps_loaded_weights(hf_dir: str, distributed: bool) -> bool:
    """bf16 (fp32 main params) from HF weights: a step at lr 0 must leave the loaded weights,
    not write back the random initialisation the optimizer copied at construction."""
    from megatron_klear.train.engine import restore_or_init

    eng = _engine(bf16=True, hf_checkpoint=hf_dir, lr=0.0, use_distributed_optimizer=distributed)
    restore_or_init(eng)
    loaded = _params(eng)
    eng.train_step(*_batches(0))
    eng.gather_params()
    return all(torch.equal(p, loaded[n]) for n, p in _params(eng).items())


# ------------------------------------- launch 2, DP2 part: the fresh resume
def _dp2_resume(rank, world, ckpt):
    from megatron_klear.train.engine import restore_or_init

    eng = _engine(load=ckpt, clip_grad=0.0, **DIST_OPT)
    info = restore_or_init(eng)
    losses = _train(eng, range(2, 4))
    eng.gather_params()
    return _by_value({"iteration": info.iteration, "losses": losses, "params": _params(eng)})


def _saves(rank, world, tp2_ckpt, dp2_ckpt, hf):
    """Launch 1: the TP2 flag runs and save, then the DP2 optimizers and save (each engine
    built right after reseeding, at its own layout)."""
    return {"tp2": _tp2_flags(rank, world, tp2_ckpt),
            "dp2": _dp2_optimizers(rank, world, dp2_ckpt, hf)}


def _resumes(rank, world, tp2_ckpt, dp2_ckpt):
    """Launch 2, in processes that saw nothing but the checkpoints: PP2 from the TP2 save,
    DP2 from the DP2 save."""
    return {"pp2": _pp2_resume(rank, world, tp2_ckpt), "dp2": _dp2_resume(rank, world, dp2_ckpt)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from megatron_klear.models.tiny import save_tiny_hf_model

    ckpts = {k: str(tmp_path_factory.mktemp(f"dist_opt_{k}")) for k in ("tp2", "dp2")}
    hf = save_tiny_hf_model(tmp_path_factory.mktemp("hf"), vocab_size=VOCAB, std=0.2)
    ranks = _launch(_saves, ckpts["tp2"], ckpts["dp2"], str(hf))
    return {k: (ckpts[k], [r[k] for r in ranks]) for k in ckpts}


@pytest.fixture(scope="module")
def tp2(saved):
    return saved["tp2"]


@pytest.fixture(scope="module")
def dp2(saved):
    return saved["dp2"]


@pytest.fixture(scope="module")
def resumed(saved):
    ranks = _launch(_resumes, saved["tp2"][0], saved["dp2"][0])
    return {k: [r[k] for r in ranks] for k in ("pp2", "dp2")}


@pytest.mark.parametrize("flag", ["sequence_parallel", *RECOMPUTE])
def test_flag_is_exact_against_the_run_without_it(tp2, flag):
    _, results = tp2
    for rank in results:
        ref, got = rank["none"], rank[flag]
        assert got["losses"] == ref["losses"]
        # every parameter gets a gradient (TP rank 1's vocab rows 128..255 are all padding)
        zero = [n for n, g in ref["grads"].items() if not g.abs().sum()]
        assert set(zero) <= {"embedding.word_embeddings.weight", "output_layer.weight"}, zero
        assert got["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            if flag == "sequence_parallel" and "layernorm" in name:
                # SP sums each norm weight's grad over the two halves of the sequence, then
                # over TP: the same sum in another order (measured: ~1e-9 absolute)
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-8)
            else:
                assert torch.equal(got["grads"][name], g), name
    # the TP ranks hold different shards: the comparison is per rank, not of one replica
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(results[0]["none"]["grads"][qkv], results[1]["none"]["grads"][qkv])


def test_distributed_optimizer_matches_plain_adam(dp2):
    _, results = dp2
    for rank in results:
        (plain_losses, plain_params), (losses, params) = rank["plain"], rank["dist"]
        assert losses == plain_losses
        for name, p in plain_params.items():
            assert torch.equal(params[name], p), name
        # --overlap-param-gather defers the all-gather: gather_params() is what makes them true
        assert not rank["stale_equal"]


def test_bf16_optimizers_start_from_the_loaded_weights(dp2):
    for rank in dp2[1]:
        assert rank["bf16_keeps_hf_weights"] == [True, True]  # plain and distributed


def test_distributed_optimizer_resumes_exactly_in_fresh_processes(dp2, resumed):
    _, results = dp2
    for ref, got in zip(results, resumed["dp2"]):
        assert got["iteration"] == 2
        assert got["losses"] == ref["dist"][0][2:]
        for name, p in ref["dist"][1].items():
            assert torch.equal(got["params"][name], p), name


def test_distributed_optimizer_state_reshards_tp2_to_pp2(tp2, resumed):
    _, results = tp2
    want = results[0]["dist_opt_tp2"]["losses"]
    for got in resumed["pp2"]:
        assert got["iteration"] == 2
        for a, b in zip(got["losses"], want):  # TP2 and PP2 round differently (~1e-6)
            assert abs(a - b) < 1e-5, (got["losses"], want)


def test_fused_sft_loss_equals_megatron_cross_entropy(tp2):
    for rank in tp2[1]:
        (nll, grad), (ref_nll, ref_grad) = rank["sft_loss"]["fused"], rank["sft_loss"]["megatron"]
        # another summation order than megatron's: equal to fp32 rounding (measured 5e-7)
        torch.testing.assert_close(nll, ref_nll, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
        assert (nll - ref_nll).abs().max() < 1e-6
    assert tp2[1][0]["sft_loss"]["fused"][1].abs().sum() > 0  # rank 1's vocab rows: all padding
