"""Larger-model layouts (issue 15): uneven and interleaved pipeline stages, context parallel.

* Uneven PP: 3- and 5-layer models at PP2 match the unsplit model (logits, training losses,
  grad norms); the HF mapping (conversion / weight sync) and checkpoints carry the
  stage-local layer offsets (HF weights load into PP2, a PP2 checkpoint loads at PP1).
* VPP: two model chunks per stage (interleaved 1F1B) train like PP2 without interleaving,
  and a VPP checkpoint resumes bit-exactly.
* CP: the load-balanced slicing round-trips, and a CP=2 run's losses, token normaliser and
  gradients equal the CP=1 run's (position-wise model: attention across CP ranks is
  Transformer Engine's, GPU only).
"""

import json
from pathlib import Path

import pytest
import torch

from megatron_klear.config import ConfigError, TrainConfig
from megatron_klear.models.context_parallel_layout import slice_for_cp_rank, \
    unslice_from_cp_ranks
from megatron_klear.models.pipeline_layout import PipelineLayout
from megatron_klear.train.context_parallel import slice_batch
from tests.dist import run_distributed
from tests.multiprocess.test_engine import VOCAB, _make_batches

STEPS = 4
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# ---------------------------------------------------------------- layouts (no processes)
@pytest.mark.parametrize("n,pp,first,last,want", [
    (3, 2, 2, None, (2, 1)), (5, 2, None, 2, (3, 2)), (94, 4, None, 22, (24, 24, 24, 22)),
    (28, 8, 2, 2, (2, 4, 4, 4, 4, 4, 4, 2)), (8, 4, None, None, (2, 2, 2, 2))])
def test_stage_layers_match_megatron(n, pp, first, last, want):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_klear.models.qwen3 import qwen3_config_from_hf, transformer_config
    from megatron_klear.models.tiny import tiny_qwen3_config

    layout = PipelineLayout(n, pp, first, last)
    assert layout.stage_layers == want and sum(want) == n
    arch = qwen3_config_from_hf(tiny_qwen3_config(num_hidden_layers=n))
    conf = transformer_config(arch, pp=pp, layout=layout)
    assert tuple(get_num_layers_to_build(conf, pp_rank=r) for r in range(pp)) == want
    offsets = [get_transformer_layer_offset(conf, pp_rank=r) for r in range(pp)]
    assert offsets == [sum(want[:r]) for r in range(pp)]


@pytest.mark.parametrize("kwargs,flag", [
    (dict(num_layers=3, pp=2), "--decoder-first-pipeline-num-layers"),
    (dict(num_layers=3, pp=2, first=2, last=2), "--decoder-last-pipeline-num-layers 2"),
    (dict(num_layers=10, pp=4, first=3), "must split evenly"),
    (dict(num_layers=4, pp=1, last=2), "needs --pipeline-model-parallel-size > 1"),
    (dict(num_layers=4, pp=2, first=0), "--decoder-first-pipeline-num-layers must be >= 1"),
    (dict(num_layers=4, pp=2, layers_per_virtual_stage=2), "at least 2 model chunks"),
    (dict(num_layers=6, pp=2, last=2, layers_per_virtual_stage=1), "cannot be combined"),
])
def test_layout_errors_name_the_flags(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        PipelineLayout(**kwargs)


def test_config_errors_name_the_flags():
    with pytest.raises(ConfigError, match="--transformer-impl transformer_engine"):
        TrainConfig(context_parallel_size=2).validate()
    with pytest.raises(ConfigError, match="--seq-length 6 to be a multiple of 2 x 2"):
        TrainConfig(context_parallel_size=2, transformer_impl="transformer_engine",
                    seq_length=6).validate()
    with pytest.raises(ConfigError, match="--context-parallel-size = 8 does not divide"):
        TrainConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                    context_parallel_size=2).data_parallel_size(12)
    with pytest.raises(ConfigError, match="at least --pipeline-model-parallel-size 4 micro"):
        TrainConfig(pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1,
                    global_batch_size=2).data_parallel_size(4)


