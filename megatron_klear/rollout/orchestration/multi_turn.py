"""Multi-turn tool rollouts: a generate stage of the rollout pipeline that lets the model call
tools across turns, token in and token out.

Per prompt, ``n`` trajectories run turn by turn, all active ones batched per turn:

1. the engine samples an assistant turn from the exact ids so far (``input_ids``, never
   text), until it ends its turn (stop) or a token limit;
2. the turn's text (decoded only to read it) is parsed for tool calls in the model's format
   (rollout/orchestration/tool_calls.py); no call: the trajectory ends with the answer;
3. the calls run (rollout/orchestration/tools.py; errors, timeouts and floods become messages) and their
   responses, as role ``tool`` messages, are appended as the chat template renders them:
   the conversation with the new messages is rendered, and the tokens after the
   assistant's end of turn are taken (:func:`tool_response_ids`, which checks that the
   template leaves the tokens before them unchanged);
4. until the model answers without a call, or a limit ends it: ``max_turns``, the response
   token budget ``max_response_tokens`` (sampled + tool + template tokens), a turn cut by the
   engine's token limit. The reason is ``Sample.trajectory.stop_reason``.

The sample's ``response_ids`` hold exactly the sampled ids with their rollout log-probs
(``loss_mask`` 1) and, between turns, the tool responses and template glue (``loss_mask``
0, log-prob 0). Nothing sampled is decoded and re-encoded. Per-tool limits: wall time
``tool_wall_s`` and ``max_tool_response_tokens`` tokens per tool response. A prompt may
restrict its tools and fix some of their arguments (``meta["tools"]``,
``meta["tools_kwargs"]``: data/prompts.py ``tool_fields``).
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

from megatron_klear.data.prompts import PromptSample, chat_template_kwargs
from megatron_klear.rollout.orchestration.client import SamplingParams, sample_seed
from megatron_klear.rollout.orchestration.pipeline import RolloutContext, limit_prompt, \
    register_stage
from megatron_klear.rollout.orchestration.tool_calls import (ParsedTurn, ToolCall, ToolParser,
                                                             parse_hermes)
from megatron_klear.rollout.orchestration.tools import Tool, ToolResult, run_tool_call
from megatron_klear.samples import Sample

__all__ = ["MultiTurnConfig", "Trajectory", "generate_tool_turns", "tool_response_ids",
           "sampled_turn_end", "check_tool_template", "turn_request_seed", "ToolTemplateError",
           "STOP_REASONS"]

# why a trajectory ended: the model answered without a call; the turn limit; the response
# token budget; the engine cut a turn at its token limit ("length") or aborted it
STOP_REASONS = ("answer", "max_turns", "max_response_tokens", "length", "abort")


class ToolTemplateError(ValueError):
    """The chat template cannot append tool responses without changing earlier tokens."""


@dataclass(frozen=True)
class MultiTurnConfig:
    """The tools and limits of multi-turn rollouts (``RolloutContext.multi_turn``)."""

    tools: dict[str, Tool]
    parser: ToolParser = parse_hermes
    max_turns: int = 4                   # assistant turns per trajectory
    max_response_tokens: int = 1024      # sampled + tool + template tokens after the prompt
    max_tool_response_tokens: int = 256  # per tool response (cut, with a note)
    tool_wall_s: float = 5.0             # per call
    tool_output_chars: int = 16384       # cut before tokenizing
    tool_workers: int = 4                # calls run at once
    max_tool_calls: int = 8              # calls run per assistant turn; later ones: an error

    def prompt_tools(self, prompt: PromptSample) -> dict[str, Tool]:
        """The tools ``prompt`` may call: its ``meta["tools"]`` names (data/prompts.py
        ``tool_fields``), or all; ValueError names a prompt listing an unknown tool."""
        names = prompt.meta.get("tools")
        if names is None:
            return self.tools
        unknown = [n for n in names if n not in self.tools]
        if unknown:
            where = f"{prompt.meta.get('file', 'prompt')}:{prompt.meta.get('line', prompt.index)}"
            raise ValueError(f"{where}: the prompt lists tools {unknown} that --tools does not "
                             f"give (given: {sorted(self.tools)})")
        return {n: self.tools[n] for n in names}


@dataclass
class Trajectory:
    """What happened in a multi-turn sample's turns (``Sample.trajectory``)."""

    messages: list[dict]                 # the whole conversation: prompt, assistant, tool
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # sampled ids per turn
    tool_outputs: list[str] = field(default_factory=list)
    calls: int = 0
    tool_errors: int = 0
    stop_reason: str = ""

    @property
    def answer(self) -> str:
        """The content of the last assistant turn (what math/code rewards score)."""
        turns = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return turns[-1] if turns else ""


