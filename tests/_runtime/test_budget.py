"""Extractors and rules read untrusted text under a time budget, off the event loop."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_monitor import AsyncProgressTracker, ProgressTracker
from agent_monitor._runtime.budget import BudgetExceeded, Pattern, budget, within
from agent_monitor.extractors import Boxed, RegexCapture, register_extractor
from agent_monitor.testing import FakeJudge

EXPLODES = "(x+x+)+y"  # exponential backtracking on a run of x without a y
LONG_X = "x" * 10_000


def rubric(extractors: list[Any] | None = None, rules: list[Any] | None = None) -> dict[str, Any]:
    criteria: list[dict[str, Any]] = [
        {"type": "llm", "name": "judged", "description": "How far along."}
    ]
    if rules:
        criteria.append({"type": "composite", "name": "tests", "members": rules})
    return {"title": "t", "extractors": extractors or [], "criteria": criteria}


async def max_loop_gap(during: asyncio.Future[Any]) -> float:
    """The longest the event loop went without running this ticker while `during` ran."""
    gap, last = 0.0, time.monotonic()
    while not during.done():
        await asyncio.sleep(0.005)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
    return gap


def test_a_pattern_stops_at_the_end_of_its_budget() -> None:
    p = Pattern(EXPLODES)
    start = time.monotonic()
    with (
        budget(0.05),
        pytest.raises(
            BudgetExceeded, match=r"pattern '\(x\+x\+\)\+y' ran over " r"its 50 ms budget"
        ),
    ):
        p.search(LONG_X)
    assert time.monotonic() - start < 1.0
    assert p.search("xxy") is not None  # outside a budget: an ordinary pattern


async def test_an_exploding_extractor_withholds_one_step_and_blocks_nothing() -> None:
    judge = FakeJudge(["K"])
    crit = rubric(extractors=[{"type": "regex_capture", "pattern": EXPLODES, "group": 0}])
    tracker = AsyncProgressTracker("t", judge=judge, criteria=crit)
    task = asyncio.ensure_future(tracker.update(LONG_X))
    gap = await max_loop_gap(task)
    p = task.result()
    assert not p.ok and p.reason == "extractor_timeout" and p.score is None
    assert "step 1: pattern '(x+x+)+y' ran over its 50 ms budget" in (p.error or "")
    assert judge.calls_made == 0  # a failure whatever the judge says: no call is paid for
    assert gap < 0.05, f"the event loop stalled {gap * 1000:.0f} ms"
    # The run carries on: the step stays (numbering intact), its text withheld; the next step
    # scores.
    q = await tracker.update("xxy then more")
    assert q.ok and q.step == 2 and judge.calls_made == 1
    assert tracker.steps[0].withheld and LONG_X not in tracker.steps[0].text
    assert "text withheld" in judge.prompts[-1].text()


async def test_an_exploding_rule_fails_that_score_and_names_the_criterion() -> None:
    judge = FakeJudge(["K"])
    crit = rubric(rules=[{"type": "rule.test_ratio", "passed": r"((?:x+x+)+y)"}])
    tracker = AsyncProgressTracker("t", judge=judge, criteria=crit, extract_budget_s=0.02)
    p = await tracker.update("x" * 5000)
    assert not p.ok and p.reason == "extractor_timeout"
    assert "criterion 'tests' at step 1" in (p.error or "") and "20 ms budget" in (p.error or "")
    # the rule looks 3 steps back: step 1 is still in view
    q = await tracker.update("collected 3 items")
    assert q.reason == "extractor_timeout" and "at step 2" in (q.error or "")
    for text in ("a", "b"):
        r = await tracker.update(text)
    # step 1 out of the rule's view: scoring carries on
    assert r.ok and r.step == 4 and "tests" in r.silent


def test_python_extractors_are_held_to_the_budget_too() -> None:
    @register_extractor("test_slow_extractor")
    class Slow:
        def __call__(self, text: str) -> str:
            time.sleep(0.1)
            return text

    with ProgressTracker(
        "t", judge=FakeJudge(), criteria=rubric(extractors=["test_slow_extractor"])
    ) as tracker:
        p = tracker.update("anything")
        assert p.reason == "extractor_timeout" and "step 1's extractors ran over" in (p.error or "")


def test_the_budget_is_an_option_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="extract_budget_s=0; use a number of seconds > 0"):
        AsyncProgressTracker("t", judge=FakeJudge(), extract_budget_s=0)
    assert within(lambda: 3, 0.05, "x") == 3


def _boxed_reference(text: str) -> str:
    """The old scan (quadratic on many unclosed boxes), kept as the specification."""
    import re

    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth = 1
        for i in range(m.end(), len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[m.end() : i].strip()
    return ""


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(["\\boxed{", "\\fbox {", "{", "}", "a", " 1", "\\boxed"]), max_size=30)
)
def test_boxed_in_one_pass_agrees_with_the_scan(pieces: list[str]) -> None:
    text = "".join(pieces)
    assert Boxed()(text) == _boxed_reference(text)


def test_boxed_on_many_unclosed_boxes_is_within_budget() -> None:
    text = "\\boxed{" * 20_000 + "\\boxed{42}"
    assert within(lambda: Boxed()(text), 0.5, "boxed") == "42"


def test_regex_capture_keeps_re_syntax() -> None:
    cap = RegexCapture(r"(?im)^final answer:\s*(?P<a>\w+)$", group="a")
    assert cap("x\nFinal Answer: Paris\n") == "Paris"
