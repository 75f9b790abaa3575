"""Shared pieces of the rollout tests: a tiny HF Qwen3 checkpoint, an independent reference, and
the command line of a trainer's child process (orphan checks).

The reference recomputes logprobs with transformers' Qwen3ForCausalLM over the whole sequence
in one forward pass (no KV cache, no padding, no batching), i.e. not the server's code path.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import torch


def make_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 checkpoint with large random weights (std 0.2: mapping errors show)."""
    from megatron_klear.models.tiny import save_tiny_hf_model

    return save_tiny_hf_model(out_dir, seed=seed, std=0.2)


def load_reference(model_dir: Path):
    """transformers' Qwen3ForCausalLM in fp32 eager attention, and its tokenizer."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


@torch.no_grad()
def reference_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of token j given tokens < j, for j = 1..L-1: shape [L-1]."""
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float() / temperature, dim=-1)
    return logp.gather(1, x[0, 1:, None])[:, 0]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Argmax continuation by full re-forward at every step (no cache)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def cmdline(p: psutil.Process) -> str:
    """A process's command line, or "" for a short-lived child that is already gone."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def fixed_rollout_batch(rewards: list[float], seed: int):
    """A RolloutBatch of two prompts x two samples with random ids (prompt / response lengths
    (5, 4), (5, 6), (7, 3), (7, 5)), the given rewards and their group advantages: the fixed
    batch of the loss tests."""
    from megatron_klear.algo.advantages import group_advantages
    from megatron_klear.samples import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    b = RolloutBatch(group_size=2)
    b.rewards = list(rewards)
    for i, (lp, lr) in enumerate([(5, 4), (5, 6), (7, 3), (7, 5)]):
        b.prompt_ids.append(torch.randint(0, 100, (lp,), generator=g).tolist()
                            if i % 2 == 0 else b.prompt_ids[-1])
        b.response_ids.append(torch.randint(0, 100, (lr,), generator=g).tolist())
        b.rollout_logprobs.append([0.0] * lr)
        b.prompt_index.append(i // 2)
        b.truncated.append(False)
    b.advantages = group_advantages(torch.tensor(b.rewards), 2).tolist()
    return b
