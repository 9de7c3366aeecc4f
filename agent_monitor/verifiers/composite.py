"""`CompositeVerifier`: cheap verifiers first, the next one only when a result is not confident."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import Verifier, VerifyResult


class CompositeVerifier(Verifier):
    """Tries `verifiers` in order; stops at the first confident result (no `confident` key counts as
    confident).

    The last verifier's result is taken whatever its confidence. `metadata["verifier_index"]` says
    which answered.
    """

    def __init__(self, verifiers: Sequence[Verifier]) -> None:
        if not verifiers:
            raise ValueError("CompositeVerifier needs at least one verifier")
        self.verifiers = list(verifiers)

    def verify(
        self, question: str, prediction: str, ground_truth: str, **kwargs: Any
    ) -> VerifyResult:
        for i, v in enumerate(self.verifiers):
            result = v.verify(question, prediction, ground_truth, **kwargs)
            if result.metadata.get("confident", True) or i == len(self.verifiers) - 1:
                result.metadata.setdefault("verifier_index", i)
                return result
        raise AssertionError("unreachable: the last verifier always answers")


__all__ = ["CompositeVerifier"]
