"""A conservative token count for text when no tokenizer is at hand (prompt budgets, context
checks)."""

from __future__ import annotations

import math

__all__ = ["CHARS_PER_TOKEN", "estimate_tokens"]

CHARS_PER_TOKEN = 2.0
"""UTF-8 bytes per token assumed by `estimate_tokens`; lower than real tokenizers give on agent
text, so it over-counts.

Measured by `bench/token_ratio.py` on the 32 recorded runs of `../shared/data` (every run's task and
steps as the judge reads them) with the packaged Gemma 3 270M tokenizer and SmolLM2-135M's: 2.77 and
2.66 bytes per token over all runs, 2.09 on the worst run's steps (dna-assembly, DNA sequences),
median 2.98 and 2.85. At 2.0 the estimate over-counts every run, by at least 4% (the worst run) and
by 33-39% overall. Single steps tokenise worse: 58 of the 681 steps of 1 KB or more are under 2.0,
hex dumps and DNA down to 1.13 bytes per token, so a prompt made only of such steps can be
under-counted by up to 1.8x; a judge's context-length refusal then teaches the judge its real limit
(a lower `context_tokens`), and prompt budgets follow it at the next scoring.
"""


def estimate_tokens(text: str) -> int:
    """An upper estimate of `text`'s token count: its UTF-8 bytes over `CHARS_PER_TOKEN`, rounded
    up."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / CHARS_PER_TOKEN)
