"""On-policy distillation (issue 54): the served teacher's per-token log-probs, the trainer's
advantage against a hand computation from transformers (served teacher and Megatron teacher,
TP 1 and 2), a real ``klear-rl --use-opd`` run with each, and the up-front checks (exit 2
with one line, dry run and real run alike; the dry run's memory plan of the teacher).

The teacher is a tiny Qwen3 of another size (3 layers, a wider MLP) with the student's
tokenizer: served by an embedded server, or converted to a Megatron checkpoint. A second,
smaller teacher (the student's size, other weights) is the other teacher of the
several-teachers checks; one more has a tokenizer with one more token, another a larger
vocabulary. The top-k KL term is checked against a hand computation from transformers'
full student and teacher distributions at TP=2 (the vocabulary split over two ranks).
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from megatron_klear.train.metrics import read_metrics
from tests.dist import run_distributed
from tests.rollout_helpers import fixed_rollout_batch, load_reference, reference_logprobs

LAMBDA = 0.7
TOP_K = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Student, teacher (same tokenizer, other size), and a teacher whose tokenizer differs."""
    from megatron_klear.models.tiny import build_tokenizer, save_tiny_hf_model

    d = tmp_path_factory.mktemp("opd")
    student = save_tiny_hf_model(d / "student", seed=0, std=0.2)
    teacher = save_tiny_hf_model(d / "teacher", seed=7, std=0.2, num_hidden_layers=3,
                                 intermediate_size=192)
    small = save_tiny_hf_model(d / "small", seed=11, std=0.2)
    other = save_tiny_hf_model(d / "other", seed=7, std=0.2, with_tokenizer=False)
    tok = build_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(str(other))
    wide = save_tiny_hf_model(d / "wide_vocab", seed=7, vocab_size=400)
    return {"dir": d, "student": student, "teacher": teacher, "small": small, "other": other,
            "wide": wide}


def _convert(rank, world, hf, out):
    from megatron_klear.checkpoint.convert import convert_hf_to_megatron

    return str(convert_hf_to_megatron(hf, out, dtype="fp32"))


@pytest.fixture(scope="module")
def teacher_ckpt(models):
    """The teacher as a Megatron checkpoint (converted at TP 1; loads at any TP)."""
    (path,) = run_distributed(_convert, 1, str(models["teacher"]), str(models["dir"] / "t_mg"))
    return path


@pytest.fixture(scope="module")
def servers(models):
    """An embedded server over each teacher and one over the other-tokenizer teacher."""
    from megatron_klear.rollout.engine.launcher import launch_embedded_servers

    with launch_embedded_servers(models["teacher"]) as good, \
            launch_embedded_servers(models["small"]) as small, \
            launch_embedded_servers(models["other"]) as other:
        yield {"teacher": good.urls[0], "small": small.urls[0], "other": other.urls[0]}


