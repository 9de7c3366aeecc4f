"""Rule-based progress criteria on real-looking observations; composite chains; the registry and
config."""

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_monitor.extractors import Boxed, LastNumber, Pipeline, RegexCapture, StripReasoning
from agent_monitor.rules import (
    RULES,
    AnswerMatch,
    Composite,
    CompositeScore,
    MetricCurve,
    RuleInput,
    RuleScore,
    TestRatio,
    build_rule,
    register_rule,
    rule_name,
)

PYTEST_FAIL = """$ cd /app && python -m pytest tests/ 2>&1 | tail -8
Observation:
tests/test_outputs.py ..F.F.F...E                                        [100%]
=========================== short test summary info ============================
FAILED tests/test_outputs.py::test_cancel_cleanup - AssertionError: assert [0] == [0, 1]
FAILED tests/test_outputs.py::test_keyboard_interrupt - KeyboardInterrupt
FAILED tests/test_outputs.py::test_max_concurrent - assert 3 <= 2
ERROR tests/test_outputs.py::test_grpc_server - ConnectionRefusedError: [Errno 111] Connection refused
============== 3 failed, 7 passed, 1 error, 2 warnings in 2.10s ===============
"""
PYTEST_PASS_QUIET = (
    "$ pytest -q\n..........                                                    [100%]\n10 "
    "passed in 0.12s\n"
)
# mini-swe-agent's JSON tool output: the line breaks inside "output" are the two characters \n.
JSON_PYTEST = (
    "Let me run the test suite.\n$ cd /app && pytest -q test_run.py\nObservation:\n"
    '{\n  "returncode": 1,\n  "output": "..F.s\\n=== FAILURES ===\\nE   assert 1 == 2\\n'
    "=== short test summary info ===\\nFAILED test_run.py::test_cancel - assert 1 == 2\\n"
    '1 failed, 3 passed, 1 skipped in 0.31s\\n"\n}'
)
JSON_TRACEBACK = (
    '{\n  "returncode": 1,\n  "output": "Traceback (most recent call last):\\n  File '
    '\\"\\u003cstring\\u003e\\", '
    "line 2, in \\u003cmodule\\u003e\\n    import torch\\nModuleNotFoundError: No module "
    'named \\u0027torch\\u0027\\n"\n}'
)
UNITTEST_FAIL = """$ python -m unittest -v test_kv.py
test_get (test_kv.TestKV.test_get) ... ok
test_put (test_kv.TestKV.test_put) ... FAIL
test_grpc (test_kv.TestKV.test_grpc) ... ERROR
test_slow (test_kv.TestKV.test_slow) ... skipped 'slow'

======================================================================
FAIL: test_put (test_kv.TestKV.test_put)
----------------------------------------------------------------------
Traceback (most recent call last):
  File "/app/test_kv.py", line 14, in test_put
    self.assertEqual(resp.val, 5)
AssertionError: 0 != 5

----------------------------------------------------------------------
Ran 12 tests in 0.034s

FAILED (failures=2, errors=1, skipped=2)
"""
UNITTEST_OK = (
    "....\n----------------------------------------------------------------------\nRan 4 "
    "tests in 0.002s\n\nOK\n"
)
JEST = """Test Suites: 1 failed, 1 passed, 2 total
Tests:       2 failed, 8 passed, 10 total
Snapshots:   0 total
Time:        1.532 s
"""
CARGO = (
    "running 10 tests\n...\ntest result: FAILED. 8 passed; 2 failed; 0 ignored; 0 "
    "measured; 0 filtered out\n"
)
MYPY = (
    "agent_monitor/x.py:3: error: Name 'y' is not defined  [name-defined]\nFound 3 errors "
    "in 1 file (checked 2 source files)\n"
)


def run(
    *steps: str, metadata: Sequence[Mapping[str, Any]] = (), expected: str | None = None
) -> RuleInput:
    return RuleInput(task="Make the tests pass.", steps=steps, metadata=metadata, expected=expected)


