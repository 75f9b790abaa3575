"""Multi-turn tool rollouts against the embedded server over real HTTP: over several turns,
the Sample's ids and rollout log-probs are, bit for bit, the output ids and log-probs the
server returned for each turn, each turn's request carried exactly the Sample's ids before it
(input_ids, no text), and an independent transformers forward over the whole trajectory
gives the same log-probs at the model's tokens (so the glue the engine saw is the glue that
is trained)."""

import torch

from megatron_klear.data.prompts import PromptSample
from megatron_klear.models.tiny import save_tiny_hf_model
from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams
from megatron_klear.rollout.engine.launcher import launch_embedded_servers
from megatron_klear.rollout.orchestration.multi_turn import MultiTurnConfig, generate_tool_turns
from megatron_klear.rollout.orchestration.pipeline import RolloutContext
from megatron_klear.rollout.orchestration.tool_calls import ParsedTurn, ToolCall, get_tool_parser
from megatron_klear.rollout.orchestration.tools import load_tool, tool
from tests.qwen3_files import qwen3_chat_template
from tests.rollout_helpers import load_reference, reference_logprobs

HERE = "tests.multiprocess.test_multi_turn_server"


def every_turn_calls(text: str) -> ParsedTurn:
    """A user parser by import path: a random model never writes a call, so every turn is
    one call of ``count`` (the turn limit ends the trajectory)."""
    return ParsedTurn("", [ToolCall("count", {"text": text})])


@tool({"type": "function", "function": {"name": "count", "description": "characters",
                                        "parameters": {"type": "object", "properties": {
                                            "text": {"type": "string"}}}}})
def count(arguments):
    return f"{len(arguments['text'])} characters"


class RecordingClient(RolloutClient):
    """The real client, keeping every /generate request and the server's raw reply."""

    def __init__(self, urls):
        super().__init__(urls, request_timeout_s=120, max_retries=0)
        self.exchanges = []

    async def _post_balanced(self, session, path, payload, check=None):
        reply = await super()._post_balanced(session, path, payload, check)
        if path == "/generate":
            self.exchanges += list(zip(payload["input_ids"], reply))
        return reply


def long_context_model(out_dir):
    """The tiny Qwen3 with 2048 positions (the tools' system block is long in characters)."""
    return save_tiny_hf_model(out_dir, seed=3, std=0.2, max_position_embeddings=2048)


def check_engine_trajectories(model_dir, urls, temperature: float, atol: float) -> None:
    """Multi-turn rollouts of 2 prompts x 2 samples on the servers at ``urls``: every turn's
    ids and log-probs are the server's reply bit for bit, each request carried the Sample's
    exact ids, the mask is the sampled turns, and transformers agrees within ``atol``."""
    model, tok = load_reference(model_dir)
    tok.chat_template = qwen3_chat_template()  # Qwen3's own, on the tiny model's vocabulary
    # turns end after a few tokens; a first turn that never stops (0.5^16) would have no tool turn
    stops = [i for i in range(len(tok)) if i % 2 == 0]
    params = SamplingParams(n=2, max_new_tokens=16, temperature=temperature,
                            stop_token_ids=stops)
    cfg = MultiTurnConfig({"count": load_tool(f"{HERE}:count")},
                          parser=get_tool_parser(f"{HERE}:every_turn_calls"), max_turns=3,
                          max_response_tokens=400)
    prompts = [PromptSample(i, [{"role": "user", "content": q}], None)
               for i, q in enumerate(["What is 6*7?", "Sort [3, 1, 2]."])]
    client = RecordingClient(urls)
    samples = generate_tool_turns(RolloutContext(client, tok, params, "math", 1.0,
                                                 multi_turn=cfg), prompts, [5, 6])
    assert len(samples) == 4 and len(client.exchanges) == sum(
        len(s.trajectory.turn_spans) for s in samples)
    assert sum(len(s.trajectory.turn_spans) for s in samples) >= 8    # several turns each
    left = list(client.exchanges)   # each exchange accounts for exactly one sampled turn
    for s in samples:
        assert s.trajectory.stop_reason in ("max_turns", "length")
        for a, b in s.trajectory.turn_spans:
            sent = s.prompt_ids + s.response_ids[:a]
            (k,) = [k for k, (ids, o) in enumerate(left)   # a prompt's n samples share turn 0
                    if ids == sent and o["output_ids"] == s.response_ids[a:b]][:1]
            out = left.pop(k)[1]
            assert [x[0] for x in out["meta_info"]["output_token_logprobs"]] == \
                s.rollout_logprobs[a:b]
        mask = s.loss_mask
        assert mask == [int(any(a <= k < b for a, b in s.trajectory.turn_spans))
                        for k in range(len(mask))]
        assert 0 < sum(mask) < len(mask) and all(
            lp == 0.0 for lp, m in zip(s.rollout_logprobs, mask) if not m)
        ref = reference_logprobs(model, s.prompt_ids + s.response_ids, temperature)[
            len(s.prompt_ids) - 1:]
        own = torch.tensor([m == 1 for m in mask])
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs)[own], ref[own].float(),
                                   atol=atol, rtol=0)
        assert "<tool_response>" in tok.decode(s.response_ids)
    assert not left


def test_ids_and_logprobs_are_the_engines_over_several_turns(tmp_path):
    model_dir = long_context_model(tmp_path / "tiny")
    with launch_embedded_servers(model_dir, 1, log_dir=tmp_path / "logs") as servers:
        check_engine_trajectories(model_dir, servers.urls, 0.9, 1e-4)
