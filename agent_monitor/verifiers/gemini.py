"""`GeminiVerifier`: lmms-eval's Gemini judge verifier over agent-monitor's `GeminiJudge`
(logprobs)."""

from __future__ import annotations

from typing import Any

from ..judges.base import Judge
from ._judged import JudgedVerifier, JudgeType


class GeminiVerifier(JudgedVerifier):
    """Gemini as the judge (`model`, `api_key` or the environment as `GeminiJudge` reads it), or
    `judge=`."""

    def __init__(
        self,
        model: str = "gemini-2.5-flash",
        *,
        api_key: str | None = None,
        judge: Judge | None = None,
        judge_type: JudgeType = "binary",
        custom_prompt: str | None = None,
        threshold: float = 0.5,
        **options: Any,
    ) -> None:
        def build() -> Judge:
            from ..judges.gemini import GeminiJudge

            return GeminiJudge(model, api_key=api_key, **options)

        super().__init__(
            judge or build, judge_type=judge_type, custom_prompt=custom_prompt, threshold=threshold
        )


__all__ = ["GeminiVerifier"]