def test_teacher_scores_response_tokens_as_transformers(models, servers):
    """The prefill-only request returns the teacher's log-prob of each response token (the
    entry of the prompt's last token skipped), equal to transformers' in fp32; the server's
    reply has SGLang's shape: one entry per token from logprob_start_len, the first None, of
    the unscaled logits whatever the request's temperature."""
    from megatron_klear.rollout.orchestration.client import RolloutClient
    from megatron_klear.rollout.orchestration.teacher import TeacherClient, prefill_request

    batch = fixed_rollout_batch([1.0, 0.0, 0.0, 1.0], seed=3)
    pairs = list(zip(batch.prompt_ids, batch.response_ids))
    p, r = pairs[0]
    (reply,) = RolloutClient([servers["teacher"]]).post_balanced("/generate",
                                                                 [prefill_request(p, r)])
    entries = reply["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == [p[-1], *r] and entries[0][0] is None
    assert reply["output_ids"] == []  # prefill only
    hot = {**prefill_request(p, r), "sampling_params": {"max_new_tokens": 0, "temperature": 0.5}}
    (reply_hot,) = RolloutClient([servers["teacher"]]).post_balanced("/generate", [hot])
    assert reply_hot["meta_info"]["input_token_logprobs"] == entries  # unscaled, as SGLang's
    got = TeacherClient([servers["teacher"]]).logprobs(pairs)
    hf, _ = load_reference(models["teacher"])
    for (p, r), lps in zip(pairs, got):
        want = reference_logprobs(hf, p + r)[-len(r):]
        assert len(lps) == len(r)
        torch.testing.assert_close(torch.tensor(lps), want, atol=1e-4, rtol=0)


def _hf_top_logprobs(model, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' top-k (log-probs, ids) of the distribution after each token but the last
    of ``ids``: [len - 1, k] each, sorted descending."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).topk(k, dim=-1)


def test_teacher_top_logprobs_match_transformers(models, servers):
    """top_logprobs_num k: the reply's input_top_logprobs has SGLang 0.5.23's shape (aligned
    with input_token_logprobs, the first None, k [logprob, id, None] per row sorted
    descending) and holds transformers' top-k of the teacher at each response position; the
    client returns them per response token."""
    from megatron_klear.rollout.orchestration.client import RolloutClient
    from megatron_klear.rollout.orchestration.teacher import TeacherClient, prefill_request

    batch = fixed_rollout_batch([1.0, 0.0, 0.0, 1.0], seed=3)
    pairs = list(zip(batch.prompt_ids, batch.response_ids))
    hf, _ = load_reference(models["teacher"])
    p, r = pairs[1]
    (reply,) = RolloutClient([servers["teacher"]]).post_balanced(
        "/generate", [prefill_request(p, r, top_k=TOP_K)])
    rows = reply["meta_info"]["input_top_logprobs"]
    assert rows[0] is None and len(rows) == len(reply["meta_info"]["input_token_logprobs"])
    assert reply["meta_info"]["output_top_logprobs"] == []  # no new tokens
    gen = {"input_ids": p, "return_logprob": True, "top_logprobs_num": TOP_K,
           "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}}
    (out,) = RolloutClient([servers["teacher"]]).post_balanced("/generate", [gen])
    assert out["meta_info"]["input_top_logprobs"] == []  # no logprob_start_len, as SGLang
    for (lp, tok, _), row in zip(out["meta_info"]["output_token_logprobs"],
                                 out["meta_info"]["output_top_logprobs"], strict=True):
        assert len(row) == TOP_K and row[0][0] >= lp  # the sampled token's distribution
        assert all(e[0] == pytest.approx(lp) for e in row if e[1] == tok)
    # a batch whose prompts ask different k (SGLang's per-prompt list): each row its own k
    (both,) = RolloutClient([servers["teacher"]]).post_balanced(
        "/generate", [{**gen, "input_ids": [p, p], "top_logprobs_num": [TOP_K, 2]}])
    assert [[len(row) for row in o["meta_info"]["output_top_logprobs"]] for o in both] == \
        [[TOP_K] * 3, [2] * 3]
    want_lp, want_ids = _hf_top_logprobs(hf, p + r, TOP_K)
    for row, lp, ids in zip(rows[1:], want_lp[len(p) - 1:], want_ids[len(p) - 1:]):
        assert [e[1] for e in row] == ids.tolist() and all(e[2] is None for e in row)
        assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
        torch.testing.assert_close(torch.tensor([e[0] for e in row]), lp, atol=1e-4, rtol=0)
    got = TeacherClient([servers["teacher"]], top_k=TOP_K).scores(pairs)
    for (p, r), scores in zip(pairs, got):
        want_lp, want_ids = _hf_top_logprobs(hf, p + r, TOP_K)
        assert scores.topk_ids == want_ids[-len(r):].tolist()
        torch.testing.assert_close(torch.tensor(scores.topk_logprobs), want_lp[-len(r):],
                                   atol=1e-4, rtol=0)


def test_each_sample_is_scored_by_its_prompts_teacher(models, servers):
    """Two named teachers of different sizes, a route from each prompt to one: every sample's
    teacher log-probs are transformers' of its own prompt's teacher (and not the other's);
    the per-teacher times are returned."""
    from megatron_klear.rollout.orchestration.teacher import TeacherClient
    from megatron_klear.samples import Sample

    batch = fixed_rollout_batch([1.0, 0.0, 0.0, 1.0], seed=5)
    routes = {0: "big", 1: "small"}  # prompt index -> teacher
    samples = [Sample(p, r, [0.0] * len(r), [1] * len(r), "stop", batch.prompt_index[i],
                      group=i // 2)
               for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids))]
    client = TeacherClient({"big": [servers["teacher"]], "small": [servers["small"]]},
                           routes.__getitem__)
    times = client.score(samples)
    assert set(times) == {"time/teacher_s", "time/teacher_big_s", "time/teacher_small_s"}
    hf = {"big": load_reference(models["teacher"])[0], "small": load_reference(models["small"])[0]}
    for s in samples:
        mine, theirs = routes[s.prompt_index], routes[1 - s.prompt_index]
        want = reference_logprobs(hf[mine], s.prompt_ids + s.response_ids)[-len(s.response_ids):]
        torch.testing.assert_close(torch.tensor(s.teacher_logprobs), want, atol=1e-4, rtol=0)
        other = reference_logprobs(hf[theirs], s.prompt_ids + s.response_ids)
        assert (torch.tensor(s.teacher_logprobs) - other[-len(s.response_ids):]).abs().max() > 0.05


def _topk_loss_terms(rank, world, student, batch):
    """The trainer's loss on a fixed batch at TP=``world`` from transformers' student logits
    split over the ranks' vocabulary shards: with the top-k KL (``--opd-top-k``) and without
    it (same advantages); returns the KL term's metrics and the gradient it adds to this
    rank's shard."""
    from megatron.core import parallel_state

    from megatron_klear.algo.rl_objective import PolicyLossFlags, policy_loss_fn
    from megatron_klear.data.microbatches import pad_microbatches

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)) - 1
    (mb,) = pad_microbatches(batch, list(range(len(batch))), len(batch), 0, seq_len)
    hf, _ = load_reference(student)
    with torch.no_grad():
        logits = hf(input_ids=mb["tokens"]).logits.float()
    vocab = logits.shape[-1]
    local = -(-vocab // world)
    padded = torch.nn.functional.pad(logits, (0, local * world - vocab), value=-30.0)
    shard = padded[..., rank * local:(rank + 1) * local]
    tokens = float(mb["loss_mask"].sum())
    out = {}
    for top_k in (TOP_K, 0):
        x = shard.clone().requires_grad_()
        fn = policy_loss_fn(PolicyLossFlags(), vocab, tokens, tokens,
                            opd_kl_coef=LAMBDA if top_k else 0.0, opd_top_k=top_k)
        b = {k: v.clone() if torch.is_tensor(v) else v for k, v in mb.items()}
        total, metrics = fn(x, b)
        total.backward()
        out[top_k] = (x.grad.clone(), metrics)
    grad = out[TOP_K][0] - out[0][0]
    m = out[TOP_K][1]
    return {"grad": grad, "opd_loss": float(m["train/opd_loss"]), "local": local,
            "reverse_kl": float(m["train/opd_reverse_kl"]),
            "teacher_logprob": float(m["train/opd_teacher_logprob"]), "mask": mb["loss_mask"]}


def test_topk_kl_term_matches_hand_computation_tp2(models, servers):
    """--opd-top-k K at TP=2: the loss's KL term (value, and the gradient it adds to each
    rank's vocabulary shard) equals a hand computation from transformers' full student and
    teacher distributions restricted to the teacher's top K and renormalised there: lambda x
    the token mean of sum_S q_s (log q_s - log q_t); a masked (tool) token adds nothing."""
    from megatron_klear.rollout.orchestration.teacher import TeacherClient

    batch = fixed_rollout_batch([1.0, 0.0, 0.0, 1.0], seed=3)
    batch.loss_masks = [[1] * len(r) for r in batch.response_ids]
    batch.loss_masks[1][2:4] = [0, 0]  # a tool response inside sample 1
    got = TeacherClient([servers["teacher"]], top_k=TOP_K).scores(
        list(zip(batch.prompt_ids, batch.response_ids)))
    batch.teacher_logprobs = [g.logprobs for g in got]
    batch.teacher_topk_ids = [g.topk_ids for g in got]
    batch.teacher_topk_logprobs = [g.topk_logprobs for g in got]
    ranks = run_distributed(_topk_loss_terms, 2, str(models["student"]), batch)
    hs, _ = load_reference(models["student"])
    ht, _ = load_reference(models["teacher"])
    mask = ranks[0]["mask"]
    seq_len = mask.shape[1]
    full = torch.zeros(len(batch), seq_len, hs.config.vocab_size, requires_grad=True)
    kl_sum = 0.0
    total = torch.zeros(())
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        with torch.no_grad():
            student = hs(input_ids=torch.tensor([p + r])).logits[0, :-1].float()
            teacher = torch.log_softmax(ht(input_ids=torch.tensor([p + r])).logits[0, :-1]
                                        .float(), dim=-1)
        cols = slice(len(p) - 1, len(p) - 1 + len(r))
        z = full[i, :len(p + r) - 1] + student  # the student's logits, differentiable
        ps = torch.softmax(z, dim=-1)[cols]
        top = teacher[cols].topk(TOP_K, dim=-1).indices  # the teacher's top K
        qs = ps.gather(-1, top) / ps.gather(-1, top).sum(-1, keepdim=True)
        pt = teacher[cols].exp().gather(-1, top)
        qt = pt / pt.sum(-1, keepdim=True)
        kl = (qs * (qs.log() - qt.log())).sum(-1) * mask[i, cols]
        total = total + kl.sum()
        kl_sum += float(kl.detach().sum())
    loss = LAMBDA * total / mask.sum()
    loss.backward()
    for rank, out in enumerate(ranks):
        assert out["opd_loss"] == pytest.approx(float(total.detach() / mask.sum()), abs=1e-5)
        assert out["reverse_kl"] == pytest.approx(kl_sum, abs=1e-4)
        lo, hi = rank * out["local"], min((rank + 1) * out["local"], full.shape[-1])
        torch.testing.assert_close(out["grad"][..., :hi - lo], full.grad[..., lo:hi],
                                   atol=1e-6, rtol=1e-4)
        assert not out["grad"][..., hi - lo:].any()  # rank 1's padding column
    assert kl_sum > 0.05 and full.grad.abs().max() > 1e-4  # the term is not noise


def _opd_batch():
    """The fixed batch of the advantage tests: one masked tool span, engine log-probs."""
    batch = fixed_rollout_batch([1.0, 0.0, 0.0, 1.0], seed=3)
    batch.loss_masks = [[1] * len(r) for r in batch.response_ids]
    batch.loss_masks[1][2:4] = [0, 0]  # a tool response inside sample 1: no advantage
    batch.rollout_logprobs = [[-0.1 * (j + 1) for j in range(len(r))]
                              for r in batch.response_ids]
    return batch


def _advantage_step(rank, world, student, url, teacher_ckpt):
    """The trainer's per-token advantages on a fixed batch at TP ``world``: old log-probs from
    the Megatron student (the trainer's recompute), teacher log-probs from the served teacher
    at ``url`` (if any; then plain, and under a rollout correction) and from the Megatron
    teacher of ``teacher_ckpt`` (the trainer's ``teacher_logprobs``), then
    ``token_advantages`` as the loss calls it."""
    import copy

    from megatron_klear.algo.rl_objective import old_logprobs, token_advantages
    from megatron_klear.algo.rollout_correction import RolloutCorrection
    from megatron_klear.checkpoint.convert import SafetensorsReader
    from megatron_klear.checkpoint.hf_bridge import load_hf_weights
    from megatron_klear.data.microbatches import pad_microbatches
    from megatron_klear.models.qwen3 import load_hf_config, qwen3_config_from_hf
    from megatron_klear.rollout.orchestration.teacher import TeacherClient
    from megatron_klear.train.engine import build_engine
    from megatron_klear.train.frozen_policy import FrozenModel
    from megatron_klear.train.rl import RLConfig, teacher_logprobs

    batch = _opd_batch()
    cfg = RLConfig(hf_checkpoint=str(student), prompt_data="unused", mini_batch_size=2,
                   rollout_batch_size=2, n_samples_per_prompt=2, micro_batch_size=4,
                   tensor_model_parallel_size=world)
    arch = qwen3_config_from_hf(load_hf_config(student))
    engine = build_engine(cfg, arch, with_optimizer=False)
    load_hf_weights(engine.model, arch, SafetensorsReader(student))
    seq_len = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)) - 1
    out = {"batch": batch}
    if url:
        served = copy.copy(batch)
        served.teacher_logprobs = TeacherClient([url]).logprobs(
            list(zip(batch.prompt_ids, batch.response_ids)))
        (mb,) = mbs = pad_microbatches(served, list(range(4)), 4, 0, seq_len)
        old_logprobs(engine, mbs, arch.vocab_size, 1.0)
        out["plain"], _ = token_advantages(mb, None, LAMBDA)
        out["corrected"], _ = token_advantages(mb, RolloutCorrection("tis", "token", 1.5),
                                               LAMBDA)
        out["old"] = mb["old_logprobs"]
    teacher = FrozenModel(cfg, teacher_ckpt, "--opd-teacher-load")
    (mb,) = mbs = pad_microbatches(batch, list(range(4)), 4, 0, seq_len)  # no served field
    old_logprobs(engine, mbs, arch.vocab_size, 1.0)
    teacher_logprobs(teacher, mbs, 1.0)
    out["megatron"], _ = token_advantages(mb, None, LAMBDA)
    params = [p for chunk in teacher.engine.model for p in chunk.parameters()]
    out["teacher_layers"] = teacher.engine.arch.num_layers
    out["teacher_offloaded"] = all(p.untyped_storage().nbytes() == 0 for p in params)
    out["teacher_host_bytes"] = teacher.nbytes
    out["teacher_no_grads"] = not any(p.requires_grad or p.grad is not None for p in params)
    return out


