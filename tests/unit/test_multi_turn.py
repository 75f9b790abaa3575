"""Multi-turn tool rollouts (rollout/orchestration/multi_turn.py) with a scripted engine and Qwen3's real
tokenizer and chat template (tests/qwen3_files.py; the tool-less fixture
tests/data/qwen3_like_chat_template.jinja shows a template without tool support): the ids of a 3-turn tool trajectory are the ids the template renders for the whole
conversation, the loss mask covers exactly the model's own tokens, and hostile calls are
contained, answered with errors, scored, and the rollout goes on."""

import time
from pathlib import Path

import pytest

from megatron_klear.data.microbatches import pad_microbatches
from megatron_klear.data.prompts import PromptSample
from megatron_klear.models.tiny import build_tokenizer
from megatron_klear.rewards.sandbox import SandboxLimits
from megatron_klear.rollout.orchestration.client import Generation, SamplingParams
from megatron_klear.rollout.orchestration.multi_turn import MultiTurnConfig, ToolTemplateError, \
    generate_tool_turns, sampled_turn_end, tool_response_ids
from megatron_klear.rollout.orchestration.pipeline import RolloutContext, score_samples
from megatron_klear.rollout.orchestration.tools import PYTHON_SCHEMA, python_tool
from megatron_klear.samples import RolloutBatch, Sample
from megatron_klear.train.rl_data import rollout_stats
from tests.qwen3_files import qwen3_tokenizer

PLAIN = Path(__file__).parents[1] / "data" / "qwen3_like_chat_template.jinja"


def call(code: str) -> str:
    return ('<tool_call>\n{"name": "python", "arguments": {"code": "' + code +
            '"}}\n</tool_call>')