# --- TestRatio ---


@pytest.mark.parametrize(
    ("text", "score", "counts"),
    [
        (PYTEST_FAIL, 7 / 11, "7 passed, 3 failed, 1 errors -> 7/11"),
        (PYTEST_PASS_QUIET, 1.0, "10 passed, 0 failed, 0 errors -> 10/10"),
        ("== 3 failed, 7 passed in 2.1s ==", 0.7, "7 passed, 3 failed, 0 errors -> 7/10"),
        ("=== 5 passed in 0.50s ===", 1.0, "5 passed"),
        # collection error
        ("==== 1 error in 0.31s ====", 0.0, "0 passed, 0 failed, 1 errors -> 0/1"),
        (JSON_PYTEST, 0.75, "3 passed, 1 failed, 0 errors -> 3/4"),  # skipped left out
        (UNITTEST_FAIL, 7 / 10, "7 passed, 2 failed, 1 errors -> 7/10"),  # 12 ran, 2 skipped
        (UNITTEST_OK, 1.0, "4 passed, 0 failed, 0 errors -> 4/4"),
        (
            "Ran 5 tests in 0.1s\n\nOK (skipped=1, expected failures=1)",
            1.0,
            "3 passed, 0 failed, 0 errors",
        ),
        (
            "Ran 3 tests in 0.1s\n\nFAILED (unexpected successes=1)",
            2 / 3,
            "2 passed, 1 failed, 0 errors",
        ),
        (JEST, 0.8, "8 passed, 2 failed, 0 errors -> 8/10"),
        (CARGO, 0.8, "8 passed, 2 failed, 0 errors -> 8/10"),
        ("PASS: 12 passed.", 1.0, "12 passed"),
    ],
)
def test_test_ratio_reads_pytest_unittest_jest_and_cargo_summaries(
    text: str, score: float, counts: str
) -> None:
    r = TestRatio()(run("$ ls\nObservation:\nsetup.py tests", text))
    assert r is not None
    assert r.score == pytest.approx(score) and r.confidence == 0.9
    assert r.detail.startswith("step 2: ") and counts in r.detail


def test_test_ratio_uses_the_newest_summary_within_lookback() -> None:
    steps = [PYTEST_FAIL, PYTEST_PASS_QUIET, "$ git diff\nObservation:\n+ fixed", JSON_TRACEBACK]
    r = TestRatio()(run(*steps))
    assert r is not None and r.score == 1.0 and r.detail.startswith("step 2:")
    assert TestRatio(lookback=2)(run(*steps)) is None  # the summary is three steps back
    # Within one step, the later summary wins (the agent re-ran the tests after a fix).
    r2 = TestRatio()(run(PYTEST_FAIL + "\n$ pytest -q\n" + PYTEST_PASS_QUIET))
    assert r2 is not None and r2.score == 1.0
    r3 = TestRatio()(run(UNITTEST_OK + "\n" + PYTEST_FAIL))
    assert r3 is not None and r3.score == pytest.approx(7 / 11)


@pytest.mark.parametrize(
    "text",
    [
        JSON_TRACEBACK,  # no summary at all
        "=== no tests ran in 0.01s ===",
        "=== 0 passed in 0.01s ===",  # no tests ran is not progress evidence
        "Ran 0 tests in 0.000s\n\nOK",
        "Ran 10 tests in 0.5s\n",  # output cut before the verdict
        MYPY,  # an errors count without a run time is a linter, not tests
        "ruff: Found 2 errors.",
        # code in a heredoc (recorded run)
        "    # In get_integer, ctx*=99, then ctx*99 passed to get_integer...",
        "I think 3 passed before the refactor",
        # pytest -v, cut off
        "tests/test_api.py::test_case_2 PASSED                                   [ 20%]",
        "test_task_cancel OK: got CancelledError\ntest_task_cancel passed\nCANCEL SCENARIO PASSED",
        "",
    ],
)
def test_test_ratio_has_no_opinion_without_a_test_summary(text: str) -> None:
    assert TestRatio()(run(text)) is None