def _hand(models, batch):
    """Per sample: its response columns, and A_task - lambda (student - teacher) x mask by hand
    from transformers' student and teacher log-probs (with both log-probs and the mask)."""
    hs, _ = load_reference(models["student"])
    ht, _ = load_reference(models["teacher"])
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        cols = slice(len(p) - 1, len(p) - 1 + len(r))
        student = reference_logprobs(hs, p + r)[-len(r):]
        teacher = reference_logprobs(ht, p + r)[-len(r):]
        mask = torch.tensor(batch.loss_masks[i], dtype=torch.float32)
        want = batch.advantages[i] - LAMBDA * (student - teacher) * mask
        yield i, cols, want, student, teacher, mask


def _check_megatron_teacher(out, models, batch):
    for i, cols, want, *_ in _hand(models, batch):
        torch.testing.assert_close(out["megatron"][i, cols], want, atol=2e-4, rtol=0)
    assert out["teacher_layers"] == 3  # the teacher's own size, not the student's 2
    assert out["teacher_offloaded"] and out["teacher_host_bytes"] > 0  # on the host after use
    assert out["teacher_no_grads"]


def test_trainer_advantage_matches_hand_computation(models, servers, teacher_ckpt):
    """A_t = A_task - lambda (log pi_student - log pi_teacher) per trained token, by hand from
    transformers' student and teacher log-probs, with the served teacher and with the
    Megatron teacher (its checkpoint; another size; offloaded to the host after its forward);
    a masked (tool) token keeps A_task only; under a rollout correction the student's
    log-prob is the engine's, times the TIS weight min(exp(old - rollout), cap)."""
    (out,) = run_distributed(_advantage_step, 1, str(models["student"]), servers["teacher"],
                             teacher_ckpt)
    batch = out["batch"]
    _check_megatron_teacher(out, models, batch)
    for i, cols, want, student, teacher, mask in _hand(models, batch):
        task = batch.advantages[i]
        torch.testing.assert_close(out["plain"][i, cols], want, atol=2e-4, rtol=0)
        engine = torch.tensor(batch.rollout_logprobs[i])
        weight = torch.clamp(torch.exp(out["old"][i, cols] - engine), max=1.5)
        want_corr = (task - LAMBDA * (engine - teacher) * mask) * weight
        torch.testing.assert_close(out["corrected"][i, cols] * mask, want_corr * mask,
                                   atol=2e-4, rtol=0)
        assert (student - teacher).abs().max() > 0.05  # the teacher's term is not noise
    assert float(out["plain"][1, len(batch.prompt_ids[1]) + 1]) == pytest.approx(
        batch.advantages[1])  # the masked tool token: A_task only