class ScriptedEngine:
    """Stands in for RolloutClient.generate: the turn-k text of the prompt's script (turn k:
    the number of generation prompts in the input), tokenized, with made-up log-probs; it
    records every request's input ids."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tok, self.scripts, self.requests = tokenizer, scripts, []

    def generate(self, prompt_ids, params, seeds=None, max_new_tokens=None):
        out = []
        for ids, limit in zip(prompt_ids, max_new_tokens or [params.max_new_tokens] * len(
                prompt_ids)):
            self.requests.append(list(ids))
            text = self.tok.decode(ids)
            script = next(v for k, v in self.scripts.items() if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            got = self.tok(script[turn], add_special_tokens=False)["input_ids"][:limit]
            reason = "stop" if got and got[-1] == self.tok.eos_token_id else "length"
            out.append([Generation(script[turn], got, [-(k + 1) / 64 for k in range(len(got))],
                                   reason, None, len(ids)) for _ in range(params.n)])
        return out


def score_with_tool_errors(ctx, samples):
    """A user score stage by import path that sees whole trajectories: the math reward of
    the final answer, minus 0.25 per failed tool call."""
    for s in score_samples(ctx, samples):
        s.reward -= 0.25 * s.trajectory.tool_errors
    return samples


def _tokenizer(template: Path | None = None):
    """Qwen3's real tokenizer and template; with ``template``, the tiny character tokenizer
    with that fixture template instead."""
    if template is None:
        return qwen3_tokenizer()
    tok = build_tokenizer()
    tok.chat_template = template.read_text()
    return tok


def _ctx(tok, engine, n=1, **limits):
    cfg = MultiTurnConfig({"python": python_tool(SandboxLimits(wall_s=2.0, output_bytes=4096))},
                          tool_wall_s=2.0, **{"max_response_tokens": 2000, **limits})
    return RolloutContext(engine, tok, SamplingParams(n=n, max_new_tokens=400), "math", 1.0,
                          multi_turn=cfg)


def _model_token_mask(tok, text: str, turns: list[str]) -> list[int]:
    """1 on the tokens of the turn texts, found in order in ``text`` (an independent mask
    from character offsets)."""
    spans, at = [], 0
    for t in turns:
        at = text.index(t, at)
        spans.append((at, at + len(t)))
        at += len(t)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(any(s <= a and b <= e for s, e in spans)) for a, b in enc["offset_mapping"]]


def test_three_turn_trajectory_is_the_template_rendering_of_the_conversation():
    tok = _tokenizer()
    end = "<|im_end|>"
    turns = [call("print(6 * 7)") + end,
             call("print(1 + 1)") + "\n" + call("print(2 ** 10)") + end,   # two calls at once
             "<think>\nchecked\n</think>\n\nThe answer is \\boxed{42}." + end]
    engine = ScriptedEngine(tok, {"Compute": turns})
    prompt = [{"role": "system", "content": "Use tools."},
              {"role": "user", "content": "Compute 6*7."}]
    (s,) = generate_tool_turns(_ctx(tok, engine), [PromptSample(0, prompt, "42")], [0])

    def fn(code):
        return {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}

    conversation = prompt + [
        {"role": "assistant", "content": "", "tool_calls": [fn("print(6 * 7)")]},
        {"role": "tool", "content": "42\n"},
        {"role": "assistant", "content": "", "tool_calls": [fn("print(1 + 1)"),
                                                            fn("print(2 ** 10)")]},
        {"role": "tool", "content": "2\n"}, {"role": "tool", "content": "1024\n"},
        {"role": "assistant", "content": "<think>\nchecked\n</think>\n\nThe answer is "
                                         "\\boxed{42}."}]
    full = tok.apply_chat_template(conversation, tools=[PYTHON_SCHEMA], tokenize=False)
    assert full.endswith(end + "\n") and full.count("<|im_start|>user\n<tool_response>") == 2
    text = full[:-1]                          # the trajectory ends at the model's end of turn
    want = tok(text, add_special_tokens=False)["input_ids"]
    assert s.prompt_ids + s.response_ids == want
    mask = _model_token_mask(tok, text, turns)
    assert [0] * len(s.prompt_ids) + s.loss_mask == mask
    assert sum(s.loss_mask) == sum(len(tok(t)["input_ids"]) for t in turns)
    lp = [x for x, m in zip(s.rollout_logprobs, s.loss_mask) if m]
    assert lp == [-(k + 1) / 64 for t in turns for k in range(len(tok(t)["input_ids"]))]
    assert all(x == 0.0 for x, m in zip(s.rollout_logprobs, s.loss_mask) if not m)
    # token in, token out: turn k's request is exactly the ids before its turn
    assert [len(r) for r in engine.requests] == [len(s.prompt_ids) + a
                                                 for a, _ in s.trajectory.turn_spans]
    assert all(want[:len(r)] == r for r in engine.requests)
    t = s.trajectory
    assert (t.calls, t.tool_errors, t.stop_reason, len(t.turn_spans)) == (3, 0, "answer", 3)
    assert t.tool_outputs == ["42\n", "2\n", "1024\n"]
    assert s.response_text == t.answer and t.answer.endswith("\\boxed{42}.")
    assert score_samples(_ctx(tok, engine), [s])[0].reward == 1.0   # math on the final answer
    # the trainer's labels: loss on exactly the model's tokens, their rollout log-probs
    batch = RolloutBatch.from_samples([s], 1, 1.0, {})
    (mb,) = pad_microbatches(batch, [0], 1, 0, len(want) - 1)
    assert mb["loss_mask"][0].tolist() == [float(m) for m in mask[1:]]
    assert mb["rollout_logprobs"][0].tolist() == pytest.approx(
        [0.0] * (len(s.prompt_ids) - 1) + s.rollout_logprobs)


def test_hostile_calls_are_answered_with_errors_and_the_rollout_goes_on():
    tok = _tokenizer()
    end = "<|im_end|>"
    bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n" \
           "        pass"
    turns = ['<tool_call>\n{"name": "python", "arguments": {"code": \n</tool_call>' + end,
             '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>' + end,
             call(bomb) + "\n" + call("print(\\\"x\\\" * 10**7)") + end,
             "The answer is \\boxed{7}." + end]
    engine = ScriptedEngine(tok, {"Hostile": turns})
    ctx = _ctx(tok, engine, max_turns=5, max_tool_response_tokens=64)
    (s,) = generate_tool_turns(ctx, [PromptSample(0, [{"role": "user", "content": "Hostile"}],
                                                  "7")], [0])
    t = s.trajectory
    assert t.stop_reason == "answer" and len(t.turn_spans) == 4
    assert "not valid JSON" in t.tool_outputs[0] and "unknown tool 'rm_rf'" in t.tool_outputs[1]
    assert "[timed out" in t.tool_outputs[2] and "more tokens cut" in t.tool_outputs[3]
    assert t.calls == 4 and t.tool_errors == 2   # a bomb and a flood are outputs, not errors
    assert score_samples(ctx, [s])[0].reward == 1.0
    assert ctx.stats["multi_turn/tool_calls"] == 4 and ctx.stats["multi_turn/tool_tokens"] \
        == len(s.loss_mask) - sum(s.loss_mask)


def test_hostile_user_tools_and_a_deeply_nested_call_inside_a_rollout():
    """A user tool that hangs, one that raises, one that floods, and a call nested past
    json's recursion limit (which crashed the step): each answered, the rollout scores."""
    from megatron_klear.rollout.orchestration.tools import Tool

    def schema(name):
        return {"type": "function", "function": {"name": name, "parameters": {}}}

    def boom(arguments):
        raise RuntimeError("tool bug")

    tools = {"hang": Tool("hang", schema("hang"), lambda a: time.sleep(30)),
             "boom": Tool("boom", schema("boom"), boom),
             "flood": Tool("flood", schema("flood"), lambda a: "z" * 5_000_000)}
    tok, end = _tokenizer(), "<|im_end|>"

    def named(name):
        return '<tool_call>\n{"name": "' + name + '", "arguments": {}}\n</tool_call>'

    turns = ["<tool_call>" + "[" * 3000 + "</tool_call>" + end,
             named("hang") + "\n" + named("boom") + "\n" + named("flood") + end,
             "So \\boxed{5}." + end]
    engine = ScriptedEngine(tok, {"Tools": turns})
    cfg = MultiTurnConfig(tools, tool_wall_s=0.3, max_response_tokens=5000,
                          max_tool_response_tokens=100)
    ctx = RolloutContext(engine, tok, SamplingParams(n=1, max_new_tokens=4000), "math", 1.0,
                         multi_turn=cfg)
    t0 = time.monotonic()
    (s,) = generate_tool_turns(ctx, [PromptSample(0, [{"role": "user", "content": "Tools"}],
                                                  "5")], [0])
    t = s.trajectory
    assert time.monotonic() - t0 < 10 and t.stop_reason == "answer" and t.calls == 4
    assert "nests JSON too deeply" in t.tool_outputs[0]
    assert "timed out" in t.tool_outputs[1] and "RuntimeError: tool bug" in t.tool_outputs[2]
    assert "more tokens cut" in t.tool_outputs[3] and len(t.tool_outputs[3]) < 300
    assert t.tool_errors == 3 and score_samples(ctx, [s])[0].reward == 1.0


