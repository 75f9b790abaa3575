"""N-gram decontamination: drop training prompts that share a word n-gram with any
evaluation prompt (Klear-Reasoner uses 9-grams).

Text is lower-cased and split into word tokens (``\\w+``), so punctuation, spacing and
LaTeX markup differences do not hide an overlap. A text shorter than n words is compared
as one whole gram (it then only matches an equally short text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from megatron_klear.data.prompts import record_field

DEFAULT_N = 9
_WORD = re.compile(r"\w+")


def ngram_list(text: str, n: int = DEFAULT_N) -> list[tuple[str, ...]]:
    """The word n-grams of ``text`` in order (see the module doc for short texts)."""
    if n < 1:
        raise ValueError(f"n-gram size must be >= 1, got {n}")
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return [tuple(words)] if words else []
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def ngrams(text: str, n: int = DEFAULT_N) -> set[tuple[str, ...]]:
    """The set of word n-grams of ``text``."""
    return set(ngram_list(text, n))


@dataclass
class Contamination:
    """Why a training item was removed: its first n-gram found in an evaluation set."""

    index: int
    eval_set: str
    eval_index: int
    ngram: str


class NGramIndex:
    """The n-grams of evaluation texts, each mapped to the first (set, index) it came from."""

    def __init__(self, n: int = DEFAULT_N) -> None:
        self.n = n
        self._where: dict[tuple[str, ...], tuple[str, int]] = {}

    def add(self, eval_set: str, texts: Iterable[str]) -> None:
        """Index every text of one evaluation set."""
        for i, text in enumerate(texts):
            for gram in ngrams(text, self.n):
                self._where.setdefault(gram, (eval_set, i))

    def match(self, index: int, text: str) -> Contamination | None:
        """The first overlap of ``text`` with the index (in text order), or None."""
        for gram in ngram_list(text, self.n):
            if gram in self._where:
                eval_set, eval_index = self._where[gram]
                return Contamination(index, eval_set, eval_index, " ".join(gram))
        return None


def decontaminate(train_texts: Iterable[str], eval_sets: dict[str, list[str]],
                  n: int = DEFAULT_N) -> tuple[list[int], list[Contamination]]:
    """(indices of training texts to keep, one Contamination per removed text)."""
    index = NGramIndex(n)
    for name, texts in eval_sets.items():
        index.add(name, texts)
    kept, removed = [], []
    for i, text in enumerate(train_texts):
        hit = index.match(i, text)
        if hit:
            removed.append(hit)
        else:
            kept.append(i)
    return kept, removed


DEFAULT_TEXT_KEYS = ("prompt", "problem", "question", "messages")


def record_text(rec: dict, keys: Iterable[str] = DEFAULT_TEXT_KEYS) -> str:
    """The text of a raw record to check: the first present key of ``keys``, dotted keys
    walking nested fields (chat lists such as ``messages`` contribute all their contents)."""
    for key in keys:
        value = record_field(rec, key)
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return "\n".join(m.get("content", "") for m in value if isinstance(m, dict))
    raise KeyError(f"none of the fields {list(keys)} is present (set --text-key ...)")