def test_megatron_teacher_advantage_at_tp2(models, teacher_ckpt):
    """The Megatron teacher at TP 2 (student and teacher split over two ranks, the teacher's
    TP-1 checkpoint resharded): the same hand-computed advantages."""
    out = run_distributed(_advantage_step, 2, str(models["student"]), None, teacher_ckpt)[0]
    _check_megatron_teacher(out, models, out["batch"])


def _rl_train(rank, world, argv):
    from megatron_klear.train.main import load_config
    from megatron_klear.train.rl import RLConfig, train

    return train(load_config(RLConfig, argv))


@pytest.mark.parametrize("mode", ["served_two_teachers_top_k", "megatron"])
def test_pure_distillation_run_logs_the_metrics(models, servers, teacher_ckpt, tmp_path, mode):
    """``klear-rl --use-opd --reward none``, with two served teachers chosen by a prompt field
    and the top-k KL, or with the Megatron teacher (``--opd-type megatron``): every reward 0,
    so no group has a reward spread, yet none is dropped (each carries the teacher's signal);
    the whole signal comes from the teachers; the step logs reverse KL, the teacher's mean
    log-prob and its time (and each served teacher's). With ``--export-hf-interval 1`` the model
    after step 1 is exported beside the final one (the quickstart's --distill curve): a third
    model, neither the start nor the end."""
    served = mode != "megatron"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": "x",
                                           "teacher": ("big", "small")[i % 2]}) + "\n"
                               for i in range(8)))
    teacher = (["--opd-teacher-urls", f"big={servers['teacher']}", f"small={servers['small']}",
                "--opd-teacher-key", "teacher", "--opd-top-k", str(TOP_K)] if served else
               ["--opd-type", "megatron", "--opd-teacher-load", teacher_ckpt])
    argv = ["--hf-checkpoint", str(models["student"]), "--prompt-data", str(prompts),
            "--save", str(tmp_path / "ck"), "--reward", "none", "--use-opd", *teacher,
            "--opd-kl-coef", str(LAMBDA),
            "--rollout-batch-size", "2", "--mini-batch-size", "2", "--n-samples-per-prompt",
            "2", "--micro-batch-size", "4", "--rollout-max-response-len", "8", "--lr", "1e-3",
            "--train-iters", "2", "--seed", "3", "--no-progress-bar",
            "--export-hf", str(tmp_path / "hf"), "--export-hf-interval", "1"]
    hist = run_distributed(_rl_train, 1, argv, timeout=400)[0]
    assert len(hist) == 2
    for m in hist:
        assert m["rollout/zero_adv_frac"] == 0 and m["rollout/groups_kept"] == 2
        assert m["train/opd_teacher_share"] == pytest.approx(1.0)
        assert m["train/opd_teacher_logprob"] < 0 and math.isfinite(m["train/opd_reverse_kl"])
        assert m["time/teacher_s"] > 0
        assert not served or m["train/opd_loss"] > 0  # the top-k KL term
    if served:  # each teacher's time, and both served (the seed's prompts)
        for name in ("big", "small"):
            assert all(m[f"time/teacher_{name}_s"] >= 0 for m in hist)
            assert any(m[f"time/teacher_{name}_s"] > 0 for m in hist)
    logged = read_metrics(tmp_path / "ck" / "metrics.jsonl")
    assert all("train/opd_reverse_kl" in m for m in logged)
    assert sorted(p.name for p in tmp_path.glob("hf*")) == ["hf", "hf_step1"]
    start, mid, end = (load_file(next(d.glob("*.safetensors")))["model.norm.weight"] for d in
                       (models["student"], tmp_path / "hf_step1", tmp_path / "hf"))
    assert not torch.equal(mid, start) and not torch.equal(mid, end)


