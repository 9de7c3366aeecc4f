"""The reward math against hand-computed distributions."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_monitor.scale import (
    LETTERS,
    LetterDistribution,
    ScoreError,
    aggregate,
    distribution,
    phi,
    read_letter,
    score_criterion,
)

ln = math.log


def test_scale_has_twenty_letters_evenly_spaced_a_worst() -> None:
    assert LETTERS == "ABCDEFGHIJKLMNOPQRST"
    assert phi("A") == 0.0 and phi("T") == 1.0
    assert phi("K") == pytest.approx(10 / 19)


@pytest.mark.parametrize(
    ("token", "letter"),
    [
        ("A", "A"),
        (" B", "B"),
        ("c", "C"),
        (" t", "T"),
        (">D", "D"),
        ("> E", "E"),
        ("\nF\n", "F"),
        ("T", "T"),
    ],
)
def test_tokens_that_are_exactly_one_letter_count(token: str, letter: str) -> None:
    assert read_letter(token) == letter


@pytest.mark.parametrize(
    "token", ["The", "T.", "**T**", "U", "Z", "AB", "", " ", ">", ">>A", "1", "Á"]
)
def test_other_tokens_do_not_count(token: str) -> None:
    assert read_letter(token) is None


def test_expectation_sums_spellings_of_one_letter() -> None:
    d = distribution({"C": ln(0.5), "E": ln(0.25), " e": ln(0.25)})
    assert d.mass == pytest.approx(1.0)
    assert d.probs[2] == pytest.approx(0.5) and d.probs[4] == pytest.approx(0.5)
    assert d.expectation == pytest.approx(0.5 * 2 / 19 + 0.5 * 4 / 19)
    # Two points 2/19 apart with equal weight: standard deviation 1/19.
    assert d.dispersion == pytest.approx(1 / 19)
    assert d.top in ("C", "E")


def test_renormalises_over_letters_and_reports_mass() -> None:
    d = distribution({"A": ln(0.2), "T": ln(0.2), "The": ln(0.6)}, min_mass=0.3)
    assert d.mass == pytest.approx(0.4)
    assert d.expectation == pytest.approx(0.5)
    assert d.dispersion == pytest.approx(0.5)
    assert d.as_dict() == pytest.approx({"A": 0.5, "T": 0.5})


def test_low_mass_is_a_failure_not_a_number() -> None:
    with pytest.raises(ScoreError) as e:
        distribution({"A": ln(0.2), "T": ln(0.2), "The": ln(0.6)})
    assert e.value.reason == "low_mass"
    assert "0.400" in str(e.value)


def test_the_does_not_count_as_t() -> None:
    # The reference library read first characters: "The" became T (progress 1.0).
    with pytest.raises(ScoreError) as e:
        distribution({"The": ln(0.7), "One": ln(0.2), "Based": ln(0.1)})
    assert e.value.reason == "no_letter"


def test_lower_case_letters_count() -> None:
    d = distribution([("t", ln(0.5)), (" T", ln(0.25)), ("a", ln(0.25))])
    assert d.expectation == pytest.approx(0.75)


def test_no_candidates_is_a_failure() -> None:
    with pytest.raises(ScoreError, match="none of the judge's 0 candidate tokens"):
        distribution({})


def test_weighted_criteria_and_repeats() -> None:
    t = LetterDistribution(
        probs=tuple(1.0 if letter == "T" else 0.0 for letter in LETTERS), mass=1.0
    )
    a = LetterDistribution(
        probs=tuple(1.0 if letter == "A" else 0.0 for letter in LETTERS), mass=0.8
    )
    c1 = score_criterion("c1", 0.75, [t, a])  # K = 2 repeats that disagree completely
    assert c1.score == pytest.approx(0.5)
    assert c1.spread == pytest.approx(0.5)
    assert c1.dispersion == pytest.approx(0.0)
    assert c1.uncertainty == pytest.approx(0.5)
    assert c1.mass == pytest.approx(0.9)
    assert c1.letters == pytest.approx({"A": 0.5, "T": 0.5})
    c2 = score_criterion("c2", 0.25, [distribution({"M": 0.0})])
    assert c2.score == pytest.approx(12 / 19)
    agg = aggregate([c1, c2])
    assert agg.score == pytest.approx(0.75 * 0.5 + 0.25 * 12 / 19)
    assert agg.uncertainty == pytest.approx(0.75 * 0.5)


def test_weights_are_renormalised_in_aggregate() -> None:
    c = [
        score_criterion("x", 2.0, [distribution({"T": 0.0})]),
        score_criterion("y", 2.0, [distribution({"A": 0.0})]),
    ]
    assert aggregate(c).score == pytest.approx(0.5)
    with pytest.raises(ScoreError):
        aggregate([])


def test_pooled_uncertainty_is_law_of_total_variance() -> None:
    d1 = distribution({"A": ln(0.5), "C": ln(0.5)})
    d2 = distribution({"R": ln(0.5), "T": ln(0.5)})
    c = score_criterion("c", 1.0, [d1, d2])
    pooled = distribution({"A": ln(0.25), "C": ln(0.25), "R": ln(0.25), "T": ln(0.25)})
    assert c.uncertainty == pytest.approx(pooled.dispersion)


@given(
    st.dictionaries(
        st.sampled_from(list(LETTERS) + [" " + x for x in LETTERS]),
        st.floats(0.01, 1.0),
        min_size=1,
    )
)
def test_expectation_is_within_scale_and_probs_sum_to_one(weights: dict[str, float]) -> None:
    total = sum(weights.values())
    d = distribution({t: ln(w / total) for t, w in weights.items()})
    assert sum(d.probs) == pytest.approx(1.0)
    assert 0.0 <= d.expectation <= 1.0
    assert 0.0 <= d.dispersion <= 0.5 + 1e-9
    assert d.mass == pytest.approx(1.0)


def test_sampled_distributions_add_their_sampling_error() -> None:
    d = distribution({"A": ln(0.4), "T": ln(0.4)})  # 100 draws, 80 of them letters (mass 0.8)
    c = score_criterion("c", 1.0, [d], draws=100)
    assert c.source == "sampled"
    assert c.sampling_error == pytest.approx(0.5 / math.sqrt(80))
    assert c.uncertainty == pytest.approx(math.sqrt(0.25 + 0.25 / 80))
    two = score_criterion("c", 1.0, [d, d], draws=100)
    assert two.sampling_error == pytest.approx(math.sqrt(2 * 0.25 / 80) / 2)
    assert score_criterion("c", 1.0, [d]).source == "llm"
