"""On-policy distillation's served teacher against real SGLang 0.5.23 (issue 54): the
prefill-only request scores the response tokens as transformers does, within the weight-sync
probe's tolerance, its top-k (``top_logprobs_num``) are transformers' top-k, and klear-rl's
up-front teacher check accepts the server."""

import json

import pytest
import torch

from tests.interop.conftest import start_sglang
from tests.interop.test_sglang_interop import PROBE_TOL
from tests.rollout_helpers import load_reference, reference_logprobs


@pytest.fixture(scope="module")
def teacher(sglang_model, tmp_path_factory):
    """One SGLang server over the tiny model, playing the teacher."""
    with start_sglang(sglang_model, 1, tmp_path_factory.mktemp("opd_logs")) as s:
        yield s.urls[0]


def test_sglang_teacher_logprobs_match_transformers(teacher, sglang_model):
    """Each response token's log-prob from SGLang's input_token_logprobs (logprob_start_len
    = len(prompt) - 1, the first entry None) equals transformers' fp32 one; a second pass
    (served from the prefix cache) gives the same numbers."""
    from megatron_klear.rollout.orchestration.client import RolloutClient
    from megatron_klear.rollout.orchestration.teacher import TeacherClient, prefill_request

    model, tok = load_reference(sglang_model)
    g = torch.Generator().manual_seed(0)
    prompts = [tok.encode(f"What is {i}+3?") for i in range(3)]
    pairs = [(p, torch.randint(20, 90, (5 + i,), generator=g).tolist())
             for i, p in enumerate(prompts)]
    (reply,) = RolloutClient([teacher], request_timeout_s=120).post_balanced(
        "/generate", [prefill_request(*pairs[0])])
    entries = reply["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and [e[1] for e in entries] == [pairs[0][0][-1], *pairs[0][1]]
    client = TeacherClient([teacher], request_timeout_s=120)
    first = client.logprobs(pairs)
    for (p, r), lps in zip(pairs, first):
        want = reference_logprobs(model, p + r)[-len(r):].float()
        torch.testing.assert_close(torch.tensor(lps), want, atol=PROBE_TOL, rtol=0)
    again = client.logprobs(pairs)
    assert [x for lps in again for x in lps] == pytest.approx([x for lps in first for x in lps],
                                                              abs=PROBE_TOL)


def test_sglang_teacher_top_logprobs_match_transformers(teacher, sglang_model):
    """top_logprobs_num k: SGLang's input_top_logprobs (the first row None, k [logprob, id,
    None] per row, sorted descending) hold transformers' k most likely tokens at each response
    position and their log-probs, within the probe's tolerance; the client reads them per
    response token."""
    from megatron_klear.rollout.orchestration.client import RolloutClient
    from megatron_klear.rollout.orchestration.teacher import TeacherClient, prefill_request

    k = 3
    model, tok = load_reference(sglang_model)
    g = torch.Generator().manual_seed(1)
    pairs = [(tok.encode(f"Name {i} colours."), torch.randint(20, 90, (4 + i,),
                                                               generator=g).tolist())
             for i in range(2)]
    (reply,) = RolloutClient([teacher], request_timeout_s=120).post_balanced(
        "/generate", [prefill_request(*pairs[0], top_k=k)])
    rows = reply["meta_info"]["input_top_logprobs"]
    assert rows[0] is None and len(rows) == len(pairs[0][1]) + 1
    assert all(len(row) == k and row[0][2] is None for row in rows[1:])
    assert all([e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
               for row in rows[1:])
    gen = {"input_ids": pairs[0][0], "return_logprob": True, "top_logprobs_num": k,
           "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    (out,) = RolloutClient([teacher], request_timeout_s=120).post_balanced("/generate", [gen])
    assert out["meta_info"]["input_top_logprobs"] == []  # as the embedded server answers
    assert [len(row) for row in out["meta_info"]["output_top_logprobs"]] == [k, k]
    for (p, r), got in zip(pairs, TeacherClient([teacher], top_k=k,
                                                request_timeout_s=120).scores(pairs)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, :-1].float()
        want = torch.log_softmax(logits, dim=-1)[-len(r):].topk(k, dim=-1)
        assert got.topk_ids == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(got.topk_logprobs), want.values,
                                   atol=PROBE_TOL, rtol=0)


def test_dry_run_accepts_the_sglang_teacher(teacher, sglang_model, tmp_path, capsys,
                                            monkeypatch):
    """--use-opd's up-front check reads SGLang's /model_info and finds the student's
    tokenizer there: the dry run plans (exit 0)."""
    from megatron_klear.train import rl

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    rl.main(["--hf-checkpoint", str(sglang_model), "--prompt-data", str(prompts),
             "--use-opd", "--opd-teacher-urls", teacher, "--dry-run"])
    assert '"dry_run"' in capsys.readouterr().out
