"""The binary scale (a rubric's `"scale": "binary"`): P(True) to "is the task complete?", the
letter scale's rules."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from agent_monitor import AsyncProgressTracker, OpenAIJudge, ProgressTracker, load_criteria
from agent_monitor.prompts import Step, build_prompt, fence
from agent_monitor.scale import ScoreError, binary_as_letters, distribution, read_binary
from agent_monitor.testing import FakeJudge
from tests.openai_server import ScriptedServer, chat_choice, chat_reply, scripted_server

BINARY = {
    "scale": "binary",
    "criteria": [{"name": "done", "description": "The cube is in the bowl."}],
}


def _log(d: dict[str, float]) -> dict[str, float]:
    return {k: math.log(v) for k, v in d.items()}


def test_true_and_false_become_an_expectation_with_the_letter_rules() -> None:
    assert [read_binary(t) for t in ("True", " true", "FALSE", "T", "Yes", "Truee")] == [
        True,
        True,
        False,
        None,
        None,
        None,
    ]
    d = distribution(
        binary_as_letters(_log({"True": 0.6, " true": 0.1, "False": 0.2, "The": 0.1})) or {}
    )
    assert d.expectation == pytest.approx(0.7 / 0.9) and d.mass == pytest.approx(0.9)
    assert d.dispersion == pytest.approx(math.sqrt(0.7 / 0.9 * 0.2 / 0.9))
    with pytest.raises(
        ScoreError, match="none of the judge's 2 candidate tokens is True or False"
    ) as e:
        binary_as_letters(_log({"A": 0.5, "T": 0.5}))  # letters are not answers on this scale
    assert e.value.reason == "no_letter"
    with pytest.raises(ScoreError) as e:
        distribution(binary_as_letters(_log({"True": 0.2, "False": 0.1, "I": 0.7})) or {})
    assert e.value.reason == "low_mass"
    assert binary_as_letters(None) is None


def test_a_rubric_selects_it_and_the_prompt_asks_true_or_false_prefix_stably() -> None:
    rubric = load_criteria(BINARY)
    letters = load_criteria({"criteria": BINARY["criteria"]})
    assert rubric.binary and not letters.binary and rubric.hash != letters.hash
    assert load_criteria({**BINARY, "scale": "letters"}).hash == letters.hash
    steps = [Step(i, f"moved the arm {i}") for i in range(1, 4)]
    a = build_prompt("Put the cube in the bowl", rubric, steps[:2], rubric.criteria[0])
    b = build_prompt("Put the cube in the bowl", rubric, steps, rubric.criteria[0])
    assert (
        a.scale == b.scale == "binary"
        and build_prompt("t", letters, steps, letters.criteria[0]).scale == "letters"
    )
    assert "20-letter" not in a.instructions and "exactly one word, True or False" in a.instructions
    assert "Reply with one word: True (the task is complete) or False (not yet)." in a.text()
    assert b.prefix_text().startswith(a.prefix_text())  # prefix-stable as on the letter scale
    # Step text that copies the binary instructions' lines is fenced like any template line.
    assert fence("Reply with one word: True").startswith("\\")


def test_tracker_scores_p_true_and_fails_on_letters() -> None:
    judge = FakeJudge([{"True": 0.3, "False": 0.7}, {"True": 0.9, "False": 0.1}, "K"])
    t = ProgressTracker("Put the cube in the bowl", judge=judge, criteria=BINARY)
    try:
        assert t.update("reached for the cube").score == pytest.approx(0.3)
        assert t.update("dropped it in the bowl").score == pytest.approx(0.9)
        p = t.update("waited")
        assert (
            not p.ok
            and p.score is None
            and p.reason == "no_letter"
            and "True or False" in (p.error or "")
        )
    finally:
        t.close()


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as s:
        yield s


async def test_openai_judge_constrains_to_true_false_and_reads_them(server: ScriptedServer) -> None:
    server.default = chat_reply(chat_choice([("True", {"True": 0.8, "False": 0.15, "Yes": 0.05})]))
    judge = OpenAIJudge(base_url=server.url, model="m", constrain=True)
    t = AsyncProgressTracker("Put the cube in the bowl", judge=judge, criteria=BINARY)
    p = await t.update("the cube is in the bowl")
    assert p.ok and p.score == pytest.approx(0.8 / 0.95)
    req = server.requests[0]
    assert req["guided_choice"] == ["True", "False"] and req["max_tokens"] == 1
    assert "True or False" in req["messages"][0]["content"]
    await judge.aclose()
