"""One vocabulary, one JSON form: Progress and Decision round-trip exactly, and the wire models
add and drop nothing."""

from __future__ import annotations

import json
import math
import typing

from hypothesis import given
from hypothesis import strategies as st

from agent_monitor import Decision, Progress, Usage
from agent_monitor.daemon import MonitorConfig
from agent_monitor.progress import (
    ERROR_REASONS,
    FAILURES,
    OUTAGE_REASONS,
    REFUSALS,
    SIGNALS,
    ProgressJSON,
)
from agent_monitor.scale import CriterionScore
from agent_monitor.wire import ErrorOut, ProgressOut, SignalOut, signal_json

finite = st.floats(0, 1, allow_nan=False)
names = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=8)

criterion = st.builds(
    CriterionScore,
    name=names,
    weight=finite,
    score=finite,
    dispersion=finite,
    spread=finite,
    uncertainty=finite,
    mass=finite,
    repeats=st.integers(0, 5),
    letters=st.dictionaries(st.sampled_from("ABCDEFGHIJKLMNOPQRST"), finite, max_size=4),
    source=st.sampled_from(["llm", "rule", "sampled"]),
    sampling_error=finite,
    confidence=finite,
    detail=st.text(max_size=20),
)
decision = st.builds(
    Decision,
    signal=st.sampled_from(SIGNALS),
    reason=st.text(max_size=30),
    step=st.integers(1, 10_000),
    score=st.none() | finite,
    best_step=st.none() | st.integers(1, 10_000),
    best_score=st.none() | finite,
    changed=st.booleans(),
)


@st.composite
def progress(draw: st.DrawFn) -> Progress:
    ok = draw(st.booleans())
    crits = draw(st.lists(criterion, max_size=3, unique_by=lambda c: c.name))
    return Progress(
        step=draw(st.integers(1, 10_000)),
        score=draw(finite) if ok else None,
        uncertainty=draw(finite) if ok else None,
        criteria={c.name: c for c in crits},
        ok=ok,
        error=None if ok else draw(st.text(max_size=40)),
        reason=None if ok else draw(st.sampled_from(sorted(FAILURES))),
        mass=draw(st.none() | finite),
        dispersion=draw(st.none() | finite),
        spread=draw(st.none() | finite),
        judge=draw(names),
        model=draw(st.text(max_size=10)),
        rubric=draw(st.text("0123456789abcdef", max_size=16)),
        coalesced=draw(st.integers(1, 50)),
        latency_s=draw(st.floats(0, 100)),
        usage=Usage(
            draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6)), draw(st.integers(0, 10))
        ),
        totals=Usage(
            draw(st.integers(0, 10**9)), draw(st.integers(0, 10**9)), draw(st.integers(0, 10**4))
        ),
        cost=draw(st.none() | st.floats(0, 10**4)),
        calls=draw(st.integers(0, 5)),
        calls_saved=draw(st.integers(0, 5)),
        images_dropped=draw(st.integers(0, 20)),
        silent=tuple(draw(st.lists(names, max_size=2))),
        signal=draw(st.none() | decision),
        run_id=draw(st.none() | st.from_regex(r"[a-z0-9][a-z0-9._:-]{0,20}", fullmatch=True)),
        degraded=draw(st.booleans()),
        scheduled=draw(
            st.none() | st.sampled_from(["first", "max_gap 4", "near abort_below 0.3", "end"])
        ),
        skipped=draw(st.none() | st.just("far from thresholds")),
    )


@given(progress())
def test_progress_json_round_trips_exactly_through_text(p: Progress) -> None:
    text = json.dumps(p.to_json(), allow_nan=False)
    assert Progress.from_json(json.loads(text)) == p


@given(progress())
def test_the_wire_model_adds_and_drops_nothing(p: Progress) -> None:
    data = json.loads(json.dumps(p.to_json()))
    data["run_id"] = data["run_id"] or "r1"
    out = ProgressOut.model_validate(data)
    # exclude_unset: `final` and `verdict` are only on a run's final result (absent from a scoring's
    # message).
    assert out.model_dump(mode="json", exclude_unset=True) == data
    assert out.to_progress() == Progress.from_json(data)


def test_wire_model_fields_are_the_json_form() -> None:
    assert set(ProgressOut.model_fields) == set(typing.get_type_hints(ProgressJSON))


@given(decision)
def test_signal_message_is_the_decision_form_plus_run_and_policy(d: Decision) -> None:
    policy = MonitorConfig().policy
    data = json.loads(json.dumps(signal_json("r1", d, policy)))
    assert SignalOut.model_validate(data).model_dump(mode="json") == data
    assert Decision.from_json(data) == d


def test_non_finite_numbers_become_null_never_invalid_json() -> None:
    p = Progress(
        step=1, score=math.nan, uncertainty=math.inf, criteria={}, ok=True, latency_s=math.nan
    )
    data = json.loads(json.dumps(p.to_json(), allow_nan=False))
    assert data["score"] is None and data["uncertainty"] is None and data["latency_s"] == 0.0


def test_one_vocabulary_of_reasons() -> None:
    assert set(FAILURES) >= OUTAGE_REASONS
    assert set(REFUSALS) <= set(ERROR_REASONS)
    assert all(ErrorOut(topic="t", reason=r, error="x").reason == r for r in ERROR_REASONS)