def test_calls_past_the_per_turn_cap_are_answered_not_run():
    """--max-tool-calls 2: a turn of five calls runs two (the tool counts its runs); the
    other three get an error response each, so every call has its response."""
    from megatron_klear.rollout.orchestration.tools import Tool

    runs = []
    count = Tool("count", {"type": "function", "function": {"name": "count", "parameters": {}}},
                 lambda a: runs.append(1) or str(len(runs)))
    tok, end = _tokenizer(), "<|im_end|>"
    named = '<tool_call>\n{"name": "count", "arguments": {}}\n</tool_call>'
    engine = ScriptedEngine(tok, {"Count": ["\n".join([named] * 5) + end, "\\boxed{2}" + end]})
    cfg = MultiTurnConfig({"count": count}, max_response_tokens=5000, max_tool_calls=2)
    ctx = RolloutContext(engine, tok, SamplingParams(n=1, max_new_tokens=4000), "math", 1.0,
                         multi_turn=cfg)
    (s,) = generate_tool_turns(ctx, [PromptSample(0, [{"role": "user", "content": "Count"}],
                                                  "2")], [0])
    t = s.trajectory
    assert len(runs) == 2 and t.stop_reason == "answer" and t.calls == 5
    assert sorted(t.tool_outputs[:2]) == ["1", "2"] and t.tool_errors == 3  # run at once
    assert t.tool_outputs[2:] == ["error: not run: at most 2 tool calls per turn"] * 3
    assert [m["role"] for m in t.messages].count("tool") == 5