def _turn_seed(prompt_seed: int, j: int, turn: int) -> int:
    """The client's per-prompt seed of turn ``turn`` of sample ``j`` (each an n=1 prompt)."""
    return sample_seed(sample_seed(prompt_seed, j), turn)


def turn_request_seed(prompt_seed: int, j: int, turn: int) -> int:
    """The ``sampling_seed`` sent for turn ``turn`` of sample ``j`` of a prompt seeded
    ``prompt_seed`` (distinct per sample and turn, reproducible)."""
    return sample_seed(_turn_seed(prompt_seed, j, turn), 0)


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None,
            generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt,
                                         **chat_template_kwargs(tokenizer))


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_MARK = f"[[klear:turn-end-{secrets.token_hex(8)}]]"


def tool_response_ids(tokenizer: Any, messages: list[dict], tool_messages: list[dict],
                      sampled_end: str, tools: list[dict] | None) -> list[int]:
    """The ids that follow an assistant turn (the last of ``messages``) when
    ``tool_messages`` answer it: the rest of the template's end of that turn after the text
    ``sampled_end`` the model ended it with, the tool responses as the template renders them
    (Qwen3: one user turn of ``<tool_response>`` blocks) and the next generation prompt.

    They are the token delta of the conversation's rendering after the point where the
    sampled turn ends; ToolTemplateError when the template does not end the turn with
    ``sampled_end``, leaves a tool response out, or when tokenizing the whole rendering
    changes the tokens before that point."""
    last = messages[-1]
    marked = messages[:-1] + [dict(last, content=last["content"] + _MARK)]
    text = _render(tokenizer, marked + tool_messages, tools, True)
    if text.count(_MARK) != 1:
        raise ToolTemplateError("the chat template drops or repeats the assistant turn when "
                                "tool messages follow it; use a template with tool support")
    cut = text.index(_MARK)
    text = text.replace(_MARK, "")
    if not text.startswith(sampled_end, cut):
        raise ToolTemplateError(f"the chat template ends an assistant turn with "
                                f"{text[cut:cut + 20]!r}, not with the model's {sampled_end!r}")
    cut += len(sampled_end)
    at = cut
    for m in tool_messages:
        at = text.find(m["content"], at)
        if at < 0:
            raise ToolTemplateError("the chat template does not render role 'tool' messages "
                                    "after an assistant turn; use a template with tool support "
                                    "(--chat-template FILE)")
        at += len(m["content"])
    head, full = _encode(tokenizer, text[:cut]), _encode(tokenizer, text)
    if full[:len(head)] != head:
        raise ToolTemplateError("tokenizing the tool responses changes the tokens before them "
                                f"(a token spans the end of the assistant turn at {cut})")
    return full[len(head):]


def sampled_turn_end(tokenizer: Any, ids: list[int], finish_reason: str, turn_end: str) -> str:
    """The text of a turn's last sampled token when that token is the one the template's turn
    end ``turn_end`` starts with (Qwen3: the stop token ``<|im_end|>``), else "". Compared as
    token ids: a content token that merely spells the start of ``turn_end`` (a ``<`` that a
    stop list ends the turn on) is the model's text, and the template closes the turn after
    it."""
    if finish_reason != "stop" or not ids or _encode(tokenizer, turn_end)[:1] != ids[-1:]:
        return ""
    return tokenizer.decode(ids[-1:], skip_special_tokens=False)


def _turn_end_text(tokenizer: Any, tools: list[dict] | None) -> str:
    """The text the template closes an assistant turn with (Qwen3: '<|im_end|>\\n')."""
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
    text = _render(tokenizer, probe, tools, False)
    if _MARK not in text:
        raise ToolTemplateError("the chat template drops the assistant's content; use a "
                                "template with tool support (--chat-template FILE)")
    return text[text.index(_MARK) + len(_MARK):]


