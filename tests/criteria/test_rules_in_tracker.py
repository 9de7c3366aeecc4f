"""Rules before the judge: confident rules carry a step without a judge call; silent ones hand it
to the judge."""

import json
from pathlib import Path

import pytest

from agent_monitor import AsyncProgressTracker, ProgressTracker, load_criteria
from agent_monitor.criteria import CriteriaError
from agent_monitor.rules import RuleInput, RuleScore, register_rule
from agent_monitor.testing import FakeJudge

MIXED = {
    "title": "tests first",
    "extractors": ["strip_reasoning", {"type": "truncate", "max_chars": 400}],
    "criteria": [
        {
            "type": "composite",
            "name": "goal",
            "weight": 0.5,
            "members": [
                {"type": "rule.test_ratio"},
                {"type": "llm", "description": "is the goal reached"},
            ],
        },
        {"type": "llm", "name": "health", "description": "is the run healthy", "weight": 0.25},
        {
            "type": "rule.metric_curve",
            "name": "distance",
            "field": "distance_to_goal",
            "weight": 0.25,
        },
    ],
}


async def test_confident_rule_carries_a_step_and_silent_rules_hand_it_to_the_judge() -> None:
    judge = FakeJudge(lambda p: "K")
    t = AsyncProgressTracker("Fix the tests.", judge=judge, criteria=MIXED)
    # Step 1: no test summary, no metric: goal and health go to the judge, distance is silent.
    p1 = await t.update("<think>hmm</think>looked at the repo")
    assert p1.ok and p1.calls == 2 and p1.calls_saved == 0 and p1.silent == ("distance",)
    assert {c.criterion for c in judge.prompts} == {"goal", "health"}
    assert p1.score == pytest.approx(10 / 19)  # weights renormalised over goal and health
    assert "hmm" not in t.steps[0].text  # the extractor ran before anything saw the step
    # Step 2: pytest summary and a distance reading: goal from the rule, no judge call for it.
    judge.requests.clear()
    p2 = await t.update("$ pytest -q\n3 failed, 7 passed in 0.4s", meta={"distance_to_goal": 4.0})
    assert (
        [c.criterion for c in judge.prompts] == ["health"] and p2.calls == 1 and p2.calls_saved == 1
    )
    goal = p2.criteria["goal"]
    assert (
        goal.source == "rule"
        and goal.score == pytest.approx(0.7)
        and goal.confidence == pytest.approx(0.9)
    )
    assert goal.uncertainty == pytest.approx(0.05) and "test_ratio" in goal.detail
    assert p2.criteria["health"].source == "llm"
    # distance: the first reading is the start, so progress 0 at 4.0.
    assert p2.criteria["distance"].score == pytest.approx(0.0)
    assert p2.score == pytest.approx(0.5 * 0.7 + 0.25 * 10 / 19 + 0.25 * 0.0)
    p3 = await t.update("$ pytest -q\n10 passed in 0.3s", meta={"distance_to_goal": 1.0})
    assert p3.criteria["goal"].score == 1.0 and p3.criteria["distance"].score == pytest.approx(0.75)
    assert t.calls_saved == 2 == sum(p.calls_saved for p in t.curve)
    assert p3.to_json()["criteria"]["goal"]["source"] == "rule"


async def test_rules_only_rubric_never_calls_the_judge() -> None:
    judge = FakeJudge()
    crit = {"criteria": [{"type": "rule.answer_match", "mode": "numeric", "name": "answer"}]}
    t = AsyncProgressTracker("What is 6 x 7?", judge=judge, criteria=crit, expected="42")
    p1 = await t.update("thinking about it")
    assert not p1.ok and p1.reason == "no_opinion" and p1.score is None and judge.prompts == []
    p2 = await t.update("Final answer: 41")
    # clean parse, wrong: confident low
    assert p2.ok and p2.score == 0.0 and p2.criteria["answer"].confidence == 1.0
    p3 = await t.update("Final answer: 42")
    assert p3.ok and p3.score == 1.0 and judge.prompts == []


def test_sync_hook_takes_metadata_and_judge_never_sees_it() -> None:
    judge = FakeJudge(lambda p: "T")
    crit = {
        "criteria": [
            {"type": "rule.metric_curve", "start": 10.0, "weight": 1},
            {"type": "llm", "name": "q", "description": "d"},
        ]
    }
    with ProgressTracker("Reach the goal.", judge=judge, criteria=crit) as t:
        p = t.update("moved", meta={"distance_to_goal": 5.0, "secret": "do-not-show"})
    assert p.criteria["rule.metric_curve"].score == pytest.approx(0.5)
    assert "do-not-show" not in judge.prompts[0].text() and p.score == pytest.approx(0.75)
    judge.close()


