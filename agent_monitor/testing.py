"""Test helpers for users' tests (and ours): `FakeJudge`, a scripted judge with exact letter distributions.

```python
from agent_monitor import ProgressTracker
from agent_monitor.testing import FakeJudge

judge = FakeJudge(["C", {"J": 0.7, "K": 0.3}, FakeJudge.failure("timeout")])
tracker = ProgressTracker("Make the test pass", judge=judge)
tracker.update("ran pytest").score        # 2/19: all mass on C
tracker.update("fixed the bug").score     # (0.7*9 + 0.3*10)/19
tracker.update("ran pytest again").reason # "timeout": a failure, never a made-up score
```

An answer is a letter (all probability on it), a mapping of tokens to *probabilities* (tokens
that are not scale letters, like `"The"`, take mass away from the letters, as a real model's
do), a list of those, one per repeat (`["C", "K", "T"]` with `repeats=3`: the repeats disagree;
the last is used for further repeats), or an exception to raise (`FakeJudge.failure(reason)` gives a `JudgeError` with the real
reason and retry semantics). Answers come from a list (one per call, the last one repeated), or
from a function of the prompt. With no answers, progress grows one letter per step.

Each answered call reports `usage`: a fixed `Usage`, or a function of the prompt; by default the
prompt's characters stand in for input tokens, with one output token. A failed call reports none.

```python
from agent_monitor import Prices, Usage

judge = FakeJudge(["C"], usage=Usage(input_tokens=1000, cached_input_tokens=600, output_tokens=1))
tracker = ProgressTracker("Make the test pass", judge=judge, prices=Prices(input=2.0, output=8.0, cached_input=0.5))
tracker.update("ran pytest")
tracker.update("fixed the bug")
tracker.usage  # Usage(input_tokens=2000, cached_input_tokens=1200, output_tokens=2)
tracker.cost   # (800 * 2.0 + 1200 * 0.5 + 2 * 8.0) / 1e6 = 0.002216
tracker.close()
```
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TypeAlias

from .judges.base import BaseJudge, JudgeError, JudgeRequest, JudgeResponse
from .progress import FAILURES, OUTAGE_REASONS, Usage
from .prompts import Prompt, TextPart
from .scale import LETTERS

Answer: TypeAlias = str | Mapping[str, float] | list[str | Mapping[str, float]] | BaseException
"""A letter, a token -> probability mapping, a list of those (one per repeat), or an exception to raise."""


def letter_at(step: int) -> str:
    """The letter for progress growing one letter per step (A at step 0, T from step 19 on)."""
    return LETTERS[min(max(step, 0), len(LETTERS) - 1)]


class FakeJudge(BaseJudge):
    """A judge whose answers are scripted; it records every request (`record=False`: none, for benchmarks).

    Retries, timeouts and the concurrency limit are BaseJudge's, as for a real judge.
    """

    name = "fake"

    def __init__(
        self,
        answers: Iterable[Answer] | Callable[[Prompt], Answer] | None = None,
        *,
        latency_s: float = 0.0,
        model: str = "fake-1",
        record: bool = True,
        max_retries: int = 0,
        usage: Usage | Callable[[Prompt], Usage] | None = None,
        **options: float,
    ) -> None:
        super().__init__(max_retries=max_retries, **options)  # type: ignore[arg-type]
        self._script: list[Answer] | None = None
        self._answer: Callable[[Prompt], Answer] = lambda p: letter_at(p.step)
        if callable(answers):
            self._answer = answers
        elif answers is not None:
            self._script = list(answers)
            if not self._script:
                raise ValueError("FakeJudge needs at least one answer (or none at all for the default)")
        if latency_s < 0:
            raise ValueError(f"latency_s={latency_s}; use 0 or more")
        self.latency_s = latency_s
        self._usage: Callable[[Prompt], Usage] = (
            (lambda p: Usage(input_tokens=_characters(p), output_tokens=1))
            if usage is None
            else usage
            if callable(usage)
            else (lambda _p: usage)
        )
        self.model = model
        self.record = record
        self.requests: list[JudgeRequest] = []
        self.calls_made = 0

    @property
    def prompts(self) -> list[Prompt]:
        """Every prompt the judge was asked, in order."""
        return [r.prompt for r in self.requests]

    @staticmethod
    def failure(reason: str, message: str = "", *, retry_after: float | None = None) -> JudgeError:
        """A JudgeError as a real backend raises it for `reason` (outages are retryable; see progress.FAILURES)."""
        if reason not in FAILURES:
            raise ValueError(f"unknown failure reason {reason!r}; use one of {', '.join(FAILURES)}")
        return JudgeError(
            reason, message or FAILURES[reason], retryable=reason in OUTAGE_REASONS, retry_after=retry_after
        )

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        if self.record:
            self.requests.append(request)
        self.calls_made += 1
        if self._script is not None:
            answer = self._script[min(self.calls_made - 1, len(self._script) - 1)]
        else:
            answer = self._answer(request.prompt)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, list):
            if not answer:
                raise ValueError("FakeJudge answer []: give at least one answer per call")
            per_repeat = [answer[min(i, len(answer) - 1)] for i in range(request.repeats)]
        else:
            per_repeat = [answer] * request.repeats
        return JudgeResponse(
            samples=tuple(_logprobs(a) for a in per_repeat),
            model=self.model,
            usage=self._usage(request.prompt),
        )


def _characters(prompt: Prompt) -> int:
    # The prompt's text length stands in for its tokens; summed, not rendered, so the fake costs next to nothing.
    return len(prompt.instructions) + sum(len(p.text) for p in prompt.parts if isinstance(p, TextPart))


def _logprobs(answer: str | Mapping[str, float]) -> dict[str, float]:
    if isinstance(answer, str):
        return {answer: 0.0}
    out: dict[str, float] = {}
    for token, p in answer.items():
        if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
            raise ValueError(f"FakeJudge answer {dict(answer)!r}: probabilities must be in [0, 1], got {p!r}")
        if p > 0.0:
            out[token] = math.log(p)
    return out


__all__ = ["Answer", "FakeJudge", "letter_at"]
