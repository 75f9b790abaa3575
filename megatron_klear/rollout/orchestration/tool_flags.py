"""The ``--tools`` flags of multi-turn tool rollouts, shared by klear-rl and klear-eval.

One :class:`ToolFlags` section (config.py's sections): same names, defaults, help and checks
in both CLIs, as data/prompt_flags.py's prompt flags. The response budget of a trajectory
(sampled + tool + template tokens) is the CLI's own length flag: klear-rl's
``--rollout-max-response-len``, klear-eval's ``--max-new-tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_klear.config import ConfigError, Section, opt
from megatron_klear.rollout.orchestration.multi_turn import MultiTurnConfig, ToolTemplateError, \
    check_tool_template
from megatron_klear.rollout.orchestration.tool_calls import ToolParser, get_tool_parser
from megatron_klear.rollout.orchestration.tools import Tool, load_tool, python_tool

__all__ = ["RAW_WITH_TOOLS", "ToolFlags", "check_tools_chat_template"]

RAW_WITH_TOOLS = ("--tools renders tool calls and responses with the chat template: drop "
                  "--prompt-template raw (--chat-template FILE for a model without one)")


@dataclass
class ToolFlags(Section):
    """Multi-turn tool rollouts (issue 40; rollout/orchestration/multi_turn.py, docs/rollout.md)."""

    title = "multi-turn tools"
    tools: list[str] | None = opt(None, "multi-turn tool rollouts with these tools: python (runs "
                                  "the model's code in the sandbox) and/or user tools by "
                                  "import path pkg.mod:fn (a function with a JSON schema, "
                                  "@megatron_klear.rollout.orchestration.tools.tool); the model calls them "
                                  "across turns, tool tokens are not trained")
    tool_parser: str = opt("hermes", "how tool calls are written: hermes = qwen3 "
                           "(<tool_call>{json}</tool_call>), or an import path pkg.mod:fn")
    max_turns: int = opt(4, "with --tools: assistant turns per trajectory (the response budget, "
                         "sampled + tool tokens, is klear-rl's --rollout-max-response-len, "
                         "klear-eval's --max-new-tokens)")
    max_tool_response_tokens: int = opt(256, "with --tools: a tool response longer than this is "
                                        "cut, with a note to the model")
    tool_timeout: float = opt(5.0, "with --tools: wall seconds per tool call (then an error "
                              "message to the model)")
    max_tool_calls: int = opt(8, "with --tools: tool calls run per assistant turn; the turn's "
                              "later calls are answered with an error, not run (verl's "
                              "max_parallel_calls)")

    def validate_section(self) -> None:
        """Tools load, the parser exists, limits are positive; in a config that mixes in the
        prompt flags (klear-rl), no ``--prompt-template raw`` (klear-eval checks it with its
        prompt section: :data:`RAW_WITH_TOOLS`)."""
        if not self.tools:
            return
        if getattr(self, "prompt_template", None) == "raw":
            raise ConfigError(RAW_WITH_TOOLS)
        if min(self.max_turns, self.max_tool_response_tokens, self.max_tool_calls) < 1 \
                or not self.tool_timeout > 0:
            raise ConfigError("--max-turns, --max-tool-response-tokens and --max-tool-calls "
                              "must be >= 1 and --tool-timeout > 0")
        self._tools_and_parser()

    def _tools_and_parser(self) -> tuple[dict[str, Tool], ToolParser]:
        from megatron_klear.rewards.sandbox import SandboxLimits

        tools: dict[str, Tool] = {}
        for spec in self.tools or ():
            try:
                t = python_tool(SandboxLimits(wall_s=self.tool_timeout, output_bytes=64 << 10)) \
                    if spec == "python" else load_tool(spec)
            except ValueError as e:
                raise ConfigError(f"--tools {spec}: {e}; use python or pkg.mod:fn") from None
            if t.name in tools:
                raise ConfigError(f"--tools: two tools are named {t.name!r}")
            tools[t.name] = t
        try:
            parser = get_tool_parser(self.tool_parser)
        except ValueError as e:
            raise ConfigError(f"--tool-parser: {e}") from None
        return tools, parser

    def multi_turn_config(self, max_response_tokens: int) -> MultiTurnConfig | None:
        """The ``MultiTurnConfig`` of the ``--tools`` flags with a trajectory's response budget
        ``max_response_tokens`` (sampled + tool tokens), or None without ``--tools``."""
        if not self.tools:
            return None
        tools, parser = self._tools_and_parser()
        return MultiTurnConfig(tools, parser, max_turns=self.max_turns,
                               max_response_tokens=max_response_tokens,
                               max_tool_response_tokens=self.max_tool_response_tokens,
                               tool_wall_s=self.tool_timeout, max_tool_calls=self.max_tool_calls)


def check_tools_chat_template(tokenizer: Any, multi_turn: MultiTurnConfig | None) -> None:
    """The CLIs' pre-flight of ``--tools`` with the loaded tokenizer: ConfigError (one line,
    exit 2) when its chat template cannot render tool turns
    (rollout/orchestration/multi_turn.py ``check_tool_template``); nothing without tools."""
    if multi_turn is None:
        return
    try:
        check_tool_template(tokenizer, multi_turn)
    except ToolTemplateError as e:
        raise ConfigError(f"--tools: {e}") from None