@pytest.mark.parametrize("cp,tp,sp,want", [(1, 1, False, 1), (1, 2, False, 1), (1, 2, True, 2),
                                            (2, 1, False, 4), (2, 2, False, 4), (2, 2, True, 4),
                                            (2, 4, True, 8), (3, 2, True, 6), (4, 3, True, 24)])
def test_padded_length_multiple_is_what_megatron_splits(cp, tp, sp, want):
    """2 x CP load-balanced chunks; under SP each CP rank's length / CP splits over TP."""
    from megatron_klear.data.microbatches import sequence_multiple

    assert sequence_multiple(cp, tp, sp) == want


@pytest.mark.parametrize("trainer,extra", [
    ("rl", ["--prompt-data", "p.jsonl"]),  # packs by default
    ("sft", ["--data-path", "d.jsonl"]),
    ("sft", ["--data-path", "d.jsonl", "--no-pack"]),  # one sample per THD pack
])
def test_context_parallel_with_thd_packs_is_refused_by_validate_and_dry_run(trainer, extra,
                                                                             capsys):
    """THD packs cannot be split over CP ranks yet: both trainers refuse at parse time, so the
    dry run does too, naming the way out; RL's padded micro-batches are accepted."""
    from megatron_klear.train import rl, sft

    argv = ["--context-parallel-size", "2", "--transformer-impl", "transformer_engine",
            "--hf-checkpoint", "hf", *extra]
    if trainer == "sft":  # klear-rl refuses --seq-length: its sequences are prompt + response
        argv += ["--seq-length", "64"]
    main = rl.main if trainer == "rl" else sft.main
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--dry-run"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--context-parallel-size 2" in err and "THD" in err
    assert ("--no-pack-sequences" if trainer == "rl" else "tensor/pipeline parallelism") in err
    if trainer == "rl":
        from megatron_klear.config import parse_config

        cfg = parse_config(rl.RLConfig, [*argv, "--no-pack-sequences"])
        assert cfg.context_parallel_size == 2 and not cfg.pack_sequences


# ---------------------------------------------------------------- CP slicing (no processes)
def test_cp_slicing_is_load_balanced_and_round_trips():
    t = torch.arange(2 * 16).reshape(2, 16)
    s = [slice_for_cp_rank(t, 2, r) for r in range(2)]
    # 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert s[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert s[1][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4):
        x = torch.randn(3, 32, 5)
        parts = [slice_for_cp_rank(x, cp, r) for r in range(cp)]
        assert all(p.shape == (3, 32 // cp, 5) for p in parts)
        assert torch.equal(unslice_from_cp_ranks(parts), x)
    batch = {"tokens": t, "loss_mask": t.float(), "scalar": 3, "cu": torch.zeros(2)}
    got = slice_batch(batch, 2, 1)
    assert torch.equal(got["tokens"], s[1]) and got["scalar"] == 3 and got["cu"].shape == (2,)
    with pytest.raises(ValueError, match="multiple of 2 x context-parallel size 4"):
        slice_for_cp_rank(t[:, :12], 4, 0)
    with pytest.raises(ValueError, match="packed"):
        slice_batch({**batch, "cu_seqlens": torch.tensor([0, 16])}, 2, 0)


# ---------------------------------------------------------------- multi-rank parity
def _setup(layers: int, pp: int, tp: int = 1, *, first=None, last=None, vpp_layers=None,
           cp: int = 1, lr: float = 3e-3):
    """A fresh engine (parallel state re-initialised) for a tiny ``layers``-layer Qwen3."""
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_engine

    arch = qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB, num_hidden_layers=layers))
    cfg = TrainConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, lr=lr,
                      global_batch_size=8, micro_batch_size=2, train_iters=STEPS, seed=11,
                      decoder_first_pipeline_num_layers=first,
                      decoder_last_pipeline_num_layers=last,
                      num_layers_per_virtual_pipeline_stage=vpp_layers,
                      context_parallel_size=cp)
    layout = PipelineLayout.from_config(layers, cfg)
    initialize_parallel(tp, pp, cfg.seed, vpp=layout.virtual_size, cp=cp)
    return build_engine(cfg, arch)


