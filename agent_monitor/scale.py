"""The 20-letter progress scale: exact token reading, expectation, mass, dispersion, aggregation."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

LETTERS = "ABCDEFGHIJKLMNOPQRST"
"""The progress scale, worst to best: A = nothing useful done .. T = verifiably complete."""

BINARY_TOKENS = ("True", "False")
"""The answers of the binary scale (`scale: binary` in a rubric): is the task complete?"""

_INDEX = {letter: i for i, letter in enumerate(LETTERS)}
_STEP = 1.0 / (len(LETTERS) - 1)

DEFAULT_MIN_MASS = 0.5
"""Below this probability mass on scale letters, a judge answer is not a score (unless the judge
recommends another)."""


class ScoreError(ValueError):
    """A judge answer that does not yield a usable letter distribution; `reason` says why."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def phi(letter: str) -> float:
    """Value of a scale letter on [0, 1]: phi(A) = 0 .. phi(T) = 1."""
    return _INDEX[letter] * _STEP


def read_letter(token: str) -> str | None:
    """The scale letter a token is, or None.

    A token counts only if, after stripping whitespace and one optional leading
    `>`, it is exactly one scale letter (either case). So "The" is not "T".
    """
    t = token.strip()
    if t.startswith(">"):
        t = t[1:].strip()
    if len(t) != 1:
        return None
    up = t.upper()
    return up if up in _INDEX else None


def read_binary(token: str) -> bool | None:
    """The answer a token is on the binary scale ("True" / "False", either case, spaces
    stripped), or None."""
    t = token.strip().lower()
    return True if t == "true" else False if t == "false" else None


def binary_as_letters(sample: Mapping[str, float] | None) -> dict[str, float] | None:
    """A binary judge's answer on the letter scale: False's probability on A (0), True's on T (1).

    So the expectation is P(True) / (P(True) + P(False)) and the mass is P(True) + P(False): the
    letter scale's rules (`distribution`: minimum mass, renormalisation) apply unchanged. Raises
    ScoreError("no_letter") when no candidate token is True or False.
    """
    if sample is None:
        return None
    p = {True: 0.0, False: 0.0}
    for token, lp in sample.items():
        answer = read_binary(token)
        if answer is not None and not math.isnan(lp):
            p[answer] += math.exp(min(lp, 0.0))
    if p[True] + p[False] <= 0.0:
        raise ScoreError(
            "no_letter",
            f"none of the judge's {len(sample)} candidate tokens is True or False (binary scale)",
        )
    out: dict[str, float] = {}
    if p[False] > 0.0:
        out["A"] = math.log(p[False])
    if p[True] > 0.0:
        out["T"] = math.log(p[True])
    return out


def mirrored(sample: Mapping[str, float] | None) -> dict[str, float] | None:
    """A judge's letter logprobs read on the reversed scale (A = best): each letter token becomes
    its mirror (A <-> T).

    For a rubric whose own scale puts the best letter first (the skill's rubric.json): the judge is
    told that scale, and its answer is mapped onto this one (T = best) before the expectation, so a
    score still means the same.
    """
    if sample is None:
        return None
    out: dict[str, float] = {}
    for token, lp in sample.items():
        letter = read_letter(token)
        if letter is not None:
            mirror = LETTERS[len(LETTERS) - 1 - _INDEX[letter]]
            token = (
                token.replace(letter, mirror)
                if letter in token
                else token.replace(letter.lower(), mirror.lower())
            )
        out[token] = lp
    return out


@dataclass(frozen=True, slots=True)
class LetterDistribution:
    """A renormalised distribution over the 20 scale letters, with the raw mass it came from."""

    probs: tuple[float, ...]
    mass: float
    # Computed once: every scoring reads them several times.
    expectation: float = field(init=False, compare=False, repr=False)
    """Expected scale value on [0, 1]."""
    dispersion: float = field(init=False, compare=False, repr=False)
    """Standard deviation of the scale value on [0, 1]."""

    def __post_init__(self) -> None:
        mean = sum(p * i * _STEP for i, p in enumerate(self.probs) if p)
        var = sum(p * (i * _STEP - mean) ** 2 for i, p in enumerate(self.probs) if p)
        object.__setattr__(self, "expectation", mean)
        object.__setattr__(self, "dispersion", math.sqrt(max(var, 0.0)))

    @property
    def top(self) -> str:
        """The most probable letter."""
        return LETTERS[max(range(len(self.probs)), key=self.probs.__getitem__)]

    def as_dict(self) -> dict[str, float]:
        """Letter -> probability, letters with zero probability left out."""
        return {LETTERS[i]: p for i, p in enumerate(self.probs) if p > 0.0}


def distribution(
    logprobs: Mapping[str, float] | Iterable[tuple[str, float]],
    *,
    min_mass: float = DEFAULT_MIN_MASS,
) -> LetterDistribution:
    """Build the letter distribution from candidate tokens and their log-probabilities.

    Tokens that read as the same letter (" B", "b", ">B") add up. The letters'
    probabilities are renormalised over the letters present; their raw sum is the
    `mass`. Raises ScoreError when no token is a letter or the mass is below
    `min_mass` (the renormalised expectation of a sliver of mass is noise).
    """
    items = logprobs.items() if isinstance(logprobs, Mapping) else logprobs
    raw = [0.0] * len(LETTERS)
    seen = 0
    for token, lp in items:
        seen += 1
        letter = read_letter(token)
        if letter is None or math.isnan(lp):
            continue
        raw[_INDEX[letter]] += math.exp(min(lp, 0.0))
    mass = sum(raw)
    if mass <= 0.0:
        raise ScoreError(
            "no_letter", f"none of the judge's {seen} candidate tokens is a scale letter A-T"
        )
    # Several spellings of one letter can add up past 1 through rounding in the server's logprobs.
    mass = min(mass, 1.0)
    if mass < min_mass:
        raise ScoreError(
            "low_mass",
            f"scale letters hold {mass:.3f} of the probability, below the minimum {min_mass}: "
            "a small judge "
            "puts little mass on the letters; lower min_mass, or use a stronger judge "
            f"(e.g. min_mass={mass / 2:.2g} in Python, --min-mass {mass / 2:.2g} on the "
            "command line)",
        )
    total = sum(raw)
    return LetterDistribution(probs=tuple(p / total for p in raw), mass=mass)