def _exits_2_with_one_line(argv: list[str], wants: str, capsys) -> None:
    from megatron_klear.train import rl

    for extra in (["--dry-run"], []):
        with pytest.raises(SystemExit) as exit_info:
            rl.main([*argv, *extra])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exit_info.value.code == 2 and len(lines) == 1 and wants in lines[0], lines


def test_bad_teachers_and_flags_exit_2_with_one_line(models, servers, teacher_ckpt, capsys,
                                                     monkeypatch):
    """A teacher with another tokenizer (named with the student), a URL that does not
    answer, a checkpoint that does not exist or is no checkpoint, a teacher checkpoint of
    another vocabulary or tokenizer (both named), and flags without --use-opd or their
    teacher: exit 2 with one line in the dry run and the real run; the good teachers pass the
    dry run (the controls), whose memory plan holds the Megatron teacher."""
    from megatron_klear.distributed import free_port
    from megatron_klear.train import rl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prompts = models["dir"] / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    base = ["--hf-checkpoint", str(models["student"]), "--prompt-data", str(prompts)]
    opd = [*base, "--use-opd", "--opd-teacher-urls"]
    dead = f"http://127.0.0.1:{free_port()}"
    missing = models["dir"] / "no_teacher"
    routed_prompts, unrouted = models["dir"] / "routed.jsonl", models["dir"] / "unrouted.jsonl"
    routed_prompts.write_text("".join(json.dumps({"prompt": "a", "answer": "b", "teacher": t})
                                      + "\n" for t in ("math", "chemistry", "code")))
    unrouted.write_text(prompts.read_text())

    def routed(path):
        return ["--hf-checkpoint", str(models["student"]), "--prompt-data", str(path),
                "--use-opd", "--opd-teacher-urls", f"math={servers['teacher']}",
                f"code={servers['small']}", "--opd-teacher-key", "teacher"]
    mg = [*base, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load"]
    for argv, wants in [
            ([*opd, servers["other"]], f"serves {models['other']}"),
            ([*opd, servers["other"]], f"--hf-checkpoint {models['student']}"),
            ([*opd, dead], f"--opd-teacher-urls {dead} does not answer"),
            ([*base, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(missing)],
             f"--opd-teacher-load {missing}: no such directory"),
            ([*mg, str(models["dir"])], f"--opd-teacher-load {models['dir']}: neither a "
             "Hugging Face model dir"),
            ([*mg, str(models["wide"])], f"padded vocabulary 512 (vocab_size 400) is not the "
             f"student's (--hf-checkpoint {models['student']}: 128, vocab_size 103)"),
            ([*mg, str(models["other"])], f"its tokenizer {models['other']} (104 tokens vs "
             f"103; 1 entries differ) is not the student's --hf-checkpoint {models['student']}"),
            ([*base, "--opd-kl-coef", "0.5"], "--opd-kl-coef applies with --use-opd"),
            ([*base, "--reward", "none"], "--reward none"),
            ([*base, "--use-opd"], "--opd-teacher-urls"),
            ([*opd, servers["teacher"], "--opd-teacher-temperature", "0.6"],
             "--opd-teacher-temperature 0.6"),
            ([*opd, servers["teacher"], "--opd-kl-coef", "0"], "--opd-kl-coef must be > 0"),
            ([*opd, servers["teacher"], "--loss-type", "gspo"], "--loss-type gspo"),
            ([*opd, servers["teacher"], "--opd-top-k", "-1"], "--opd-top-k must be >= 0"),
            ([*base, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load",
              str(models["teacher"]), "--opd-top-k", "4"], "--opd-top-k needs a served"),
            ([*opd, servers["teacher"], "--opd-teacher-key", "teacher"],
             "--opd-teacher-key picks a teacher by name"),
            ([*opd, f"a={servers['teacher']}", f"b={servers['small']}"],
             "add --opd-teacher-key FIELD"),
            ([*opd, f"a={servers['teacher']}", servers["small"]], "mixes plain URLs"),
            ([*opd, f"a={servers['teacher']}", f"b={servers['other']}", "--opd-teacher-key",
              "teacher"], f"serves {models['other']}"),
            (routed(routed_prompts), f"--opd-teacher-key teacher: {routed_prompts}:2 has "
             "'chemistry', not one of the teachers of --opd-teacher-urls (math, code)"),
            (routed(unrouted), f"--opd-teacher-key teacher: {unrouted}:1 has None")]:
        _exits_2_with_one_line(argv, wants, capsys)
    rl.main([*opd, servers["teacher"], "--dry-run"])
    assert '"dry_run"' in capsys.readouterr().out
    routed_prompts.write_text("".join(json.dumps({"prompt": "a", "answer": "b", "teacher": t})
                                      + "\n" for t in ("math", "code")))
    rl.main([*routed(routed_prompts), "--opd-top-k", "4", "--dry-run"])  # two teachers pass
    assert '"dry_run"' in capsys.readouterr().out
    rl.main([*mg, teacher_ckpt, "--dry-run"])
    memory = json.loads(capsys.readouterr().out)["dry_run"]["memory"]
    assert memory["opd_teacher"]["model"] == "3 layers, hidden 64", memory


def test_killed_gppo_opd_run_resumes_bitwise(models, servers, tmp_path):
    """GPPO + OPD with a served teacher, SIGKILLed after its second step and resumed: every
    step's loss, reverse KL, rewards and prompts equal an uninterrupted run's; some step mixes
    both signals (the teacher's share strictly between 0 and 1)."""
    import os
    import subprocess
    import sys

    from tests.kill_points import kill_when_logged

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {i}.",
                                           "answer": "x"}) + "\n" for i in range(12)))
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def cli(save):
        return [sys.executable, "-m", "megatron_klear.train.rl", "--hf-checkpoint",
                str(models["student"]), "--prompt-data", str(prompts), "--save", str(save),
                "--reward", "tests.reward_plugins:parity_reward", "--use-opd",
                "--opd-teacher-urls", servers["teacher"], "--opd-kl-coef", "0.5",
                "--rollout-batch-size", "2", "--mini-batch-size", "2",
                "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
                "--rollout-max-response-len", "8", "--lr", "1e-3", "--train-iters", "4",
                "--seed", "3", "--no-progress-bar", "--save-interval", "1"]

    ref_run = subprocess.Popen(cli(tmp_path / "ref"), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cli(tmp_path / "run"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    kill_when_logged(proc, metrics, 2, group=True, timeout=400)
    assert ref_run.wait(timeout=400) == 0, ref_run.stderr.read()[-3000:]
    subprocess.run(cli(tmp_path / "run"), check=True, env=env, capture_output=True)
    ref = {r["step"]: r for r in read_metrics(tmp_path / "ref" / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics(metrics)}
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        for key in ("train/loss", "train/opd_reverse_kl", "train/opd_teacher_logprob",
                    "rollout/reward_mean", "data/prompt_indices"):
            assert got[step][key] == ref[step][key], (step, key)
    assert any(0 < r["train/opd_teacher_share"] < 1 for r in ref.values())
    assert all(r["time/teacher_s"] > 0 for r in ref.values())
