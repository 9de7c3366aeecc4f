"""A scripted in-process judge for exact, fast tracker tests (fault injection and exact logprobs)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping

from agent_monitor.judges.base import BaseJudge, JudgeError, JudgeRequest, JudgeResponse, Usage
from agent_monitor.prompts import Prompt
from agent_monitor.scale import LETTERS


def letter_at(step: int, total: int = 19) -> dict[str, float]:
    """All mass on the letter whose index is min(step, 19): progress grows one letter per step."""
    return {LETTERS[min(step, total)]: 0.0}


class ScriptedJudge(BaseJudge):
    """Answers from a function of the prompt, after an optional delay; records every prompt."""

    name = "scripted"

    def __init__(
        self,
        answer: Callable[[Prompt], Mapping[str, float] | Exception] = lambda p: letter_at(p.step),
        *,
        delay_s: float = 0.0,
        **kw: object,
    ) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.answer = answer
        self.delay_s = delay_s
        self.model = "scripted-1"
        self.prompts: list[Prompt] = []

    async def _call(self, request: JudgeRequest) -> JudgeResponse:
        self.prompts.append(request.prompt)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        a = self.answer(request.prompt)
        if isinstance(a, Exception):
            raise a
        return JudgeResponse(
            samples=tuple(dict(a) for _ in range(request.repeats)),
            model=self.model,
            usage=Usage(input_tokens=len(request.prompt.text()), output_tokens=1),
        )


def logp(dist: Mapping[str, float]) -> dict[str, float]:
    """Token -> probability, as token -> logprob."""
    return {t: math.log(p) for t, p in dist.items()}


__all__ = ["JudgeError", "ScriptedJudge", "letter_at", "logp"]