@pytest.mark.parametrize("limit, reason, turns_taken", [
    ({"max_turns": 2}, "max_turns", 2),
    # Qwen3's tokens: the call turn is 22, the tool response before the next turn 14
    ({"max_response_tokens": 30}, "max_response_tokens", 1),
])
def test_limits_end_the_trajectory_with_their_reason(limit, reason, turns_taken):
    tok = _tokenizer()
    loop = [call("print(1)") + "<|im_end|>"] * 4
    ctx = _ctx(tok, ScriptedEngine(tok, {"Loop": loop}), n=2, **limit)
    samples = generate_tool_turns(ctx, [PromptSample(0, [{"role": "user", "content": "Loop"}],
                                                    "1")], [0])
    assert [x.trajectory.stop_reason for x in samples] == [reason] * 2
    assert [len(x.trajectory.turn_spans) for x in samples] == [turns_taken] * 2
    assert all(len(x.response_ids) < 2000 for x in samples)
    assert [x.truncated for x in samples] == [reason == "max_response_tokens"] * 2
    key = "turn_limit_hits" if reason == "max_turns" else "token_limit_hits"
    assert ctx.stats[f"multi_turn/{key}"] == 2
    means = rollout_stats(ctx, samples, 1, 0, 1)     # the dashboard's per-trajectory means
    assert means[f"multi_turn/{key}"] == 1.0 and "multi_turn/samples" not in means
    assert means["multi_turn/tool_calls"] == turns_taken - (reason == "max_turns")


def test_a_turn_cut_by_the_token_limit_ends_with_length():
    tok = _tokenizer()
    ctx = _ctx(tok, ScriptedEngine(tok, {"Long": [" x" * 500]}))
    (s,) = generate_tool_turns(ctx, [PromptSample(0, [{"role": "user", "content": "Long"}],
                                                  "1")], [0])
    assert s.trajectory.stop_reason == "length" and s.truncated and len(s.response_ids) == 400


def test_a_template_without_tool_support_is_refused_by_name():
    """Negative control of the template delta: the tool-less fixture drops role tool; the
    pre-flight (check_tool_template) refuses it before a run."""
    from megatron_klear.rollout.orchestration.multi_turn import check_tool_template

    cfg = _ctx(_tokenizer(), None).multi_turn
    check_tool_template(_tokenizer(), cfg)
    check_tool_template(build_tokenizer(), cfg)   # plain ChatML renders role tool as a turn
    with pytest.raises(ToolTemplateError, match="tool support"):
        check_tool_template(_tokenizer(PLAIN), cfg)
    tok = _tokenizer(PLAIN)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": call("1")}]
    with pytest.raises(ToolTemplateError, match="tool support|ends an assistant turn"):
        tool_response_ids(tok, msgs, [{"role": "tool", "content": "1"}], "<|im_end|>", None)
    qwen3 = _tokenizer()
    good = tool_response_ids(qwen3, msgs, [{"role": "tool", "content": "1"}], "<|im_end|>", None)
    assert qwen3.decode(good) == "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>" \
        "<|im_end|>\n<|im_start|>assistant\n"


