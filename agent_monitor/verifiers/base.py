"""The per-sample verification vocabulary (lmms-eval's shape): `VerifyResult`, `Verifier`,
`Extractor`."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class VerifyResult:
    """One sample's verdict: a score on [0, 1], whether it is correct, and what the verifier wants
    to say.

    `metadata["confident"]` False asks a `CompositeVerifier` to try its next verifier (absent:
    confident); `metadata["judge_failed"]` True says an LLM judge could not answer (the score is
    then 0, never a grade).
    """

    score: float
    is_correct: bool
    raw_output: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


class Verifier(abc.ABC):
    """Decides whether a prediction is correct for a question and its ground truth."""

    @abc.abstractmethod
    def verify(
        self, question: str, prediction: str, ground_truth: str, **kwargs: Any
    ) -> VerifyResult:
        """The verdict on one sample."""

    def __call__(
        self, question: str, prediction: str, ground_truth: str, **kwargs: Any
    ) -> VerifyResult:
        return self.verify(question, prediction, ground_truth, **kwargs)


class Extractor(abc.ABC):
    """Turns a raw model output into the text a verifier reads."""

    @abc.abstractmethod
    def extract(self, text: str, **kwargs: Any) -> str:
        """The cleaned text."""

    def __call__(self, text: str, **kwargs: Any) -> str:
        return self.extract(text, **kwargs)


__all__ = ["Extractor", "Verifier", "VerifyResult"]
