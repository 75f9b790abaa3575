"""LoRA on megatron-core (issue 41), checked against transformers + peft.

One launch of 2 gloo ranks: at TP2 random adapters (non-zero B) are exported as a PEFT folder
and as merged HF weights; at PP2 that folder is imported. The logits of both layouts must
equal those of transformers' Qwen3ForCausalLM with ``peft`` loading the folder (the
reference, computed in the test process), within the conversion tests' tolerance. Then an
SFT step with LoRA at TP2 (frozen base, adapters-only optimizer and checkpoint, bitwise
resume).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_klear.models.tiny import save_tiny_hf_model
from tests.dist import run_distributed

TOL = 1e-4  # tests/multiprocess/test_convert.py's
RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # fused layers half targeted


def _cfg(hf: Path, tp: int, pp: int, **kw):
    from megatron_klear.config import TrainConfig

    cfg = TrainConfig(hf_checkpoint=str(hf), tensor_model_parallel_size=tp,
                      pipeline_model_parallel_size=pp, lora_rank=RANK, lora_alpha=ALPHA,
                      lora_target_modules=TARGETS, global_batch_size=4, micro_batch_size=2,
                      lr=1e-2, seed=5, **kw)
    cfg.validate()
    return cfg


def _randomize_b(chunks) -> None:
    """Non-zero B (PEFT initialises it to zero, which would hide any layout error): full
    tensors from a seed per name, split as the model splits them."""
    from megatron.core import parallel_state as ps

    from megatron_klear.models.lora import adapters

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for layer, suffix, adapter in adapters(chunks):
            for part in adapter.targeted:
                b = adapter.lora_B[part]
                out = b.shape[0] * (tp if adapter.column else 1)
                g = torch.Generator().manual_seed(100 * layer + TARGETS.index(part))
                full = torch.randn(out, RANK, generator=g) * 0.3
                b.copy_(full.chunk(tp)[rank] if adapter.column else full)


def _logits(chunks, arch, ids):
    from megatron.core import parallel_state as ps

    from megatron_klear.checkpoint.convert import megatron_logits

    out = megatron_logits(chunks, arch, ids)
    return out if out is not None and ps.get_tensor_model_parallel_rank() == 0 else None


def _parity(rank, world, hf: Path, out: Path):
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.checkpoint.hf_io import SafetensorsReader, export_model_to_hf
    from megatron_klear.checkpoint.peft_io import export_peft_adapter, load_peft_adapter
    from megatron_klear.models.lora import adapters_disabled, lora_spec
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.engine import build_model, initialize_parallel

    arch = qwen3_config_from_hf(load_hf_config(hf))
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    res = {}
    for tp, pp in ((2, 1), (1, 2)):
        initialize_parallel(tp, pp)
        cfg = _cfg(hf, tp, pp)
        chunks = [c.eval() for c in build_model(arch, cfg, wrap_ddp=False)]
        load_hf_weights(chunks, arch, SafetensorsReader(str(hf)))
        if tp == 2:
            _randomize_b(chunks)
            export_peft_adapter(chunks, lora_spec(cfg), out / "peft_tp2", base_model=str(hf))
            export_model_to_hf(chunks, arch, out / "merged_tp2")
        else:  # PP2 imports what TP2 exported, and exports it again
            load_peft_adapter(chunks, lora_spec(cfg), out / "peft_tp2")
            export_peft_adapter(chunks, lora_spec(cfg), out / "peft_pp2")
        res[f"tp{tp}pp{pp}"] = _logits(chunks, arch, ids)
        with adapters_disabled(chunks):
            res[f"tp{tp}pp{pp}_off"] = _logits(chunks, arch, ids)
    res["ids"] = ids
    return res


def _batches(vocab: int):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (4, 17), generator=g)
    return [dict(tokens=tokens[r, :-1], labels=tokens[r, 1:],
                 position_ids=torch.arange(16).expand(2, 16)) for r in ([0, 1], [2, 3])]


def _sft(rank, world, hf: Path, out: Path):
    """SFT steps with LoRA at TP2 on a full base checkpoint (``--load``, converted from another
    model than ``--hf-checkpoint``): what changes, what the optimizer holds, what is saved,
    and a resume from the adapters-only checkpoint."""
    from megatron_klear.checkpoint.convert import convert_hf_to_megatron
    from megatron_klear.checkpoint.hf_bridge import unwrap_model
    from megatron_klear.checkpoint.state import find_latest_checkpoint, read_meta
    from megatron_klear.models.lora import is_adapter_key
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.engine import build_engine, initialize_parallel, restore_or_init
    from megatron_klear.train.sft_objective import token_nll

    base_hf = out / "base_hf"
    full = convert_hf_to_megatron(base_hf, out / "full", dtype="fp32")
    arch = qwen3_config_from_hf(load_hf_config(hf))
    initialize_parallel(2, 1)
    cfg = _cfg(hf, 2, 1, load=str(full), save=str(out / "lora_ckpt"))
    batches = _batches(arch.vocab_size)

    def loss_fn(logits, b):
        nll = token_nll(logits, b["labels"], arch.vocab_size).sum() / 64
        return nll, {"loss": nll.detach()}

    def named(eng):
        return dict(unwrap_model(eng.model[0]).named_parameters())

    eng = build_engine(cfg, arch)
    restore_or_init(eng)
    params = named(eng)
    before = {n: p.detach().clone() for n, p in params.items()}
    eng.train_step(batches, loss_fn)
    eng.train_step(batches, loss_fn)  # B moves at step 1, A from step 2 (B starts at zero)
    adapters = {n for n in params if is_adapter_key(n)}
    opt_ids = {id(p) for g in eng.optimizer.param_groups for p in g["params"]}
    res = {
        "base_from_load": torch.equal(params["decoder.final_layernorm.weight"].detach(),
                                      _hf_tensor(base_hf, "model.norm.weight")),
        "base_changed": sorted(n for n in params if n not in adapters
                               and not torch.equal(params[n], before[n])),
        "base_requires_grad": sorted(n for n in params if n not in adapters
                                     and params[n].requires_grad),
        "adapters_unchanged": sorted(n for n in adapters if torch.equal(params[n], before[n])),
        "adapters": len(adapters),
        "optimizer_params_are_adapters": opt_ids == {id(params[n]) for n in adapters},
        "optimizer_state_params": len(eng.optimizer.optimizer.state),
        "grad_buffer_numel": sum(b.numel for b in eng.model[0].buffers),
        "adapter_numel": sum(params[n].numel() for n in adapters),
    }
    eng.save(2, {"consumed": 8})
    saved = find_latest_checkpoint(out / "lora_ckpt")
    meta = read_meta(saved)
    from torch.distributed.checkpoint import FileSystemReader

    res["saved"] = (meta["lora"], sum(meta["files"].values()),
                    sum(f.stat().st_size for f in Path(full).rglob("*") if f.is_file()),
                    sorted(FileSystemReader(str(saved)).read_metadata().state_dict_metadata))
    eng.train_step(batches, loss_fn)
    after_three = {n: params[n].detach().clone() for n in adapters}
    resumed = build_engine(cfg, arch)
    info = restore_or_init(resumed)
    res["resumed_at"] = info.iteration if info else None
    resumed.train_step(batches, loss_fn)
    again = named(resumed)
    res["resume_diff"] = sorted(n for n in adapters if not torch.equal(again[n], after_three[n]))
    res["resumed_base"] = torch.equal(again["decoder.final_layernorm.weight"].detach(),
                                      _hf_tensor(base_hf, "model.norm.weight"))
    resumed.export_hf(str(out / "exported"))  # merged weights + peft_adapter/ (trained A, B)
    return res


def _layouts_step(rank, world, hf: Path):
    """One step from the same adapters (non-zero B) at TP1 x DP2, TP2 and TP2 with sequence
    parallelism: the adapters' full gradients (as megatron DDP reduced them), per layout."""
    from megatron.core import parallel_state as ps

    from megatron_klear.checkpoint.peft_io import _stage_tensors
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.engine import build_engine, initialize_parallel, restore_or_init
    from megatron_klear.train.sft_objective import token_nll

    arch = qwen3_config_from_hf(load_hf_config(hf))
    out = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        initialize_parallel(tp, 1)
        eng = build_engine(_cfg(hf, tp, 1, sequence_parallel=sp), arch)
        restore_or_init(eng)
        _randomize_b(eng.model)
        batches = _batches(arch.vocab_size)
        if ps.get_data_parallel_world_size() == 2:
            batches = batches[rank:rank + 1]

        def loss_fn(logits, b):
            nll = token_nll(logits, b["labels"], arch.vocab_size).sum() / 64
            return nll, {"loss": nll.detach()}

        eng.train_step(batches, loss_fn)
        with torch.no_grad():  # the reduced gradients (Adam's first step hides their scale)
            for p in eng.model[0].parameters():
                if p.requires_grad:
                    p.copy_(p.main_grad)
        out[f"tp{tp}{'sp' if sp else ''}"] = {n: t.cpu() for n, t in
                                             _stage_tensors(eng.model).items()}
    return out