def test_tools_flags_and_collect_batch_with_tools():
    """--tools builds the MultiTurnConfig (bad entries refused by flag); collect_batch with it
    generates multi-turn samples, scores their final answers and keeps their loss masks."""
    from megatron_klear.config import ConfigError, parse_config
    from megatron_klear.train.rl_config import RLConfig
    from megatron_klear.train.rl_data import DynamicSamplingFlags, PromptStream, collect_batch

    required = ["--hf-checkpoint", "x", "--prompt-data", "x"]
    cfg = parse_config(RLConfig, required + ["--tools", "python", "tests.unit.test_tools:add",
                                             "--max-turns", "3", "--tool-timeout", "2"])
    mt = cfg.multi_turn_config(cfg.rollout_max_response_len)
    assert sorted(mt.tools) == ["add", "python"] and mt.max_turns == 3 and mt.tool_wall_s == 2
    assert parse_config(RLConfig, required).multi_turn_config(256) is None
    for extra, msg in [(["--tools", "nope:fn"], "--tools nope:fn"),
                       (["--tools", "tests.unit.test_tools:not_a_tool"], "schema"),
                       (["--tools", "python", "python"], "two tools are named 'python'"),
                       (["--tools", "python", "--tool-parser", "nope"], "--tool-parser"),
                       (["--tools", "python", "--max-turns", "0"], "--max-turns")]:
        with pytest.raises(ConfigError, match=msg):
            parse_config(RLConfig, required + extra)
    tok = _tokenizer()
    engine = ScriptedEngine(tok, {"Q": [call("print(3)") + "<|im_end|>",
                                       "It is \\boxed{3}.<|im_end|>"]})
    prompts = [PromptSample(0, [{"role": "user", "content": "Q"}], "3")]
    batch = collect_batch(engine, tok, PromptStream(prompts, 0), 1,
                          SamplingParams(n=2, max_new_tokens=400), "math",
                          DynamicSamplingFlags(dynamic_sampling=False), multi_turn=mt)
    assert batch.rewards == [1.0, 1.0] and len(batch.loss_masks) == 2
    assert all(0 < sum(m) < len(m) for m in batch.loss_masks)
    assert batch.stats["multi_turn/tool_calls"] == 1.0 and batch.stats["multi_turn/turns"] == 2
    # rewards that see the trajectory: a score stage reading Sample.trajectory
    engine = ScriptedEngine(tok, {"Q": ['<tool_call>\n{"name": "nope"}\n</tool_call><|im_end|>',
                                       "It is \\boxed{3}.<|im_end|>"]})
    batch = collect_batch(engine, tok, PromptStream(prompts, 0), 1,
                          SamplingParams(n=2, max_new_tokens=400), "math",
                          DynamicSamplingFlags(dynamic_sampling=False), multi_turn=mt,
                          stages=["score=tests.unit.test_multi_turn:score_with_tool_errors"])
    assert batch.rewards == [0.75, 0.75]