def check_tool_template(tokenizer: Any, cfg: MultiTurnConfig) -> None:
    """Refuse, before a run builds anything, a chat template that cannot carry ``cfg``'s
    tool turns: a probe conversation (a question, an assistant turn with a call ended by the
    tokenizer's EOS, one tool response) must give its glue as :func:`tool_response_ids`
    takes it. Raises ToolTemplateError saying why."""
    schemas = [t.schema for t in cfg.tools.values()] or None
    turn_end = _turn_end_text(tokenizer, schemas)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    name = next(iter(cfg.tools), "tool")
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": '<tool_call>\n{"name": "' + name +
                 '", "arguments": {}}\n</tool_call>'}]
    tool_response_ids(tokenizer, messages, [{"role": "tool", "content": "1"}],
                      sampled_turn_end(tokenizer, eos, "stop", turn_end), schemas)


@dataclass
class _Rollout:
    """One trajectory in flight."""

    sample: Sample
    seed: int                       # its prompt's seed
    j: int                          # its index among the prompt's n samples
    tools: dict[str, Tool] = field(default_factory=dict)  # what its prompt may call
    tools_kwargs: dict[str, dict] = field(default_factory=dict)  # the prompt's fixed arguments
    calls: list[ToolCall] = field(default_factory=list)   # to run after this turn
    sampled_end: str = ""

    def schemas(self) -> list[dict] | None:
        """The JSON schemas of its tools for the chat template (None without tools)."""
        return [t.schema for t in self.tools.values()] or None

    def call(self, c: ToolCall) -> ToolCall:
        """``c`` with its prompt's fixed arguments for the tool (they win over the model's)."""
        fixed = self.tools_kwargs.get(c.name)
        return c if c.error or not fixed else ToolCall(c.name, {**c.arguments, **fixed})


def _take_turn(ctx: RolloutContext, cfg: MultiTurnConfig, r: _Rollout, gen: Any,
               turn_end: str) -> bool:
    """Append a sampled turn; True when the trajectory goes on to its tool calls."""
    s, traj = r.sample, r.sample.trajectory
    start = len(s.response_ids)
    s.response_ids += gen.output_ids
    s.rollout_logprobs += gen.logprobs
    s.loss_mask += [1] * len(gen.output_ids)
    s.finish_reason = gen.finish_reason
    traj.turn_spans.append((start, len(s.response_ids)))
    ids = list(gen.output_ids)
    r.sampled_end = sampled_turn_end(ctx.tokenizer, ids, gen.finish_reason, turn_end)
    ends_turn = bool(r.sampled_end)
    content = ctx.tokenizer.decode(ids[:-1] if ends_turn else ids, skip_special_tokens=False)
    traj.messages.append({"role": "assistant", "content": content})
    parsed: ParsedTurn = cfg.parser(content)
    r.calls = parsed.calls
    if gen.finish_reason != "stop":
        traj.stop_reason = "length" if gen.finish_reason == "length" else gen.finish_reason
    elif not parsed.calls:
        traj.stop_reason = "answer"
    elif len(traj.turn_spans) >= cfg.max_turns:
        traj.stop_reason = "max_turns"
    return not traj.stop_reason


def _tool_message(ctx: RolloutContext, cfg: MultiTurnConfig, text: str) -> str:
    ids = _encode(ctx.tokenizer, text)
    if len(ids) <= cfg.max_tool_response_tokens:
        return text
    return ctx.tokenizer.decode(ids[:cfg.max_tool_response_tokens]) + \
        f"\n[... {len(ids) - cfg.max_tool_response_tokens} more tokens cut]"


def _answer_calls(ctx: RolloutContext, cfg: MultiTurnConfig, rollouts: list[_Rollout],
                  pool: ThreadPoolExecutor) -> list[_Rollout]:
    """Run the calls of every rollout, append their responses; the rollouts that go on."""
    t0 = time.time()
    cap = cfg.max_tool_calls
    futures = [[pool.submit(run_tool_call, r.call(c), r.tools, cfg.tool_wall_s,
                            cfg.tool_output_chars) for c in r.calls[:cap]] for r in rollouts]
    # every call gets a response (the template pairs them); those past the cap are not run
    over = ToolResult(f"error: not run: at most {cap} tool calls per turn", True)
    results = [[f.result() for f in fs] + [over] * (len(r.calls) - len(fs))
               for r, fs in zip(rollouts, futures)]
    ctx.add_stat("time/tools_s", time.time() - t0)
    going = []
    for r, res in zip(rollouts, results):
        s, traj = r.sample, r.sample.trajectory
        msgs = [{"role": "tool", "content": _tool_message(ctx, cfg, x.text)} for x in res]
        traj.calls += len(res)
        traj.tool_errors += sum(x.error for x in res)
        traj.tool_outputs += [m["content"] for m in msgs]
        glue = tool_response_ids(ctx.tokenizer, traj.messages, msgs, r.sampled_end,
                                 r.schemas())
        traj.messages += msgs
        if len(s.response_ids) + len(glue) >= cfg.max_response_tokens:
            traj.stop_reason = "max_response_tokens"
            s.finish_reason = "length"   # cut without an answer: truncated, as a long turn
            continue
        s.response_ids += glue
        s.rollout_logprobs += [0.0] * len(glue)
        s.loss_mask += [0] * len(glue)
        going.append(r)
    return going