def _hf_tensor(hf: Path, name: str) -> torch.Tensor:
    return load_file(hf / "model.safetensors")[name]


def _launch(rank, world, hf: Path, out: Path):
    return {**_parity(rank, world, hf, out), **_sft(rank, world, hf, out),
            "steps": _layouts_step(rank, world, hf)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf = save_tiny_hf_model(root / "hf", std=0.2, seed=2)
    save_tiny_hf_model(root / "base_hf", std=0.2, seed=9, with_tokenizer=False)
    return run_distributed(_launch, 2, hf, root), hf, root


@pytest.fixture(scope="module")
def parity(launched):
    ranks, hf, root = launched
    got = {k: v for r in ranks for k, v in r.items() if v is not None}
    return got, hf, root


def _peft_logits(hf: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                 attn_implementation="eager")
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2"])
def test_logits_equal_transformers_with_peft(parity, layout):
    from megatron_klear.checkpoint.convert import hf_logits

    got, hf, root = parity
    ref = _peft_logits(hf, root / "peft_tp2", got["ids"])
    diff = (got[layout] - ref).abs().max().item()
    print(f"{layout}: max |megatron+LoRA - transformers+peft| = {diff:.3g}")
    assert diff < TOL
    # the adapters matter (non-zero B): the base alone is far off, and equals transformers'
    assert (hf_logits(hf, got["ids"]) - ref).abs().max().item() > 100 * TOL
    assert (got[f"{layout}_off"] - hf_logits(hf, got["ids"])).abs().max().item() < TOL


def test_peft_folder_has_peft_names_and_round_trips_bitwise(parity):
    _, _, root = parity
    cfg = json.loads((root / "peft_tp2" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", RANK, ALPHA)
    tp2 = load_file(root / "peft_tp2" / "adapter_model.safetensors")
    pp2 = load_file(root / "peft_pp2" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in tp2
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in tp2
    assert not any("k_proj" in n or "gate_proj" in n for n in tp2)  # not targeted
    assert tp2.keys() == pp2.keys() and all(torch.equal(tp2[n], pp2[n]) for n in tp2)


def test_merged_export_equals_peft(parity):
    from megatron_klear.checkpoint.convert import hf_logits

    got, hf, root = parity
    ref = _peft_logits(hf, root / "peft_tp2", got["ids"])
    assert (hf_logits(root / "merged_tp2", got["ids"]) - ref).abs().max().item() < TOL


def test_sft_step_with_lora_moves_adapters_only(launched):
    for res in launched[0]:
        assert res["base_from_load"]  # --load's full checkpoint, not --hf-checkpoint
        assert res["base_changed"] == [] and res["base_requires_grad"] == []
        # 2 layers x (q, v, up: A and B; o, down: A and B) = 20 adapter tensors
        assert res["adapters"] == 20 and res["adapters_unchanged"] == []
        assert res["optimizer_params_are_adapters"]
        assert 0 < res["optimizer_state_params"] <= res["adapters"]
        # megatron DDP's grad buffer holds the adapters only (no base parameter)
        assert res["adapter_numel"] <= res["grad_buffer_numel"] < 2 * res["adapter_numel"]


def test_memory_plan_counts_this_ranks_adapters(launched):
    """train/memory.py's adapter count equals the TP2 model's, and its state bytes are the
    adapters' only (fp32 grads, Adam m and v)."""
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.memory import lora_params_per_layer, plan_memory

    ranks, hf, _ = launched
    arch = qwen3_config_from_hf(load_hf_config(hf))
    cfg = _cfg(hf, 2, 1)
    assert ranks[0]["adapter_numel"] == arch.num_layers * lora_params_per_layer(arch, cfg)
    stage = plan_memory(arch, cfg, 2).stages[0]
    assert (stage.grads, stage.optimizer) == (4 * ranks[0]["adapter_numel"],
                                              8 * ranks[0]["adapter_numel"])


def test_lora_checkpoint_holds_adapters_only_and_resumes_bitwise(launched):
    for res in launched[0]:
        lora, lora_bytes, full_bytes, keys = res["saved"]
        # the model part is the adapters (no base tensor), with their Adam moments; the
        # whole checkpoint (optimizer and RNG included) is smaller than the base model alone
        assert lora and lora_bytes < full_bytes
        model_keys = [k for k in keys if not k.startswith(("optimizer", "extra", "opt_param"))]
        assert model_keys and all(".adapter." in k for k in model_keys), model_keys[:3]
        assert any(k.startswith("optimizer") for k in keys)
        assert res["resumed_at"] == 2 and res["resumed_base"]
        assert res["resume_diff"] == []


# ---------------------------------------------------------------- RL: weight sync, KL reference
PROBE_IDS = [7, 20, 33, 41, 8, 15, 62, 70, 11, 5, 90, 24]
SYNCED_TOL, STALE_MIN = 1e-4, 1e-2  # tests/multiprocess/test_weight_sync.py's


def _sync(rank, world, url: str, hf: Path):
    """DP2 with megatron DDP and the distributed optimizer (every base weight a view of one
    buffer: the path that sends parameter memory as is). The server must receive the
    merged weights after every sync, also after the adapters moved."""
    from megatron.core import parallel_state as ps

    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.checkpoint.hf_io import SafetensorsReader
    from megatron_klear.models.lora import adapters, adapters_disabled
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.rollout.transport.probe import trainer_sequence_logprobs
    from megatron_klear.rollout.transport.weight_sync import WeightSync
    from megatron_klear.train.engine import build_model, initialize_parallel

    initialize_parallel(1, 1)
    arch = qwen3_config_from_hf(load_hf_config(hf))
    model = build_model(arch, _cfg(hf, 1, 1, use_distributed_optimizer=True))
    load_hf_weights(model, arch, SafetensorsReader(str(hf)))
    sync = WeightSync([url], model, arch, bucket_bytes=32 * 1024, min_direct_bytes=1)
    sync.connect()
    diffs = {}

    def probe(tag: str) -> None:
        lp = trainer_sequence_logprobs(model, arch, PROBE_IDS)
        if rank == 0:
            diffs[tag] = sync.probe(PROBE_IDS, lp)

    with torch.no_grad():
        for _, _, adapter in adapters(model):  # the same on both DP replicas
            for part in adapter.targeted:
                b = adapter.lora_B[part]
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(b.numel()))
                        * 0.3)
    probe("before_sync")
    sync.sync("v1")
    probe("synced")
    with torch.no_grad():  # the adapters move (as after an optimizer step), the base does not
        for _, _, adapter in adapters(model):
            for b in adapter.lora_B.values():
                b.mul_(-1)
    probe("adapters_moved")
    sync.sync("v2")
    probe("synced_again")
    with adapters_disabled(model):  # the KL reference: the base the server started from
        probe("reference_vs_merged")
    sync.close()
    return diffs if ps.get_data_parallel_rank() == 0 else {}


def test_weight_sync_sends_merged_weights_every_sync(tmp_path):
    from megatron_klear.rollout.engine.launcher import launch_embedded_servers

    hf = save_tiny_hf_model(tmp_path / "hf", std=0.2, seed=4)
    with launch_embedded_servers(hf, 1, log_dir=tmp_path / "logs") as server:
        diffs = run_distributed(_sync, 2, server.urls[0], hf, timeout=240)[0]
    assert diffs["before_sync"] > STALE_MIN, diffs  # the adapters change the model
    assert diffs["synced"] < SYNCED_TOL, diffs
    assert diffs["adapters_moved"] > STALE_MIN, diffs
    assert diffs["synced_again"] < SYNCED_TOL, diffs
    assert diffs["reference_vs_merged"] > STALE_MIN, diffs  # adapters off: the base model


def test_trainer_export_writes_merged_weights_and_a_peft_folder_that_agree(launched):
    from megatron_klear.checkpoint.convert import hf_logits

    _, _, root = launched
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(8))
    peft = _peft_logits(root / "base_hf", root / "exported" / "peft_adapter", ids)
    merged = hf_logits(root / "exported", ids)
    assert (merged - peft).abs().max().item() < TOL
    assert (hf_logits(root / "base_hf", ids) - peft).abs().max().item() > 100 * TOL


def test_adapter_gradients_are_the_same_at_tp1_tp2_and_with_sequence_parallel(launched):
    """The TP collectives of the adapters (A replicated / B split, and back; SP's gathers
    and the TP all-reduce of replicated adapter grads) give TP1's gradients."""
    steps = launched[0][0]["steps"]
    ref = steps["tp1"]
    for layout in ("tp2", "tp2sp"):
        assert steps[layout].keys() == ref.keys()
        diff = max((steps[layout][n] - ref[n]).abs().max().item() for n in ref)
        moved = max((steps[layout][n] - 0).abs().max().item() for n in ref)
        print(f"{layout}: max |adapter grads - TP1's| = {diff:.3g} (largest {moved:.3g})")
        assert diff < 1e-5 and moved > 0


# ---------------------------------------------------------------- klear-rl with LoRA
from tests.multiprocess.test_rl import _rl_args, hf_model, prompts  # noqa: E402,F401 (fixtures)

LORA_RL = ["--lora-rank", "8", "--lora-alpha", "16", "--kl-coef", "0.01"]


def test_rl_with_lora_trains_syncs_merged_weights_and_resumes_bitwise(hf_model, prompts,
                                                                     tmp_path):
    """klear-rl with LoRA and a KL term (reference: the base, adapters off), one uninterrupted
    4-step run that is both the plain run and the reference of a SIGKILLed and resumed one:
    every step trains (two optimizer steps), the servers match the trainer after every sync
    (merged weights), the weights move, the KL is not 0 once the adapters moved; the killed
    run, resumed from its last save, repeats the reference bitwise. (TP=2's merged weights
    are test_trainer_export_writes_merged_weights_and_a_peft_folder_that_agree's: the sync
    and the export walk the same hf_bridge.export_views.)"""
    import os
    import subprocess
    import sys

    from megatron_klear.train.metrics import read_metrics
    from tests.kill_points import kill_when_logged

    env = dict(os.environ, OMP_NUM_THREADS="1")
    cli = lambda save: [sys.executable, "-m", "megatron_klear.train.rl",  # noqa: E731
                        *_rl_args(hf_model, prompts, save, 4, "--save-interval", "1",
                                  "--max-sampling-rounds", "8", *LORA_RL)]
    # the uninterrupted run goes side by side with the run that is killed (independent runs:
    # their imports and model loads overlap)
    ref_log = (tmp_path / "ref.log").open("w")
    ref_run = subprocess.Popen(cli(tmp_path / "ref"), env=env, stdout=ref_log,
                               stderr=subprocess.STDOUT)
    proc = subprocess.Popen(cli(tmp_path / "run"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = tmp_path / "run" / "metrics.jsonl"
    kill_when_logged(proc, metrics, 2)
    assert ref_run.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    ref_log.close()
    hist = read_metrics(tmp_path / "ref" / "metrics.jsonl")
    assert len(hist) == 4
    for m in hist:
        assert m["train/optimizer_steps"] == 2
        assert m["weight_sync/probe_max_abs_diff"] < 1e-3
    means = [m["weight_sync/probe_logprob_mean"] for m in hist]
    assert all(abs(a - b) > 1e-5 for a, b in zip(means, means[1:]))
    # the reference is the base (adapters off): once the adapters moved, the KL is not 0
    assert hist[-1]["train/kl"] != 0

    subprocess.run(cli(tmp_path / "run"), check=True, env=env, capture_output=True)
    ref = {r["step"]: r for r in hist}
    got = {r["step"]: r for r in read_metrics(metrics)}
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        for key in ("train/loss", "train/policy_loss", "rollout/reward_mean",
                    "weight_sync/probe_logprob_mean", "data/prompt_indices"):
            assert got[step][key] == ref[step][key], (step, key)


@pytest.mark.parametrize("flags, message", [
    (dict(lora_rank=4, lora_target_modules=["q_proj", "foo"]), "--lora-target-modules"),
    (dict(lora_rank=4, lora_target_modules=[]), "--lora-target-modules"),
    (dict(lora_rank=-1), "--lora-rank"),
    (dict(lora_rank=4, lora_alpha=0.0), "--lora-alpha"),
    (dict(lora_rank=4, lora_dropout=1.0), "--lora-dropout"),
    (dict(lora_dropout=0.1), "--lora-dropout needs --lora-rank"),
    (dict(lora_target_modules=["q_proj"]), "--lora-target-modules needs --lora-rank"),
    (dict(lora_load="adapter"), "--lora-load needs --lora-rank")])
def test_bad_lora_flags_are_refused_by_name(flags, message):
    from megatron_klear.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match=message):
        TrainConfig(**flags).validate()