def test_prompts_with_their_own_tools_and_fixed_arguments(tmp_path):
    """verl's multi-turn layout: a prompt's ``tools`` subset goes into its system block, a
    call of another tool is unknown to it, and ``extra_info.tools_kwargs`` (create_kwargs)
    fixes arguments the model cannot override."""
    import json

    from megatron_klear.data.prompts import DataError, load_prompt_dataset
    from megatron_klear.rollout.orchestration.tools import load_tool

    rec = {"prompt": [{"role": "user", "content": "Q"}], "reward_model": {"ground_truth": "3"},
           "tools": ["add"], "extra_info": {"tools_kwargs": {"add": {"create_kwargs": {"b": 1}}}}}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    (p,) = load_prompt_dataset(path, answer_key="reward_model.ground_truth")
    assert p.meta["tools"] == ["add"] and p.meta["tools_kwargs"] == {"add": {"b": 1}}
    tok = _tokenizer()
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 100}}\n</tool_call>'
    engine = ScriptedEngine(tok, {"Q": [add + "\n" + call("print(1)") + "<|im_end|>",
                                       "\\boxed{3}<|im_end|>"]})
    ctx = _ctx(tok, engine)
    ctx.multi_turn.tools["add"] = load_tool("tests.unit.test_tools:add")
    (s,) = generate_tool_turns(ctx, [p], [0])
    assert '"name": "add"' in s.prompt_text and '"name": "python"' not in s.prompt_text
    assert s.trajectory.tool_outputs[0] == "3"             # 2 + the prompt's fixed b = 1
    assert "unknown tool 'python'; the tools are add" in s.trajectory.tool_outputs[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rec, "tools": "add"}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl:1: field 'tools' must be a list"):
        load_prompt_dataset(bad, answer_key="reward_model.ground_truth")
    p.meta["tools"] = ["search"]
    with pytest.raises(ValueError, match=r"p.jsonl:1: the prompt lists tools \['search'\]"):
        generate_tool_turns(ctx, [p], [0])


def test_loss_aggregation_counts_only_the_trained_tokens(monkeypatch):
    """aggregation_totals (--loss-aggregation's divisors) counts a multi-turn sample's own
    tokens, not its tool tokens; whole responses count every token as before."""
    from megatron_klear.algo import rl_objective

    monkeypatch.setattr(rl_objective.parallel_state, "get_data_parallel_world_size", lambda: 1)
    own = Sample([1], [5, 6, 7, 8, 9], [-.1] * 5, [1, 0, 0, 1, 1], "stop", 0, 0, reward=1.0)
    whole = Sample([1], [5, 6], [-.1] * 2, [1, 1], "stop", 0, 0, reward=0.0)
    masked = rl_objective.aggregation_totals(RolloutBatch.from_samples([own, whole], 2, 1.0, {}),
                                        [0, 1])
    assert masked[:2] == (5.0, 3.0)        # 3 + 2 trained tokens; the positive's 3
    own.loss_mask = [1] * 5
    plain = rl_objective.aggregation_totals(RolloutBatch.from_samples([own, whole], 2, 1.0, {}),
                                       [0, 1])
    assert plain[:2] == (7.0, 5.0)


def test_a_turn_stopped_on_a_token_that_spells_the_turn_ends_start_is_content():
    """A stop list may end a turn on '<' (real SGLang did, in the interop test with every even
    id a stop token): that '<' is the model's text, not the template's '<|im_end|>', and the
    tool responses follow the turn the template closes after it. The turn-end token itself
    is still recognised."""
    tok = _tokenizer()
    turn_end = "<|im_end|>\n"
    lt = tok("<", add_special_tokens=False)["input_ids"]
    im_end = tok("<|im_end|>", add_special_tokens=False)["input_ids"]
    assert len(lt) == len(im_end) == 1 and lt != im_end
    assert sampled_turn_end(tok, [5] + lt, "stop", turn_end) == ""
    assert sampled_turn_end(tok, [5] + im_end, "stop", turn_end) == "<|im_end|>"
    assert sampled_turn_end(tok, [5] + im_end, "length", turn_end) == ""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "p<"}]
    glue = tool_response_ids(tok, msgs, [{"role": "tool", "content": "1"}], "", None)
    assert tok.decode(glue, skip_special_tokens=False).startswith("<|im_end|>")
    with pytest.raises(ToolTemplateError, match="spans the end of the assistant turn"):
        tool_response_ids(tok, msgs[:1] + [{"role": "assistant", "content": "p"}],
                          [{"role": "tool", "content": "1"}], "<", None)