def _loss_and_batches():
    from megatron.core import parallel_state as ps

    from megatron_klear.train.sft_objective import token_nll

    batches, total = _make_batches(ps.get_data_parallel_rank(),
                                   ps.get_data_parallel_world_size())

    def loss_fn(logits, b):
        nll = (token_nll(logits, b["labels"], VOCAB) * b["loss_mask"]).sum() / total
        return nll, {"loss": nll.detach(), "tokens": b["loss_mask"].sum()}

    return batches, loss_fn


def _train(eng, steps):
    batches, loss_fn = _loss_and_batches()
    return [eng.train_step(batches, loss_fn) for _ in range(steps)]


def _full_hf(eng) -> dict:
    """The whole model's HF state dict on every rank (stages gathered over PP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_klear.checkpoint.hf_bridge import hf_state_dict_from_megatron

    eng.gather_params()
    mine = hf_state_dict_from_megatron(eng.model, eng.arch)
    parts = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, mine, group=ps.get_pipeline_model_parallel_group())
    return {k: v for p in parts for k, v in p.items()}


def _logits(eng):
    from megatron_klear.checkpoint.convert import megatron_logits
    from megatron_klear.train.engine import broadcast_from_last_stage

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    return broadcast_from_last_stage(megatron_logits(eng.model, eng.arch, ids))


def _max_diff(a: dict, b: dict) -> float:
    """Max |a - b| over the tensors of two HF state dicts (inf when their names differ)."""
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _uneven_parity(rank, world, ckpt_root):
    """Per model: PP1 (DP2) reference, then PP2 uneven from its HF weights, then the PP2
    checkpoint back at PP1. Returns numbers only (tensors do not survive the rank's exit)."""
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.checkpoint.state import load_checkpoint, save_checkpoint

    out = {}
    for layers, first, last in ((3, 2, None), (5, None, 2)):
        ref = _setup(layers, 1)
        init = _full_hf(ref)
        ref_logits, ref_metrics = _logits(ref), _train(ref, STEPS)
        pp2 = _setup(layers, 2, first=first, last=last)
        load_hf_weights(pp2.model, pp2.arch, init)
        pp2.optimizer.reload_model_params()
        init_diff = _max_diff(_full_hf(pp2), init)
        logits_diff = float((_logits(pp2) - ref_logits).abs().max())
        metrics = _train(pp2, STEPS)
        trained = _full_hf(pp2)
        save_checkpoint(f"{ckpt_root}/{layers}", STEPS, pp2.model)
        stage_layers = [layer.layer_number for layer in pp2.model[0].module.decoder.layers]
        back = _setup(layers, 1)
        load_checkpoint(f"{ckpt_root}/{layers}", back.model, load_rng=False)
        out[layers] = dict(ref_metrics=ref_metrics, metrics=metrics, init_diff=init_diff,
                           logits_diff=logits_diff, stage_layers=stage_layers,
                           ckpt_diff=_max_diff(_full_hf(back), trained))
    return out


def _two_rank_checks(rank, world, root):
    """This file's three 2-rank checks in one launch (each sets its own layout: uneven PP,
    VPP, CP; in that order, as the tests below come)."""
    return {"uneven": _uneven_parity(rank, world, f"{root}/uneven"),
            "vpp": _vpp_parity(rank, world, f"{root}/vpp_ckpt"),
            "cp": _cp_parity(rank, world)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(_two_rank_checks, 2, str(tmp_path_factory.mktemp("layouts")),
                           timeout=600)


def test_uneven_pipeline_matches_unsplit(two_ranks):
    results = [r["uneven"] for r in two_ranks]
    for rank, res in enumerate(results):
        for layers, want_local in ((3, ([1, 2], [3])), (5, ([1, 2, 3], [4, 5]))):
            r = res[layers]
            assert r["stage_layers"] == want_local[rank]  # global layer numbers of the stage
            assert r["init_diff"] == 0.0  # HF -> PP2 -> HF is exact (the one mapping)
            assert r["logits_diff"] < 1e-5
            ref = r["ref_metrics"]
            assert ref[-1]["loss"] < ref[0]["loss"]  # the reference trains
            for got, want in zip(r["metrics"], ref):
                assert abs(got["loss"] - want["loss"]) < 1e-5, (layers, got, want)
                assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-5 * max(1, want["grad_norm"])
                assert got["tokens"] == want["tokens"]
            assert r["ckpt_diff"] == 0.0  # the PP2 checkpoint loads at PP1 exactly


def _vpp_parity(rank, world, ckpt_dir):
    """PP2 without interleaving, then PP2 x VPP2 from its weights, then a VPP resume."""
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.train.engine import restore_or_init

    plain = _setup(4, 2)
    init = _full_hf(plain)
    plain_metrics = _train(plain, STEPS)
    vpp = _setup(4, 2, vpp_layers=1)
    load_hf_weights(vpp.model, vpp.arch, init)
    vpp.optimizer.reload_model_params()
    chunk_layers = [[layer.layer_number for layer in c.module.decoder.layers] for c in vpp.model]
    first = _train(vpp, STEPS // 2)
    vpp.cfg.save = ckpt_dir
    vpp.save(STEPS // 2, {})
    vpp_metrics = first + _train(vpp, STEPS - STEPS // 2)
    resumed = _setup(4, 2, vpp_layers=1)
    resumed.cfg.load = ckpt_dir
    info = restore_or_init(resumed)
    out = dict(plain=plain_metrics, vpp=vpp_metrics, chunk_layers=chunk_layers,
               resumed_iteration=info.iteration, resumed=_train(resumed, STEPS - STEPS // 2))
    batches, loss_fn = _loss_and_batches()
    try:  # fewer micro-batches than stages: a clear error, not megatron's assertion
        resumed.forward_only(batches[:1], loss_fn)
    except ValueError as exc:
        out["too_few_error"] = str(exc)
    return out


def test_virtual_pipeline_matches_plain_pipeline_and_resumes(two_ranks):
    results = [r["vpp"] for r in two_ranks]
    # interleaving: stage 0 holds layers 1 and 3, stage 1 layers 2 and 4 (one per chunk)
    assert [r["chunk_layers"] for r in results] == [[[1], [3]], [[2], [4]]]
    for r in results:
        assert r["plain"][-1]["loss"] < r["plain"][0]["loss"]
        for got, want in zip(r["vpp"], r["plain"]):
            assert abs(got["loss"] - want["loss"]) < 1e-5, (got, want)
            assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-5 * max(1, want["grad_norm"])
        assert r["resumed_iteration"] == STEPS // 2
        tail = r["vpp"][STEPS // 2:]
        assert [m["loss"] for m in r["resumed"]] == [m["loss"] for m in tail]
        assert [m["grad_norm"] for m in r["resumed"]] == [m["grad_norm"] for m in tail]
        assert "at least --pipeline-model-parallel-size 2 micro-batches" in r["too_few_error"]


# ---------------------------------------------------------------- CP reductions (2 ranks)
class PositionwiseLM(torch.nn.Module):
    """Embedding -> SiLU MLP -> vocab projection, each token on its own.

    Stands in for megatron's GPTModel (megatron/core/models/gpt/gpt_model.py), whose
    attention across CP ranks needs Transformer Engine: without token mixing, slicing the
    sequence changes nothing but which rank scores which token, which is what the engine's
    CP slicing, loss shares, metric sums and DDP gradient reduction must get right.
    """

    def __init__(self, config, vocab: int, hidden: int = 32):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mlp = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens, position_ids, attention_mask, packed_seq_params=None):
        return self.out(torch.nn.functional.silu(self.mlp(self.embed(tokens))))

    def set_input_tensor(self, tensor):  # the schedule's hook (one stage: unused)
        pass


def _cp_run(cp: int, steps: int = STEPS):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import Engine, build_optimizer

    initialize_parallel(1, 1, 11, cp=cp)
    cfg = TrainConfig(lr=3e-3, global_batch_size=8, micro_batch_size=2, seed=11,
                      context_parallel_size=cp)
    tconf = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=1,
                              context_parallel_size=cp)
    torch.manual_seed(5)
    module = PositionwiseLM(tconf, VOCAB)
    model = [DistributedDataParallel(config=tconf, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), module=module)]
    eng = Engine(cfg=cfg, arch=None, model=model)
    eng.optimizer, eng.scheduler = build_optimizer(model, cfg)
    return _train(eng, steps)


def _schedule_length(cp: int) -> int:
    """The seq_length the engine hands megatron's schedule at CP ``cp`` (micro-batches of 16
    tokens): megatron divides it by CP itself for the pipeline sends (get_tensor_shapes)."""
    import megatron.core.pipeline_parallel as pipeline

    seen = {}
    original = pipeline.get_forward_backward_func

    def spy():
        run = original()

        def wrapped(**kwargs):
            seen["seq_length"] = kwargs["seq_length"]
            return run(**kwargs)
        return wrapped

    pipeline.get_forward_backward_func = spy
    try:
        _cp_run(cp, steps=1)
    finally:
        pipeline.get_forward_backward_func = original
    return seen["seq_length"]


def _cp_probe() -> dict:
    """The probe's logits helper at CP 2 on 7 tokens: each rank runs only its slice of the
    sequence padded to 8 (4 tokens), and the gathered logits are the whole sequence's."""
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig

    from megatron_klear.checkpoint.convert import megatron_logits

    torch.manual_seed(5)
    model = PositionwiseLM(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=1,
                                             context_parallel_size=2), VOCAB)
    fed, forward = [], model.forward

    def recording(tokens, *args, **kwargs):
        fed.append(tuple(tokens.shape))
        return forward(tokens, *args, **kwargs)

    model.forward = recording
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    got = megatron_logits(model, SimpleNamespace(vocab_size=VOCAB), ids)
    want = forward(ids, None, None)
    return {"fed": fed, "shape": tuple(got.shape), "max_diff": float((got - want).abs().max())}


def _cp_parity(rank, world):
    out = dict(cp1=_cp_run(1), cp2=_cp_run(2))  # CP1: DP2 on these 2 ranks; CP2: DP1
    out["schedule_length"] = _schedule_length(2)
    out["probe"] = _cp_probe()
    return out


def test_context_parallel_loss_and_normaliser_equal_no_cp(two_ranks):
    for r in (r["cp"] for r in two_ranks):
        assert r["cp1"][-1]["loss"] < r["cp1"][0]["loss"]
        for got, want in zip(r["cp2"], r["cp1"]):
            assert got["tokens"] == want["tokens"]  # the normaliser, summed over CP slices
            assert abs(got["loss"] - want["loss"]) < 1e-6, (got, want)
            assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-6 * max(1, want["grad_norm"])
        # the engine hands megatron the whole length (megatron divides by CP for its sends)
        assert r["schedule_length"] == 16
        probe = r["probe"]  # the weight-sync probe's logits helper under CP
        assert probe["fed"] == [(2, 4)] and probe["shape"] == (2, 7, VOCAB)
        assert probe["max_diff"] < 1e-6


# ---------------------------------------------------------------- memory plan (no processes)
def _dense_94_layers(tmp_path) -> Path:
    """Qwen3-235B-A22B's depth and attention shape (examples/uneven_pp_94_layers) as a DENSE
    model, so the per-stage parameters below stay hand-computable (MoE: tests/multiprocess/test_moe.py)."""
    cfg = json.loads((EXAMPLES / "uneven_pp_94_layers/hf_config/config.json").read_text())
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                "output_router_logits"):
        cfg.pop(key)
    cfg.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_memory_plan_follows_the_layout(tmp_path):
    """Per-stage layers and parameters of a 94-layer model, CP halving activations,
    interleaving's larger warm-up (hand-computed counts)."""
    from dataclasses import replace

    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.memory import plan_memory

    arch = qwen3_config_from_hf(load_hf_config(_dense_94_layers(tmp_path)))
    cfg = TrainConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
                      decoder_last_pipeline_num_layers=22, bf16=True, seq_length=4096,
                      global_batch_size=64, transformer_impl="transformer_engine")
    plan = plan_memory(arch, cfg, 32)
    assert [st.layers for st in plan.stages] == [24, 24, 24, 22]
    h, d, F, t = 4096, 128, 12288, 4
    layer = (h * (64 + 2 * 4) * d + 64 * d * h + 3 * h * F) // t + 2 * h + 2 * d
    assert plan.stages[1].params == 2 * 24 * layer  # bf16 bytes, no embedding or head
    # + final norm and the output layer over the vocab padded to a multiple of 128 x TP
    assert plan.stages[3].params == 2 * (22 * layer + h + 152064 * h // t)
    cp2 = plan_memory(arch, replace(cfg, context_parallel_size=2), 64)
    for a, b in zip(plan.stages, cp2.stages):
        assert abs(b.activations - a.activations / 2) <= 1
        assert abs(b.logits_loss - a.logits_loss / 2) <= 1
    arch64 = qwen3_config_from_hf(load_hf_config(EXAMPLES / "qwen3_32b/hf_config"))  # 64 layers
    even = replace(cfg, decoder_last_pipeline_num_layers=None, pipeline_model_parallel_size=2)
    vpp = plan_memory(arch64, replace(even, num_layers_per_virtual_pipeline_stage=16), 16)
    # PP2 x 2 chunks: stage i holds 2 (pp - i - 1) + (v - 1) pp + 1 chunk-micro-batches
    assert [st.in_flight for st in vpp.stages] == [5, 3]
    assert [st.in_flight for st in plan_memory(arch64, even, 16).stages] == [2, 1]


def test_dry_run_checks_context_parallel_and_uneven_stages(monkeypatch, capsys, tmp_path):
    from megatron_klear.train.dry_run import dry_run

    hf = _dense_94_layers(tmp_path)
    cfg = TrainConfig(hf_checkpoint=str(hf), tensor_model_parallel_size=4,
                      pipeline_model_parallel_size=4, decoder_last_pipeline_num_layers=22,
                      context_parallel_size=2, transformer_impl="transformer_engine",
                      bf16=True, seq_length=4096, global_batch_size=64,
                      use_distributed_optimizer=True)
    cfg.validate()
    monkeypatch.setenv("WORLD_SIZE", "64")
    report = dry_run(cfg)
    assert report["data_parallel_size"] == 2  # 64 / (TP4 x PP4 x CP2)
    assert report["pipeline_stage_layers"] == [24, 24, 24, 22] and report["memory"]["fits"]
    monkeypatch.setenv("WORLD_SIZE", "48")
    with pytest.raises(ConfigError, match="--context-parallel-size = 32 does not divide"):
        dry_run(cfg)
    monkeypatch.setenv("WORLD_SIZE", "32")
    cfg.decoder_last_pipeline_num_layers = None
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 4 does not divide "
                                          "num_hidden_layers=94; set --decoder-first"):
        dry_run(cfg)
