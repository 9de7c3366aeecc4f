"""A conservative token count for text when no tokenizer is at hand (prompt budgets, context checks)."""

from __future__ import annotations

import math

__all__ = ["CHARS_PER_TOKEN", "estimate_tokens"]

CHARS_PER_TOKEN = 3.0
"""UTF-8 bytes per token assumed by `estimate_tokens`; lower than real tokenizers give on agent text, so it over-counts.

Placeholder until measured on the recorded runs with a real tokenizer (issue 42 says how and the margin).
"""


def estimate_tokens(text: str) -> int:
    """An upper estimate of `text`'s token count: its UTF-8 bytes over `CHARS_PER_TOKEN`, rounded up."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / CHARS_PER_TOKEN)
