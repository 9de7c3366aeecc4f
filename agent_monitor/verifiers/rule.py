"""Rule verifiers (lmms-eval's names): no judge call; each says whether it is `confident` (see
`composite`)."""

from __future__ import annotations

import math
import re
from typing import Any

from .base import Verifier, VerifyResult
from .extractors import mcq_letter


def _verdict(correct: bool, raw: str, *, confident: bool) -> VerifyResult:
    return VerifyResult(1.0 if correct else 0.0, correct, raw, {"confident": confident})


class ExactMatchVerifier(Verifier):
    """Equal after stripping (and lower-casing, `ignore_case`); a mismatch is not confident (it
    falls through)."""

    def __init__(self, ignore_case: bool = True, strip: bool = True) -> None:
        self.ignore_case = ignore_case
        self.strip = strip

    def _norm(self, text: str) -> str:
        text = " ".join(text.split()) if self.strip else text
        return text.lower() if self.ignore_case else text

    def verify(
        self, question: str, prediction: str, ground_truth: str, **kwargs: Any
    ) -> VerifyResult:
        p, g = self._norm(prediction), self._norm(ground_truth)
        return _verdict(p == g, f"exact_match: {p!r} vs {g!r}", confident=p == g)


class ContainsVerifier(Verifier):
    """The ground truth occurs in the prediction; a miss is not confident (it falls through)."""

    def __init__(self, ignore_case: bool = True) -> None:
        self.ignore_case = ignore_case

    def verify(
        self, question: str, prediction: str, ground_truth: str, **kwargs: Any
    ) -> VerifyResult:
        p, g = (
            (prediction.lower(), ground_truth.lower())
            if self.ignore_case
            else (prediction, ground_truth)
        )
        found = g.strip() in p
        return _verdict(found, f"contains: {g.strip()!r} in prediction: {found}", confident=found)


class MCQMatchVerifier(Verifier):
    """The same multiple-choice letter, whatever the format ((A), A., A), "Answer: A").

    Confident unless a single letter cannot be read from the prediction or the ground truth:
    a cleanly read wrong letter is a confident wrong and does not fall through.
    """

    def __init__(self, choices: list[str] | None = None) -> None:
        self.choices = choices

    def verify(
        self, question: str, prediction: str, ground_truth: str, **kwargs: Any
    ) -> VerifyResult:
        choices = kwargs.get("choices", self.choices)
        p, g = mcq_letter(prediction, choices), mcq_letter(ground_truth, choices)
        if p is None or g is None:
            return _verdict(
                False,
                f"mcq_parse_fail: prediction={prediction!r} ground_truth={ground_truth!r}",
                confident=False,
            )
        return _verdict(p == g, f"mcq_match: {p!r} vs {g!r}", confident=True)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def parse_number(text: str) -> float | None:
    """The number `text` is (or its last number), commas and `%` dropped; None when there is
    none."""
    t = text.strip().replace(",", "").replace("%", "").replace("\u2212", "-")
    try:
        x = float(t)
    except ValueError:
        found = _NUMBER.findall(t)
        if not found:
            return None
        x = float(found[-1])
    return x if math.isfinite(x) else None


class NumericToleranceVerifier(Verifier):
    """Numbers equal within `rel_tol` / `abs_tol`; not confident only when either side is not a
    number."""

    def __init__(self, rel_tol: float = 1e-3, abs_tol: float = 1e-6) -> None:
        if not (rel_tol >= 0 and abs_tol >= 0):
            raise ValueError(f"rel_tol={rel_tol}, abs_tol={abs_tol}: tolerances are >= 0")
        self.rel_tol = rel_tol
        self.abs_tol = abs_tol

    def verify(
        self, question: str, prediction: str, ground_truth: str, **kwargs: Any
    ) -> VerifyResult:
        p, g = parse_number(prediction), parse_number(ground_truth)
        if p is None or g is None:
            return _verdict(
                False,
                f"numeric_parse_fail: prediction={prediction!r} ground_truth={ground_truth!r}",
                confident=False,
            )
        ok = math.isclose(p, g, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        return _verdict(
            ok,
            f"numeric: {p} vs {g} (rel_tol={self.rel_tol}, abs_tol={self.abs_tol})",
            confident=True,
        )


__all__ = [
    "ContainsVerifier",
    "ExactMatchVerifier",
    "MCQMatchVerifier",
    "NumericToleranceVerifier",
    "parse_number",
]