@dataclass(frozen=True, slots=True)
class CriterionScore:
    """One criterion's score: the mean over K repeats, with dispersion and spread."""

    name: str
    weight: float
    score: float
    dispersion: float
    spread: float
    uncertainty: float
    mass: float
    repeats: int
    letters: dict[str, float]
    source: str = "llm"
    sampling_error: float = 0.0
    confidence: float = 1.0
    detail: str = ""
    expectations: tuple[float, ...] = field(default=(), compare=False)
    """Each repeat's expectation, in order (the reference library's per-repeat scores); empty for
    a rule's score."""


def rule_score(
    name: str, weight: float, score: float, confidence: float, detail: str = ""
) -> CriterionScore:
    """A criterion answered by a confident rule; its uncertainty is 0.5 * (1 - confidence).

    0.5 is the largest standard deviation a score on [0, 1] can have, so a rule
    with no confidence would be as uncertain as a coin between A and T.
    """
    return CriterionScore(
        name=name,
        weight=weight,
        score=score,
        dispersion=0.0,
        spread=0.0,
        uncertainty=0.5 * (1.0 - confidence),
        mass=1.0,
        repeats=0,
        letters={},
        source="rule",
        confidence=confidence,
        detail=detail,
    )


def score_criterion(
    name: str, weight: float, repeats: Sequence[LetterDistribution], *, draws: int = 0
) -> CriterionScore:
    """Combine K repeats of one criterion.

    `score` is the mean expectation, `dispersion` the mean within-repeat standard
    deviation, `spread` the standard deviation of the K expectations, and
    `uncertainty` the standard deviation of the pooled mixture (law of total
    variance: mean within-variance plus variance of the means).

    `draws` > 0 says each distribution was estimated from that many sampled
    answers (a judge without logprobs): the standard error of the mean from
    sampling, `sampling_error`, is then added in quadrature to `uncertainty`.
    """
    if not repeats:
        raise ScoreError("no_repeats", f"criterion {name!r} has no judge answers to combine")
    k = len(repeats)
    means = [d.expectation for d in repeats]
    mean = sum(means) / k
    within = sum(d.dispersion**2 for d in repeats) / k
    between = sum((m - mean) ** 2 for m in means) / k
    # One repeat (the default) is its own pooled distribution: the same floats, without 20 sums.
    pooled = (
        repeats[0].probs
        if k == 1
        else [sum(d.probs[i] for d in repeats) / k for i in range(len(LETTERS))]
    )
    # Each expectation from n valid draws has variance var/n; the mean of K of them, sum(var/n) /
    # K^2.
    se2 = (
        sum(d.dispersion**2 / max(1.0, d.mass * draws) for d in repeats) / k**2
        if draws > 0
        else 0.0
    )
    return CriterionScore(
        name=name,
        weight=weight,
        score=mean,
        dispersion=sum(d.dispersion for d in repeats) / k,
        spread=math.sqrt(between),
        uncertainty=math.sqrt(within + between + se2),
        mass=sum(d.mass for d in repeats) / k,
        repeats=k,
        letters={LETTERS[i]: p for i, p in enumerate(pooled) if p > 0.0},
        source="sampled" if draws > 0 else "llm",
        sampling_error=math.sqrt(se2),
        expectations=tuple(means),
    )


def score_samples(
    name: str,
    weight: float,
    samples: Sequence[Mapping[str, float] | None],
    *,
    repeats: int,
    min_mass: float = DEFAULT_MIN_MASS,
    draws: int = 0,
) -> CriterionScore:
    """One criterion's score from the judge's answer positions, one per repeat; raise ScoreError
    when it has none.

    A repeat with no answer position (None) is `no_answer`, fewer samples than `repeats` is
    `missing_repeats`, and each sample must pass `distribution` (a letter, enough mass).
    """
    dists = []
    for i, sample in enumerate(samples):
        if sample is None:
            raise ScoreError("no_answer", f"repeat {i + 1} returned no tokens with logprobs")
        dists.append(distribution(sample, min_mass=min_mass))
    if len(dists) < repeats:
        raise ScoreError("missing_repeats", f"asked for {repeats} repeats, got {len(dists)}")
    return score_criterion(name, weight, dists, draws=draws)


@dataclass(frozen=True, slots=True)
class Aggregate:
    """The weighted combination of criterion scores."""

    score: float
    uncertainty: float
    mass: float
    dispersion: float
    spread: float


def aggregate(criteria: Sequence[CriterionScore]) -> Aggregate:
    """Weighted mean over criteria (weights renormalised to sum to 1)."""
    if not criteria:
        raise ScoreError("no_criteria", "there are no criterion scores to aggregate")
    total = sum(c.weight for c in criteria)
    if total <= 0.0:
        raise ScoreError(
            "bad_weights", "criterion weights sum to zero; give at least one a positive weight"
        )

    def mean(attr: str) -> float:
        return sum(c.weight * float(getattr(c, attr)) for c in criteria) / total

    return Aggregate(
        score=mean("score"),
        uncertainty=mean("uncertainty"),
        mass=mean("mass"),
        dispersion=mean("dispersion"),
        spread=mean("spread"),
    )
