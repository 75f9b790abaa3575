"""Helpers that cut a model response down to the part a reward looks at."""

from __future__ import annotations

import re

THINK_END = "</think>"
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "python3", "py", ""}


def final_section(response: str) -> str | None:
    """The text after the last ``</think>``; None when thinking was opened but never closed
    (a truncated response has no final answer)."""
    if not isinstance(response, str):
        return None
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1]
    return None if "<think>" in response else response


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    best = None
    for cmd in ("\\boxed", "\\fbox"):
        start = text.rfind(cmd + "{")
        if start > (best[0] if best else -1):
            best = (start, start + len(cmd) + 1)
    if best is None:
        return None
    depth, i = 1, best[1]
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[best[1]:i]
        i += 1
    return None


def last_python_block(response: str) -> str | None:
    """The last fenced code block tagged python (or untagged) in the final section."""
    text = final_section(response)
    if text is None:
        return None
    blocks = [body for tag, body in _FENCE.findall(text) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None
