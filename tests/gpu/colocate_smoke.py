"""1-GPU smoke test of colocated mode (issue 31). NEVER RUN YET: no GPU was lent while writing it.

    python3 tests/gpu/colocate_smoke.py            (or tests/gpu/run_gpu_checks.sh)

1. Trainer offload on the GPU: a tiny model (bf16, distributed optimizer) trains two steps
   with :class:`TrainerOffload` offloading between them; the GPU memory allocated while
   offloaded drops by at least the bytes it moved (pinned host buffers), and the losses and
   the final parameters equal a run without offload bitwise (the CPU twin:
   tests/test_offload.py).
2. Where SGLang with torch_memory_saver is installed: one SGLang server on the same GPU
   (``--enable-memory-saver``, ``--mem-fraction-static 0.3``), released (KV cache, then
   weights): the GPU's free memory rises; then ``klear-rl --colocate`` against it for two
   steps: CUDA IPC tensor handles, the probe below 1e-3 after every sync (the CPU twins:
   tests/test_colocate.py and tests/interop/). Prints ``COLOCATE SMOKE OK``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

VOCAB = 512


def _train(offload: bool, start: dict | None) -> tuple[list[float], dict, int]:
    from megatron_klear.config import TrainConfig
    from megatron_klear.models.qwen3 import qwen3_config_from_hf
    from megatron_klear.models.tiny import tiny_qwen3_config
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.offload import TrainerOffload
    from megatron_klear.train.token_loss import token_nll

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


def offload_check() -> None:
    _, start, _ = _train(False, None)  # a start both runs share
    plain = _train(False, start)
    moved = _train(True, start)
    assert plain[0] == moved[0], (plain[0], moved[0])
    assert all(torch.equal(plain[1][n], moved[1][n]) for n in plain[1])
    print(f"offload: bitwise equal, {moved[2] / 2**20:.1f} MiB freed while offloaded",
          flush=True)


def sglang_check(tmp: Path) -> None:
    from megatron_klear.config import parse_config
    from megatron_klear.models.tiny import save_tiny_hf_model
    from megatron_klear.rollout.client import RolloutClient
    from megatron_klear.rollout.launcher import launch_sglang_servers
    from megatron_klear.train.rl import RLConfig, train

    model = save_tiny_hf_model(tmp / "hf", seed=0, std=0.2)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x"}) + "\n"
                               for i in range(8)))
    with launch_sglang_servers(model, 1, mem_fraction=0.3, log_dir=tmp / "logs",
                               extra_args=["--enable-memory-saver"]) as servers:
        free_before = torch.cuda.mem_get_info()[0]
        RolloutClient(servers.urls).post_all("/release_memory_occupation",
                                             {"tags": ["kv_cache", "weights"]})
        gained = torch.cuda.mem_get_info()[0] - free_before
        assert gained > 0.2 * torch.cuda.mem_get_info()[1], f"release freed {gained} bytes"
        hist = train(parse_config(RLConfig, [
            "--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--colocate",
            "--rollout-urls", servers.urls[0], "--reward", "math", "--rollout-batch-size", "4",
            "--mini-batch-size", "2", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
            "--rollout-max-response-len", "16", "--no-dynamic-sampling", "--bf16",
            "--use-distributed-optimizer", "--train-iters", "2", "--save", str(tmp / "ck"),
            "--no-progress-bar"]))
    assert all(m["weight_sync/probe_max_abs_diff"] < 1e-3 for m in hist), hist
    print(f"sglang: released {gained / 2**30:.1f} GiB; colocated probe "
          f"{[m['weight_sync/probe_max_abs_diff'] for m in hist]}", flush=True)


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
