"""1-GPU smoke test of colocated mode (issue 31). NEVER RUN YET: no GPU was lent while writing it.

    python3 tests/gpu/colocate_smoke.py            (or tests/gpu/run_gpu_checks.sh)

1. Trainer offload on the GPU: a tiny model (bf16, distributed optimizer) trains two steps
   with :class:`TrainerOffload` offloading between them; the GPU memory allocated while
   offloaded drops by at least the bytes it moved (pinned host buffers), and the losses and
   the final parameters equal a run without offload bitwise (the CPU twin:
   tests/multiprocess/test_offload.py).
2. Where SGLang with torch_memory_saver is installed: one SGLang server on the same GPU
   (``--enable-memory-saver``, ``--mem-fraction-static 0.3``, ``--dtype bfloat16``),
   released (KV cache and weights): the GPU's free memory rises by at least the weights'
   bytes; resumed, so that ``klear-rl --colocate`` starts from the engine's launch state and
   releases it itself (never twice: issue 38, defect 1); then two colocated steps: CUDA IPC
   tensor handles, the probe after every sync below a bf16 bound (the CPU twins:
   tests/multiprocess/test_colocate.py and tests/interop/). Prints ``COLOCATE SMOKE OK``.

The engine serves in bf16, as the trainer trains (issue 38, defect 6): the tiny model's
config says float32, which SGLang's ``--dtype auto`` serves in float16
(sglang/srt/configs/model_config.py ``_get_and_verify_dtype``: float32 -> float16), so the
probe would measure fp16 against bf16 rounding. tests/gpu/gpu_check.py runs the same
colocated run against the embedded server on the GPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests`, the worktree's package

VOCAB = 512
# trainer and engine both in bf16, different kernels: the probe's 32 log-probs differ by bf16
# rounding (relative 2^-8 of activations), not by 1e-3; a missed tensor leaves NaN and fails
PROBE_BOUND_BF16 = 0.05


def _train(offload: bool, start: dict | None) -> tuple[list[float], dict, int]:
    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.offload import TrainerOffload
    from megatron_klear.train.sft_objective import token_nll

    cfg = TrainConfig(bf16=True, use_distributed_optimizer=True, global_batch_size=2,
                      micro_batch_size=1, lr=3e-3, seed=5)
    eng = build_engine(cfg, qwen3_config_from_hf(tiny_qwen3_config(vocab_size=VOCAB)))
    params = dict(eng.model[0].named_parameters())
    if start is not None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(start[n])
        eng.optimizer.reload_model_params()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 65), generator=g)
    mbs = [dict(tokens=tokens[i:i + 1, :-1], labels=tokens[i:i + 1, 1:],
                loss_mask=torch.ones(1, 64), position_ids=torch.arange(64)[None])
           for i in range(2)]

    def loss_fn(logits, b):
        nll = (token_nll(logits, b["labels"], VOCAB) * b["loss_mask"]).sum() / 128
        return nll, {"loss": nll.detach()}

    mover = TrainerOffload(eng.model, eng.optimizer) if offload else None
    losses, freed = [], 0
    for _ in range(2):
        losses.append(eng.train_step(mbs, loss_fn)["loss"])
        if mover is not None:
            before = torch.cuda.memory_allocated()
            mover.offload()
            freed = max(freed, before - torch.cuda.memory_allocated())
            assert freed >= mover.nbytes, (freed, mover.nbytes)
            mover.onload()
    return losses, {n: p.detach().cpu().clone() for n, p in params.items()}, freed


def offload_check() -> str:
    """Offload between steps frees what it moved and changes no bit; a one-line summary."""
    _, start, _ = _train(False, None)  # a start both runs share
    plain = _train(False, start)
    moved = _train(True, start)
    assert plain[0] == moved[0], (plain[0], moved[0])
    assert all(torch.equal(plain[1][n], moved[1][n]) for n in plain[1])
    summary = f"bitwise equal, {moved[2] / 2**20:.1f} MiB freed while offloaded"
    print(f"offload: {summary}", flush=True)
    return summary


def _weight_bytes(model: Path, itemsize: int = 2) -> int:
    """Bytes of the checkpoint's tensors at ``itemsize`` bytes each (bf16: 2)."""
    from safetensors import safe_open

    n = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n += torch.Size(st.get_slice(k).get_shape()).numel()
    return n * itemsize


def colocated_run(urls: list[str], model: Path, tmp: Path, bound: float) -> dict:
    """Release the engines' memory (KV cache and weights) and read the GPU's free memory
    rise, resume them (back as launched), then ``klear-rl --colocate --rollout-engine-memory
    launched`` for two steps in bf16 -- the one hand-over of run_rl_colocate.sh and
    tests/multiprocess/test_colocate.py: the trainer releases them before its model's build (issue 51):
    {"ok", "numbers", "history"}."""
    from megatron_klear.train.main import load_config
    from megatron_klear.rollout.orchestration.client import RolloutClient
    from megatron_klear.rollout.transport.probe import PROBE_METRIC
    from megatron_klear.train.rl import RLConfig, train

    client, tags = RolloutClient(urls), {"tags": ["kv_cache", "weights"]}
    weights = _weight_bytes(model)
    free_before = torch.cuda.mem_get_info()[0]
    client.post_all("/release_memory_occupation", tags)
    gained = torch.cuda.mem_get_info()[0] - free_before
    client.post_all("/resume_memory_occupation", tags)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                               for i in range(8)))
    hist = train(load_config(RLConfig, [
        "--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--colocate",
        "--rollout-urls", *urls, "--rollout-engine-memory", "launched", "--reward", "math",
        "--rollout-batch-size", "4",
        "--mini-batch-size", "2", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
        "--rollout-max-response-len", "16", "--no-dynamic-sampling", "--bf16",
        "--use-distributed-optimizer", "--train-iters", "2", "--probe-interval", "1",
        "--save", str(tmp / "ck"),
        "--no-progress-bar"]))
    probes = [m.get(PROBE_METRIC) for m in hist]
    ok = (gained >= 0.8 * weights and len(probes) == 2
          and all(p is not None and p < bound for p in probes))
    return {"ok": ok, "history": hist, "numbers": (
        f"release freed {gained / 2**20:.0f} MiB of GPU memory (weights {weights / 2**20:.0f} "
        f"MiB in bf16; need >= 80%); probe after each of {len(probes)} syncs "
        f"{[None if p is None else float(f'{p:.2e}') for p in probes]} (bound {bound})")}


def sglang_check(tmp: Path) -> None:
    from megatron_klear.models.tiny import save_tiny_hf_model
    from megatron_klear.rollout.engine.launcher import launch_sglang_servers

    model = save_tiny_hf_model(tmp / "hf", seed=0)
    with launch_sglang_servers(model, 1, mem_fraction=0.3, log_dir=tmp / "logs",
                               extra_args=["--enable-memory-saver", "--dtype",
                                           "bfloat16"]) as servers:
        got = colocated_run(servers.urls, model, tmp, PROBE_BOUND_BF16)
    print(f"sglang: {got['numbers']}", flush=True)
    assert got["ok"], got["history"]


def main() -> None:
    assert torch.cuda.is_available(), "needs a GPU"
    offload_check()
    if importlib.util.find_spec("sglang") and importlib.util.find_spec("torch_memory_saver"):
        sglang_check(Path(tempfile.mkdtemp(prefix="klear_colocate_")))
    else:
        print("sglang or torch_memory_saver not installed: the engine half is not checked",
              file=sys.stderr)
    print("COLOCATE SMOKE OK")


if __name__ == "__main__":
    main()
