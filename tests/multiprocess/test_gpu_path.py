"""The GPU-bound calls of issue 30, on the strict virtual-CUDA platform (tests/virtual_cuda.py).

One strict launch (one rank) runs each call a GPU run makes and records its result or the
error it raised, so each test below fails on its own defect:

* the weight-sync probe (``trainer_sequence_logprobs``; defect 1: CPU token ids fed to the
  CUDA embedding) against transformers' log-probs, and ``compare_logits`` (the same helper);
* the weight sync with the embedded CPU server (defect 6: an NCCL group with a CPU process);
  the server's log-probs after the sync against transformers on the trainer's export;
* RL steps on THD packs and on shared-prompt packs (defect 5: a CPU tree mask given to CUDA
  attention);
* the converters' model (defect 4): every parameter and buffer on ``meta``;
* the CUDA loss kernels' dispatch (``--loss-backend auto`` resolving to ``cuda``, every kernel
  input on the logits' device);
* ``--optimizer-cpu-offload`` (defect 2, with ``--bf16``, which config.py requires: megatron
  cannot offload fp32 parameters): megatron's hybrid optimizer really offloads (CPU copies of
  pinned copies), HF weights are loaded, one step at lr 0 leaves them unchanged.

On a machine with CUDA the same launch runs on the real GPU (the strict mode is off there, the
CUDA kernels are the extension's): tests/gpu/run_gpu_checks.sh runs this file as issue 30's GPU
check (not run on a GPU yet).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from tests.virtual_cuda import run_strict

PROBE_IDS = list(range(3, 40, 2))
VOCAB_KW = dict(global_batch_size=4, micro_batch_size=2, seq_length=64, seed=5)


def _batch():
    """Two prompts, two samples each (the shape of a GRPO group), uneven lengths."""
    from megatron_klear.algo.advantages import group_advantages
    from megatron_klear.samples import RolloutBatch

    g = torch.Generator().manual_seed(2)
    b = RolloutBatch(group_size=2)
    for i, n in enumerate([5, 9, 3, 7]):
        if i % 2 == 0:
            prompt = torch.randint(3, 90, (4 + i,), generator=g).tolist()
        b.prompt_ids.append(prompt)
        b.response_ids.append(torch.randint(3, 90, (n,), generator=g).tolist())
        b.rollout_logprobs.append((-torch.rand(n, generator=g)).tolist())
        b.rewards.append(float(i % 3 == 0))
        b.prompt_index.append(i // 2)
        b.truncated.append(False)
    b.advantages = group_advantages(torch.tensor(b.rewards), 2).tolist()
    return b


def _record(results: dict, name: str, fn) -> None:
    try:
        results[name] = {"value": fn()}
    except Exception as exc:  # noqa: BLE001 - each sub-check's failure is its own test's
        results[name] = {"error": f"{type(exc).__name__}: {exc}"}


def _engine(hf_dir: str, **changes):
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.train.engine import build_engine, restore_or_init
    from megatron_klear.train.rl import RLConfig

    cfg = RLConfig(**{**VOCAB_KW, "hf_checkpoint": hf_dir, "loss_backend": "torch", **changes})
    eng = build_engine(cfg, qwen3_config_from_hf(load_hf_config(hf_dir)))
    restore_or_init(eng)
    return eng


def _rl_step(eng, **changes) -> float:
    from dataclasses import replace

    from megatron_klear.train.rl import train_on_batch

    eng.cfg = replace(eng.cfg, **changes)
    return train_on_batch(eng, eng.cfg, _batch(), pad_id=0)["train/loss"]


def _offload_step(hf_dir: str) -> dict:
    """Load HF weights under --optimizer-cpu-offload, one step at lr 0: weights unchanged."""
    from tests.virtual_cuda import offloaded_copies

    eng = _engine(hf_dir, use_distributed_optimizer=True, optimizer_cpu_offload=True, lr=0.0,
                  min_lr=0.0, bf16=True)
    before = [p.detach().clone() for p in eng.model[0].parameters()]
    copies = offloaded_copies(eng.optimizer)
    _rl_step(eng, pack_sequences=False)
    eng.gather_params()
    after = list(eng.model[0].parameters())
    return {"offloaded": len(copies),
            "on_cpu": all(c.device.type == "cpu" for c in copies.values()),
            "params": sum(1 for _ in after),
            "max_change": max(float((a.float() - b.float()).abs().max())
                              for a, b in zip(after, before))}


def _meta_model_devices() -> dict[str, list[str]]:
    """The devices of the converters' model's parameters and buffers, dense and MoE."""
    from megatron_klear.checkpoint.torch_dist_io import meta_model
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config, tiny_qwen3_moe_config

    out = {}
    for kind, cfg in (("dense", tiny_qwen3_config()), ("moe", tiny_qwen3_moe_config())):
        model = meta_model(qwen3_config_from_hf(cfg), torch.bfloat16)
        out[kind] = sorted({str(t.device) for t in [*model.parameters(), *model.buffers()]})
    return out


def _gpu_path(rank, world, hf_dir, url, tmp):
    from megatron_klear import platform
    from megatron_klear.checkpoint.convert import compare_logits
    from megatron_klear.ops.backend import loss_backend
    from megatron_klear.rollout.transport.weight_sync import WeightSync
    from megatron_klear.rollout.transport.probe import trainer_sequence_logprobs
    from tests.virtual_cuda import virtual_cuda_kernels

    assert platform.device().type == "cuda" and torch.cuda.is_available()
    out: dict = {}
    eng = _engine(hf_dir, save=f"{tmp}/ckpt")
    _record(out, "probe", lambda: trainer_sequence_logprobs(eng.model, eng.arch, PROBE_IDS)
            .cpu().tolist())
    eng.save(1, {})
    _record(out, "packed", lambda: _rl_step(eng, pack_sequences=True))
    _record(out, "shared_prompts", lambda: _rl_step(eng, pack_sequences=True,
                                                     share_prompts=True))
    # a GPU machine (tests/gpu/run_gpu_checks.sh) runs the real kernels of a CUDA build
    with virtual_cuda_kernels() if platform.is_emulated() else contextlib.nullcontext():
        _record(out, "cuda_loss", lambda: (loss_backend("auto"),
                                           _rl_step(eng, pack_sequences=False,
                                                    share_prompts=False, loss_backend="auto")))

    def sync() -> dict:
        ws = WeightSync([url], eng.model, eng.arch, bucket_bytes=64 * 1024)
        try:
            ws.connect()
            ws.sync("v1")
            server = ws.client.prompt_logprobs(PROBE_IDS)[0]
            eng.export_hf(f"{tmp}/synced")
            return {"backend": ws.backend, "server_logprobs": server}
        finally:
            ws.close()

    _record(out, "weight_sync", sync)
    _record(out, "offload", lambda: _offload_step(hf_dir))
    _record(out, "meta_model", _meta_model_devices)
    _record(out, "compare_logits", lambda: compare_logits(hf_dir, f"{tmp}/ckpt"))
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from tests.rollout_helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def strict_run(hf_dir, tmp_path_factory):
    from megatron_klear.rollout.engine.launcher import launch_embedded_servers

    tmp = tmp_path_factory.mktemp("gpu_path")
    with launch_embedded_servers(hf_dir, 1, log_dir=tmp) as servers:
        return tmp, run_strict(_gpu_path, 1, str(hf_dir), servers.urls[0], str(tmp))[0]


def _value(strict_run, name: str):
    got = strict_run[1][name]
    assert "error" not in got, got.get("error")
    return got["value"]


def _reference(model_dir) -> torch.Tensor:
    from tests.rollout_helpers import load_reference, reference_logprobs

    return reference_logprobs(load_reference(model_dir)[0], PROBE_IDS)


def test_probe_runs_on_the_device_and_matches_transformers(strict_run, hf_dir):
    got = torch.tensor(_value(strict_run, "probe"), dtype=torch.float64)
    assert (got - _reference(hf_dir).double()).abs().max() < 1e-4


def test_compare_logits_runs_on_the_device(strict_run):
    assert _value(strict_run, "compare_logits") < 1e-4


def test_weight_sync_with_a_cpu_server_forms_a_gloo_group(strict_run):
    got = _value(strict_run, "weight_sync")
    assert got["backend"] == "gloo"
    ref = _reference(strict_run[0] / "synced").double()
    assert (torch.tensor(got["server_logprobs"], dtype=torch.float64) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["packed", "shared_prompts"])
def test_packed_batches_run_on_the_device(strict_run, name):
    assert torch.isfinite(torch.tensor(_value(strict_run, name)))


def test_cuda_loss_kernels_get_device_tensors(strict_run):
    backend, loss = _value(strict_run, "cuda_loss")
    assert backend == "cuda" and torch.isfinite(torch.tensor(loss))


def test_offload_keeps_loaded_weights(strict_run):
    got = _value(strict_run, "offload")
    # the hybrid optimizer offloaded every parameter shard: the fp32 master copies it makes of
    # pinned copies of the bf16 shards (hybrid_optimizer.py _get_sub_optimizer_param_groups)
    assert got["offloaded"] == got["params"] and got["on_cpu"]
    assert got["max_change"] == 0.0  # lr 0: the loaded weights, not the random init


def test_converter_model_is_all_on_meta(strict_run):
    """Defect 4: megatron's layers and the local RMSNorm name the CUDA device explicitly, which
    ``with torch.device("meta")`` alone does not override (a GPU would allocate the model)."""
    assert _value(strict_run, "meta_model") == {"dense": ["meta"], "moe": ["meta"]}


def test_gpu_check_steps_fit_the_time_left_after_the_build():
    """Issue 51: tests/gpu/gpu_check.py's step budgets add up to at most what
    tools/gpu_check.sh leaves the checks (its 480 s, less the setup's allowance and the closing
    margin), so every check has its turn in 8 minutes (they added up to 930 s against about
    420); the script uses the same totals, and every step has a budget, in run order."""
    import re

    from tests.gpu import gpu_check

    assert list(gpu_check.STEPS) == list(gpu_check.STEP_TIMEOUT_S)
    assert sum(gpu_check.STEP_TIMEOUT_S.values()) <= gpu_check.CHECKS_BUDGET_S
    assert gpu_check.TOTAL_S == 480  # 8 minutes on one H100/H200
    script = (Path(__file__).parents[2] / "tools" / "gpu_check.sh").read_text()
    total, close = map(int, re.search(r"budget=\$\(\((\d+) - \(SECONDS - start\) - (\d+)\)\)",
                                      script).groups())
    assert (total, close) == (gpu_check.TOTAL_S, gpu_check.CLOSE_S)
    assert f"(allowed {gpu_check.SETUP_ALLOWANCE_S})" in script