def test_test_ratio_no_steps_and_custom_patterns() -> None:
    assert TestRatio()(run()) is None
    mocha = TestRatio(passed=r"(\d+) passing", failed=r"(\d+) failing", confidence=0.6)
    r = mocha(run("  9 passing (2s)\n  1 failing\n"))
    # one line at a time: the last is "1 failing"
    assert r is not None and r.score == 0.0 and r.confidence == 0.6
    r = mocha(run("  9 passing, 1 failing (2s)"))
    assert r is not None and r.score == 0.9


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"passed": r"\d+ passed"}, "the passed pattern .* needs a group around the count"),
        ({"failed": "(unclosed"}, "test_ratio failed: invalid regular expression"),
        ({"lookback": 0}, "lookback must be an integer in"),
        ({"confidence": 1.5}, "confidence must be a number in"),
    ],
)
def test_test_ratio_rejects_bad_config(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TestRatio(**params)


# --- MetricCurve ---


def test_metric_curve_linear_from_the_first_reading_to_the_goal() -> None:
    meta: list[dict[str, Any]] = [
        {"distance_to_goal": 2.0},
        {},
        {"distance_to_goal": 1.5, "gripper": "open"},
        {"camera": "front"},
    ]
    r = MetricCurve()(run("a", "b", "c", "d", metadata=meta))
    assert r == RuleScore(0.25, 0.8, "step 3: distance_to_goal=1.5, linear from 2 to 0")
    first = MetricCurve()(run("a", metadata=meta[:1]))
    assert first is not None and first.score == 0.0  # where the run started
    away = MetricCurve()(
        run("a", "b", metadata=[{"distance_to_goal": 2.0}, {"distance_to_goal": 3.0}])
    )
    assert away is not None and away.score == 0.0  # clamped, not negative
    at_goal = MetricCurve(start=4.0)(run("a", metadata=[{"distance_to_goal": 0}]))
    assert at_goal is not None and at_goal.score == 1.0


def test_metric_curve_rising_goal_nested_field_and_numeric_strings() -> None:
    meta: list[dict[str, Any]] = [{"eval": {"coverage": 40}}, {"eval": {"coverage": "85"}}]
    r = MetricCurve(field="eval.coverage", goal=100)(run("a", "b", metadata=meta))
    assert r is not None and r.score == pytest.approx(0.75)  # 40 -> 100, now 85


def test_metric_curve_exp() -> None:
    r = MetricCurve(curve="exp", scale=0.5)(run("a", metadata=[{"distance_to_goal": 0.5}]))
    assert r is not None and r.score == pytest.approx(math.exp(-1)) and "exp(-0.5/0.5)" in r.detail
    r0 = MetricCurve(curve="exp")(run("a", metadata=[{"distance_to_goal": 0.0}]))
    assert r0 is not None and r0.score == 1.0


@pytest.mark.parametrize(
    "meta",
    [
        [],  # no metadata at all
        [{}, {}],
        [{"distance": 1.0}, {"reward": 0.0}],
        [{"distance_to_goal": 1.0}, {"distance_to_goal": "far"}],  # the newest reading is garbage
        [{"distance_to_goal": None}],
        [{"distance_to_goal": True}],
        [{"distance_to_goal": float("nan")}],
        [{"distance_to_goal": [1.0]}],
        [{"distance_to_goal": 0.0}, {"distance_to_goal": 0.0}],  # started at the goal: no scale
    ],
)
def test_metric_curve_has_no_opinion_on_missing_or_non_numeric_readings(
    meta: list[dict[str, Any]],
) -> None:
    steps = ["s"] * len(meta) if meta else ["s", "s"]
    assert MetricCurve()(run(*steps, metadata=meta)) is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"curve": "sigmoid"}, "curve must be 'linear' or 'exp', got 'sigmoid'"),
        ({"scale": 0}, "scale must be above 0"),
        ({"scale": -1.0}, "scale must be a number in"),
        ({"field": ""}, "field must be a non-empty metadata key"),
        ({"goal": "0"}, "goal must be a number"),
        ({"start": float("nan")}, "start must be a number"),
    ],
)
def test_metric_curve_rejects_bad_config(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MetricCurve(**params)


def test_rule_input_metadata_must_line_up_with_steps() -> None:
    with pytest.raises(ValueError, match="2 steps but 1 metadata entries; give one dict per step"):
        run("a", "b", metadata=[{}])


# --- AnswerMatch ---


@pytest.mark.parametrize(
    ("mode", "step", "expected", "score"),
    [
        ("exact", "I checked the output.\nFinal answer: Paris", "paris", 1.0),
        ("exact", "**Final Answer:** `New  York`.", "new york", 1.0),
        ("exact", "FINAL ANSWER = Lyon", "Paris", 0.0),
        ("contains", "Final answer: The capital is Paris, France.", "Paris", 1.0),
        ("contains", "Final answer: The capital is Lyon.", "Paris", 0.0),
        ("numeric", "Final answer: 1,234.0", "1234", 1.0),
        ("numeric", "Final answer: x = 42", "42.0", 1.0),
        ("numeric", "Final answer: 3/4", "0.75", 1.0),
        ("numeric", "Final answer: 50%", "50", 1.0),
        ("numeric", "Final answer: 41.9", "42", 0.0),
    ],
)
def test_answer_match_modes(mode: str, step: str, expected: str, score: float) -> None:
    r = AnswerMatch(mode=mode)(run("$ ls", step, expected=expected))  # type: ignore[arg-type]
    assert r is not None and r.score == score and r.confidence == 1.0
    assert ("does not match" in r.detail) == (score == 0.0) and f"({mode})" in r.detail


def test_answer_match_with_extractors() -> None:
    boxed = AnswerMatch(mode="numeric", extractor=Boxed(), confidence=0.95)
    r = boxed(
        run(
            r"<think>maybe \boxed{3}</think> So the result is \boxed{\frac{6}{2}} hmm, i.e. "
            r"\boxed{3}",
            expected="3",
        )
    )
    assert r == RuleScore(1.0, 0.95, "declared answer '3' matches the expected answer (numeric)")
    digit = AnswerMatch(mode="numeric", extractor=Pipeline((StripReasoning(), LastNumber())))
    r = digit(run("Observation:\nprediction.txt content: [2]\n<think>or 7?</think>", expected="7"))
    assert r is not None and r.score == 0.0
    assert (
        AnswerMatch(mode="numeric", tolerance=0.01)(run("Final answer: 3.14159", expected="3.14"))
        is not None
    )
    close = AnswerMatch(mode="numeric", tolerance=0.01)(run("Final answer: 3.141", expected="3.14"))
    assert close is not None and close.score == 1.0


@pytest.mark.parametrize(
    ("rule", "inp"),
    [
        (AnswerMatch(), run("Final answer: 42")),  # no expected answer
        (AnswerMatch(), run("Final answer: 42", expected="  ")),
        (AnswerMatch(), run(expected="42")),  # no steps
        (AnswerMatch(), run(JSON_TRACEBACK, expected="42")),  # nothing declared
        # only the latest step counts
        (AnswerMatch(), run("Final answer: 42", "still checking", expected="42")),
        (AnswerMatch(), run("Final answer:   ", expected="42")),
        (AnswerMatch(extractor=Boxed()), run("The answer is 42", expected="42")),
        (AnswerMatch(extractor=RegexCapture(r"ANSWER: (\d+)")), run("answer: 42", expected="42")),
        # does not parse
        (AnswerMatch(mode="numeric"), run("Final answer: forty-two", expected="42")),
        # ambiguous
        (AnswerMatch(mode="numeric"), run("Final answer: between 3 and 5", expected="4")),
        (AnswerMatch(mode="numeric"), run("Final answer: 42", expected="n/a")),
        (AnswerMatch(mode="numeric"), run("Final answer: 1/0", expected="0")),
    ],
)
def test_answer_match_has_no_opinion_without_a_clean_parse(
    rule: AnswerMatch, inp: RuleInput
) -> None:
    assert rule(inp) is None


def test_answer_match_rejects_bad_config() -> None:
    with pytest.raises(
        ValueError, match="mode must be 'exact', 'contains' or 'numeric', got 'fuzzy'"
    ):
        AnswerMatch(mode="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tolerance must be a number in"):
        AnswerMatch(tolerance=-1)
    with pytest.raises(ValueError, match="extractor must be a str -> str callable"):
        AnswerMatch(extractor="boxed")  # type: ignore[arg-type]


# --- Composite ---


@dataclass(frozen=True)
class Fixed:
    """A stand-in member (the LLM judge will be one) that always answers."""

    score: float = 0.5
    confidence: float = 1.0
    name: str = "llm"

    def __call__(self, inp: RuleInput) -> RuleScore | None:
        return RuleScore(self.score, self.confidence, "judged")


def test_composite_first_confident_member_answers() -> None:
    chain = Composite([AnswerMatch(extractor=Boxed()), TestRatio(), Fixed(0.4)])
    r = chain(run(PYTEST_FAIL))
    assert isinstance(r, CompositeScore)
    assert (r.member_index, r.member_name) == (1, "rule.test_ratio")
    assert r.score == pytest.approx(7 / 11) and r.confidence == 0.9
    assert r.detail == "[1] rule.test_ratio: step 1: 7 passed, 3 failed, 1 errors -> 7/11"
    # Rules silent: the last member (the judge) answers.
    r2 = chain(run(JSON_TRACEBACK))
    assert r2 is not None and (r2.member_index, r2.member_name, r2.score, r2.detail) == (
        2,
        "llm",
        0.4,
        "[2] llm: judged",
    )


def test_composite_skips_unconfident_members_and_may_have_no_answer() -> None:
    chain = Composite([TestRatio(confidence=0.3), Fixed(0.2, confidence=0.49)], min_confidence=0.5)
    assert chain(run(PYTEST_PASS_QUIET)) is None
    assert (
        Composite([TestRatio(confidence=0.3)], min_confidence=0.3)(run(PYTEST_PASS_QUIET))
        is not None
    )
    nested = Composite([Composite([MetricCurve()]), Fixed(0.9)])
    r = nested(run("a", metadata=[{"distance_to_goal": 1.0}]))
    assert r is not None and r.detail.startswith(
        "[0] rule.composite: [0] rule.metric_curve: step 1:"
    )


def test_composite_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="members is empty"):
        Composite([])
    with pytest.raises(ValueError, match="member 1 is a int, not a rule"):
        Composite([TestRatio(), 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="min_confidence must be a number in"):
        Composite([TestRatio()], min_confidence=2)


def test_rule_score_is_checked() -> None:
    with pytest.raises(ValueError, match=r"RuleScore.score must be a number in \[0, 1\], got 1.2"):
        RuleScore(1.2, 1.0, "")
    with pytest.raises(ValueError, match=r"RuleScore\.confidence"):
        RuleScore(0.5, float("nan"), "")


# --- Registry and config ---


def test_build_rule_with_or_without_prefix_ignoring_rubric_keys() -> None:
    assert build_rule(
        {"type": "rule.test_ratio", "confidence": 0.8, "weight": 0.5, "name": "tests"}
    ) == TestRatio(confidence=0.8)
    assert build_rule({"type": "metric_curve", "curve": "exp", "scale": 2.0}) == MetricCurve(
        curve="exp", scale=2.0
    )
    am = build_rule({"type": "rule.answer_match", "mode": "numeric", "extractor": "boxed"})
    assert am == AnswerMatch(mode="numeric", extractor=Pipeline((Boxed(),)))
    am2 = build_rule(
        {"type": "answer_match", "extractor": ["strip_reasoning", {"type": "last_number"}]}
    )
    assert am2(run("<think>7</think>so 12", expected="12")) == RuleScore(
        1.0, 1.0, "declared answer '12' matches the expected answer (exact)"
    )
    chain = build_rule(
        {
            "type": "composite",
            "min_confidence": 0.7,
            "members": [{"type": "rule.answer_match"}, {"type": "test_ratio"}],
        }
    )
    assert chain == Composite((AnswerMatch(), TestRatio()), min_confidence=0.7)
    assert rule_name(chain) == "rule.composite" and rule_name(Fixed()) == "llm"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"type": "llm"},
            "unknown rule 'llm'; known rules: answer_match, composite, metric_curve, test_ratio",
        ),
        ({"confidence": 0.5}, "needs a 'type' naming one of: answer_match"),
        (
            {"type": "rule.test_ratio", "lookbak": 2},
            "rule 'test_ratio' does not take 'lookbak'; its parameters are: passed, failed, "
            "errors, confidence, lookback",
        ),
        (
            {"type": "test_ratio", "confidence": "high"},
            "test_ratio: confidence must be a number in",
        ),
        (
            {"type": "answer_match", "extractor": "boxd"},
            "extractors\\[0\\]: unknown extractor 'boxd'",
        ),
        ({"type": "answer_match", "mod": "numeric"}, "rule 'answer_match' does not take 'mod'"),
        ({"type": "composite"}, "members must be a list of rule configs, got None"),
        (
            {"type": "composite", "members": [{"type": "nope"}]},
            "composite' members\\[0\\]: unknown rule 'nope'",
        ),
        (["test_ratio"], "a rule config must be a dict with a 'type'"),
    ],
)
def test_build_rule_errors_say_what_is_wrong(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_rule(spec)


@pytest.fixture
def clean_registry() -> Iterator[None]:
    before = dict(RULES)
    yield
    RULES.clear()
    RULES.update(before)


@pytest.mark.usefixtures("clean_registry")
def test_a_users_own_rule_is_one_decorator_away() -> None:
    @register_rule("rule.returncode")
    @dataclass(frozen=True)
    class ReturnCode:
        confidence: float = 0.6

        def __call__(self, inp: RuleInput) -> RuleScore | None:
            if not inp.steps or '"returncode": ' not in inp.steps[-1]:
                return None
            ok = '"returncode": 0' in inp.steps[-1]
            return RuleScore(1.0 if ok else 0.0, self.confidence, "exit status")

    rule = build_rule({"type": "rule.returncode"})
    assert rule(run(JSON_TRACEBACK)) == RuleScore(0.0, 0.6, "exit status")
    assert rule_name(rule) == "rule.returncode"
    assert build_rule({"type": "returncode", "confidence": 0.7}) == ReturnCode(0.7)
    with pytest.raises(ValueError, match="rule name 'test_ratio' is already taken by TestRatio"):
        register_rule("rule.test_ratio")(ReturnCode)
    with pytest.raises(ValueError, match="rule name must be a non-empty string"):
        register_rule("rule.")


# --- Robustness: rules never raise on what an agent prints ---


@given(st.lists(st.text(max_size=300), min_size=1, max_size=4), st.text(max_size=40))
def test_rules_never_raise_on_arbitrary_text(steps: list[str], expected: str) -> None:
    inp = run(*steps, metadata=[{"distance_to_goal": s} for s in steps], expected=expected)
    for rule in (
        TestRatio(),
        MetricCurve(),
        AnswerMatch(),
        AnswerMatch(mode="numeric"),
        AnswerMatch(mode="contains"),
    ):
        r = rule(inp)
        assert r is None or (0.0 <= r.score <= 1.0 and 0.0 <= r.confidence <= 1.0)
