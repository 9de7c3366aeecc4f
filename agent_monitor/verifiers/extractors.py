"""Per-sample extractors (lmms-eval's names), on agent-monitor's step extractors where one
already does the job."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .. import extractors as _steps
from .base import Extractor

_LETTERS = "ABCDEFGHIJ"


class StripReasoningExtractor(Extractor):
    """Removes `<think>...</think>` / `<thinking>...</thinking>` blocks (an unclosed one to the
    end)."""

    def __init__(self, tag_pairs: Sequence[Sequence[str]] | None = None) -> None:
        self.tag_pairs = (
            [tuple(p) for p in tag_pairs]
            if tag_pairs
            else [("<think>", "</think>"), ("<thinking>", "</thinking>")]
        )
        self._patterns = [
            re.compile(rf"{re.escape(o)}.*?(?:{re.escape(c)}|\Z)", re.DOTALL | re.IGNORECASE)
            for o, c in self.tag_pairs
        ]

    def extract(self, text: str, **kwargs: Any) -> str:
        if not isinstance(text, str):
            return "" if text is None else str(text)
        for p in self._patterns:
            text = p.sub("", text)
        return text.strip()


class RegexExtractor(Extractor):
    """The first match's capture group `group` (the whole match if the pattern has none), else
    `fallback`."""

    def __init__(self, pattern: str, group: int = 1, fallback: str = "", flags: int = 0) -> None:
        try:
            self.regex = re.compile(pattern, flags)
        except re.error as e:
            raise ValueError(f"regex pattern {pattern!r} does not compile: {e}") from None
        self.group = group
        self.fallback = fallback

    def extract(self, text: str, **kwargs: Any) -> str:
        m = self.regex.search(text)
        if m is None:
            return self.fallback
        return (
            m.group(self.group) if self.group <= (self.regex.groups or 0) else m.group(0)
        ).strip()


# Explicit answers first ("Answer: B", "the answer is (B)"), then a letter formatted as a choice.
_EXPLICIT = re.compile(
    r"(?:answer|option|choice)\s*(?:is|:)?\s*[:\-]?\s*\(?\s*([A-Z])\s*\)?(?![A-Za-z])",
    re.IGNORECASE,
)
# In prose a letter counts only when formatted as a choice: "(B)", "B.", "B)", "B:" (the pronoun "I"
# is not one).
_ALONE = re.compile(r"\(([A-Z])\)|(?<![A-Za-z(])([A-Z])[.):](?![\w])")


def mcq_letter(text: str, choices: Sequence[str] | None = None) -> str | None:
    """The one multiple-choice letter `text` answers with ((A), A., A), "Answer: A"), or None if
    none or ambiguous."""
    allowed = {c.upper() for c in choices} if choices else set(_LETTERS)
    stripped = text.strip()
    bare = stripped.strip("().: ").upper()
    # the whole answer is one letter, any case: "b", "(b)", "B."
    if len(bare) == 1 and bare in allowed:
        return bare
    explicit: list[str] = [m.upper() for m in _EXPLICIT.findall(stripped) if m.upper() in allowed]
    if explicit:
        return explicit[-1]
    alone: set[str] = {a or b for a, b in _ALONE.findall(stripped)} & allowed
    return alone.pop() if len(alone) == 1 else None


class MCQExtractor(Extractor):
    """The answer's multiple-choice letter; the text unchanged when there is no single one (the
    verifier then says so)."""

    def __init__(self, choices: Sequence[str] | None = None) -> None:
        self.choices = list(choices) if choices else None

    def extract(self, text: str, **kwargs: Any) -> str:
        letter = mcq_letter(text, kwargs.get("choices", self.choices))
        return letter if letter is not None else text.strip()


class NumberExtractor(Extractor):
    r"""`\boxed{...}` content if present, else the last number in the text (thousands commas
    dropped), else `fallback`."""

    def __init__(self, fallback: str = "") -> None:
        self.fallback = fallback
        self._boxed = _steps.Boxed()
        self._last = _steps.LastNumber()

    def extract(self, text: str, **kwargs: Any) -> str:
        return self._boxed(text) or self._last(text) or self.fallback


class StripExtractor(Extractor):
    """Strips whitespace and common special tokens (`</s>`, `<|im_end|>`, `<|endoftext|>`,
    `[/INST]`, ...)."""

    def __init__(self) -> None:
        self._special = _steps.StripSpecialTokens()

    def extract(self, text: str, **kwargs: Any) -> str:
        return self._special(text)


__all__ = [
    "MCQExtractor",
    "NumberExtractor",
    "RegexExtractor",
    "StripExtractor",
    "StripReasoningExtractor",
    "mcq_letter",
]
