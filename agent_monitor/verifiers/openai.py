"""`OpenAIVerifier`: lmms-eval's LLM-as-judge verifier over agent-monitor's OpenAI-compatible
judge (logprobs)."""

from __future__ import annotations

from typing import Any

from ..judges.base import Judge
from ._judged import JudgedVerifier, JudgeType


class OpenAIVerifier(JudgedVerifier):
    """An OpenAI-compatible judge server (`base_url`, `model`; the environment as `OpenAIJudge`
    reads it), or `judge=`.

    The SDK loads on the first verification, not here. `response_format` is refused: the answer is
    one letter whose logprobs are read, never free text.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        judge: Judge | None = None,
        judge_type: JudgeType = "binary",
        custom_prompt: str | None = None,
        threshold: float = 0.5,
        **options: Any,
    ) -> None:
        if "response_format" in options:
            raise TypeError(
                "response_format: this verifier reads the logprobs of one letter A..T, never "
                "free text; leave it out"
            )

        def build() -> Judge:
            from ..judges.openai import OpenAIJudge

            return OpenAIJudge(base_url=base_url, model=model, api_key=api_key, **options)

        super().__init__(
            judge or build, judge_type=judge_type, custom_prompt=custom_prompt, threshold=threshold
        )


__all__ = ["OpenAIVerifier"]