def _sample_turn(ctx: RolloutContext, cfg: MultiTurnConfig, rollouts: list[_Rollout],
                 turn: int) -> list:
    """One engine call for the next turn of every rollout (n=1 each, its own seed)."""
    params = SamplingParams(**{**vars(ctx.params), "n": 1})
    budgets = [min(ctx.params.max_new_tokens,
                   cfg.max_response_tokens - len(r.sample.response_ids)) for r in rollouts]
    t0 = time.time()
    gens = ctx.client.generate([r.sample.prompt_ids + r.sample.response_ids for r in rollouts],
                               params, [_turn_seed(r.seed, r.j, turn) for r in rollouts],
                               max_new_tokens=budgets)
    ctx.add_stat("time/generate_s", time.time() - t0)
    return [g[0] for g in gens]


def generate_tool_turns(ctx: RolloutContext, prompts: Sequence[PromptSample],
                        seeds: Sequence[int]) -> list[Sample]:
    """The ``multi_turn`` generate stage: ``params.n`` tool-using trajectories per prompt
    (see the module doc), in prompt order; ``ctx.multi_turn`` holds the tools and limits."""
    cfg: MultiTurnConfig | None = ctx.multi_turn
    if cfg is None:
        raise ValueError("the multi_turn generate stage needs tools: set "
                         "RolloutContext.multi_turn (klear-rl: --tools)")
    tok, n = ctx.tokenizer, ctx.params.n
    turn_end = _turn_end_text(tok, [t.schema for t in cfg.tools.values()] or None)
    rollouts = []
    for i, (p, seed) in enumerate(zip(prompts, seeds)):
        tools = cfg.prompt_tools(p)
        text = _render(tok, p.messages, [t.schema for t in tools.values()] or None, True)
        ids = limit_prompt(_encode(tok, text), p, ctx.prompt_limit)
        rollouts += [_Rollout(Sample(ids, [], [], [], "", p.index, i, label=p.label,
                                     prompt_text=text,
                                     trajectory=Trajectory([dict(m) for m in p.messages])),
                              seed, j, tools, dict(p.meta.get("tools_kwargs") or {}))
                     for j in range(n)]
    active = list(rollouts)
    with ThreadPoolExecutor(cfg.tool_workers, thread_name_prefix="tools") as pool:
        for turn in range(cfg.max_turns):
            gens = _sample_turn(ctx, cfg, active, turn)
            calling = [r for r, g in zip(active, gens) if _take_turn(ctx, cfg, r, g, turn_end)]
            active = _answer_calls(ctx, cfg, calling, pool)
            if not active:
                break
    for r in rollouts:
        r.sample.response_text = r.sample.trajectory.answer
        _add_metrics(ctx, r.sample)
    return [r.sample for r in rollouts]


def _add_metrics(ctx: RolloutContext, s: Sample) -> None:
    """Sums over the batch's samples; rl_data.rollout_stats makes them per-sample means."""
    traj = s.trajectory
    model = sum(s.loss_mask)
    for key, value in (("samples", 1), ("turns", len(traj.turn_spans)),
                       ("tool_calls", traj.calls), ("tool_errors", traj.tool_errors),
                       ("turn_limit_hits", traj.stop_reason == "max_turns"),
                       ("token_limit_hits", traj.stop_reason == "max_response_tokens"),
                       ("model_tokens", model), ("tool_tokens", len(s.loss_mask) - model)):
        ctx.add_stat(f"multi_turn/{key}", float(value))


register_stage("multi_turn", generate_tool_turns)
