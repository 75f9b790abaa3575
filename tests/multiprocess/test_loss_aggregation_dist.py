"""``--loss-aggregation token-mean-micro`` through the trainer's loss on real megatron ranks.

One 2-rank launch runs two layouts of the same mini-batch (4 responses, two micro-batches of
2 rows): TP=2 (DP=1, both micro-batches on each rank) and TP=1 x DP=2 (one micro-batch per
rank, gradients averaged by DDP). Klear's official actor gives both the same loss (``m01 * 2/4 + m23 * 2/4`` on one rank = ``(m01 * 2/2 +
m23 * 2/2) / 2`` over two), so each layout's summed loss share and its global gradient norm
must equal a float64 re-implementation of the official arithmetic on transformers' Qwen3
log-probs (tests/unit/test_losses_exact.py ``official_micro_loss`` / ``official_general_beta``,
dual clip c = 10), differentiated by torch autograd on the HF model.
"""

import pytest
import torch

from tests.dist import run_distributed
from tests.rollout_helpers import fixed_rollout_batch

MINI = 4   # responses per mini-batch (2 prompts x 2 samples)


def _batch():
    # +-1 with a format penalty: positives 0 and 2
    return fixed_rollout_batch([1.0, -1.0, 1.0, -0.5], seed=3)


def _old_shift(mb, k):
    """Deterministic old log-prob offsets (+-0.5 or 0): every GPPO case appears."""
    g = torch.Generator().manual_seed(10 + k)
    return (torch.randint(0, 3, mb["labels"].shape, generator=g) - 1) * 0.5


def _reference(hf_dir, batch, mbs):
    """Official loss (float64) and the HF model's gradient norm."""
    from transformers import Qwen3ForCausalLM

    from tests.unit.test_losses_exact import official_general_beta, official_micro_loss

    hf = Qwen3ForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").float()
    total = 0.0
    for k, mb in enumerate(mbs):
        logits = hf(input_ids=mb["tokens"]).logits.double()
        logp = torch.log_softmax(logits, -1).gather(-1, mb["labels"][..., None])[..., 0]
        old = logp.detach() + _old_shift(mb, k)
        pg = official_general_beta(old, logp, mb["advantages"].double(), 0.2, 0.28, 10.0, 1.0,
                                   1.0)
        rows = [2 * k, 2 * k + 1]
        reward = torch.tensor([batch.rewards[i] for i in rows], dtype=torch.float64)
        total = total + official_micro_loss(pg, logp, mb["loss_mask"].long(), reward, 1.0, 0.1,
                                            MINI)
    total.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters()
                          if p.grad is not None))
    return float(total), float(norm)


def _layouts(rank, world, hf_dir):
    from megatron.core import parallel_state

    from megatron_klear.checkpoint.convert import SafetensorsReader
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.distributed import initialize_parallel
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.rl import RLConfig
    from megatron_klear.algo.rl_objective import PolicyLossFlags, aggregation_totals, \
        annotate_aggregation, policy_loss_fn
    from megatron_klear.data.microbatches import pad_microbatches

    batch = _batch()
    arch = qwen3_config_from_hf(load_hf_config(hf_dir))
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)) - 1
    all_mbs = pad_microbatches(batch, list(range(MINI)), 2, 0, seq_len)
    ref_loss, ref_norm = _reference(hf_dir, batch, all_mbs) if rank == 0 else (None, None)
    out = {"ref_loss": ref_loss, "ref_norm": ref_norm}
    for name, tp, pp in (("tp2", 2, 1), ("dp2", 1, 1)):
        initialize_parallel(tp, pp, seed=0)
        cfg = RLConfig(hf_checkpoint=str(hf_dir), prompt_data="unused",
                       tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       mini_batch_size=2, rollout_batch_size=2, n_samples_per_prompt=2,
                       micro_batch_size=2, dual_clip=10.0, loss_aggregation="token-mean-micro",
                       lr=0.0, clip_grad=1e6)   # clip_grad > 0: megatron reports the norm
        engine = build_engine(cfg, arch)
        load_hf_weights(engine.model, arch, SafetensorsReader(hf_dir))
        dp = parallel_state.get_data_parallel_world_size()
        ks = [parallel_state.get_data_parallel_rank()] if dp == 2 else [0, 1]
        mbs = pad_microbatches(batch, [r for k in ks for r in (2 * k, 2 * k + 1)], 2, 0,
                               seq_len)
        annotate_aggregation(mbs)
        engine.forward_only(mbs, _fill_old(arch.vocab_size, ks))   # old = current + offsets
        m = engine.train_step(mbs, policy_loss_fn(cfg.part(PolicyLossFlags), arch.vocab_size,
                                                  0.0, 0.0, aggregation_totals(batch, range(MINI)),
                                                  temperature=cfg.rollout_temperature,
                                                  backend=cfg.loss_backend))
        out[name] = {"loss": m.get("train/loss"), "norm": m["grad_norm"]}
        parallel_state.destroy_model_parallel()
    return out


def _fill_old(vocab_size, ks):
    """A forward-only loss that stores old log-probs = current + _old_shift (and entropy)."""
    from megatron_klear.algo.rl_objective import fill_logprobs

    seen = iter(ks)

    def fn(logits, b):
        fill_logprobs(logits, b, vocab_size, 1.0, "auto")
        b["old_logprobs"] = b["old_logprobs"] + _old_shift(b, next(seen))
        return logits.new_zeros(()), {}

    return fn


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from megatron_klear.models.tiny import save_tiny_hf_model

    return save_tiny_hf_model(tmp_path_factory.mktemp("agg") / "hf", seed=0, std=0.2)


def test_token_mean_micro_matches_official_arithmetic_tp2_dp2(hf_model):
    results = run_distributed(_layouts, 2, str(hf_model))
    ref_loss, ref_norm = results[0]["ref_loss"], results[0]["ref_norm"]
    assert ref_norm > 1e-2
    for rank, r in enumerate(results):
        for name in ("tp2", "dp2"):
            got = r[name]
            assert abs(got["loss"] - ref_loss) < 2e-5, (rank, name, got, ref_loss)
            assert abs(got["norm"] - ref_norm) < 1e-4 * ref_norm, (rank, name, got, ref_norm)