async def test_broken_user_rule_is_no_opinion_and_the_judge_answers() -> None:
    @register_rule("always_breaks")
    class Breaks:
        def __call__(self, inp: RuleInput) -> RuleScore | None:
            raise ZeroDivisionError("bug")

    crit = {
        "criteria": [
            {
                "type": "composite",
                "name": "g",
                "members": [{"type": "always_breaks"}, {"type": "llm", "description": "d"}],
            }
        ]
    }
    p = await AsyncProgressTracker("t", judge=FakeJudge(), criteria=crit).update("x")
    assert p.ok and p.calls == 1 and p.criteria["g"].source == "llm"


def test_rubric_json_and_hash(tmp_path: Path) -> None:
    f = tmp_path / "rubric.json"
    f.write_text(json.dumps({**MIXED, "thresholds": {"abort_below": 0.1}}))
    r = load_criteria(f)
    assert [c.name for c in r.criteria] == ["goal", "health", "distance"]
    assert [c.name for c in r.judged] == ["goal", "health"]
    assert sum(c.weight for c in r.criteria) == pytest.approx(1.0)
    other = load_criteria({**MIXED, "extractors": []})
    assert r.hash == load_criteria(MIXED).hash != other.hash


@pytest.mark.parametrize(
    ("crit", "message"),
    [
        ({"criteria": [{"type": "rule.nope"}]}, "has type 'rule.nope'"),
        (
            {
                "criteria": [
                    {
                        "type": "composite",
                        "members": [
                            {"type": "llm", "description": "d"},
                            {"type": "rule.test_ratio"},
                        ],
                    }
                ]
            },
            "must come last",
        ),
        ({"criteria": [{"type": "rule.test_ratio", "bogus": 1}]}, "bogus"),
        ({"criteria": [{"type": "llm", "name": "x"}]}, "lacks 'description'"),
        ({"extractors": ["nope"], "criteria": [{"type": "llm", "description": "d"}]}, "extractors"),
    ],
)
def test_bad_pipeline_config_gets_clear_errors(crit: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(CriteriaError, match=message):
        load_criteria(crit)


async def test_calls_saved_are_exported_on_the_registry_passed_in() -> None:
    # The tracker sets Progress.calls_saved; the daemon counts it on the registry its Monitor was
    # given.
    import json

    from prometheus_client import CollectorRegistry, generate_latest

    from agent_monitor.daemon import Monitor

    registry = CollectorRegistry()
    async with Monitor(judge=FakeJudge(), registry=registry) as mon:
        await mon.handle(
            "agents/r1/start",
            json.dumps({"task": "Fix the tests.", "criteria": "coding_tests"}).encode(),
        )
        await mon.handle("agents/r1/step", json.dumps({"text": "$ ls"}).encode())
        await mon.drain()
        assert registry.get_sample_value("agent_monitor_judge_calls_saved_total") == 0.0
        # One step at a time: each prefix is scored on its own (no coalescing), as the tracker did.
        for text in (
            "$ pytest\n=== 2 failed, 8 passed in 1.2s ===",
            "$ pytest\n=== 10 passed in 1.1s ===",
        ):
            await mon.handle("agents/r1/step", json.dumps({"text": text}).encode())
            await mon.drain()
        t = mon.tracker("r1")
        assert t is not None and [p.calls_saved for p in t.curve] == [0, 1, 1]
        assert (
            registry.get_sample_value("agent_monitor_judge_calls_saved_total")
            == 2.0
            == t.calls_saved
        )
        assert b"agent_monitor_judge_calls_saved_total 2.0" in generate_latest(registry)


def test_rubric_yaml(tmp_path: Path) -> None:
    f = tmp_path / "rubric.yaml"
    f.write_text(
        "title: tests first\n"
        "extractors: [strip_reasoning]\n"
        "criteria:\n"
        "  - {type: rule.test_ratio, weight: 1}\n"
        "  - {type: llm, name: health, description: is the run healthy, weight: 1}\n"
    )
    r = load_criteria(f)
    assert [c.name for c in r.criteria] == ["rule.test_ratio", "health"] and r.criteria[0].rules
    bad = tmp_path / "bad.yml"
    bad.write_text("criteria: [unclosed")
    with pytest.raises(CriteriaError, match="not valid YAML"):
        load_criteria(bad)
